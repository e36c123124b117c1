"""Plain vs speculative decoding on the RL workload, side by side in one run, and where a round's time goes.

    python -m experiments.bench_decode [configs/bench_decode.yaml] [key=value ...]
    (= mtp-rollout bench-decode ...; `--help` lists every key with the values a run uses)

The workload is the RL job's: reasoning-gym prompts (the `tasks` block, as in `mtp-rollout run`),
batches of GRPO groups (batch 8 = one prompt 8 times, 16 = two prompts), `history_epochs` untimed
passes over the measured prompts first, so that rollout history holds earlier epochs as it does in
RL. Each setting has its own engine (its own history, predictor and cost model) over the same
weights: `plain` (k = 0), `fixed` (every row drafts k head tokens), `heads`, `history` and `both`
(each row chooses per round by predicted acceptance from those sources: `both` is the engine's
default, which runs a batch size's calls plain where speculating them recently cost more;
`both_always` speculates in every call). Within a repeat every setting decodes the same batch, in turn (the order reversed every
other repeat); medians over repeats of tok/s and of the per-repeat ratio to plain are printed with
acceptance, tokens per round, the share of tokens from each source and the per-round time of draft /
verify / accept / commit, and of the engine's host work around the round (the row view, what the chooser,
the cost model and the history learn from it).

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

import numpy as np
import torch

from experiments.common import check_device, machine
from rollout.config_loader import config_help, load_config, packaged_config, wants_help
from rollout.engine.config import EngineConfig, bucket
from rollout.engine.forwards import compiles
from rollout.engine.round import PHASES
from rollout.models.decoder import CausalLM
from rollout.models.dtypes import dtype_name
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from trainers.tasks import TaskConfig

DEFAULT_CONFIG = packaged_config("bench_decode")
# setting -> EngineConfig fields of its engine (plain decodes with k = 0)
SETTINGS: dict[str, dict] = {
    "plain": {},
    "fixed": dict(draft_lengths="fixed"),
    "heads": dict(draft_sources=("heads",)),
    "history": dict(draft_sources=("history",)),
    "both": dict(draft_sources=("heads", "history")),
    "both_always": dict(draft_sources=("heads", "history"), plain_when_slower=False),   # no call runs plain
}


@dataclass(frozen=True)
class BenchDecodeConfig:
    model: str = "smollm2-135m"            # named model, .gguf file or HF directory
    heads: str = "shipped"                 # shipped | init | a heads checkpoint path
    num_depths: int = 1                    # depths of heads=init; a checkpoint's must match
    num_draft_tokens: int = 4              # k: the most drafts a row verifies per round
    settings: list[str] = field(default_factory=lambda: list(SETTINGS))   # which of SETTINGS to run
    draft_mode: str = "rejection"          # greedy | rejection (heads)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])   # 1, or multiples of group_size
    group_size: int = 8                    # rows per prompt in a batch (GRPO groups)
    temperature: float = 1.0
    max_new_tokens: int = 128
    ignore_eos: bool = True                # every row makes max_new_tokens (equal work per setting); false: rows
                                           # stop at EOS as in the RL job (lengths differ between settings)
    repeats: int = 3                       # interleaved repeats, each on its own prompts; medians are reported
    history_epochs: int = 1                # untimed passes over the measured prompts first (earlier epochs)
    plain_when_slower: bool = True         # the engine's gate (EngineConfig): false makes every call of the chosen
                                           # settings speculate (a study of the chooser itself)
    tasks: TaskConfig = field(default_factory=lambda: TaskConfig(num_prompts=64, heldout_prompts=0))
    dtype: str = "auto"                    # float32 | bfloat16 | auto (hardware's best)
    compile: bool | None = None            # torch.compile the forwards; None = the engine's choice (GPUs compiled,
                                           # CPUs eager, which is faster there)
    threads: int = 1                       # torch threads
    device: str = "cpu"                    # cpu | cuda | cuda:N: where the policy, heads and caches live
    json: str = ""                         # write all rows here
    log: str = ""                          # append a markdown table to this file (experiments/LOG.md)

    def __post_init__(self) -> None:
        from mtp_heads.shipped import check_heads_spec
        check_heads_spec("heads", self.heads)
        check_device("device", self.device)
        if not 1 <= self.num_draft_tokens:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        unknown = [s for s in self.settings if s not in SETTINGS]
        if unknown or "plain" not in self.settings:
            raise ValueError(f"settings must include plain and name only {list(SETTINGS)}, got {list(self.settings)}")
        bad = [b for b in self.batch_sizes if b < 1 or (b > 1 and b % self.group_size)]
        if bad:
            raise ValueError(f"batch_sizes must be 1 or multiples of group_size={self.group_size}, got {bad}")
        for key, value in (("repeats", self.repeats), ("max_new_tokens", self.max_new_tokens),
                           ("group_size", self.group_size)):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.history_epochs < 0:
            raise ValueError(f"history_epochs must be >= 0, got {self.history_epochs}")


def load_bench_config(argv: list[str]) -> tuple[BenchDecodeConfig, str]:
    """configs/bench_decode.yaml first unless argv names a YAML file, then argv."""
    if all("=" in a for a in argv):
        argv = [str(DEFAULT_CONFIG), *argv]
    return load_config(BenchDecodeConfig, argv)


# ------------------------------------------------------------------------------ function API
def make_engine(policy: CausalLM, heads, *, compile: bool | None, **engine_fields) -> TorchEngine:
    return TorchEngine(policy, heads, config=EngineConfig(compile=compile, profile=True, **engine_fields))


def run_ours(engine: TorchEngine, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    """One timed generate: tok/s (compile time excluded), acceptance, tokens per round, the share of
    tokens from each draft source, per-round phase times (ms)."""
    batch = engine.generate(prompts, sampling)
    stats = batch.spec_stats()
    decode_s = batch.wall_time_s - batch.compile_time_s
    rounds = max(engine.times.rounds, 1)
    accepted = {"heads": 0, "history": 0}
    drafted_rows = 0
    for c in batch.completions:
        for n, src in zip(c.round_accepted, c.round_sources or ["heads"] * len(c.round_accepted)):
            accepted[src] += n
        drafted_rows += len(c.round_accepted)
    return dict(tok_s=batch.num_tokens / decode_s, tokens=batch.num_tokens, decode_s=decode_s,
                compile_s=batch.compile_time_s, rounds=engine.times.rounds,
                acceptance=stats.acceptance_rate, tau=stats.acceptance_length,
                tokens_per_round=batch.num_tokens / rounds / max(len(prompts), 1),
                share={src: n / max(batch.num_tokens, 1) for src, n in accepted.items()},
                mean_drafts=stats.num_draft_tokens / drafted_rows if drafted_rows else 0.0,
                speedup_estimate=batch.plain_estimate_s / batch.wall_time_s,   # the engine's own (nan: none)
                paused=batch.speculation_paused, tail_only=batch.speculation_tail_only,
                # plain calls' cost over the cost model's price for them, as the gate now holds it (1: none ran)
                price_check=engine.gate.calibration(bucket(len(prompts), engine.config.batch_buckets)),
                margin=engine.chooser.margin.get(len(prompts), 1.0) if engine.chooser is not None else 1.0,
                phase_ms={p: 1e3 * engine.times.seconds.get(p, 0.0) / rounds for p in PHASES})


# ------------------------------------------------------------------------------ the study
def workload(cfg: BenchDecodeConfig, encode) -> dict[int, list[list[list[int]]]]:
    """batch size -> the batches of the repeats: groups of `group_size` rows per prompt (1 row at batch 1),
    each repeat on prompts of its own."""
    from trainers.tasks import TaskSource
    texts = [t.prompt for t in TaskSource(cfg.tasks).train]
    out = {}
    for B in cfg.batch_sizes:
        per = max(1, B // cfg.group_size)
        rows = 1 if B == 1 else cfg.group_size
        if per * cfg.repeats > len(texts):
            raise ValueError(f"tasks.num_prompts={len(texts)} is too few for {cfg.repeats} repeats of batch {B}")
        out[B] = [[encode(texts[r * per + i]) for i in range(per) for _ in range(rows)] for r in range(cfg.repeats)]
    return out


def bench(policy, heads, cfg: BenchDecodeConfig, batches: dict[int, list], label: str) -> list[dict]:
    engines = {name: make_engine(policy, heads if name != "plain" else None, compile=cfg.compile,
                                 **{"plain_when_slower": cfg.plain_when_slower, **SETTINGS[name]})
               for name in cfg.settings}
    rows = []
    for B, repeats in batches.items():
        sps = {name: SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                    num_draft_tokens=0 if name == "plain" else cfg.num_draft_tokens,
                                    draft_mode=cfg.draft_mode, ignore_eos=cfg.ignore_eos)
               for name in cfg.settings}
        t0 = time.perf_counter()
        for epoch in range(cfg.history_epochs):     # earlier epochs over the same prompts: history, warm shapes
            for r, prompts in enumerate(repeats):
                for name, engine in engines.items():
                    engine.generate(prompts, replace(sps[name], seed=10_000 * (epoch + 1) + r))
        warm_s = time.perf_counter() - t0
        runs = {name: [] for name in engines}
        for r, prompts in enumerate(repeats):
            for name, engine in in_turn(engines, r):
                runs[name].append(run_ours(engine, prompts, replace(sps[name], seed=r)))
        for name, rs in runs.items():
            med = lambda key: statistics.median(x[key] for x in rs)   # noqa: E731
            ratios = [x["tok_s"] / p["tok_s"] for x, p in zip(rs, runs["plain"])]
            row = dict(engine=label, batch=B, setting=name, temperature=cfg.temperature, tok_s=med("tok_s"),
                       ratio_to_plain=statistics.median(ratios), all_ratios=ratios,
                       pooled_ratio=pooled_tok_s(rs) / pooled_tok_s(runs["plain"]),
                       pooled_interval=pooled_ratio_interval(rs, runs["plain"]),
                       speedup_estimate=med("speedup_estimate"), margin=med("margin"),
                       paused=sum(x["paused"] for x in rs), tail_only=sum(x["tail_only"] for x in rs),
                       price_check=rs[-1]["price_check"],
                       acceptance=med("acceptance") if name != "plain" else None,
                       tokens_per_round=med("tokens_per_round"), tokens_per_row=med("tokens") / B,
                       mean_drafts=med("mean_drafts"),
                       share={src: statistics.median(x["share"][src] for x in rs) for src in ("heads", "history")},
                       phase_ms={p: statistics.median(x["phase_ms"][p] for x in rs) for p in PHASES},
                       warmup_s=warm_s, all_tok_s=[x["tok_s"] for x in rs])
            rows.append(row)
            ph = " ".join(f"{p} {v:.1f}" for p, v in row["phase_ms"].items())
            print(f"{label:<10} T={cfg.temperature} B={B:<2} {name:<8} {row['tok_s']:7.1f} tok/s  x{row['ratio_to_plain']:.3f}"
                  f"  [{min(row['all_ratios']):.2f}-{max(row['all_ratios']):.2f}] pooled x{row['pooled_ratio']:.3f} (95% {row['pooled_interval'][0]:.2f}-{row['pooled_interval'][1]:.2f}; engine's estimate x{row['speedup_estimate']:.3f}, margin {row['margin']:.2f}, plain calls {row['paused']}/{len(rs)}, tail only {row['tail_only']}/{len(rs)}, price check x{row['price_check']:.3f})"
                  f"  acc {row['acceptance'] if row['acceptance'] is not None else float('nan'):.3f}"
                  f"  tok/row {row['tokens_per_row']:.0f}  tok/round/row {row['tokens_per_round']:.2f}  drafts/row-round {row['mean_drafts']:.2f}"
                  f"  share heads {row['share']['heads']:.2f} history {row['share']['history']:.2f}  ms/round: {ph}",
                  flush=True)
    return rows


def in_turn(engines: dict, repeat: int) -> list:
    """The (setting, engine) pairs in the order repeat `repeat` runs them: reversed every other repeat,
    so that the machine's drift within a repeat (tens of percent within minutes on a shared CPU)
    favours neither the setting that runs first nor the one that runs last."""
    order = list(engines.items())
    return order[::-1] if repeat % 2 else order


def pooled_tok_s(runs: list[dict]) -> float:
    """All repeats' tokens over all their seconds: what a job decoding these batches sees. With rows
    stopping at EOS each repeat's lengths differ between settings and per-repeat ratios scatter with them."""
    return sum(r["tokens"] for r in runs) / sum(r["decode_s"] for r in runs)


