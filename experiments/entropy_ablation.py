"""`mtp-rollout ablate`: Bebop's grid, drafter source x draft mode x head objective, over async RL runs whose
entropy rises.

    mtp-rollout ablate                                     # configs/ablation.yaml: SmolLM2, the full grid
    mtp-rollout ablate configs/ablation_tiny.yaml          # the small setting CI runs (tiny model, minutes)
    mtp-rollout ablate 'objectives=[ce,tv]' 'rl=[steps=20]' out_dir=runs/ablation/two
    mtp-rollout ablate --help                              # every key, its default and meaning

For every objective the heads are trained once, from the same initialisation, data, tokens and steps
(`mtp-rollout train-heads` with one phase of that objective), and every (draft mode, objective) cell
runs the RL job (`mtp-rollout run`) with those heads while the co-trainer refreshes them with the
same objective. The drafter-source axis (`draft_sources`) says what drafts in those runs: `heads`
(every row drafts k head tokens each round: the heads' own acceptance-vs-entropy slope), `chosen`
(the engine's default: each row, each round, drafts 0..k tokens from the heads or rollout history,
by predicted acceptance) and `history` (drafts copied from earlier rollouts only: one cell, since it
has no heads, objective or draft mode). One plain-decoding run (k = 0, no co-trainer) is the speed
baseline. Per cell: the slope of acceptance on entropy across steps and across draft positions (entropy-binned, cumulative)
with 95% bootstrap intervals (rollout.monitor), mean acceptance rate, acceptance length, rollout
speed over plain decoding, and the same per task domain. Entropy rises because the RL preset ramps
the sampling temperature and the entropy bonus over the run (configs/async_rl.yaml).

out_dir holds heads/<objective>/ (train-heads' out_dir), runs/<cell>/ (full RL run directories) and the results:
ablation.json, ablation.csv, ablation.md (cells and per-domain tables) and ablation.png (a panel
per draft mode, a line per objective). Finished heads and runs are reused, interrupted ones resumed,
so re-running the command continues a grid; `results_dir` gets a copy of the four result files.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from experiments.common import (check_cells, finish_mode_panel, fmt_num, mode_panels, run_cell, summarize_run,
                                write_study_results)
from mtp_heads.distill import check_objective
from rollout.config_loader import packaged_config, preset_main, write_resolved
from rollout.monitor.plots import column, save_png
from rollout.monitor.records import fit_from_dict
from rollout.run_dir import RunLock
from rollout.types import check_draft_modes

DEFAULT_CONFIG = packaged_config("ablation")
RESULTS = ("ablation.json", "ablation.csv", "ablation.md", "ablation.png")
PLAIN = "plain"


@dataclass(frozen=True)
class AblationConfig:
    """The grid (draft_modes x objectives), how each objective's heads are trained, and the RL run."""

    objectives: list[str] = field(default_factory=lambda: ["ce", "fkl", "tv", "tv_e2e"])  # head losses
    draft_modes: list[str] = field(default_factory=lambda: ["greedy", "rejection"])       # greedy and/or rejection
    draft_sources: list[str] = field(default_factory=lambda: ["heads"])   # what drafts: heads | chosen | history
    heads_config: str = "heads_smollm2"   # train-heads preset (configs/<name>.yaml) or a YAML path
    heads_overrides: list[str] = field(default_factory=list)   # key=value overrides of every head training
                                                               # (same for all objectives)
    head_steps: int = 400                 # steps of each objective's single training phase; 0 = no training:
                                          # every cell drafts with the shipped heads (a drafter-source study
                                          # without the token store), its co-trainer refreshing with the objective
    head_lr: float = 2e-3                 # its peak learning rate
    rl_config: str = "async_rl"           # RL preset every cell runs (configs/<name>.yaml) or a YAML path
    rl: list[str] = field(default_factory=list)      # key=value overrides of every RL run (e.g. steps=20)
    plain_baseline: bool = True           # also run k = 0 without co-trainer: the baseline of `speedup`
    out_dir: str = "runs/ablation"        # heads/, runs/, results; finished parts are reused on a re-run
    results_dir: str = ""                 # also copy the result files here ("" = no copy)
    progress: bool = True                 # progress bars of the head trainings and RL runs

    def __post_init__(self) -> None:
        if not self.objectives:
            raise ValueError("objectives must list at least one head loss")
        for objective in self.objectives:
            check_objective(objective)
        check_draft_modes(self.draft_modes)
        bad = [x for x in self.draft_sources if x not in SOURCE_OVERRIDES]
        if not self.draft_sources or bad or len(set(self.draft_sources)) != len(self.draft_sources):
            raise ValueError(f"draft_sources must list each of {list(SOURCE_OVERRIDES)} at most once, got "
                             f"{list(self.draft_sources)}")
        if self.head_steps < 0 or not self.head_lr > 0:
            raise ValueError(f"need head_steps >= 0 and head_lr > 0, got {self.head_steps}, {self.head_lr}")
        for key, entries in (("heads_overrides", self.heads_overrides), ("rl", self.rl)):
            bad = [e for e in entries if "=" not in e]
            if bad:
                raise ValueError(f"{key} entries must be key=value overrides, got {bad}")
        self.check_cells()

    def check_cells(self) -> None:
        """Every head training and every cell's run config loads: a bad key fails now, naming the cell."""
        from experiments.pretrain_heads import load_train_heads_config

        for objective in self.objectives if self.head_steps else ():
            try:
                load_train_heads_config(head_training_argv(self, objective, Path(self.out_dir)))
            except ValueError as e:
                raise ValueError(f"head training of objective {objective!r} ({self.heads_config} + "
                                 f"heads_overrides): {e}") from None
        cells = {name: overrides for name, overrides, _ in self.cells()}
        check_cells(self.rl_config, self.rl, {**({PLAIN: PLAIN_OVERRIDES} if self.plain_baseline else {}), **cells})

    def cells(self) -> list[tuple[str, list[str], dict]]:
        """(run name, overrides, record labels) of every cell, in run order: per objective its heads'
        cells (trained once, then shared), the history cell last."""
        out = []
        for objective in self.objectives:
            heads_path = objective_heads_path(Path(self.out_dir), objective) if self.head_steps else SHIPPED
            for source in (x for x in self.draft_sources if x != HISTORY):
                for mode in self.draft_modes:
                    name = f"{mode}-{objective}" if source == "heads" else f"{source}-{mode}-{objective}"
                    out.append((name, [*cell_overrides(objective, mode, heads_path), *SOURCE_OVERRIDES[source]],
                                {"draft_source": source, "draft_mode": mode, "objective": objective}))
        if HISTORY in self.draft_sources:
            out.append((HISTORY, SOURCE_OVERRIDES[HISTORY], {"draft_source": HISTORY, "draft_mode": "-",
                                                             "objective": "-"}))
        return out



