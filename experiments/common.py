"""Helpers the experiments' entry points share: the machine they ran on, prompt rotation for
benchmarks, running and summarising an RL cell for the studies, number formatting, result copies
and the studies' figure panels. Entry points import each other only where one job composes
another (tests/test_layering.py lists those pairs); everything else they share lives here.
"""
from __future__ import annotations

import json
import math
import platform
import re
import shutil
from pathlib import Path

import torch

from rollout.config_loader import packaged_config
from rollout.fileio import atomic_write
from rollout.monitor.monitor import AcceptanceMonitor
from rollout.monitor.plots import new_figure
from rollout.monitor.records import as_float, json_safe, records_csv
from rollout.run_dir import read_jsonl


def cpu_name() -> str:
    """The CPU model of this machine (cards and benchmark logs name it beside each figure)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def machine() -> str:
    """CPU, threads, torch version, load and the GPU when one is in use: the line a benchmark's log
    entry starts with."""
    cpu = cpu_name()
    try:
        load = open("/proc/loadavg").read().split()[:3]
    except OSError:
        load = ["?"]
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() and torch.cuda.is_initialized() else ""
    return (f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, load average "
            f"{' '.join(load)}{gpu}")


def check_device(key: str, value: str) -> None:
    """A config's `device` names a device this machine has: cpu, cuda or cuda:N (ValueError naming the key)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise ValueError(f"{key} must be cpu, cuda or cuda:N, got {value!r}")
    if value.startswith("cuda"):
        index = int(value.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"{key}={value!r}: this machine has {torch.cuda.device_count()} CUDA devices")


def batch_of(prompts_ids: list[list[int]], batch_size: int, offset: int) -> list[list[int]]:
    """The prompts of one repeat: every setting of a repeat decodes the same ones, and the repeats
    rotate through the list, so that batch 1 is not one prompt's acceptance."""
    return [prompts_ids[(offset + i) % len(prompts_ids)] for i in range(batch_size)]


def check_cells(rl_config: str, rl: list[str], cells: dict[str, list[str]], what: str = "cell") -> None:
    """Load the run config of every cell now ([rl_config, *rl, *cell overrides]), so that a misspelt key
    or a bad value in one cell fails when the study's config loads, naming the cell, not hours later
    when that cell's turn comes."""
    from trainers.config import load_run_config

    base = [str(packaged_config(rl_config)), *rl]
    for name, overrides in cells.items():
        try:
            load_run_config([*base, *overrides])
        except ValueError as e:
            raise ValueError(f"{what} {name!r} ({rl_config} + rl + its overrides): {e}") from None


def run_cell(cfg, name: str, overrides: list[str], out: Path) -> Path:
    """One RL run directory under runs/<name>; resumed if it stopped early, reused if complete.

    cfg: a study config with rl_config (preset name or YAML path), rl (overrides) and progress."""
    from experiments import async_rl
    from trainers.config import load_run_config

    run_dir = out / "runs" / name
    argv = [str(packaged_config(cfg.rl_config)), *cfg.rl, *overrides, f"out_dir={run_dir}",
            f"progress={str(cfg.progress).lower()}"]
    run_cfg, _ = load_run_config(argv)
    done = len(read_jsonl(run_dir / "rl.jsonl")) if (run_dir / "rl.jsonl").is_file() else 0
    if done >= run_cfg.total_steps:
        return run_dir
    if async_rl.holds_run(run_dir):
        argv.append("resume=true")
    run_cfg, resolved = load_run_config(argv)
    async_rl.run(run_cfg, resolved)
    return run_dir


DRAFTING_TOTALS = ("plain_token_share", "draft_length")   # monitor `drafting` keys that are not sources


def slope_fields(d: dict | None) -> dict:
    """A monitor record's slope block as floats (JSON null -> nan) and its n."""
    d = d or {}
    fit = {k: as_float(d.get(k)) for k in ("slope", "intercept", "r2", "ci_low", "ci_high")}   # None (JSON NaN) -> nan
    return {**fit, "n": int(d.get("n") or 0)}


def summarize_group(steps: list[dict]) -> dict:
    """Run-level numbers of one group (the whole batch or one domain) from its per-step blocks."""
    drafted = sum(s.get("num_draft_tokens", 0) for s in steps)
    accepted = sum(s.get("num_accepted_tokens", 0) for s in steps)
    rounds = sum(s.get("num_drafts", 0) for s in steps)
    entropy = [as_float(s.get("entropy_drafted")) for s in steps]
    last = steps[-1] if steps else {}
    return {"acceptance_rate": accepted / drafted if drafted else math.nan,
            "acceptance_length": (accepted + rounds) / rounds if rounds else math.nan,
            "entropy_first": entropy[0] if entropy else math.nan,
            "entropy_last": entropy[-1] if entropy else math.nan,
            "slope_step": slope_fields(last.get("slope_step_run")),
            "slope_position": slope_fields(last.get("slope_position_cum"))}


