"""Where decoding time goes, and plain vs speculative throughput, side by side in one run.

    python -m experiments.bench_decode [configs/bench_decode.yaml] [key=value ...]
    (= mtp-rollout bench-decode ...; `--help` lists every key with the values a run uses)

For every engine setting (dtype x eager/compiled) and batch size: compile first (timed apart),
measure the verification-cost curve V(n) = cost(n-token forward) / cost(1-token forward), then
`repeats` interleaved generations: plain (k = 0), speculative with each fixed k of `num_draft_tokens`
and adaptive k up to the largest, all on the same prompts within a repeat (repeats rotate through the prompt list).
Prints medians of tok/s, the median of per-repeat ratios to plain, acceptance, tau, the per-round
time of draft / verify / accept / commit and adaptive k's rounds per k; writes JSON.

Function API (used by the vLLM side-by-side bench): `make_engine(...)` and
`run_ours(engine, prompts, sampling) -> dict` (one timed generate with its breakdown).
"""
from __future__ import annotations

import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from experiments.common import batch_of, machine
from rollout.config_loader import config_help, load_config, packaged_config, wants_help
from rollout.engine.config import EngineConfig
from rollout.engine.round import PHASES
from rollout.models.decoder import CausalLM
from rollout.models.dtypes import dtype_name
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams

DEFAULT_CONFIG = packaged_config("bench_decode")
BENCH_PROMPTS = [
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "What is the capital of France? Answer in one sentence.",
    "Explain in two sentences why the sky is blue.",
    "List four animals that live in the ocean.",
    "What is 12 times 7? Explain briefly.",
    "Describe a sunrise in one sentence.",
    "Name three programming languages and one use of each.",
]


@dataclass(frozen=True)
class BenchDecodeConfig:
    model: str = "smollm2-135m"            # named model, .gguf file or HF directory
    heads: str = "shipped"                 # shipped | init | a heads checkpoint path
    num_depths: int = 1                    # depths of heads=init; a checkpoint's must match
    num_draft_tokens: list[int] = field(default_factory=lambda: [3])   # fixed-k settings (each >= 1); the
                                           # largest is adaptive k's maximum
    adaptive: bool = True                  # also run adaptive k (EngineConfig.adaptive_k) up to the largest k
    draft_mode: str = "rejection"          # greedy | rejection
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    temperature: float = 1.0
    max_new_tokens: int = 64
    repeats: int = 3                       # interleaved repeats; medians are reported
    dtypes: list[str] = field(default_factory=lambda: ["auto"])   # float32 | bfloat16 | auto (hardware's best)
    compile: list[bool] = field(default_factory=lambda: [True])   # engine settings to run: eager and/or compiled
    threads: int = 1                       # torch threads
    verify_ns: list[int] = field(default_factory=lambda: [1, 2, 4, 8])   # n of the V(n) curve
    cost_repeats: int = 15                 # timed forwards per V(n) point (median; widths interleaved)
    json: str = ""                         # write all rows here
    log: str = ""                          # append a markdown table to this file (experiments/LOG.md)

    def __post_init__(self) -> None:
        from mtp_heads.shipped import check_heads_spec
        check_heads_spec("heads", self.heads)
        if not self.num_draft_tokens or min(self.num_draft_tokens) < 1:
            raise ValueError(f"num_draft_tokens must list draft counts >= 1 (plain decoding always runs), "
                             f"got {list(self.num_draft_tokens)}")

    @property
    def max_k(self) -> int:
        return max(self.num_draft_tokens)


def load_bench_config(argv: list[str]) -> tuple[BenchDecodeConfig, str]:
    """configs/bench_decode.yaml first unless argv names a YAML file, then argv."""
    if all("=" in a for a in argv):
        argv = [str(DEFAULT_CONFIG), *argv]
    return load_config(BenchDecodeConfig, argv)



# ------------------------------------------------------------------------------ function API
def make_engine(policy: CausalLM, heads, *, compile: bool) -> TorchEngine:
    return TorchEngine(policy, heads, config=EngineConfig(compile=compile, profile=True))


