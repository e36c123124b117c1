"""Turn a finished train-heads run into the shipped default heads: bf16 safetensors + model card.

    python -m experiments.ship_heads <train-heads out_dir> [--model smollm2-135m] [--command "..."] [--wall-s N]

Reads <out_dir>/heads.safetensors and its heads.run.json (written by experiments/pretrain_heads.py; a
heads file may be given instead of the directory) and writes
mtp_heads/default_heads/<model>.safetensors (weights in bfloat16, draft vocabulary, header) and
<model>.md (the model card: data, tokens, steps, seed, commit, objective schedule, held-out
acceptance per position at each temperature in both draft modes, the reproducing command, cost).
"""
from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import torch

from experiments.common import cpu_name
from mtp_heads.checkpoint import load_heads, read_meta, save_heads
from mtp_heads.shipped import HEADS_FILE, SHIPPED, SHIPPED_DIR

MAX_BYTES = 32 * 2**20


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _table(acc: dict) -> list[str]:
    lines = ["| T | mode | position 1 | position 2 | position 3 | tau (k=3) |", "|---|---|---|---|---|---|"]
    for T, modes in sorted(acc.items(), key=lambda kv: float(kv[0])):
        for mode, r in modes.items():
            per = " | ".join(f"{a:.3f}" for a in r["per_position"])
            lines.append(f"| {float(T):g} | {mode} | {per} | {r['tau']:.2f} |")
    return lines


def model_card(report: dict, meta, model: str, command: str, wall_s: float | None, commit: str) -> str:
    final = report["final"] or {}
    cfg_yaml = report.get("config", "")
    data = report["data"]
    steps = report["steps"]
    lines = [f"# Draft heads for {model}", "",
             f"A recurrent drafter of {meta.num_layers} decoder layer(s) (`MTPHeads`, num_depths = {meta.num_depths}, "
             f"num_layers = {meta.num_layers}, applied to its own output for every",
             "draft position, the EAGLE-style drafter vLLM runs), trained with training-time test by",
             "`mtp-rollout train-heads`. Loaded by `mtp_heads.shipped.load_shipped_heads(policy, model)`.", "",
             "## How it was made", "",
             f"- Command: `{command}`",
             f"- Commit: {commit}; seed: {_seed(cfg_yaml)}",
             f"- Data: {json.dumps(data)}",
             f"- Steps: {steps}; objective schedule: {meta.loss}",
             f"- Draft vocabulary: {meta.draft_vocab_size} token ids (most frequent trained tokens + EOS)",
             f"- Training throughput: {report['train_tokens_per_s']:.0f} sequence tokens/s "
             f"({report['train_rows_per_s']:.0f} trained (position, step) rows/s), {report['threads']} torch threads, "
             f"{report.get('machine') or cpu_name()}",
             f"- Wall time: {wall_s if wall_s is not None else report['seconds_total']:.0f} s in all "
             f"(training {report['train_seconds_this_call']:.0f} s of the last call, periodic evaluation "
             f"{report['eval_seconds']:.0f} s); peak RSS {report['peak_rss_gb']:.2f} GB", "",
             "## Held-out teacher-forced acceptance (conditional, per draft position)", ""]
    sources = sorted(k for k in final if k.startswith("heldout_"))   # eval.heldout_sources, scored apart
    lines += _table(final.get("heldout", {}))
    for key in sources:
        lines += ["", f"Held-out split of the `{key.removeprefix('heldout_')}` source alone:", ""] + _table(final[key])
    if "train" in final:
        lines += ["", "On training sequences (the train / held-out gap):", ""] + _table(final["train"])
    lines += ["", "Rejection = E[1 - TV(p, q)] (drafts sampled from q); greedy = E[p(argmax q)]; tau = expected",
              "tokens per verification round at k = 3 (bonus included) over chains where all 3 positions are",
              "scored. Measured by mtp_heads.evaluate on the held-out split of the token store.", "",
              "## Scaling curve (held-out and training acceptance vs steps, T = 1, rejection)", "",
              "| step | held-out pos 1/2/3 | held-out tau | train pos 1/2/3 | train tau |", "|---|---|---|---|---|"]
    if sources:
        lines[-2] += "".join(f" {k.removeprefix('heldout_')} pos 1/2/3 | tau |" for k in sources)
        lines[-1] += "---|---|" * len(sources)
    for h in report.get("history", []):
        T = max(h["heldout"], key=float)
        ho, tr = h["heldout"][T]["rejection"], h.get("train", {}).get(T, {}).get("rejection")
        row = (f"| {h['step']} | {' / '.join(f'{a:.3f}' for a in ho['per_position'])} | {ho['tau']:.2f} | "
               + (f"{' / '.join(f'{a:.3f}' for a in tr['per_position'])} | {tr['tau']:.2f} |" if tr else " | |"))
        for k in sources:
            r = h.get(k, {}).get(T, {}).get("rejection")
            row += f" {' / '.join(f'{a:.3f}' for a in r['per_position'])} | {r['tau']:.2f} |" if r else " | |"
        lines.append(row)
    lines += ["", "## Resolved config", "", "```yaml", cfg_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


def _seed(cfg_yaml: str) -> str:
    for line in cfg_yaml.splitlines():
        if line.strip().startswith("seed:"):
            return line.split(":", 1)[1].strip()
    return "?"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="train-heads' out_dir, or the heads file in it")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--command", default="mtp-rollout train-heads heads_smollm2")
    ap.add_argument("--wall-s", type=float, default=None, help="wall time of the whole run (resumes included)")
    a = ap.parse_args(argv)
    if Path(a.checkpoint).is_dir():
        a.checkpoint = str(Path(a.checkpoint) / HEADS_FILE)
    from rollout.models.loaders import load_policy
    policy, _ = load_policy(a.model, "float32")
    heads, meta = load_heads(a.checkpoint, policy)
    report = json.loads(Path(a.checkpoint).with_suffix(".run.json").read_text())
    target = SHIPPED_DIR / SHIPPED[a.model]
    commit = _commit()
    heads = heads.to(torch.bfloat16)
    save_heads(target, heads, replace(read_meta(a.checkpoint), notes=f"{meta.notes} commit={commit}"))
    size = target.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{target} is {size / 2**20:.1f} MB > 32 MB")
    card = target.with_suffix(".md")
    card.write_text(model_card(report, meta, a.model, a.command, a.wall_s, commit))
    print(f"{target} ({size / 2**20:.1f} MB), card {card}")
    return target


if __name__ == "__main__":
    main()