# ----------------------------------------------------------------------------------- the grid


def objective_heads_path(out: Path, objective: str) -> Path:
    """heads/<objective>/heads.safetensors: what train-heads writes into out_dir=heads/<objective>."""
    from mtp_heads.shipped import HEADS_FILE
    return out / "heads" / objective / HEADS_FILE


def head_training_argv(cfg: AblationConfig, objective: str, out: Path) -> list[str]:
    phase = f"train.phases=[{{objective: {objective}, steps: {cfg.head_steps}, lr: {cfg.head_lr}}}]"
    return [str(packaged_config(cfg.heads_config)), *cfg.heads_overrides, phase,
            f"out_dir={objective_heads_path(out, objective).parent}", f"progress={str(cfg.progress).lower()}"]


def train_objective_heads(cfg: AblationConfig, objective: str, out: Path) -> Path:
    """heads/<objective>/heads.safetensors, trained once with the shared preset and overrides."""
    from experiments import pretrain_heads

    path = objective_heads_path(out, objective)
    if path.with_suffix(".run.json").is_file():
        return path                                    # finished earlier
    path.parent.mkdir(parents=True, exist_ok=True)
    argv = head_training_argv(cfg, objective, out)
    if path.is_file():
        argv.append("resume=true")                     # interrupted: continue from its checkpoint
    pretrain_heads.main(argv)
    return path


SHIPPED = "shipped"     # the cells' heads where head_steps = 0


def cell_overrides(objective: str, mode: str, heads_path: Path | str) -> list[str]:
    return [f"heads={heads_path}", f"sampling.draft_mode={mode}",
            f"accelerator.cotrainer.loss={objective}"]


