"""Speculative vs plain decoding of the same torch engine, side by side in one run.

    mtp-rollout bench-decode --heads auto --k 3 --repeats 3 [--log experiments/LOG.md]

For each (batch size, temperature): `repeats` interleaved pairs of plain (k = 0) and
speculative (k) generation of the same prompts; prints median tokens/s of each, the median
of the per-pair ratios, acceptance rate and acceptance length (tau, bonus included).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys

import torch

from experiments.generate import DEFAULT_PROMPTS, resolve_heads
from mtp_heads.pretrain import TrainConfig
from rollout.models.loaders import DEFAULT_MODEL, apply_chat_template
from rollout.models.policy import load_policy
from rollout.torch_engine import TorchEngine
from rollout.types import DRAFT_MODES, SamplingParams

BENCH_PROMPTS = DEFAULT_PROMPTS + [
    "List four animals that live in the ocean.",
    "What is 12 times 7? Explain briefly.",
    "Describe a sunrise in one sentence.",
    "Name three programming languages and one use of each.",
]


def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def measure(engine: TorchEngine, prompts, sampling: SamplingParams) -> tuple[float, object]:
    batch = engine.generate(prompts, sampling)
    return batch.tokens_per_s, batch.spec_stats()


def bench(engine, prompts_ids, args) -> list[dict]:
    rows = []
    for batch_size in args.batch_sizes:
        prompts = [prompts_ids[i % len(prompts_ids)] for i in range(batch_size)]
        for temperature in args.temperatures:
            common = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, ignore_eos=True, seed=0)
            plain_sp = SamplingParams(**common)
            spec_sp = SamplingParams(**common, num_draft_tokens=args.k, draft_mode=args.draft_mode)
            measure(engine, prompts[:1], SamplingParams(max_new_tokens=4))            # warm-up
            plain, spec, ratios, stats = [], [], [], None
            for _ in range(args.repeats):
                p, _ = measure(engine, prompts, plain_sp)
                s, st = measure(engine, prompts, spec_sp)
                plain.append(p), spec.append(s), ratios.append(s / p)
                stats = st if stats is None else stats.merge(st)
            row = dict(batch=batch_size, temperature=temperature, k=args.k, mode=args.draft_mode,
                       plain_tok_s=statistics.median(plain), spec_tok_s=statistics.median(spec),
                       ratio=statistics.median(ratios), acceptance_rate=stats.acceptance_rate,
                       acceptance_length=stats.acceptance_length,
                       cond_acceptance=[round(a, 3) for a in stats.conditional_acceptance])
            rows.append(row)
            print(f"batch {batch_size:>2}  T={temperature:<4} plain {row['plain_tok_s']:7.2f} tok/s  "
                  f"spec {row['spec_tok_s']:7.2f} tok/s  ratio {row['ratio']:.2f}x  "
                  f"acceptance {row['acceptance_rate']:.3f}  tau {row['acceptance_length']:.2f}", flush=True)
    return rows


def append_log(path: str, argv: list[str], heads_desc: str, rows: list[dict]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"\n## {dt.date.today().isoformat()} bench_decode (commit {commit})\n",
             f"Command: `python -m experiments.bench_decode {' '.join(argv)}`  ",
             f"Machine: {machine()}  ", f"Heads: {heads_desc}\n",
             "| batch | T | k | mode | plain tok/s | spec tok/s | ratio (median of pairs) | acceptance | tau |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['temperature']} | {r['k']} | {r['mode']} | {r['plain_tok_s']:.2f} | "
              f"{r['spec_tok_s']:.2f} | {r['ratio']:.2f}x | {r['acceptance_rate']:.3f} | {r['acceptance_length']:.2f} |"
              for r in rows]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="mtp-rollout bench-decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--heads", default="auto", help="heads checkpoint, 'init' or 'auto'")
    ap.add_argument("--num-depths", type=int, default=TrainConfig.num_depths, help="depths of the 'auto' heads")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-mode", choices=DRAFT_MODES, default="rejection")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--log", help="append the results to this markdown file (experiments/LOG.md)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    policy, loaded = load_policy(args.model, args.dtype)
    heads, heads_desc = resolve_heads(policy, args.model, args.heads, args.num_depths)
    engine = TorchEngine(policy, heads)
    prompts = [apply_chat_template(loaded, [{"role": "user", "content": p}]) for p in BENCH_PROMPTS]
    print(f"{args.model}  heads: {heads_desc}  machine: {machine()}")
    rows = bench(engine, prompts, args)
    if args.log:
        append_log(args.log, argv, heads_desc, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