def pooled_ratio_interval(runs: list[dict], plain_runs: list[dict], n_boot: int = 2000,
                          seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the pooled ratio to plain, from resampling the repeats (each repeat's
    setting and plain run together: they decoded the same batch). Where rows stop at EOS the settings'
    lengths differ from repeat to repeat, and runs of one cell scatter by several percent; the interval
    says whether a run resolves the difference it is read for."""
    tokens, seconds = (np.array([r[key] for r in runs], dtype=float) for key in ("tokens", "decode_s"))
    plain_tokens, plain_seconds = (np.array([r[key] for r in plain_runs], dtype=float) for key in ("tokens", "decode_s"))
    picks = np.random.default_rng(seed).integers(0, len(runs), size=(n_boot, len(runs)))     # [n_boot, repeats]
    ratios = (tokens[picks].sum(1) / seconds[picks].sum(1)) / (plain_tokens[picks].sum(1) / plain_seconds[picks].sum(1))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def append_log(path: str, argv: list[str], heads_desc: str, rows: list[dict]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"\n## {dt.date.today().isoformat()} bench_decode (commit {commit})\n",
             f"Command: `python -m experiments.bench_decode {' '.join(argv)}`  ",
             f"Machine: {machine()}  ", f"Heads: {heads_desc}\n",
             "| engine | T | batch | setting | tok/s | x plain (range) | pooled x plain (95% interval) | tokens per row | acceptance | "
             "drafts per row-round | token share heads / history | draft / verify / accept / commit / host ms per round | "
             "calls run plain / drafting only in their tails (plain_when_slower) | plain calls' cost / the model's price |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        ph = " / ".join(f"{v:.1f}" for v in r["phase_ms"].values())
        lines.append(f"| {r['engine']} | {r['temperature']} | {r['batch']} | {r['setting']} | {r['tok_s']:.1f} | "
                     f"{r['ratio_to_plain']:.3f} ({min(r['all_ratios']):.2f}-{max(r['all_ratios']):.2f}) | {r['pooled_ratio']:.3f} ({r['pooled_interval'][0]:.2f}-{r['pooled_interval'][1]:.2f}) | "
                     f"{r['tokens_per_row']:.0f} | {acc} | "
                     f"{r['mean_drafts']:.2f} | {r['share']['heads']:.2f} / {r['share']['history']:.2f} | {ph} | "
                     f"{r['paused']} / {r['tail_only']} of {len(r['all_ratios'])} | {r['price_check']:.3f} |")
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
    from rollout.models.loaders import apply_chat_template, load_policy
    policy, loaded = load_policy(cfg.model, cfg.dtype, cfg.device)
    heads, heads_desc = resolve_heads(policy, cfg.heads, model=cfg.model, num_depths=cfg.num_depths)
    batches = workload(cfg, lambda text: apply_chat_template(loaded, [{"role": "user", "content": text}]))
    label = f"{dtype_name(cfg.dtype, cfg.device)}{' compiled' if compiles(policy, cfg.compile) else ''}"
    print(f"{cfg.model} {label}  heads: {heads_desc}  k <= {cfg.num_draft_tokens}  machine: {machine()}", flush=True)
    rows = bench(policy, heads, cfg, batches, label)
    print(f"machine at the end: {machine()}")
    if cfg.log:
        append_log(cfg.log, argv, heads_desc, rows)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(dict(config=resolved, machine=machine(), rows=rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
