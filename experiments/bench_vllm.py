"""Ours vs vLLM side by side: `mtp-rollout bench-decode --against vllm`.

    mtp-rollout bench-decode --against vllm [configs/bench_vllm.yaml] [key=value ...]   (default: that file)
    python -m experiments.bench_vllm [configs/bench_vllm.yaml] [key=value ...]     (--help: every key)

One process tree: for every setting (dtype x torch threads) the parent starts one child process per
engine (our torch engine, which serves plain and speculative calls; vLLM plain; vLLM speculative
with our heads as its drafter, or, when `heads` is an EAGLE-3 directory, with vLLM's own eagle3
method). Children wait on a pipe, so only one engine computes at a time.
Each repeat runs every (batch size, engine variant) once with the same prompts and seed, in an
order rotated per repeat; the repeats rotate through the prompt list, so batch 1 is not one prompt.
Reported: median tokens/s, the median of the per-repeat ratios, and acceptance (rate, tau,
conditional per draft position). JSON with `json=PATH`, a dated
experiments/LOG.md entry with `log=PATH`. Function API: `run(AgainstVLLMConfig) -> dict`.
Threads: our engine calls torch.set_num_threads; vLLM's CPU worker pins that many OpenMP threads
(VLLM_CPU_OMP_THREADS_BIND) to cores 0..t-1 and our engine's process is pinned to the next t cores
where the machine has them (`engine_cores`), so neither runs beside the other's idle threads; the
machine's load average is recorded before and after.
"""
from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from experiments.common import batch_of, cpu_name
from rollout.models.loaders import DEFAULT_MODEL
from rollout.types import SamplingParams, SpecDecodingStats

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List four animals that live in the ocean.",
    "What is 12 times 7? Explain briefly.",
    "Give two tips for learning a new language.",
    "Explain what a prime number is to a child.",
]
VARIANTS = ("torch-plain", "torch-spec", "vllm-plain", "vllm-spec")   # what `engines` may list


@dataclass(frozen=True)
class AgainstVLLMConfig:
    """One side-by-side benchmark of our engine and vLLM (configs/bench_vllm.yaml)."""

    model: str = DEFAULT_MODEL          # named model, .gguf file or HF directory
    heads: str = "shipped"              # shipped | shipped-eagle3 | init | a heads checkpoint path | an EAGLE-3 directory
    num_depths: int = 1                 # depths of heads=init (vLLM drafts with depth 1 only)
    num_draft_tokens: int = 3           # draft tokens per round of the speculative variants
    draft_mode: str = "rejection"       # greedy | rejection
    vllm_draft_method: str = "heads"    # vllm-spec drafts with: heads (ours; an EAGLE-3 `heads` directory drafts
                                        # with vLLM's eagle3) | eagle3 (needs that directory) | ngram | suffix
    temperature: float = 1.0            # sampling temperature of every engine (0 = greedy)
    max_new_tokens: int = 64            # per completion; EOS ignored so every call emits the same count
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])            # prompts per generate call
    dtypes: list[str] = field(default_factory=lambda: ["bfloat16", "float32"])
    threads: list[int] = field(default_factory=lambda: [1])        # torch / vLLM OpenMP threads per engine
    repeats: int = 3                    # timed calls per (setting, batch, engine), after one warm-up call
    engines: list[str] = field(default_factory=lambda: list(VARIANTS))       # subset of VARIANTS
    vllm_compile: bool = False          # vLLM without enforce_eager (torch.compile; CUDA graphs on GPU)
    torch_compile: bool | None = None   # our engine's EngineConfig.compile (None = auto: eager on CPU, compiled on GPU)
    device: str = "cpu"                 # of our engine (vLLM picks its platform itself)
    gpu_memory_utilization: float = 0.3  # per vLLM instance (two run at once on a GPU)
    seed: int = 1000                    # repeat r uses seed + r for every engine
    json: str | None = None             # write all results here
    log: str | None = None              # append a dated entry to this markdown file (experiments/LOG.md)

    def __post_init__(self):
        bad = [e for e in self.engines if e not in VARIANTS]
        if bad or not self.engines:
            raise ValueError(f"engines must be a non-empty subset of {VARIANTS}, got {list(self.engines)}")
        if self.repeats < 1 or self.num_draft_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("repeats, num_draft_tokens and max_new_tokens must be >= 1")
        from mtp_heads.shipped import check_heads_spec
        check_heads_spec("heads", self.heads)
        from rollout.vllm.engine import DRAFT_METHODS
        if self.vllm_draft_method not in DRAFT_METHODS:
            raise ValueError(f"vllm_draft_method must be one of {list(DRAFT_METHODS)}, got {self.vllm_draft_method!r}")
        if self.vllm_draft_method == "eagle3":
            vllm_drafter(self.heads, self.vllm_draft_method, self.model)   # names a `heads` that is no EAGLE-3 dir


