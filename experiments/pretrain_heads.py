"""`mtp-rollout train-heads`: pre-train draft heads for a policy, evaluate them, write a report.

    mtp-rollout train-heads heads_smollm2                      # the shipped heads (configs/heads_smollm2.yaml)
    mtp-rollout train-heads configs/train_heads.yaml train.phases='[{objective: tv, steps: 300}]'
    mtp-rollout train-heads heads_smollm2 resume=true          # continue an interrupted run exactly
    mtp-rollout train-heads --help                             # every key, its default and meaning

The first argument may be a preset name (a YAML file in configs/) or a YAML path; `key=value`
overrides follow, exactly like `mtp-rollout run`. Data: a token store (data.store, built by
experiments/build_head_data.py) or, without one, the policy's own rollouts (data.generate).
Writes into out_dir: heads.safetensors (the heads, header inside), heads.train.pt (optimizer state
for resume), heads.run.json (resolved config, losses, the held-out/training acceptance curve,
timings) and heads.config.yaml. With train.drafter=eagle3 (the eagle3_smollm2 preset) the drafter is
an EAGLE-3 directory, <out_dir>/eagle3/ (config.json + model.safetensors, vLLM's layout), with
eagle3.train.pt, eagle3.run.json and eagle3.config.yaml beside it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from experiments.common import check_device
from experiments.heads_data import GenerateConfig
from mtp_heads.checkpoint import read_meta
from mtp_heads.evaluate import EvalSet, format_acceptance, teacher_forced_acceptance
from mtp_heads.pretrain import SHIPPED_INIT, TrainConfig, train_heads
from mtp_heads.shipped import HEADS_FILE, shipped_heads_path, trained_heads_dir, trained_heads_path
from mtp_heads.token_data import draft_vocab_from_counts, trained_token_counts
from rollout.config_loader import CONFIGS_DIR, config_help, load_config, packaged_config, wants_help
from rollout.fileio import atomic_write
from rollout.models.default_model import cache_dir
from rollout.run_dir import check_writable
from rollout.types import MAX_DRAFT_TOKENS



@dataclass(frozen=True)
class DataConfig:
    """Where the training and held-out sequences come from."""

    store: str = ""                     # token store root (experiments/build_head_data.py); "" = generate rollouts
    sources: list[str] = field(default_factory=lambda: ["sharegpt", "onpolicy"])   # store sources used
    vocab_count_sequences: int = 4000   # training sequences whose trained tokens are counted for the draft vocab
    max_train_sequences: int = 0        # use only the first n training sequences (0 = all): pins a growing store
    aux_states: str = "record"          # eagle3: `record` the training sequences' aux states once (under
                                        # $MTP_ROLLOUT_CACHE/aux_states/) or `recompute` them every step
    generate: GenerateConfig = field(default_factory=GenerateConfig)   # rollouts when there is no store

    def __post_init__(self) -> None:
        if self.aux_states not in AUX_STATES:
            raise ValueError(f"data.aux_states={self.aux_states!r}: choose one of {list(AUX_STATES)}")


AUX_STATES = ("record", "recompute")


@dataclass(frozen=True)
class EvalConfig:
    """Teacher-forced acceptance (mtp_heads.evaluate) during and after training; engine runs at the end."""

    temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0])   # sampling temperatures scored
    steps: int = 3                      # draft positions scored (k)
    heldout_sequences: int = 16         # held-out sequences scored (first n of the split)
    train_sequences: int = 16           # training sequences scored too: the train/held-out gap
    max_seq_len: int = 512              # evaluation sequences are cut to this many tokens
    engine_prompts: int = 0             # held-out chat prompts decoded by the torch engine at the end (0 = skip)
    engine_new_tokens: int = 64         # new tokens per engine prompt
    speedup_prompts: int = 0            # batch-1 plain vs speculative decode prompts (0 = skip)
    heldout_sources: list[str] = field(default_factory=list)   # also score each of these store sources' held-out split on its own
    at_start: bool = False              # also score the initial heads (step 0): the curve's start when fine-tuning
    compare: list[str] = field(default_factory=list)   # other drafters scored at the end on the same held-out
                                                       # sets: `shipped`, a heads .safetensors or an EAGLE-3 directory

    def __post_init__(self) -> None:
        """Refused before the model loads and training starts (a bad value used to fail after it)."""
        if not 1 <= self.steps <= MAX_DRAFT_TOKENS:
            raise ValueError(f"eval.steps (draft positions scored) must be in 1..{MAX_DRAFT_TOKENS}, got {self.steps}")
        if not self.temperatures or not all(0 < t < float("inf") for t in self.temperatures):
            raise ValueError(f"eval.temperatures must list temperatures > 0, got {list(self.temperatures)}")
        if self.heldout_sequences < 1 or self.max_seq_len < 2:
            raise ValueError(f"need eval.heldout_sequences >= 1 and eval.max_seq_len >= 2, got "
                             f"{self.heldout_sequences}, {self.max_seq_len}")
        for name in ("train_sequences", "engine_prompts", "engine_new_tokens", "speedup_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class TrainHeadsConfig:
    """One head pre-training run."""

    model: str = "smollm2-135m"         # named model, .gguf file or HF directory
    out_dir: str = ""                   # the heads go to <out_dir>/heads.safetensors (reports beside them);
                                        # "" = $MTP_ROLLOUT_CACHE/heads/<model>/, where heads=shipped finds them
    resume: bool = False                # continue from out_dir's checkpoint (same config) instead of starting over
    threads: int = 0                    # torch threads (0 = leave as is)
    device: str = "cpu"                 # cpu | cuda | cuda:N: where the policy and the drafter train
    progress: bool = True               # a tqdm bar
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        check_device("device", self.device)


def load_train_heads_config(argv: list[str]) -> tuple[TrainHeadsConfig, str]:
    """argv[0] may name a preset in configs/ ("heads_smollm2"); the rest are YAML files and overrides."""
    argv = list(argv)
    if argv and "=" not in argv[0] and not Path(argv[0]).is_file() and (CONFIGS_DIR / f"{argv[0]}.yaml").is_file():
        argv[0] = str(packaged_config(argv[0]))
    return load_config(TrainHeadsConfig, argv)


class FirstN:
    """The first n sequences of a source (a store split keeps growing while it is built)."""

    def __init__(self, source, n: int):
        self.source, self.n = source, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.source[i]


def open_data(cfg: TrainHeadsConfig, policy, encode, progress: bool):
    """(train source, held-out source, description) from the token store or generated rollouts."""
    if cfg.data.store:
        from mtp_heads.data.token_store import TokenStore
        store = TokenStore(Path(cfg.data.store).expanduser())
        if store.meta.get("policy_fingerprint") not in (None, policy.config.fingerprint()):
            raise ValueError(f"token store {cfg.data.store} was built for another policy "
                             f"({store.meta.get('policy_fingerprint')}); rebuild it for {cfg.model}")
        src = tuple(cfg.data.sources)
        train, held = store.split("train", sources=src), store.split("heldout", sources=src)
        if 0 < cfg.data.max_train_sequences < len(train):
            train = FirstN(train, cfg.data.max_train_sequences)
        n_tok = int(sum(len(train[i].tokens) for i in range(len(train)))) if isinstance(train, FirstN) else \
            store.num_tokens("train", src)
        desc = {"store": cfg.data.store, "sources": list(src), "train_tokens": n_tok,
                "train_sequences": len(train), "heldout_sequences": len(held),
                "heldout_tokens": store.num_tokens("heldout", src)}
        return train, held, desc
    from experiments.heads_data import prepare_generated_data
    train, held = prepare_generated_data(policy, encode, cfg.data.generate, progress=progress)
    return train, held, {"generated": asdict(cfg.data.generate), "train_tokens": int(train.offsets[-1]),
                         "train_sequences": len(train), "heldout_sequences": len(held)}


EVAL_SET_FORMAT = 2     # EvalSet.to_state (format 1 pickled DistillBatch objects)


def cached_eval_set(policy, source, ev: EvalConfig, n: int, key: dict,
                    aux_layer_ids: tuple[int, ...] | None = None) -> EvalSet:
    """EvalSet.build, reused across runs on the same data (the full-vocabulary normaliser is the
    expensive part): $MTP_ROLLOUT_CACHE/eval_sets/<hash of data, sequences, settings>.pt. With
    aux_layer_ids the set also holds the aux states an EAGLE-3 drafter reads (same sequences)."""
    n = min(n, len(source))
    blob = json.dumps({"format": EVAL_SET_FORMAT, "key": key, "n": n, "len": ev.max_seq_len, "T": ev.temperatures,
                       "policy": policy.config.fingerprint(), "lengths": [len(source[i].tokens) for i in range(n)],
                       **({"aux": list(aux_layer_ids)} if aux_layer_ids else {})},
                      sort_keys=True, default=str)
    path = cache_dir() / "eval_sets" / f"{hashlib.sha256(blob.encode()).hexdigest()[:20]}.pt"
    if path.is_file():
        try:      # weights_only: a cache file is data, never code; an unreadable one is rebuilt
            return EvalSet.from_state(torch.load(path, map_location=policy.lm_head_weight.device, weights_only=True))
        except Exception as e:  # noqa: BLE001 - any failure means: build it again
            print(f"train-heads: rebuilding the evaluation set, {path} is unreadable ({type(e).__name__})", flush=True)
    es = EvalSet.build(policy, source, ev.temperatures, max_sequences=n, max_seq_len=ev.max_seq_len,
                       aux_layer_ids=aux_layer_ids)
    buf = io.BytesIO()
    torch.save(es.to_state(), buf)
    atomic_write(path, buf.getvalue())
    return es


def draft_vocab_for(cfg: TrainHeadsConfig, policy, train) -> torch.Tensor | None:
    V = policy.config.vocab_size
    if not 0 < cfg.train.draft_vocab_size < V:
        return None
    counts = trained_token_counts(train, V, cfg.data.vocab_count_sequences)
    return draft_vocab_from_counts(counts, cfg.train.draft_vocab_size, always=policy.config.eos_token_ids)


def heads_file(cfg: TrainHeadsConfig) -> Path:
    """<out_dir>/heads.safetensors, or the cached heads of cfg.model that heads=shipped falls back to;
    for train.drafter=eagle3 the directory <out_dir>/eagle3 (default: beside those cached heads)."""
    if cfg.train.drafter == "eagle3":
        return (Path(cfg.out_dir).expanduser() if cfg.out_dir else trained_heads_dir(cfg.model)) / EAGLE3_DIR
    return Path(cfg.out_dir).expanduser() / HEADS_FILE if cfg.out_dir else trained_heads_path(cfg.model)


EAGLE3_DIR = "eagle3"   # train-heads' EAGLE-3 output directory inside out_dir


def eagle3_aux_ids(cfg: TrainHeadsConfig, policy) -> tuple[int, ...] | None:
    """The aux layers the EAGLE-3 drafter reads, checked against the policy before any data or training
    (None for heads); a bad value is one line naming the key and the value."""
    if cfg.train.drafter != "eagle3":
        return None
    from mtp_heads.eagle3_checkpoint import aux_layer_ids_of, check_eagle3_dir
    from mtp_heads.eagle3_train import EAGLE3_INITS, aux_layer_ids_for
    if cfg.train.init not in EAGLE3_INITS:                     # an EAGLE-3 directory to fine-tune
        raw = check_eagle3_dir(Path(cfg.train.init).expanduser(), policy)
        ids = tuple(aux_layer_ids_of(raw, policy.config.num_hidden_layers))
        if cfg.train.aux_layer_ids and tuple(cfg.train.aux_layer_ids) != ids:
            raise ValueError(f"train.aux_layer_ids={list(cfg.train.aux_layer_ids)} but train.init={cfg.train.init} "
                             f"reads aux layers {list(ids)}; leave train.aux_layer_ids empty to keep them")
        return ids
    try:
        return aux_layer_ids_for(policy, cfg.train.aux_layer_ids)
    except ValueError as e:
        raise ValueError(f"train.aux_layer_ids={list(cfg.train.aux_layer_ids)}: {e}") from None


def load_drafter(spec: str, policy, model: str):
    """A drafter to compare (eval.compare): `shipped`, a heads .safetensors or an EAGLE-3 directory."""
    from mtp_heads.checkpoint import load_heads
    from mtp_heads.eagle3_checkpoint import drafter_layout, load_eagle3
    path = shipped_heads_path(model) if spec == SHIPPED_INIT else Path(spec).expanduser()
    if path is None:
        raise ValueError(f"eval.compare: no heads are shipped for model {model!r}")
    try:
        layout = drafter_layout(path)
    except ValueError as e:
        raise ValueError(f"eval.compare={spec!r}: {e}") from None
    drafter = load_heads(path, policy)[0] if layout == "heads" else load_eagle3(path, policy)
    return drafter.float().eval()         # scored in float32, as the trained drafter is


def with_aux_states(cfg: TrainHeadsConfig, policy, train, aux_ids: tuple[int, ...], where: dict):
    """The training source with recorded aux states (data.aux_states=record), computed once per
    (data, sequences, layers, policy) and kept under $MTP_ROLLOUT_CACHE/aux_states/."""
    from mtp_heads.data.aux_states import record_aux_states
    blob = json.dumps({"where": where, "n": len(train), "aux": list(aux_ids), "policy": policy.config.fingerprint()},
                      sort_keys=True, default=str)
    path = cache_dir() / "aux_states" / f"{hashlib.sha256(blob.encode()).hexdigest()[:20]}.npy"
    return record_aux_states(policy, train, aux_ids, path, log=lambda m: print(f"train-heads: {m}", flush=True))


def with_shipped_init(cfg: TrainHeadsConfig) -> TrainHeadsConfig:
    """train.init=shipped: fine-tune the heads shipped for cfg.model (mtp_heads/default_heads)."""
    if cfg.train.init != SHIPPED_INIT:
        return cfg
    path = shipped_heads_path(cfg.model)
    if path is None:
        raise ValueError(f"train.init=shipped: no heads are shipped for model {cfg.model!r}; "
                         "use last_layer or a .safetensors checkpoint")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init=str(path)))


def run(cfg: TrainHeadsConfig, resolved: str = "", policy=None, loaded=None) -> dict:
    """Data -> draft vocabulary -> training with periodic evaluation -> report. Returns the report."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg = with_shipped_init(cfg)
    t0 = time.perf_counter()
    out = heads_file(cfg)
    check_writable(out.parent, "out_dir")     # before the model, the data and minutes of training
    check_writable(cache_dir(), "the cache ($MTP_ROLLOUT_CACHE), where evaluation sets and generated data are kept")
    encode = None                              # task text -> prompt ids, needed only to generate data
    if policy is None:
        from trainers.rl_policy import BUILTIN_POLICIES, load_rl_policy
        if cfg.model in BUILTIN_POLICIES:      # the tiny test model: its prompts are bytes
            rl = load_rl_policy(cfg.model, "float32")
            policy, encode = rl.model, rl.codec.encode_prompt
        else:
            from rollout.models.loaders import load_policy
            policy, loaded = load_policy(cfg.model, "float32", cfg.device)
    if encode is None:
        from trainers.codec import ChatCodec

        def encode(text: str) -> list[int]:    # the chat template; a model without a tokenizer fails here
            if loaded is None:
                raise ValueError("generating head training data needs the model's tokenizer: pass `loaded`, "
                                 "or point data.store at a token store")
            return ChatCodec(loaded).encode_prompt(text)
    aux_ids = eagle3_aux_ids(cfg, policy)
    ev = cfg.eval
    if aux_ids is not None and (ev.engine_prompts or ev.speedup_prompts):
        raise ValueError(f"eval.engine_prompts={ev.engine_prompts} / eval.speedup_prompts={ev.speedup_prompts}: the "
                         "engine runs of train-heads draft with heads; set both to 0 for train.drafter=eagle3")
    compare = {spec: load_drafter(spec, policy, cfg.model) for spec in ev.compare}
    train, held, data_desc = open_data(cfg, policy, encode, cfg.progress)
    keep_vocab = cfg.train.init.endswith(".safetensors") and not cfg.train.draft_vocab_size or \
        aux_ids is not None and Path(cfg.train.init).expanduser().is_dir()     # a checkpoint keeps its own
    vocab = None if keep_vocab else draft_vocab_for(cfg, policy, train)
    where = {k: data_desc.get(k) for k in ("store", "sources", "generated")}   # not the (growing) sizes
    t_aux = time.perf_counter()
    if aux_ids is not None and cfg.data.aux_states == "record":
        train = with_aux_states(cfg, policy, train, aux_ids, {**where, "max_train_sequences": cfg.data.max_train_sequences})
    aux_record_s = time.perf_counter() - t_aux
    t_eval = time.perf_counter()
    held_set = cached_eval_set(policy, held, ev, ev.heldout_sequences, {"split": "heldout", **where}, aux_ids)
    train_set = cached_eval_set(policy, train, ev, ev.train_sequences, {"split": "train", **where}, aux_ids) \
        if ev.train_sequences else None
    by_source = {}
    if ev.heldout_sources:
        if not cfg.data.store:
            raise ValueError("eval.heldout_sources needs a token store (data.store)")
        from mtp_heads.data.token_store import TokenStore
        store = TokenStore(Path(cfg.data.store).expanduser())
        by_source = {src: cached_eval_set(policy, store.split("heldout", sources=[src]), ev, ev.heldout_sequences,
                                          {"split": "heldout", "store": cfg.data.store, "sources": [src]}, aux_ids)
                     for src in ev.heldout_sources}
    eval_build_s = time.perf_counter() - t_eval
    eval_seconds = [0.0]

    def score(drafter) -> dict:
        """Held-out (and training) acceptance of heads or an EAGLE-3 drafter on this run's sets."""
        res = {"heldout": teacher_forced_acceptance(policy, drafter, held_set, ev.steps)}
        for src, es in by_source.items():
            res[f"heldout_{src}"] = teacher_forced_acceptance(policy, drafter, es, ev.steps)
        if train_set is not None:
            res["train"] = teacher_forced_acceptance(policy, drafter, train_set, ev.steps)
        return res

    def on_eval(step: int, heads) -> dict:
        t = time.perf_counter()
        res = score(heads)
        eval_seconds[0] += time.perf_counter() - t
        T1 = max(ev.temperatures)
        h = res["heldout"][T1]["rejection"]
        tr = res["train"][T1]["rejection"] if "train" in res else None
        per_src = "".join(f" | {src} {' / '.join(f'{a:.3f}' for a in r[T1]['rejection']['per_position'])} tau "
                          f"{r[T1]['rejection']['tau']:.2f}" for src, r in
                          ((k.removeprefix("heldout_"), v) for k, v in res.items() if k.startswith("heldout_")))
        print(f"[eval] step {step}: held-out T={T1:g} rejection per position "
              f"{' / '.join(f'{a:.3f}' for a in h['per_position'])} tau {h['tau']:.2f}" + per_src
              + (f" | train {' / '.join(f'{a:.3f}' for a in tr['per_position'])} tau {tr['tau']:.2f}" if tr else "")
              + f" | {time.perf_counter() - t0:.0f} s", flush=True)
        return res

    print(f"train-heads: {data_desc} -> {out} ({cfg.train.total_steps} steps; eval set {held_set.num_positions} "
          f"held-out positions, built in {eval_build_s:.0f} s)", flush=True)
    meta = {"model_spec": cfg.model, "notes": json.dumps({"data": data_desc, "phases": [asdict(p) for p in
                                                                                        cfg.train.phases]})}
    t_train = time.perf_counter()
    result = train_heads(policy, train, cfg.train, draft_vocab=vocab, checkpoint=out, resume=cfg.resume,
                         meta_defaults=meta, progress=cfg.progress, on_eval=on_eval, eval_at_start=ev.at_start)
    train_s = time.perf_counter() - t_train
    from experiments.common import cpu_name
    report = {"config": resolved, "out": str(out), "out_dir": str(out.parent), "data": data_desc, "threads": torch.get_num_threads(),
              "machine": f"{os.cpu_count()} cores of {cpu_name()}",
              "steps": result.steps, "losses": result.losses, "history": result.history,
              "final": result.history[-1] if result.history else None,
              "train_seconds_this_call": train_s, "eval_seconds": eval_seconds[0], "eval_build_seconds": eval_build_s,
              "aux_record_seconds": aux_record_s,
              "train_tokens_per_s": result.tokens_per_s, "train_rows_per_s": result.rows_per_s,
              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
              "meta": asdict(read_meta(out)) if aux_ids is None else
              {**json.loads((out / "config.json").read_text()), "steps": result.steps}}
    if ev.engine_prompts or ev.speedup_prompts:
        report.update(engine_report(policy, encode, result.heads, ev, cfg.train.temperature))
    if compare:
        report["compare"] = {spec: score(drafter) for spec, drafter in compare.items()}
    report["seconds_total"] = time.perf_counter() - t0
    atomic_write(out.with_suffix(".run.json"), json.dumps(report, indent=2, default=str) + "\n")
    if resolved:
        atomic_write(out.with_suffix(".config.yaml"), resolved)
    if report["final"]:
        print("held-out:\n" + format_acceptance(report["final"]["heldout"]))
    for spec, res in report.get("compare", {}).items():
        print(f"held-out, {spec} (same sequences):\n" + format_acceptance(res["heldout"]))
    print(f"{'drafter' if aux_ids is not None else 'heads'}: {out}\nreport: {out.with_suffix('.run.json')}")
    return report


def engine_report(policy, encode, heads, ev: EvalConfig, temperature: float) -> dict:
    """Engine acceptance per mode and batch-1 speed on held-out chat prompts (experiments.eval_heads)."""
    from experiments.eval_heads import decode_speedup, draft_cost, engine_acceptance
    from experiments.heads_data import chat_prompts
    prompts = chat_prompts(encode, max(ev.engine_prompts, ev.speedup_prompts), held_out=True)
    out = {}
    if ev.engine_prompts:
        out["engine"] = engine_acceptance(policy, heads, prompts[:ev.engine_prompts], k=ev.steps,
                                          temperature=temperature, max_new_tokens=ev.engine_new_tokens)
    if ev.speedup_prompts:
        out["draft_cost_ms"] = draft_cost(policy, heads, k=ev.steps)
        out["speedup"] = decode_speedup(policy, heads, prompts[:ev.speedup_prompts], k=ev.steps,
                                        temperature=temperature, max_new_tokens=ev.engine_new_tokens)
    return out


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(config_help(TrainHeadsConfig, usage=__doc__))
        return None
    cfg, resolved = load_train_heads_config(argv)
    return run(cfg, resolved)


if __name__ == "__main__":
    main()
