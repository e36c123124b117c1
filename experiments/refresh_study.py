"""`mtp-rollout refresh-study`: when should the co-trainer refresh the heads? One RL run per schedule.

    mtp-rollout refresh-study                              # configs/refresh_study.yaml: SmolLM2, 4 schedules
    mtp-rollout refresh-study configs/refresh_study_tiny.yaml   # the small setting CI runs (tiny model)
    mtp-rollout refresh-study --help                       # every key, its default and meaning

Every schedule runs the same RL job (`rl_config` with `rl` overrides: same prompts, seeds, heads and
draft mode) and differs only in its co-trainer settings: `never` (heads pre-trained once, no
co-trainer at all: Bebop's claim is that this suffices for sampled drafts with TV-trained heads),
refresh every N steps, when entropy rose, when acceptance dropped. Per schedule: acceptance rate
and acceptance length over the run and per step, the refreshes made and the co-trainer compute they
spent (sum of the refreshes' training seconds). out_dir holds runs/<schedule>/ and the results
refresh.json, refresh.csv, refresh.md and refresh.png (acceptance per step, a line per schedule,
refreshes marked); `results_dir` gets a copy. Finished runs are reused, interrupted ones resumed.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from experiments.common import check_cells, fmt_num, run_cell, summarize_run, write_study_results
from rollout.config_loader import packaged_config, preset_main, write_resolved
from rollout.monitor.monitor import AcceptanceMonitor
from rollout.monitor.plots import column, new_figure, save_png
from rollout.monitor.records import as_float
from rollout.run_dir import RunLock

DEFAULT_CONFIG = packaged_config("refresh_study")
RESULTS = ("refresh.json", "refresh.csv", "refresh.md", "refresh.png")


@dataclass(frozen=True)
class RefreshStudyConfig:
    """The schedules (name -> co-trainer overrides) and the RL run they share."""

    # name -> key=value co-trainer overrides; set in the YAML (dicts merge key by key, so a default here
    # would be added to every YAML's schedules)
    schedules: dict[str, list[str]] = field(default_factory=dict)
    rl_config: str = "async_rl"           # RL preset every schedule runs (configs/<name>.yaml) or a YAML path
    rl: list[str] = field(default_factory=list)   # key=value overrides of every run (heads, steps, draft mode)
    out_dir: str = "runs/refresh_study"   # runs/<schedule>/ and the results; finished runs are reused
    results_dir: str = ""                 # also copy the result files here ("" = no copy)
    progress: bool = True                 # progress bars of the RL runs

    def __post_init__(self) -> None:
        if not self.schedules:
            raise ValueError("schedules must name at least one co-trainer schedule")
        for name, entries in {"rl": self.rl, **{f"schedules.{k}": v for k, v in self.schedules.items()}}.items():
            bad = [e for e in entries if "=" not in e]
            if bad:
                raise ValueError(f"{name} entries must be key=value overrides, got {bad}")
        check_cells(self.rl_config, self.rl, {k: list(v) for k, v in self.schedules.items()}, what="schedule")


def summarize_schedule(name: str, run_dir: Path) -> dict:
    """A run's summary (experiments.common.summarize_run) plus the co-trainer's cost."""
    records = AcceptanceMonitor.load_records(run_dir)
    refreshes = [r for r in records if r.get("event") == "head_refresh"]
    steps = [r for r in records if "event" not in r]
    detail = [r.get("detail", {}) for r in refreshes]
    return {"schedule": name, **summarize_run(run_dir, records),
            # the step whose rollouts triggered each refresh, and the driver's step when its heads reached workers
            "refresh_steps": [int(d.get("refresh_step", r["step"])) for d, r in zip(detail, refreshes)],
            "published_at": [r["step"] for r in refreshes],
            "cotrainer_train_s": sum(float(d.get("train_time_s") or 0.0) for d in detail),
            "per_step": [{"step": s["step"], "acceptance_rate": s.get("acceptance_rate"),
                          "acceptance_length": s.get("acceptance_length"), "entropy": s.get("entropy_drafted"),
                          "head_version": s.get("head_version_max")} for s in steps]}


def table(records: list[dict]) -> str:
    lines = ["| schedule | steps | refreshes (at steps) | co-trainer training s | acceptance rate | acceptance length "
             "| acceptance first -> last step | entropy first -> last |", "|" + "---|" * 8]
    # refreshes are listed by the step whose rollouts triggered them; their heads draft from a later step
    for r in records:
        acc = [s["acceptance_rate"] for s in r["per_step"]]
        at = ", ".join(str(s) for s in r["refresh_steps"]) or "-"
        lines.append(f"| {r['schedule']} | {r['steps']} | {len(r['refresh_steps'])} ({at}) | "
                     f"{fmt_num(r['cotrainer_train_s'], '.1f')} | {fmt_num(r['acceptance_rate'])} | "
                     f"{fmt_num(r['acceptance_length'], '.2f')} | {fmt_num(acc[0] if acc else math.nan)} -> "
                     f"{fmt_num(acc[-1] if acc else math.nan)} | {fmt_num(r['entropy_first'])} -> "
                     f"{fmt_num(r['entropy_last'])} |")
    return "\n".join(lines) + "\n"


def plot_refresh_study(path: Path, records: list[dict]) -> None:
    """The refresh-schedule study's figure: acceptance rate and mean entropy per RL step, a line per
    schedule, each refresh marked with a triangle on its schedule's line; the legend gives each
    schedule's refreshes and co-trainer training seconds."""
    fig, axes = new_figure(2, 1, (10, 7), dict(left=0.08, right=0.98, bottom=0.07, top=0.97, hspace=0.08),
                            sharex=True)
    ax_acc, ax_ent = axes[:, 0]
    for i, r in enumerate(records):
        color = f"C{i % 10}"
        steps, acc = column(r["per_step"], "step"), column(r["per_step"], "acceptance_rate")
        label = (f"{r['schedule']}: {len(r['refresh_steps'])} refreshes, "
                 f"{as_float(r['cotrainer_train_s']):.0f} s co-trainer training")
        ax_acc.plot(steps, acc, "o-", ms=3, color=color, label=label)
        hit = np.isin(steps, np.asarray(r["refresh_steps"], dtype=np.float64))
        ax_acc.plot(steps[hit], acc[hit], "^", ms=8, color=color)
        ax_ent.plot(steps, column(r["per_step"], "entropy"), "o-", ms=3, color=color, label=r["schedule"])
    ax_acc.set(ylabel="acceptance rate (accepted / proposed)")
    ax_ent.set(ylabel="mean entropy at drafted positions (nats)", xlabel="RL step")
    from matplotlib.ticker import MaxNLocator
    ax_ent.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_acc, ax_ent):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    save_png(fig, path)


def write_results(out: Path, records: list[dict], results_dir: str) -> None:
    write_study_results(out, "refresh", records, table(records), plot_refresh_study,
                        ("domains", "points", "per_step", "refresh_steps", "published_at"), results_dir)


def run(cfg: RefreshStudyConfig, resolved: str) -> list[dict]:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with RunLock(out):
        write_resolved(resolved, out)
        records = []
        for name, overrides in cfg.schedules.items():               # ---- the driver loop ----
            records.append(summarize_schedule(name, run_cell(cfg, name, list(overrides), out)))
            write_results(out, records, cfg.results_dir)            # after every run: partial results are readable
    print(table(records))
    print(f"out_dir {out}: " + ", ".join(RESULTS))
    return records


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mtp-rollout refresh-study`: YAML files and key=value overrides; without a YAML
    file configs/refresh_study.yaml comes first."""
    return preset_main(RefreshStudyConfig, DEFAULT_CONFIG, run, sys.argv[1:] if argv is None else argv,
                       usage=__doc__)


if __name__ == "__main__":
    sys.exit(main())