def vllm_drafter(heads: str, vllm_draft_method: str, model: str) -> tuple[str, str | None]:
    """vLLM's draft_method and drafter_path for a `heads` setting: our drafter plugin computes MTP heads
    only, so an EAGLE-3 directory drafts with vLLM's built-in eagle3 method; history methods need no drafter."""
    from mtp_heads.eagle3_checkpoint import CONFIG_FILE, drafter_layout
    from rollout.vllm.engine import HISTORY_METHODS

    if vllm_draft_method in HISTORY_METHODS:
        return vllm_draft_method, None
    from mtp_heads.shipped import drafter_location
    heads = drafter_location(heads, model)
    path = None if heads in ("shipped", "init") else Path(heads).expanduser()
    if path is not None and (path.is_dir() or path.name == CONFIG_FILE) and drafter_layout(path) == "eagle3":
        return "eagle3", str(path if path.is_dir() else path.parent)
    if vllm_draft_method == "eagle3":
        raise ValueError(f"vllm_draft_method=eagle3 needs heads=<an EAGLE-3 directory>, got heads={heads!r}")
    return "heads", None


# --------------------------------------------------------------------------- child processes
def engine_cores(kind: str, threads: int) -> list[int]:
    """The cores an engine's process computes on: vLLM's pinned OpenMP threads take cores 0..t-1, ours
    the next t cores when the machine has them (else the same ones): left unpinned beside vLLM's
    processes, ours ran well below its speed alone."""
    n = os.cpu_count() or 1
    first = threads if not kind.startswith("vllm") and n >= 2 * threads else 0
    return list(range(first, first + threads))


def _child(conn, cfg: AgainstVLLMConfig, kind: str, dtype: str, threads: int, prompts: list[list[int]]) -> None:
    """One engine in its own process: answers ("gen", batch, k, seed, max_new) until ("stop",)."""
    try:
        cores = engine_cores(kind, threads)
        if kind.startswith("vllm"):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
        elif hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        import torch

        torch.set_num_threads(threads)
        from mtp_heads.shipped import resolve_heads
        from rollout.models.loaders import load_policy

        policy, _ = load_policy(cfg.model, dtype)
        heads, heads_desc = resolve_heads(policy, cfg.heads, model=cfg.model, num_depths=cfg.num_depths)
        policy, heads = policy.to(cfg.device), heads.to(cfg.device)
        t0 = time.perf_counter()
        if kind == "torch":
            from rollout.engine.config import EngineConfig
            from rollout.torch_engine import TorchEngine
            engine = TorchEngine(policy, heads, config=EngineConfig(compile=cfg.torch_compile))
        else:
            from rollout.vllm import VLLMEngine, VLLMEngineConfig
            method, drafter_path = vllm_drafter(cfg.heads, cfg.vllm_draft_method, cfg.model)
            engine = VLLMEngine(policy, heads if method == "heads" else None, config=VLLMEngineConfig(
                dtype=dtype, enforce_eager=not cfg.vllm_compile, gpu_memory_utilization=cfg.gpu_memory_utilization,
                draft_method=method, drafter_path=drafter_path))
        conn.send(("ready", heads_desc))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, batch, k, seed, max_new, offset = msg
            sp = SamplingParams(max_new_tokens=max_new, temperature=cfg.temperature, num_draft_tokens=k,
                                draft_mode=cfg.draft_mode, ignore_eos=True, seed=seed)
            out = engine.generate(batch_of(prompts, batch, offset), sp)
            stats = out.spec_stats() if k else SpecDecodingStats()
            conn.send(("ok", dict(tok_s=out.tokens_per_s, tokens=out.num_tokens, wall_s=out.wall_time_s,
                                  stats=asdict(stats), start_s=getattr(engine, "start_time_s", None),
                                  setup_s=time.perf_counter() - t0)))
        if hasattr(engine, "close"):
            engine.close()
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the run with it
        conn.send(("error", traceback.format_exc()))