def summarize_run(run_dir: Path, records: list[dict] | None = None) -> dict:
    """One cell's record: its monitor's steps and rl.jsonl's rollout times and rewards (`records`: the run's
    monitor records when the caller has read them already)."""
    records = AcceptanceMonitor.load_records(run_dir) if records is None else records
    steps = [r for r in records if "event" not in r]
    rl = read_jsonl(run_dir / "rl.jsonl")
    tokens = sum(s.get("num_tokens", 0) for s in steps)
    rollout_s = sum(r["rollout_s"] for r in rl)
    domains = sorted({d for s in steps for d in s.get("domains", {})})
    return {"steps": len(steps), "tokens": tokens, "rollout_s": rollout_s,
            "rollout_tok_s": tokens / rollout_s if rollout_s else math.nan,
            "reward_first": rl[0]["reward"] if rl else math.nan, "reward_last": rl[-1]["reward"] if rl else math.nan,
            "refreshes": sum(1 for r in records if r.get("event") == "head_refresh"),
            **summarize_group(steps),
            "domains": {d: summarize_group([s["domains"][d] for s in steps if d in s.get("domains", {})])
                        for d in domains},
            "points": [{"entropy": s.get("entropy_drafted"), "acceptance": s.get("acceptance_rate")} for s in steps],
            "by_source": by_source(steps)}


def by_source(steps: list[dict]) -> dict:
    """Per draft source over a run's steps: drafted and accepted tokens, acceptance rate, share of the
    emitted tokens, and the last step's cumulative acceptance-vs-entropy slope (rollout.monitor)."""
    out = {}
    emitted = sum(s.get("num_tokens", 0) for s in steps)
    for src in dict.fromkeys(x for s in steps for x in (s.get("drafting") or {}) if x not in DRAFTING_TOTALS):
        blocks = [s["drafting"][src] for s in steps if isinstance((s.get("drafting") or {}).get(src), dict)]
        drafted = sum(b.get("draft_tokens") or 0 for b in blocks)
        accepted = sum(b.get("accepted_tokens") or 0 for b in blocks)
        slopes = [s["slope_by_source"][src]["cum"] for s in steps if src in (s.get("slope_by_source") or {})]
        out[src] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                    "acceptance_rate": accepted / drafted if drafted else math.nan,
                    "token_share": accepted / emitted if emitted else math.nan,
                    "slope_cum": slope_fields(slopes[-1]) if slopes else slope_fields(None)}
    return out


def fmt_num(x, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def copy_results(out: Path, names: tuple[str, ...], results_dir: str) -> None:
    """Copy a study's result files from out to results_dir ("" = nowhere), e.g. experiments/results/<study>/."""
    if results_dir:
        dst = Path(results_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(out / name, dst / name)


def write_study_results(out: Path, stem: str, records: list[dict], table_md: str, plot, nested: tuple[str, ...],
                        results_dir: str) -> tuple[str, ...]:
    """A study's four result files in out (<stem>.json, .csv without the `nested` keys, .md, .png drawn by
    plot(path, records)), each written atomically, then copied to results_dir; their names."""
    safe = [json_safe(r) for r in records]
    atomic_write(out / f"{stem}.json", json.dumps(safe, indent=1) + "\n")
    atomic_write(out / f"{stem}.csv", records_csv([{k: v for k, v in r.items() if k not in nested} for r in safe]))
    atomic_write(out / f"{stem}.md", table_md)
    plot(out / f"{stem}.png", records)
    names = tuple(f"{stem}.{ext}" for ext in ("json", "csv", "md", "png"))
    copy_results(out, names, results_dir)
    return names


def mode_panels(n: int):
    """A row of n panels (one per draft mode) sharing the acceptance axis."""
    return new_figure(1, max(n, 1), (6.2 * max(n, 1), 4.8),
                      dict(left=0.07, right=0.99, bottom=0.11, top=0.92, wspace=0.12), sharey=True)


def finish_mode_panel(ax, mode: str, xlabel: str, legend_title: str) -> None:
    ax.set(title=f"{mode} drafting", xlabel=xlabel, ylabel="acceptance rate (accepted / proposed)", ylim=(0, 1))
    ax.yaxis.set_tick_params(labelleft=True)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best", title=legend_title, title_fontsize=7)