PLAIN_OVERRIDES = ["heads=init", "sampling.num_draft_tokens=0", "accelerator.cotrainer.enabled=false"]
HISTORY = "history"
SOURCE_OVERRIDES = {     # draft source -> the RL run's overrides (on top of the cell's heads, mode and loss); the
    # chosen cells speculate in every call (no plain_when_slower pauses): their slopes need every step's drafts
    "heads": ["accelerator.workers.draft_lengths=fixed"],
    "chosen": ["accelerator.workers.draft_lengths=chosen", "accelerator.workers.draft_sources=[heads,history]",
               "accelerator.workers.plain_when_slower=false"],
    HISTORY: ["heads=init", "accelerator.workers.draft_lengths=chosen", "accelerator.workers.draft_sources=[history]",
              "accelerator.workers.plain_when_slower=false", "accelerator.cotrainer.enabled=false"],
}


# ----------------------------------------------------------------------------------- results


def heads_heldout(heads_path: Path, mode: str) -> dict:
    """The heads' held-out teacher-forced acceptance in this draft mode, from train-heads' final evaluation
    (<heads>.run.json): {temperature: {"per_position": [a_1..a_k], "tau": tau}}; {} if there is none."""
    run_json = heads_path.with_suffix(".run.json")
    if not run_json.is_file():
        return {}
    held = (json.loads(run_json.read_text()).get("final") or {}).get("heldout") or {}
    return {T: {"per_position": r[mode]["per_position"], "tau": r[mode]["tau"]} for T, r in held.items() if mode in r}


def _heldout_cell(r: dict) -> str:
    held = r.get("heads_heldout") or {}
    if not held:
        return "n/a"
    T = min(held, key=lambda t: abs(float(t) - 1.0))           # the rollout temperature range's upper end
    return " / ".join(f"{a:.3f}" for a in held[T]["per_position"]) + f" (tau {held[T]['tau']:.2f}, T={float(T):g})"


def _ci(f: dict) -> str:
    if not math.isfinite(f["slope"]):
        return "n/a"
    return f"{f['slope']:+.3f} [{f['ci_low']:+.3f}, {f['ci_high']:+.3f}]"


def _cell(r: dict) -> str:
    """A table row's first three columns: drafter, draft mode, objective."""
    return f"| {r['draft_source']} | {r['draft_mode']} | {r['objective']} |"


def tables(records: list[dict]) -> str:
    head = ("| drafter | draft mode | objective | steps | entropy first -> last | acceptance rate | acceptance length "
            "| slope per step [95% CI] | slope per position [95% CI] | speedup vs plain | reward first -> last "
            "| heads' held-out acceptance pos 1 / 2 / 3 (teacher-forced) |")
    lines = ["## Cells", "", head, "|" + "---|" * 12]
    for r in records:
        lines.append(f"{_cell(r)} {r['steps']} | {fmt_num(r['entropy_first'])} -> "
                     f"{fmt_num(r['entropy_last'])} | {fmt_num(r['acceptance_rate'])} | "
                     f"{fmt_num(r['acceptance_length'], '.2f')} | {_ci(r['slope_step'])} | {_ci(r['slope_position'])} "
                     f"| {fmt_num(r['speedup'], '.2f')}x | {fmt_num(r['reward_first'], '.2f')} -> "
                     f"{fmt_num(r['reward_last'], '.2f')} | {_heldout_cell(r)} |")
    lines += ["", "## Per draft source", "",
              "Where each cell's drafts came from (with `chosen`, each row each round picks the heads, history or "
              "nothing).", "",
              "| drafter | draft mode | objective | source | drafted tokens | acceptance rate | share of tokens "
              "| slope on entropy, all steps [95% CI] |", "|" + "---|" * 8]
    for r in records:
        for src, g in r.get("by_source", {}).items():
            lines.append(f"{_cell(r)} {src} | {g['draft_tokens']} | {fmt_num(g['acceptance_rate'])} | "
                         f"{fmt_num(g['token_share'])} | {_ci(g['slope_cum'])} |")
    lines += ["", "## Per task domain", "",
              "| drafter | draft mode | objective | domain | acceptance rate | acceptance length "
              "| slope per step [95% CI] | slope per position [95% CI] |", "|" + "---|" * 8]
    for r in records:
        for d, g in r["domains"].items():
            lines.append(f"{_cell(r)} {d} | {fmt_num(g['acceptance_rate'])} | "
                         f"{fmt_num(g['acceptance_length'], '.2f')} | {_ci(g['slope_step'])} | "
                         f"{_ci(g['slope_position'])} |")
    return "\n".join(lines) + "\n"