class _Engine:
    """The parent's handle on one child process."""

    def __init__(self, ctx, cfg, kind: str, dtype: str, threads: int, prompts):
        self.kind = kind
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, cfg, kind, dtype, threads, prompts), daemon=True)
        self.proc.start()
        self.heads_desc = self._reply()

    def _reply(self):
        status, payload = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.kind} engine process failed:\n{payload}")
        return payload

    def generate(self, batch: int, k: int, seed: int, max_new: int, offset: int = 0) -> dict:
        """`batch` prompts from the list, starting at `offset` (experiments.common.batch_of)."""
        self.conn.send(("gen", batch, k, seed, max_new, offset))
        return self._reply()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


# --------------------------------------------------------------------------- the benchmark
def _chat_prompts(cfg: AgainstVLLMConfig) -> list[list[int]]:
    from rollout.models.loaders import apply_chat_template, load_model

    loaded = load_model(cfg.model)
    return [apply_chat_template(loaded, [{"role": "user", "content": p}]) for p in PROMPTS]


def _merge(rows: list[dict]) -> SpecDecodingStats:
    total = SpecDecodingStats()
    for r in rows:
        total = total.merge(SpecDecodingStats(**r["stats"]))
    return total


def _setting(ctx, cfg: AgainstVLLMConfig, dtype: str, threads: int, prompts) -> dict:
    """All engines of one (dtype, threads) setting, interleaved; returns per (batch, variant) results."""
    kinds = {"torch": any(e.startswith("torch") for e in cfg.engines),
             "vllm-plain": "vllm-plain" in cfg.engines, "vllm-spec": "vllm-spec" in cfg.engines}
    load_before = os.getloadavg()
    engines = {}
    try:
        for kind, wanted in kinds.items():
            if wanted:
                engines[kind] = _Engine(ctx, cfg, kind, dtype, threads, prompts)
        route = {"torch-plain": ("torch", 0), "torch-spec": ("torch", cfg.num_draft_tokens),
                 "vllm-plain": ("vllm-plain", 0), "vllm-spec": ("vllm-spec", cfg.num_draft_tokens)}
        runs: dict[tuple[int, str], list[dict]] = {}
        for b in cfg.batch_sizes:                          # warm-up: first-call allocations, compilation
            for v in cfg.engines:
                kind, k = route[v]
                engines[kind].generate(b, k, cfg.seed - 1, min(8, cfg.max_new_tokens))
        for r in range(cfg.repeats):
            for b in cfg.batch_sizes:
                order = list(cfg.engines)[r % len(cfg.engines):] + list(cfg.engines)[:r % len(cfg.engines)]
                for v in order:
                    kind, k = route[v]
                    res = engines[kind].generate(b, k, cfg.seed + r, cfg.max_new_tokens, offset=r + 1)
                    runs.setdefault((b, v), []).append(res)
                    st = SpecDecodingStats(**res["stats"])
                    acc = f"  acceptance {st.acceptance_rate:.3f} tau {st.acceptance_length:.2f}" if k else ""
                    print(f"  {dtype} {threads}t B={b} rep {r} {v:11s} {res['tok_s']:8.1f} tok/s{acc}", flush=True)
        heads_desc = next(iter(engines.values())).heads_desc
    finally:
        for e in engines.values():
            e.stop()
    rows = []
    for (b, v), reps in runs.items():
        st = _merge(reps) if route[v][1] else None
        rows.append(dict(dtype=dtype, threads=threads, batch=b, engine=v,
                         tok_s=statistics.median(x["tok_s"] for x in reps), tok_s_all=[x["tok_s"] for x in reps],
                         acceptance=st.acceptance_rate if st else None, tau=st.acceptance_length if st else None,
                         cond_acceptance=st.conditional_acceptance if st else None,
                         vllm_start_s=reps[0]["start_s"]))
    ratios = {}
    for b in cfg.batch_sizes:
        for num, den in (("torch-spec", "torch-plain"), ("vllm-spec", "vllm-plain"), ("torch-plain", "vllm-plain"),
                         ("torch-spec", "vllm-plain")):
            if (b, num) in runs and (b, den) in runs:
                ratios[f"B={b} {num} / {den}"] = statistics.median(
                    x["tok_s"] / y["tok_s"] for x, y in zip(runs[(b, num)], runs[(b, den)]))
    return dict(dtype=dtype, threads=threads, heads=heads_desc, rows=rows, ratios=ratios,
                load_before=load_before, load_after=os.getloadavg())