def run_ours(engine: TorchEngine, prompts: list[list[int]], sampling: SamplingParams,
             adaptive: bool = False) -> dict:
    """One timed generate: tok/s (compile time excluded), acceptance, per-round phase times (ms)."""
    engine.config = replace(engine.config, adaptive_k=adaptive, profile=True)  # no effect on compiled graphs
    batch = engine.generate(prompts, sampling)
    stats = batch.spec_stats()
    decode_s = batch.wall_time_s - batch.compile_time_s
    rounds = max(engine.times.rounds, 1)
    ks = [c.k for c in batch.k_choices]
    return dict(tok_s=batch.num_tokens / decode_s, tokens=batch.num_tokens, decode_s=decode_s,
                compile_s=batch.compile_time_s, rounds=engine.times.rounds,
                acceptance=stats.acceptance_rate, tau=stats.acceptance_length,
                phase_ms={p: 1e3 * engine.times.seconds.get(p, 0.0) / rounds for p in PHASES},
                mean_k=statistics.mean(ks) if ks else float(sampling.num_draft_tokens),
                k_hist={k: ks.count(k) for k in sorted(set(ks))})


@torch.inference_mode()
def verify_cost_curve(engine: TorchEngine, prompts: list[list[int]], ns: list[int], repeats: int) -> dict:
    """V(n): median time of an n-token target forward over the median 1-token time, same batch.
    Forwards start at each row's pending position, as in decoding (cache context = the prompt); the
    widths are interleaved within each repeat, so that the machine's drift does not land on one n."""
    sp = SamplingParams(max_new_tokens=max(ns) + 2, temperature=1.0, ignore_eos=True, seed=0)
    ctx, st, _ = engine._prefill(prompts, sp)
    c = st.committed
    rows = torch.arange(st.batch)[:, None]
    tokens = {n: st.seq[rows, (c - 1)[:, None] + torch.arange(n)] for n in ns}
    for n in ns:
        engine.forwards.target(tokens[n], c - 1, st.target)       # compile / warm up
    samples: dict[int, list[float]] = {n: [] for n in ns}
    for _ in range(repeats):
        for n in ns:
            t0 = time.perf_counter()
            engine.policy.compute_logits(engine.forwards.target(tokens[n], c - 1, st.target))
            samples[n].append(time.perf_counter() - t0)
    times = {n: statistics.median(ts) for n, ts in samples.items()}
    return {"ms": {n: 1e3 * t for n, t in times.items()}, "V": {n: times[n] / times[ns[0]] for n in ns}}


# ------------------------------------------------------------------------------ the study
def settings(cfg: BenchDecodeConfig) -> list[tuple[str, int, bool]]:
    """(name, k, adaptive) of every generation setting: plain, the largest k, adaptive k, the other ks."""
    k = cfg.max_k
    out = [("plain", 0, False), (f"k={k}", k, False)]
    if cfg.adaptive:
        out.append((f"adaptive<={k}", k, True))
    out += [(f"k={j}", j, False) for j in dict.fromkeys(cfg.num_draft_tokens) if j != k]
    return out


