"""`mtp-rollout sweep`: draft acceptance against entropy at a fixed policy and fixed heads, with the
sampling temperature scanned so that entropy moves: each cell's curve in minutes, without RL.

    mtp-rollout sweep                                          # configs/sweep.yaml: SmolLM2 + its shipped heads
    mtp-rollout sweep 'head_files=[ce=runs/h/ce/heads.safetensors,tv=runs/h/tv/heads.safetensors]' out_dir=runs/sweep/objectives
    mtp-rollout sweep 'temperatures=[0.5,1.0,1.5]' prompts=8 max_new_tokens=64 'draft_modes=[rejection]'
    mtp-rollout sweep --help                                   # every key, its default and meaning

Cells are draft_modes x head_files; every cell decodes the same held-out chat prompts at every
temperature with a fixed num_draft_tokens (the measurement is experiments/sweep_measure.py). Written into out_dir (which
must be empty unless overwrite=true): config.yaml, sweep.jsonl (one record per cell and temperature),
sweep.csv (the same records, flat columns), sweep.md (the tables) and sweep.png (a panel per draft
mode, a line per heads file). CSV, tables and figure are rewritten after each cell.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from experiments.common import finish_mode_panel, mode_panels
from experiments.heads_data import prompt_texts
from experiments.sweep_measure import SweepSettings, add_cell_slopes, check_temperatures, decode_at, temperature_record
from mtp_heads.checkpoint import load_heads
from mtp_heads.shipped import load_shipped_heads, shipped_heads_path
from rollout.config_loader import packaged_config, preset_main, write_resolved
from rollout.fileio import atomic_write
from rollout.monitor.plots import column, save_png
from rollout.monitor.records import fit_from_dict, json_safe, records_csv
from rollout.run_dir import LOCK_NAME, RunLock
from rollout.engine.config import EngineConfig
from rollout.torch_engine import TorchEngine
from rollout.types import check_draft_modes
from trainers.rl_policy import load_rl_policy
from trainers.tasks import TaskConfig, TaskSource

DEFAULT_CONFIG = packaged_config("sweep")
FILES = ("sweep.jsonl", "sweep.csv", "sweep.md", "sweep.png")


@dataclass(frozen=True)
class SweepConfig:
    """One entropy sweep: cells = draft_modes x head_files, each at every temperature."""

    model: str = "smollm2-135m"         # `smollm2-135m`, `tiny-random`, a .gguf file or an HF directory
    head_files: list[str] = field(default_factory=list)   # head checkpoints as name=path (a bare path is
                                                          # named by its file stem); [] = the shipped heads
    draft_modes: list[str] = field(default_factory=lambda: ["greedy", "rejection"])   # greedy and/or rejection
    temperatures: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.7, 1.0, 1.3, 1.6])   # each > 0
    prompts: int = 16                   # held-out prompts (cycled when there are fewer)
    prompts_from: str = "chat"          # `chat`: the 8 built-in held-out chat messages; `tasks`: the held-out
                                        # prompts of `tasks` (the RL job's prompts)
    tasks: TaskConfig = field(default_factory=TaskConfig)   # the RL prompt source, for prompts_from=tasks
    max_new_tokens: int = 96            # tokens per completion at most
    num_draft_tokens: int = 3           # draft tokens per round (fixed)
    batch_size: int = 8                 # prompts decoded together
    seed: int = 0                       # sampling seed: batch b uses seed + b at every temperature and cell
    n_bins: int = 10                    # quantile entropy bins of the per-position slopes
    n_boot: int = 1000                  # bootstrap resamples per slope interval
    threads: int = 0                    # torch threads (0 = leave as is)
    out_dir: str = "runs/sweep/${now:%Y%m%d-%H%M%S}"   # where the files go; must be empty
    overwrite: bool = False             # allow a non-empty out_dir (its sweep files are replaced)
    progress: bool = True               # a tqdm bar with tokens/s and acceptance

    def __post_init__(self) -> None:
        check_temperatures(self.temperatures)
        check_draft_modes(self.draft_modes)
        self.settings()
        parse_heads(self.head_files)
        if self.prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {self.prompts}")
        if self.prompts_from not in ("chat", "tasks"):
            raise ValueError(f"prompts_from must be chat or tasks, got {self.prompts_from!r}")
        if self.prompts_from == "tasks" and self.tasks.heldout_prompts < 1:
            raise ValueError("prompts_from=tasks needs tasks.heldout_prompts >= 1")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = leave as is), got {self.threads}")

    def settings(self) -> SweepSettings:
        return SweepSettings(num_draft_tokens=self.num_draft_tokens, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
                             seed=self.seed, n_bins=self.n_bins, n_boot=self.n_boot)


def parse_heads(entries: list[str]) -> dict[str, Path]:
    """name=path entries -> {name: path}; ValueError naming `head_files` for a missing file or a name used twice."""
    out: dict[str, Path] = {}
    for entry in entries:
        name, sep, path = str(entry).partition("=")
        name, path = (name.strip(), path.strip()) if sep else (Path(entry).stem, str(entry))
        if not name or not path:
            raise ValueError(f"head_files: entry {entry!r} must be name=path (or a path)")
        if not Path(path).expanduser().is_file():
            raise ValueError(f"head_files: no head checkpoint at {path} (entry {entry!r}); give name=path of a file "
                             "written by `mtp-rollout train-heads`")
        if name in out:
            raise ValueError(f"head_files: the name {name!r} is used twice ({entries}); names label the figure's lines")
        out[name] = Path(path).expanduser()
    return out


def load_head_files(policy, cfg: SweepConfig) -> dict[str, tuple]:
    """{name: (heads, meta, path)} for cfg.head_files, or the heads shipped for cfg.model."""
    files = parse_heads(cfg.head_files)
    if files:
        return {name: (*load_heads(path, policy), str(path)) for name, path in files.items()}
    shipped = load_shipped_heads(policy, cfg.model)
    if shipped is None:
        raise ValueError(f"head_files: no heads are shipped for model {cfg.model!r}; pass head_files=[name=path,...]")
    return {"shipped": (*shipped, str(shipped_heads_path(cfg.model)))}


def check_out_dir(out: Path, overwrite: bool) -> None:
    held = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)
    if held and not overwrite:
        raise ValueError(f"out_dir {out} is not empty (holds {', '.join(held[:5])}{' ...' if len(held) > 5 else ''}); "
                         "pass overwrite=true to replace its sweep files, or another out_dir=...")


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _fit(d: dict | None) -> str:
    if not d or d.get("slope") is None:
        return "-"
    return f"{d['slope']:+.3f} [{_fmt(d.get('ci_low'), '+.3f')}, {_fmt(d.get('ci_high'), '+.3f')}]"


def tables(records: list[dict], cfg: SweepConfig) -> str:
    """sweep.md: one row per cell and temperature, then one row per cell with its slopes."""
    lines = [f"# Entropy sweep ({dt.date.today().isoformat()})", "",
             f"model `{cfg.model}`, k = {cfg.num_draft_tokens}, {cfg.prompts} held-out prompts x {cfg.max_new_tokens} new tokens, "
             f"seed {cfg.seed}", "",
             "| heads | mode | T | mean entropy (nats) | acceptance rate | cond. acceptance per position | tau "
             "| per-position slope at T [95% CI] | rounds | tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        cond = " / ".join(_fmt(a) for a in r["cond_acceptance"])
        lines.append(f"| {r['head']} | {r['draft_mode']} | {r['temperature']:g} | {_fmt(r['entropy_drafted'])} "
                     f"| {_fmt(r['acceptance_rate'])} | {cond} | {_fmt(r['acceptance_length'])} "
                     f"| {_fit(r['slope_position'])} | {r['num_drafts']} | {_fmt(r['tokens_per_s'], '.1f')} |")
    lines += ["", "| heads | mode | slope over temperatures [95% CI] | per-position slope, temperatures pooled "
              "[95% CI] |", "|---|---|---|---|"]
    for key in dict.fromkeys((r["head"], r["draft_mode"]) for r in records):
        r = next(r for r in records if (r["head"], r["draft_mode"]) == key)
        lines.append(f"| {key[0]} | {key[1]} | {_fit(r['slope_temperature'])} | {_fit(r['slope_position_cell'])} |")
    return "\n".join(lines) + "\n"


def plot_sweep(path: Path, records: list[dict]) -> None:
    """One panel per draft mode, one line per heads file: acceptance rate against mean entropy at
    the reached draft positions, one point per temperature (labelled), the cell's slope over
    temperatures with its 95% interval in the legend."""
    modes = list(dict.fromkeys(r["draft_mode"] for r in records))
    heads = list(dict.fromkeys(r["head"] for r in records))
    fig, axes = mode_panels(len(modes))
    colors = {h: f"C{i % 10}" for i, h in enumerate(heads)}
    for ax, mode in zip(axes[0], modes):
        for head in heads:
            cell = sorted((r for r in records if r["draft_mode"] == mode and r["head"] == head),
                          key=lambda r: r["temperature"])
            if not cell:
                continue
            x, y = column(cell, "entropy_drafted"), column(cell, "acceptance_rate")
            fit = fit_from_dict(cell[0].get("slope_temperature"))
            label = (f"{head}: {fit.slope:+.3f}/nat [{fit.ci_low:+.3f}, {fit.ci_high:+.3f}]"
                     if math.isfinite(fit.slope) else f"{head}: slope n/a (< 3 temperatures)")
            ax.plot(x, y, "o-", color=colors[head], label=label)
            for r, xi, yi in zip(cell, x, y):
                if math.isfinite(xi) and math.isfinite(yi):
                    ax.annotate(f"T={r['temperature']:g}", (xi, yi), textcoords="offset points", xytext=(3, 4),
                                fontsize=6, color=colors[head])
        finish_mode_panel(ax, mode, "mean entropy H(p) at reached draft positions (nats)",
                           "heads: slope over temperatures, 95% CI")
    save_png(fig, path)


def write_outputs(out: Path, records: list[dict], cfg: SweepConfig) -> None:
    atomic_write(out / "sweep.csv", records_csv(records))
    atomic_write(out / "sweep.md", tables(records, cfg))
    plot_sweep(out / "sweep.png", records)


def sweep_prompt_texts(cfg: SweepConfig) -> list[str]:
    """The sweep's prompts: built-in held-out chat messages, or the task source's held-out prompts
    (never trained on by the RL job), cycled to cfg.prompts."""
    if cfg.prompts_from == "chat":
        return prompt_texts(cfg.prompts, held_out=True)
    held = [t.prompt for t in TaskSource(cfg.tasks).heldout]
    return [held[i % len(held)] for i in range(cfg.prompts)]


def run(cfg: SweepConfig, resolved: str) -> list[dict]:
    out = Path(cfg.out_dir)
    with RunLock(out):
        check_out_dir(out, cfg.overwrite)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        policy = load_rl_policy(cfg.model, "float32")
        head_files = load_head_files(policy.model, cfg)
        prompts = [policy.codec.encode_prompt(t) for t in sweep_prompt_texts(cfg)]
        settings, temps = cfg.settings(), check_temperatures(cfg.temperatures)
        write_resolved(resolved, out)
        engine, records = TorchEngine(policy.model, config=EngineConfig(draft_lengths="fixed")), []   # the heads at k
        per_run = len(prompts) * cfg.max_new_tokens
        total = len(head_files) * len(cfg.draft_modes) * len(temps) * per_run
        with open(out / "sweep.jsonl", "w", encoding="utf-8") as log, \
                tqdm(total=total, unit="tok", disable=not cfg.progress, dynamic_ncols=True) as bar:
            for name, (heads, meta, path) in head_files.items():         # ---- the driver loop ----
                engine.set_heads(heads, meta.head_version)
                for mode in cfg.draft_modes:
                    cell, points = [], []
                    for t in temps:
                        bar.set_description(f"{name} {mode} T={t:g}")
                        run_t = decode_at(engine, prompts, mode, t, settings, progress_to(bar))
                        bar.total -= per_run - run_t.num_tokens           # stopped early: the bar still ends full
                        bar.refresh()
                        record, pts = temperature_record(run_t, settings)
                        cell.append({"head": name, "heads_path": path, "heads_loss": meta.loss, **record})
                        points.append(pts)
                    for r in add_cell_slopes(cell, points, settings):
                        records.append(json_safe(r))
                        log.write(json.dumps(records[-1]) + "\n")
                    log.flush()
                    write_outputs(out, records, cfg)
    print(tables(records, cfg))
    print(f"out_dir {out}: " + ", ".join(FILES))
    return records


def progress_to(bar: tqdm):
    """engine.generate's per-round callback -> the bar, with this temperature's acceptance."""
    seen = {"accepted": 0, "proposed": 0}

    def progress(new_tokens: int, accepted: int, proposed: int) -> None:
        seen["accepted"] += accepted
        seen["proposed"] += proposed
        if seen["proposed"]:
            bar.set_postfix(acceptance=f"{seen['accepted'] / seen['proposed']:.2f}", refresh=False)
        bar.update(new_tokens)
    return progress


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mtp-rollout sweep`: argv = YAML files and key=value overrides; without a
    YAML file configs/sweep.yaml comes first."""
    return preset_main(SweepConfig, DEFAULT_CONFIG, run, sys.argv[1:] if argv is None else argv, usage=__doc__)


if __name__ == "__main__":
    sys.exit(main())