def run(cfg: AgainstVLLMConfig) -> dict:
    """Every (dtype, threads) setting in turn; returns {"config", "machine", "settings": [...]}."""
    ctx = mp.get_context("spawn")
    prompts = _chat_prompts(cfg)
    out = dict(config=asdict(cfg), machine=f"{cpu_name()}, {os.cpu_count()} logical CPUs",
               vllm_drafts=vllm_drafter(cfg.heads, cfg.vllm_draft_method, cfg.model)[0],
               started=dt.datetime.now(dt.timezone.utc).isoformat(),
               settings=[])
    for dtype in cfg.dtypes:
        for threads in cfg.threads:
            print(f"== {dtype}, {threads} thread(s)", flush=True)
            s = _setting(ctx, cfg, dtype, threads, prompts)
            out["settings"].append(s)
            print(_table(s), flush=True)
    return out


def _table(s: dict) -> str:
    fmt = lambda xs: "[" + " ".join(f"{x:.2f}" for x in xs) + "]"  # noqa: E731
    lines = [f"{s['dtype']}, {s['threads']} thread(s); heads: {s['heads']}; load average "
             f"{s['load_before'][0]:.1f} before, {s['load_after'][0]:.1f} after", "",
             "| batch | engine | tok/s (median) | acceptance | tau | conditional acceptance per position |",
             "|---|---|---|---|---|---|"]
    for r in s["rows"]:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        cond = "" if r["cond_acceptance"] is None else fmt(r["cond_acceptance"])
        lines.append(f"| {r['batch']} | {r['engine']} | {r['tok_s']:.1f} | {acc} | {tau} | {cond} |")
    lines += ["", "Ratios (median of per-repeat ratios): " + "; ".join(f"{k} = {v:.2f}" for k, v in s["ratios"].items())]
    return "\n".join(lines)


def append_log(path: str, argv: list[str], result: dict) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cfg = result["config"]
    head = [f"\n## {dt.date.today().isoformat()} — bench-decode --against vllm (commit {commit})\n",
            f"Command: `mtp-rollout bench-decode --against vllm {' '.join(argv)}`  ",
            f"Machine: {result['machine']}; k={cfg['num_draft_tokens']} {cfg['draft_mode']}, vLLM drafts "
            f"{result['vllm_drafts']}, T={cfg['temperature']}, "
            f"{cfg['max_new_tokens']} new tokens, {cfg['repeats']} repeats, vLLM "
            f"{'compiled' if cfg['vllm_compile'] else 'eager'}\n"]
    with open(path, "a") as f:
        f.write("\n".join(head) + "\n" + "\n\n".join(_table(s) for s in result["settings"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    from rollout.config_loader import config_help, load_config, packaged_config, wants_help

    argv = sys.argv[1:] if argv is None else argv
    rest = [a for a in argv if not wants_help([a])]
    layers = rest if any("=" not in a for a in rest) else [str(packaged_config("bench_vllm")), *rest]
    if wants_help(argv):         # the defaults shown are those a run with this argv uses
        print(config_help(AgainstVLLMConfig, usage=__doc__, argv=layers), end="")
        return 0
    cfg, _ = load_config(AgainstVLLMConfig, layers)
    result = run(cfg)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(result, f, indent=1)
    if cfg.log:
        append_log(cfg.log, argv, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