def bench_engine(engine: TorchEngine, prompts_ids, cfg: BenchDecodeConfig, label: str) -> list[dict]:
    rows = []
    for batch_size in cfg.batch_sizes:
        prompts = batch_of(prompts_ids, batch_size, 0)
        common = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, ignore_eos=True)
        sps = {name: (SamplingParams(**common, num_draft_tokens=k, draft_mode=cfg.draft_mode), ad)
               for name, k, ad in settings(cfg)}
        t0 = time.perf_counter()
        compile_s = 0.0
        for name, (sp, ad) in sps.items():   # warm-up: compiles every shape these settings use
            compile_s += run_ours(engine, prompts, replace(sp, seed=0), ad)["compile_s"]
        vcurve = verify_cost_curve(engine, prompts, cfg.verify_ns, cfg.cost_repeats)
        warm_s = time.perf_counter() - t0
        runs = {name: [] for name in sps}
        for rep in range(cfg.repeats):
            batch = batch_of(prompts_ids, batch_size, rep + 1)
            for name, (sp, ad) in sps.items():
                runs[name].append(run_ours(engine, batch, replace(sp, seed=rep + 1), ad))
        for name, rs in runs.items():
            row = dict(engine=label, batch=batch_size, setting=name, temperature=cfg.temperature,
                       tok_s=statistics.median(r["tok_s"] for r in rs),
                       ratio_to_plain=statistics.median(r["tok_s"] / p["tok_s"] for r, p in zip(rs, runs["plain"])),
                       acceptance=statistics.median(r["acceptance"] for r in rs) if name != "plain" else None,
                       tau=statistics.median(r["tau"] for r in rs) if name != "plain" else None,
                       mean_k=statistics.median(r["mean_k"] for r in rs),
                       phase_ms={p: statistics.median(r["phase_ms"][p] for r in rs) for p in PHASES},
                       compile_s=compile_s, warmup_s=warm_s, V=vcurve["V"], forward_ms=vcurve["ms"],
                       all_tok_s=[r["tok_s"] for r in rs],
                       k_rounds={k: sum(r["k_hist"].get(k, 0) for r in rs)
                                 for k in sorted({k for r in rs for k in r["k_hist"]})})
            rows.append(row)
            ph = " ".join(f"{p} {v:.1f}" for p, v in row["phase_ms"].items())
            print(f"{label:<18} B={batch_size:<2} {name:<13} {row['tok_s']:7.2f} tok/s  x{row['ratio_to_plain']:.2f}"
                  f"  acc {row['acceptance'] if row['acceptance'] is not None else float('nan'):.3f}"
                  f"  mean k {row['mean_k']:.2f}  ms/round: {ph}"
                  + (f"  rounds per k {row['k_rounds']}" if name.startswith("adaptive") else ""), flush=True)
        print(f"{label:<18} B={batch_size:<2} V(n): " + "  ".join(f"V({n})={v:.2f}" for n, v in vcurve["V"].items())
              + f"   1-token forward {vcurve['ms'][cfg.verify_ns[0]]:.1f} ms   compile {compile_s:.1f} s", flush=True)
    return rows


def append_log(path: str, argv: list[str], heads_desc: str, rows: list[dict]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"\n## {dt.date.today().isoformat()} bench_decode (commit {commit})\n",
             f"Command: `python -m experiments.bench_decode {' '.join(argv)}`  ",
             f"Machine: {machine()}  ", f"Heads: {heads_desc}\n",
             "| engine | batch | setting | tok/s | x plain | acceptance | mean k | draft / verify / accept / commit ms per round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        ph = " / ".join(f"{v:.1f}" for v in r["phase_ms"].values())
        lines.append(f"| {r['engine']} | {r['batch']} | {r['setting']} | {r['tok_s']:.2f} | {r['ratio_to_plain']:.2f} | "
                     f"{acc} | {r['mean_k']:.2f} | {ph} |")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["--against", "vllm"]:         # ours vs vLLM side by side: experiments/bench_vllm.py
        from experiments.bench_vllm import main as against_vllm
        return against_vllm(argv[2:])
    if wants_help(argv):
        rest = [a for a in argv if not wants_help([a])]
        print(config_help(BenchDecodeConfig, usage=__doc__,
                          argv=rest if any("=" not in a for a in rest) else [str(DEFAULT_CONFIG), *rest]), end="")
        return 0
    cfg, resolved = load_bench_config(argv)
    torch.set_num_threads(cfg.threads)
    from mtp_heads.shipped import resolve_heads
    from rollout.models.loaders import apply_chat_template
    from rollout.models.loaders import load_policy
    rows = []
    for dtype in cfg.dtypes:
        name = dtype_name(dtype)
        policy, loaded = load_policy(cfg.model, name)
        heads, heads_desc = resolve_heads(policy, cfg.heads, model=cfg.model, num_depths=cfg.num_depths)
        prompts = [apply_chat_template(loaded, [{"role": "user", "content": p}]) for p in BENCH_PROMPTS]
        print(f"{cfg.model} {name}  heads: {heads_desc}  machine: {machine()}", flush=True)
        for compiled in cfg.compile:
            engine = make_engine(policy, heads, compile=compiled)
            rows += bench_engine(engine, prompts, cfg, f"{name} {'compiled' if compiled else 'eager'}")
    print(f"machine at the end: {machine()}")
    if cfg.log:
        append_log(cfg.log, argv, heads_desc, rows)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(dict(config=resolved, machine=machine(), rows=rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