def plot_ablation(path: Path, records: list[dict]) -> None:
    """The ablation's figure: one panel per (drafter, draft mode), one colour per head objective; each RL
    step is a point (mean entropy at reached draft positions, acceptance rate), with the cell's
    across-step slope and its 95% interval in the legend."""
    panels = list(dict.fromkeys(_panel(r) for r in records))
    objectives = list(dict.fromkeys(r["objective"] for r in records))
    fig, axes = mode_panels(len(panels))
    colors = {o: f"C{i % 10}" for i, o in enumerate(objectives)}
    for ax, mode in zip(axes[0], panels):
        for r in (r for r in records if _panel(r) == mode):
            x, y = column(r["points"], "entropy"), column(r["points"], "acceptance")
            ok = np.isfinite(x) & np.isfinite(y)
            fit = fit_from_dict(r.get("slope_step"))
            label = (f"{r['objective']}: {fit.slope:+.3f}/nat [{fit.ci_low:+.3f}, {fit.ci_high:+.3f}]"
                     if math.isfinite(fit.slope) else f"{r['objective']}: slope n/a")
            ax.plot(x[ok], y[ok], "o", color=colors[r["objective"]], alpha=0.7, label=label)
            if ok.sum() >= 2 and math.isfinite(fit.slope):      # the fitted line through the points' centroid
                xs = np.linspace(x[ok].min(), x[ok].max(), 20)
                ax.plot(xs, y[ok].mean() + fit.slope * (xs - x[ok].mean()), color=colors[r["objective"]])
        finish_mode_panel(ax, mode, "mean entropy H(p) at reached draft positions (nats), per RL step",
                           "objective: slope per step, 95% CI")
    save_png(fig, path)


def _panel(r: dict) -> str:
    """A figure panel's title: the draft mode, after the drafter where that is not the heads alone."""
    if r["draft_source"] == HISTORY:
        return "history"
    return r["draft_mode"] if r["draft_source"] == "heads" else f"{r['draft_source']}: {r['draft_mode']}"


def write_results(out: Path, records: list[dict], results_dir: str) -> None:
    write_study_results(out, "ablation", records, tables(records), plot_ablation,
                        ("domains", "points", "heads_heldout", "by_source"), results_dir)


def run(cfg: AblationConfig, resolved: str) -> list[dict]:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with RunLock(out):
        write_resolved(resolved, out)
        plain = summarize_run(run_cell(cfg, PLAIN, PLAIN_OVERRIDES, out)) if cfg.plain_baseline else None
        records = []
        for name, overrides, labels in cfg.cells():              # ---- the driver loop ----
            heads_path = None
            if labels["draft_source"] != HISTORY:     # trained once per objective, or the shipped heads
                heads_path = train_objective_heads(cfg, labels["objective"], out) if cfg.head_steps else SHIPPED
            rec = summarize_run(run_cell(cfg, name, overrides, out))
            rec = {**labels, "heads_path": str(heads_path or ""), **rec,
                   "speedup": rec["rollout_tok_s"] / plain["rollout_tok_s"] if plain else math.nan,
                   "heads_heldout": (heads_heldout(heads_path, labels["draft_mode"]) if isinstance(heads_path, Path)
                                     else {})}
            records.append(rec)
            write_results(out, records, cfg.results_dir)          # after every cell: a partial grid is readable
    print(tables(records))
    print(f"out_dir {out}: " + ", ".join(RESULTS))
    return records


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mtp-rollout ablate`: argv = YAML files and key=value overrides; without a
    YAML file configs/ablation.yaml comes first."""
    return preset_main(AblationConfig, DEFAULT_CONFIG, run, sys.argv[1:] if argv is None else argv, usage=__doc__)


if __name__ == "__main__":
    sys.exit(main())
