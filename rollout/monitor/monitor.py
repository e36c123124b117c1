"""AcceptanceMonitor: per-step draft acceptance, slope fits with CIs, drift alerts, and files.

The question it answers: as RL raises the policy's entropy, how fast does draft acceptance
fall (the slope, per nat), and is that slope flat enough for the heads in use? Two slopes
are measured (see docs/design.md "Definitions"):

- per step: least squares over step means (mean entropy at drafted positions, acceptance
  rate = accepted / proposed), over the whole run and over a rolling window;
- per position: reached draft positions binned by entropy (quantile bins), conditional
  acceptance accepted / reached per bin, weighted least squares over bin centres; for this
  step and cumulatively over the run.

The per-position slope is also fitted per draft source (MTP heads, tokens copied from
history). Each slope comes with a bootstrap 95% percentile interval. Per step it also
records where drafts came from, how long they were and how well the engine's acceptance
predictor was calibrated, and it alerts at the step where the heads' acceptance collapses, naming
the likely cause from the policy and drafter versions (rollout.monitor.collapse). Output goes to an
append-only JSONL (fsync'ed per record, readable after a crash), TensorBoard scalars, a CSV summary
and three PNG figures.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.fileio import atomic_write
from rollout.monitor.collapse import check_config as check_collapse_config
from rollout.monitor.collapse import collapse_alert
from rollout.monitor.drafting import SOURCES, Calibration, drafting_stats
from rollout.monitor.plots import plot_acceptance_vs_entropy, plot_calibration, plot_over_steps
from rollout.monitor.positions import (MIN_BINS, EntropyHistogram, PositionPoints, binned_slope, entropy_bins,
                                       per_position_slope)
from rollout.monitor.records import (fit_from_dict, flatten_record, json_safe, load_records, records_csv,
                                     repair_jsonl_tail)
from rollout.monitor.slope import per_step_slope
from rollout.monitor.step_stats import GroupHistory, batch_versions, by_domain, group_stats
from rollout.types import Completion, RolloutBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MonitorConfig:
    """Where the monitor writes and when it alerts. Plain values only: picklable for Ray."""

    out_dir: str                     # monitor output directory (follows `out_dir` in a run)
    window: int = 20                 # steps in the rolling slope / acceptance window
    n_bins: int = 10                 # quantile entropy bins of the per-position slope
    n_boot: int = 1000               # bootstrap resamples per slope interval
    min_acceptance: float = 0.5      # alert when the windowed acceptance rate falls below
    min_slope: float = -0.5          # alert when the windowed slope's CI is entirely below (per nat)
    collapse_fraction: float = 0.25  # alert acceptance_collapse when a step's heads acceptance is below this
                                     # fraction of the median of the last `window` healthy steps (and below
                                     # collapse_floor)
    collapse_floor: float = 0.15     # acceptance_collapse also needs the step's heads acceptance below this
    collapse_min_draft_tokens: int = 64  # head drafts a step needs to be judged or to count in that median
    tensorboard: bool = True         # write TensorBoard scalars under `tb/`
    plot_every: int = 10             # rewrite CSV and PNGs every N steps (0: only at the end)
    plots: bool = True               # write PNG figures at all (false: e.g. headless workers)
    seed: int = 0                    # bootstrap seed (step s uses seed + s)
    hist_width: float = 0.01         # nats per cell of the cumulative entropy histogram
    max_entropy: float = 16.0        # range of that histogram in nats (log of a 256k vocabulary: 12.5)

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError(f"window must be >= 3 steps (a slope needs 3 points), got {self.window}")
        if self.n_bins < 3:
            raise ValueError(f"n_bins must be >= 3 (a slope needs 3 bins), got {self.n_bins}")
        if self.n_boot < 0 or self.plot_every < 0 or self.seed < 0:
            raise ValueError("n_boot, plot_every and seed must be >= 0")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        check_collapse_config(self.collapse_fraction, self.collapse_floor, self.collapse_min_draft_tokens)


class AcceptanceMonitor:
    """Per-RL-step acceptance/entropy statistics, slope fits, drift alerts and their files.

    Files under config.out_dir: monitor.jsonl (append-only, one record per step or event),
    monitor_state.json (cumulative histograms and calibration, for re-opening), summary.csv, tb/,
    acceptance_vs_entropy.png, over_steps.png, calibration.png. Re-opening an existing out_dir continues
    the run: records are read back (a truncated last line is cut) and appended to.
    """

    JSONL = "monitor.jsonl"
    STATE = "monitor_state.json"
    CSV = "summary.csv"
    PNG_SCATTER = "acceptance_vs_entropy.png"
    PNG_STEPS = "over_steps.png"
    PNG_CALIBRATION = "calibration.png"

    def __init__(self, config: MonitorConfig):
        self.config = config
        self.out_dir = Path(config.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._all = self._new_group()
        self._domains: dict[str, GroupHistory] = {}
        # run-long aggregates per draft source: reached positions (per-source cumulative slope), calibration
        self._source_hists: dict[str, EntropyHistogram] = {}
        self._calibration: dict[str, Calibration] = {s: Calibration() for s in SOURCES}
        self._records: list[dict] = []          # step records in memory, for CSV and plots
        self._events: list[dict] = []
        self._active_alerts: set[str] = set()
        self._first_step: int | None = None
        self._last_refresh: int | None = None
        self._resume()
        self._fh = open(self.out_dir / self.JSONL, "a", encoding="utf-8")
        self._writer = self._open_tensorboard() if config.tensorboard else None
        self._closed = False

    # -- public API ---------------------------------------------------------------------------

    def record_step(self, step: int, batch: RolloutBatch, *, tokens_per_s: float | None = None,
                    staleness: int | None = None, extra: dict | None = None) -> dict:
        """Compute, log and return the record of one RL step (keys: README, "Acceptance monitor")."""
        self._check_open()
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._rewind_to(step)
        if self._first_step is None:
            self._first_step = int(step)
        comps = batch.completions
        group, pts = self._update_group(self._all, comps, step)
        drafting, calibration = drafting_stats(comps)
        for name, cal in calibration.items():
            self._calibration.setdefault(name, Calibration()).merge(cal)
        rec: dict[str, Any] = {
            "step": int(step),
            "time": time.time(),
            "tokens_per_s": batch.tokens_per_s if tokens_per_s is None else tokens_per_s,
            "wall_time_s": batch.wall_time_s,
            "plain_estimate_s": batch.plain_estimate_s,
            "speedup_estimate": batch.plain_estimate_s / batch.wall_time_s if batch.wall_time_s > 0 else float("nan"),
            **batch_versions(comps),
            "head_staleness": self._staleness(step) if staleness is None else staleness,
            **group,
            "domains": {d: self._update_group(self._domain(d), cs, step)[0]
                        for d, cs in by_domain(comps).items()},
            "drafting": drafting,
            "history_sizes": batch.history_sizes,
            "speculation_paused": batch.speculation_paused,
            "speculation_tail_only": batch.speculation_tail_only,
            "slope_by_source": self._source_slopes(pts, step, list(calibration)),
        }
        rec["alerts"] = self._check_alerts(rec)
        rec["extra"] = dict(extra or {})
        rec = json_safe(rec)
        self._append(rec)
        self._records.append(rec)
        self._emit_alert_events(rec)
        self._tensorboard(rec)
        self._save_state()
        self._maybe_plot()
        return rec

    def record_event(self, step: int, kind: str, detail: dict | None = None) -> dict:
        """Append an event ("head_refresh" with reason and head_version, "cotrainer_failed",
        "worker_restarted", ...) to the JSONL; head refreshes reset the derived staleness."""
        self._check_open()
        if not kind or not isinstance(kind, str):
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        rec = json_safe({"event": kind, "step": int(step), "time": time.time(), "detail": dict(detail or {})})
        self._append(rec)
        self._note_event(rec)
        return rec

    def summary_csv(self) -> Path:
        """Write <out_dir>/summary.csv: one row per step, flat columns (see flatten_record)."""
        return atomic_write(self.out_dir / self.CSV, records_csv(self._records))

    def plot(self) -> list[Path]:
        """Write acceptance_vs_entropy.png, over_steps.png and calibration.png from the run so far."""
        a = self.out_dir / self.PNG_SCATTER
        b = self.out_dir / self.PNG_STEPS
        c = self.out_dir / self.PNG_CALIBRATION
        last = self._records[-1] if self._records else {}
        plot_acceptance_vs_entropy(a, self._all.hist.bins(self.config.n_bins),
                                    fit_from_dict(last.get("slope_position_cum")), self._records,
                                    fit_from_dict(last.get("slope_step_run")))
        plot_over_steps(b, self._records, self._events, window=self.config.window,
                        min_acceptance=self.config.min_acceptance)
        plot_calibration(c, self._calibration)
        return [a, b, c]

    def close(self) -> None:
        """Final CSV and plots, then close the JSONL and TensorBoard writer. Idempotent."""
        if self._closed:
            return
        try:
            if self._records:
                self.summary_csv()
                if self.config.plots:
                    self.plot()
        finally:
            self._closed = True
            self._fh.close()
            if self._writer is not None:
                self._writer.close()

    def __enter__(self) -> "AcceptanceMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def records(self) -> list[dict]:
        """Step records of this run (after resume: including the earlier ones)."""
        return list(self._records)

    @property
    def events(self) -> list[dict]:
        return list(self._events)

    @staticmethod
    def load_records(path: str | os.PathLike) -> list[dict]:
        """All records (steps and events) of a JSONL, or of <path>/monitor.jsonl for a directory
        (see rollout.monitor.records.load_records)."""
        path = Path(path)
        return load_records(path / AcceptanceMonitor.JSONL if path.is_dir() else path)

    # -- per-group statistics ---------------------------------------------------------------

    def _new_group(self) -> GroupHistory:
        return GroupHistory(EntropyHistogram(self.config.hist_width, self.config.max_entropy))

    def _domain(self, name: str) -> GroupHistory:
        if name not in self._domains:
            self._domains[name] = self._new_group()
        return self._domains[name]

    def _update_group(self, g: GroupHistory, comps: Sequence[Completion],
                      step: int) -> tuple[dict[str, Any], PositionPoints]:
        """Step means + all four slopes of one group (updates its history first), and its points."""
        cfg = self.config
        block, pts = group_stats(comps)
        g.append(step, block)
        g.hist.add(pts.entropy[pts.reached], pts.accepted[pts.reached])
        seed, w = cfg.seed + int(step), cfg.window
        fit_now, bins_now = per_position_slope(pts, n_bins=cfg.n_bins, n_boot=cfg.n_boot, seed=seed)
        fits = {
            "slope_step_run": per_step_slope(g.entropy, g.acceptance, n_boot=cfg.n_boot, seed=seed),
            "slope_step_window": per_step_slope(g.entropy[-w:], g.acceptance[-w:], n_boot=cfg.n_boot, seed=seed),
            "slope_position_step": fit_now,
            "slope_position_cum": binned_slope(g.hist.bins(cfg.n_bins), n_boot=cfg.n_boot, seed=seed),
        }
        return {**block, "acceptance_window": g.window_acceptance(w),
                **{k: f.to_dict() for k, f in fits.items()}, "bins_step": bins_now.to_dict()}, pts

    def _source_slopes(self, pts: PositionPoints, step: int, names: list[str]) -> dict[str, dict[str, dict]]:
        """Per-position slope of each draft source's reached positions, this step ("step") and over the
        run ("cum"); a fit is listed once it has the MIN_BINS entropy bins every per-position fit needs,
        a source once it has a fit. Updates the per-source cumulative histograms first."""
        cfg, seed = self.config, self.config.seed + int(step)
        out: dict[str, dict[str, dict]] = {}
        for name in dict.fromkeys([*names, *self._source_hists]):   # this step's sources (heads, history first)
            m = pts.reached & (pts.source == name)
            if m.any():
                self._source_hist(name).add(pts.entropy[m], pts.accepted[m])
            fits = {"step": binned_slope(entropy_bins(pts.entropy[m], pts.accepted[m], n_bins=cfg.n_bins),
                                         n_boot=cfg.n_boot, seed=seed)}
            if name in self._source_hists:
                fits["cum"] = binned_slope(self._source_hists[name].bins(cfg.n_bins), n_boot=cfg.n_boot, seed=seed)
            fits = {k: f.to_dict() for k, f in fits.items() if f.n >= MIN_BINS}
            if fits:
                out[name] = fits
        return out

    def _source_hist(self, name: str) -> EntropyHistogram:
        if name not in self._source_hists:
            self._source_hists[name] = EntropyHistogram(self.config.hist_width, self.config.max_entropy)
        return self._source_hists[name]

    def _staleness(self, step: int) -> int:
        """Steps since the last head_refresh event, or since the first step if none yet."""
        ref = self._last_refresh if self._last_refresh is not None else self._first_step
        return int(step) - int(ref)

    # -- alerts ---------------------------------------------------------------------------------

    def _check_alerts(self, rec: dict) -> list[dict]:
        """Drift conditions that hold at this step (an alert stays listed while it holds); the
        acceptance collapse is judged against the earlier steps (self._records, this one not yet in)."""
        cfg, alerts = self.config, []
        acc = rec["acceptance_window"]
        if math.isfinite(acc) and acc < cfg.min_acceptance:
            alerts.append({"name": "acceptance_low", "value": acc, "threshold": cfg.min_acceptance,
                           "message": f"acceptance rate over the last {cfg.window} steps is "
                                      f"{acc:.3f} < {cfg.min_acceptance}"})
        fit = rec["slope_step_window"]
        if math.isfinite(fit["ci_high"]) and fit["ci_high"] < cfg.min_slope:
            alerts.append({"name": "slope_steep", "value": fit["slope"], "threshold": cfg.min_slope,
                           "message": f"windowed slope {fit['slope']:+.3f}/nat, CI "
                                      f"[{fit['ci_low']:+.3f}, {fit['ci_high']:+.3f}] below {cfg.min_slope}"})
        collapse = collapse_alert(rec, self._records, window=cfg.window, fraction=cfg.collapse_fraction,
                                  floor=cfg.collapse_floor, min_draft_tokens=cfg.collapse_min_draft_tokens)
        if collapse is not None:
            alerts.append(collapse)
        return alerts

    def _emit_alert_events(self, rec: dict) -> None:
        """Warn and log an "alert" event when a condition starts, "alert_cleared" when it ends."""
        now = {a["name"]: a for a in rec["alerts"]}
        for name, a in now.items():
            if name not in self._active_alerts:
                logger.warning("monitor step %d: %s", rec["step"], a["message"])
                self.record_event(rec["step"], "alert", a)
        for name in sorted(self._active_alerts - now.keys()):
            logger.info("monitor step %d: alert %s cleared", rec["step"], name)
            self.record_event(rec["step"], "alert_cleared", {"name": name})
        self._active_alerts = set(now)

    # -- files ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("AcceptanceMonitor is closed; open a new one on the same out_dir to continue")

    def _append(self, rec: dict) -> None:
        """One strict-JSON line, flushed and fsync'ed: a crash keeps every completed record."""
        self._fh.write(json.dumps(rec, allow_nan=False, separators=(",", ":")) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def _note_event(self, rec: dict) -> None:
        self._events.append(rec)
        if rec["event"] == "head_refresh":
            self._last_refresh = rec["step"]

    def _rewind_to(self, step: int) -> None:
        """A step at or before the last one (run resumed from a checkpoint) replaces the later ones."""
        if not self._records or step > self._records[-1]["step"]:
            return
        logger.warning("monitor: step %d <= last recorded step %d; dropping later step means "
                       "(the cumulative per-position histogram keeps them)", step, self._records[-1]["step"])
        self._records = [r for r in self._records if r["step"] < step]
        for g in (self._all, *self._domains.values()):
            g.rewind(step)

    def _resume(self) -> None:
        """Rebuild histories from an existing JSONL and the histogram state file."""
        path = self.out_dir / self.JSONL
        if not path.exists():
            return
        repair_jsonl_tail(path)
        for rec in self.load_records(path):
            if "event" in rec:
                self._note_event(rec)
                continue
            self._rewind_to(rec["step"])
            if self._first_step is None:
                self._first_step = rec["step"]
            self._all.append(rec["step"], rec)
            for d, block in rec.get("domains", {}).items():
                self._domain(d).append(rec["step"], block)
            self._records.append(rec)
            self._active_alerts = {a["name"] for a in rec.get("alerts", [])}
        self._load_state()

    def _save_state(self) -> None:
        state = {"step": self._records[-1]["step"] if self._records else None,
                 "all": self._all.hist.to_dict(),
                 "domains": {d: g.hist.to_dict() for d, g in self._domains.items()},
                 "sources": {s: h.to_dict() for s, h in self._source_hists.items()},
                 "calibration": {s: c.to_dict() for s, c in self._calibration.items()}}
        atomic_write(self.out_dir / self.STATE, json.dumps(state))  # dumps: C encoder

    def _load_state(self) -> None:
        path = self.out_dir / self.STATE
        if not path.exists():
            if self._records:
                logger.warning("%s missing: cumulative per-position slopes and calibration restart from zero", path)
            return
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); it is damaged: delete it (the cumulative "
                             "per-position slope then restarts) or resume the run from a checkpoint") from None
        self._all.hist = EntropyHistogram.from_dict(state["all"])
        for d, h in state["domains"].items():
            self._domain(d).hist = EntropyHistogram.from_dict(h)
        # a state file from before per-source drafting lacks these: they start from zero
        self._source_hists = {s: EntropyHistogram.from_dict(h) for s, h in state.get("sources", {}).items()}
        for s, c in state.get("calibration", {}).items():
            self._calibration[s] = Calibration.from_dict(c)
        last = self._records[-1]["step"] if self._records else None
        if state["step"] != last:
            logger.warning("%s is from step %s but the log ends at step %s", path, state["step"], last)

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:   # tensorboard package missing: JSONL/CSV still have everything
            logger.warning("TensorBoard disabled (%s)", e)
            return None
        return SummaryWriter(log_dir=str(self.out_dir / "tb"))

    def _tensorboard(self, rec: dict) -> None:
        if self._writer is None:
            return
        for tag, v in flatten_record(rec, sep="/").items():
            if tag not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._writer.add_scalar(tag, v, rec["step"])
        self._writer.add_scalar("alerts/active", len(rec["alerts"]), rec["step"])
        self._writer.flush()

    def _maybe_plot(self) -> None:
        """Periodic CSV + PNGs; a plotting failure is logged, never raised into the RL loop."""
        every = self.config.plot_every
        if not every or len(self._records) % every:
            return
        try:
            self.summary_csv()
            if self.config.plots:
                self.plot()
        except Exception:  # noqa: BLE001 - figures are best effort, the JSONL is the record
            logger.exception("monitor: periodic CSV/plot failed at step %d", self._records[-1]["step"])

