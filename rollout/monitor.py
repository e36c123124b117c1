"""Acceptance-vs-entropy monitor: per-step draft acceptance, slope fits with CIs, drift alerts.

The question it answers: as RL raises the policy's entropy, how fast does draft acceptance
fall (the slope, per nat), and is that slope flat enough for the heads in use? Two slopes
are measured (see DESIGN.md "Definitions"):

- per step: least squares over step means (mean entropy at drafted positions, acceptance
  rate = accepted / proposed), over the whole run and over a rolling window;
- per position: reached draft positions binned by entropy (quantile bins), conditional
  acceptance accepted / reached per bin, weighted least squares over bin centres; for this
  step and cumulatively over the run.

Each slope comes with a bootstrap 95% percentile interval. Output goes to an append-only
JSONL (fsync'ed per record, readable after a crash), TensorBoard scalars, a CSV summary
and two PNG figures.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from rollout.fileio import atomic_write
from rollout.types import Completion, RolloutBatch, SpecDecodingStats

logger = logging.getLogger(__name__)

_BOOT_CHUNK_ELEMS = 1_000_000  # resample-count matrix per chunk (n_boot rows x n points): ~8 MB


# ---------------------------------------------------------------------------------------------
# Slope fit with a bootstrap interval
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlopeFit:
    """Least-squares line acceptance = intercept + slope * entropy, slope CI from a bootstrap.

    nan fields mean "not identifiable" (all entropies equal, too few points), never an error.
    """

    slope: float
    intercept: float
    r2: float
    ci_low: float
    ci_high: float
    n: int

    @classmethod
    def empty(cls, n: int = 0) -> "SlopeFit":
        nan = float("nan")
        return cls(nan, nan, nan, nan, nan, n)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _moments(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per-point weighted moments [n, 5] = (w, w x, w y, w x^2, w x y) of centred x and y.

    Any resample's sums are counts @ moments, one matmul for all resamples; centring keeps
    the sums well conditioned (the slope does not depend on the centre).
    """
    xc = x - np.average(x, weights=w)
    yc = y - np.average(y, weights=w)
    return np.stack([w, w * xc, w * yc, w * xc * xc, w * xc * yc], axis=1)


def _slope_from_sums(sums: np.ndarray, x_scale: float) -> np.ndarray:
    """Least-squares slope from moment sums [..., 5] -> [...]; nan where x has no spread.

    x_scale = max x^2 of the raw points: the tolerance is relative to it because centring
    equal values can leave ulp-sized residues.
    """
    sw, sx, sy, sxx, sxy = np.moveaxis(sums, -1, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        vxx = sxx - sx * sx / sw                         # sw * Var_w(x)
        ok = vxx > 1e-12 * sw * (x_scale + np.finfo(float).tiny)
        return np.where(ok, (sxy - sx * sy / sw) / np.where(ok, vxx, 1.0), np.nan)


def _as_points(entropy, acceptance, weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate fit inputs once, so that the bootstrap can assume clean 1-D float arrays."""
    x = np.asarray(entropy, dtype=np.float64)
    y = np.asarray(acceptance, dtype=np.float64)
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"entropy and acceptance must be 1-D, got shapes {x.shape} and {y.shape}")
    if x.shape != y.shape:
        raise ValueError(f"entropy and acceptance differ in length: {x.size} vs {y.size}")
    if x.size < 3:
        raise ValueError(f"fit_slope needs at least 3 points, got {x.size}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("entropy and acceptance must be finite (NaN or inf found); drop those points first")
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != x.shape:
        raise ValueError(f"weights must match the points in length: {w.size} vs {x.size}")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be finite, >= 0 and not all zero")
    return x, y, w


def _bootstrap_slopes(x: np.ndarray, y: np.ndarray, w: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """Slopes of n_boot pairs-bootstrap resamples: [n_boot] (nan = degenerate resample).

    Resample counts [b, n] come from one bincount per chunk, sums from one matmul: ~3 passes
    over the b x n matrix instead of a dozen gathers and products.
    """
    rng = np.random.default_rng(seed)
    n = x.size
    m = _moments(x, y, w)                                          # [n, 5]
    rows = max(1, _BOOT_CHUNK_ELEMS // n)
    out = []
    for start in range(0, n_boot, rows):
        b = min(rows, n_boot - start)
        idx = rng.integers(0, n, size=(b, n)) + n * np.arange(b)[:, None]     # [b, n] flat indices
        counts = np.bincount(idx.ravel(), minlength=b * n).reshape(b, n)      # [b, n]
        out.append(_slope_from_sums(counts.astype(np.float64) @ m, float(np.max(x * x))))  # [b]
    return np.concatenate(out) if out else np.empty(0)


def fit_slope(entropy, acceptance, *, weights=None, n_boot: int = 1000, seed: int = 0) -> SlopeFit:
    """Slope of acceptance on entropy (per nat) with a bootstrap 95% percentile interval.

    Points (with their weights) are resampled with replacement n_boot times. Raises
    ValueError for fewer than 3 points, mismatched lengths or non-finite values. If all
    entropies are equal the slope is not identifiable: slope, r2 and the CI are nan and
    intercept is the weighted mean acceptance. The CI is nan when n_boot == 0 or when
    more than half of the resamples are degenerate.
    """
    if n_boot < 0:
        raise ValueError(f"n_boot must be >= 0, got {n_boot}")
    x, y, w = _as_points(entropy, acceptance, weights)
    x_mean, y_mean = float(np.average(x, weights=w)), float(np.average(y, weights=w))
    slope = float(_slope_from_sums(_moments(x, y, w).sum(0), float(np.max(x * x))))
    if math.isnan(slope):
        return SlopeFit(float("nan"), y_mean, float("nan"), float("nan"), float("nan"), int(x.size))
    intercept = y_mean - slope * x_mean
    ss_tot = float((w * (y - y_mean) ** 2).sum())
    ss_res = float((w * (y - intercept - slope * x) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    boots = _bootstrap_slopes(x, y, w, n_boot, seed)
    boots = boots[np.isfinite(boots)]
    if n_boot > 0 and boots.size * 2 >= n_boot:
        lo, hi = (float(v) for v in np.percentile(boots, [2.5, 97.5]))
    else:
        lo = hi = float("nan")
    return SlopeFit(slope, intercept, r2, lo, hi, int(x.size))


def per_step_slope(step_entropy, step_acceptance, *, n_boot: int = 1000, seed: int = 0) -> SlopeFit:
    """Slope across RL steps from step means; steps without drafts (nan) are left out.

    Returns SlopeFit.empty when fewer than 3 usable steps remain (early in a run).
    """
    x = np.asarray(step_entropy, dtype=np.float64)
    y = np.asarray(step_acceptance, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"step_entropy and step_acceptance differ in length: {x.size} vs {y.size}")
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3:
        return SlopeFit.empty(int(keep.sum()))
    return fit_slope(x[keep], y[keep], n_boot=n_boot, seed=seed)


# ---------------------------------------------------------------------------------------------
# Completions -> per-position points -> entropy bins
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PositionPoints:
    """One row per draft position that has an entropy. M rows."""

    entropy: np.ndarray    # [M] float64, H(p) at the draft position (nats)
    position: np.ndarray   # [M] int64, draft position j in its round (0-based)
    reached: np.ndarray    # [M] bool, j <= accepted in that round (its verdict was decided)
    accepted: np.ndarray   # [M] bool, j < accepted in that round

    def __len__(self) -> int:
        return int(self.entropy.size)


def _completion_points(c: Completion) -> PositionPoints | None:
    """Rows of one completion, vectorised over its rounds (ragged rounds allowed); None if
    the engine recorded counts but no entropies (nothing to place on the x-axis)."""
    if not c.draft_entropies:
        return None
    k = c.num_draft_tokens
    if len(c.draft_entropies) != len(c.round_accepted):
        raise ValueError(f"draft_entropies has {len(c.draft_entropies)} rounds, "
                         f"round_accepted has {len(c.round_accepted)}")
    acc = np.asarray(c.round_accepted, np.int64)                         # [R]
    lens = np.fromiter(map(len, c.draft_entropies), np.int64, acc.size)  # [R]
    bad = np.flatnonzero((acc < 0) | (acc > k))
    if bad.size:
        raise ValueError(f"round {bad[0]}: accepted {acc[bad[0]]} outside [0, k={k}]")
    bad = np.flatnonzero((lens < np.minimum(acc + 1, k)) | (lens > k))
    if bad.size:
        r = bad[0]
        raise ValueError(f"round {r}: {lens[r]} draft entropies for k={k} with {acc[r]} accepted "
                         f"(need every reached position, at most k)")
    ent = np.fromiter(chain.from_iterable(c.draft_entropies), np.float64, int(lens.sum()))  # [M]
    pos = np.arange(ent.size) - np.repeat(np.cumsum(lens) - lens, lens)  # [M] j within its round
    acc_rep = np.repeat(acc, lens)                                       # [M]
    return PositionPoints(ent, pos, pos <= acc_rep, pos < acc_rep)


def position_points(completions: Iterable[Completion]) -> PositionPoints:
    """Per-position (entropy, reached, accepted) rows from Completion.draft_entropies/round_accepted.

    Position j of round r is reached iff j <= round_accepted[r] and accepted iff
    j < round_accepted[r]. Unreached positions are kept (reached=False) when the engine
    recorded their entropy. Completions without draft_entropies contribute no rows.
    """
    parts = [p for p in map(_completion_points, completions) if p is not None]
    if not parts:
        return PositionPoints(np.empty(0), np.empty(0, np.int64), np.empty(0, bool), np.empty(0, bool))
    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    pts = PositionPoints(cat("entropy"), cat("position"), cat("reached"), cat("accepted"))
    if not np.isfinite(pts.entropy).all():
        raise ValueError("draft_entropies contain NaN or inf")
    return pts


@dataclass(frozen=True)
class EntropyBins:
    """Conditional acceptance per entropy bin. B non-empty bins (B <= n_bins)."""

    entropy: np.ndarray     # [B] mean entropy of the reached positions in the bin
    acceptance: np.ndarray  # [B] accepted / reached
    count: np.ndarray       # [B] reached positions

    def to_dict(self) -> dict[str, list]:
        return {"entropy": self.entropy.tolist(), "acceptance": self.acceptance.tolist(),
                "count": self.count.tolist()}


def entropy_bins(entropy, accepted, *, counts=None, n_bins: int = 10) -> EntropyBins:
    """Quantile bins over reached positions, ties kept in one bin.

    entropy [A], accepted [A] (0/1 or counts), counts [A] reached per atom (default 1):
    an "atom" is one reached position or one histogram cell, so raw points and the
    cumulative histogram share this code. Bin edges are count-weighted quantiles.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    x = np.asarray(entropy, dtype=np.float64)
    acc = np.asarray(accepted, dtype=np.float64)
    cnt = np.ones_like(x) if counts is None else np.asarray(counts, dtype=np.float64)
    if not x.shape == acc.shape == cnt.shape:
        raise ValueError(f"entropy, accepted and counts differ in shape: {x.shape}, {acc.shape}, {cnt.shape}")
    if x.size == 0 or cnt.sum() <= 0:
        return EntropyBins(np.empty(0), np.empty(0), np.empty(0, np.int64))
    order = np.argsort(x, kind="stable")
    cum = np.cumsum(cnt[order])                                   # [A]
    qs = np.arange(1, n_bins) / n_bins * cum[-1]                  # [n_bins-1] target cumulative counts
    edges = np.unique(x[order][np.searchsorted(cum, qs)])         # interior edges, ties merged
    bin_id = np.searchsorted(edges, x, side="left")               # x <= edge_0 -> bin 0, ...
    n_reached = np.bincount(bin_id, weights=cnt, minlength=edges.size + 1)
    n_acc = np.bincount(bin_id, weights=acc, minlength=edges.size + 1)
    h_sum = np.bincount(bin_id, weights=cnt * x, minlength=edges.size + 1)
    keep = n_reached > 0
    return EntropyBins(h_sum[keep] / n_reached[keep], n_acc[keep] / n_reached[keep],
                       n_reached[keep].astype(np.int64))


def binned_slope(bins: EntropyBins, *, n_boot: int = 1000, seed: int = 0) -> SlopeFit:
    """fit_slope over bin centres weighted by reached counts; empty fit if < 3 bins.

    The bootstrap resamples bins, so the CI reflects scatter between bins, not the
    binomial noise inside each bin.
    """
    if bins.entropy.size < 3:
        return SlopeFit.empty(int(bins.entropy.size))
    return fit_slope(bins.entropy, bins.acceptance, weights=bins.count, n_boot=n_boot, seed=seed)


def per_position_slope(points: PositionPoints, *, n_bins: int = 10, n_boot: int = 1000,
                       seed: int = 0) -> tuple[SlopeFit, EntropyBins]:
    """Binned per-position slope over the reached positions of `points`."""
    r = points.reached
    bins = entropy_bins(points.entropy[r], points.accepted[r], n_bins=n_bins)
    return binned_slope(bins, n_boot=n_boot, seed=seed), bins


class EntropyHistogram:
    """Reached/accepted counts of draft positions on a fixed entropy grid.

    Keeps the cumulative per-position data of a whole run in O(cells) memory (a run can
    see tens of millions of positions); bin centres stay exact because the entropy sum
    per cell is kept, only bin edges are rounded to the grid.
    """

    def __init__(self, width: float = 0.01, max_entropy: float = 16.0):
        if width <= 0 or max_entropy <= width:
            raise ValueError(f"need 0 < width < max_entropy, got {width}, {max_entropy}")
        self.width = float(width)
        n = int(math.ceil(max_entropy / width - 1e-9))  # exact multiples stay exact
        self.reached = np.zeros(n, np.int64)      # [cells]
        self.accepted = np.zeros(n, np.int64)     # [cells]
        self.entropy_sum = np.zeros(n, np.float64)  # [cells]

    def add(self, entropy: np.ndarray, accepted: np.ndarray) -> None:
        """Add reached positions: entropy [M], accepted [M] bool. Out-of-grid values clip to the ends."""
        entropy = np.asarray(entropy, np.float64)
        n = self.reached.size
        idx = np.clip((entropy / self.width).astype(np.int64), 0, n - 1)
        self.reached += np.bincount(idx, minlength=n)
        self.accepted += np.bincount(idx, weights=np.asarray(accepted, np.float64), minlength=n).astype(np.int64)
        self.entropy_sum += np.bincount(idx, weights=entropy, minlength=n)

    def bins(self, n_bins: int = 10) -> EntropyBins:
        nz = self.reached > 0
        return entropy_bins(self.entropy_sum[nz] / self.reached[nz], self.accepted[nz],
                            counts=self.reached[nz], n_bins=n_bins)

    def to_dict(self) -> dict[str, Any]:
        """Sparse, JSON-able form (non-empty cells only)."""
        nz = np.flatnonzero(self.reached)
        return {"width": self.width, "cells": self.reached.size, "index": nz.tolist(),
                "reached": self.reached[nz].tolist(), "accepted": self.accepted[nz].tolist(),
                "entropy_sum": self.entropy_sum[nz].tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EntropyHistogram":
        h = cls(d["width"], d["width"] * d["cells"])
        idx = np.asarray(d["index"], np.int64)
        h.reached[idx] = d["reached"]
        h.accepted[idx] = d["accepted"]
        h.entropy_sum[idx] = d["entropy_sum"]
        return h


# ---------------------------------------------------------------------------------------------
# Records: strict JSON values, flat columns
# ---------------------------------------------------------------------------------------------

_NOT_COLUMNS = frozenset({"bins_step"})   # per-bin arrays stay in the JSONL, out of CSV/TensorBoard


def _json_safe(v: Any) -> Any:
    """numpy -> Python and NaN/inf -> None, so every line is strict JSON (jq, pandas, browsers)."""
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_json_safe(x) for x in (v.tolist() if isinstance(v, np.ndarray) else v)]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v if v is None or isinstance(v, str) else str(v)


def _num(v: Any) -> float:
    """Record value -> float, None (a NaN written to JSON) -> nan."""
    return float("nan") if v is None else float(v)


def _fit_from(d: dict | None) -> SlopeFit:
    """A slope dict read back from a record -> SlopeFit (None -> nan)."""
    if not d:
        return SlopeFit.empty()
    return SlopeFit(*(_num(d[k]) for k in ("slope", "intercept", "r2", "ci_low", "ci_high")), int(d["n"]))


def flatten_record(rec: dict, sep: str = ".") -> dict[str, Any]:
    """Nested step record -> flat columns (CSV, TensorBoard tags).

    slope_step_window.ci_low, cond_acceptance.0, domains.math.acceptance_rate; alerts
    become one column of ';'-joined names; bins_* arrays are left out.
    """
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k not in _NOT_COLUMNS:
                    walk(f"{prefix}{sep}{k}" if prefix else k, x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{prefix}{sep}{i}", x)
        else:
            out[prefix] = v

    walk("", {k: v for k, v in rec.items() if k != "alerts"})
    if "alerts" in rec:
        out["alerts"] = ";".join(a["name"] for a in rec["alerts"])
    return out


def _repair_tail(path: Path) -> None:
    """Make a crashed run's JSONL appendable: cut a truncated last line, or end a complete one."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    try:
        json.loads(data[cut:])
    except ValueError:
        logger.warning("%s: dropping a truncated last line (%d bytes) from an interrupted write",
                       path, len(data) - cut)
        with open(path, "r+b") as f:
            f.truncate(cut)
            os.fsync(f.fileno())
        return
    with open(path, "ab") as f:   # a complete record whose newline was lost
        f.write(b"\n")
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Per-group step statistics and history
# ---------------------------------------------------------------------------------------------


def _mean(xs) -> float:
    a = np.asarray(xs, dtype=np.float64)
    return float(a.mean()) if a.size else float("nan")


def _group_stats(completions: Sequence[Completion]) -> tuple[dict[str, Any], PositionPoints]:
    """Step means of one group of completions (the whole batch or one domain)."""
    stats = SpecDecodingStats()
    for c in completions:
        stats = stats.merge(c.spec_stats())
    pts = position_points(completions)
    block = {
        "num_completions": len(completions),
        "num_tokens": sum(len(c.tokens) for c in completions),
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "acceptance_length": stats.acceptance_length,
        "cond_acceptance": stats.conditional_acceptance,
        "entropy_drafted": _mean(pts.entropy[pts.reached]),
        "entropy_token": _mean([h for c in completions for h in c.entropies]),
    }
    return block, pts


def _by_domain(completions: Sequence[Completion]) -> dict[str, list[Completion]]:
    """Group by Completion.domain; {} when no completion is labelled."""
    if all(c.domain is None for c in completions):
        return {}
    groups: dict[str, list[Completion]] = {}
    for c in completions:
        groups.setdefault("unlabelled" if c.domain is None else str(c.domain), []).append(c)
    return groups


@dataclass
class _GroupHistory:
    """What one group keeps across steps: step means for the across-step slopes, draft
    counts for the windowed acceptance, and the cumulative per-position histogram."""

    hist: EntropyHistogram
    step: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)

    def append(self, step: int, block: dict[str, Any]) -> None:
        """block: a group's step record (live or read back from the JSONL)."""
        self.step.append(int(step))
        self.entropy.append(_num(block["entropy_drafted"]))
        self.acceptance.append(_num(block["acceptance_rate"]))
        self.accepted.append(int(block["num_accepted_tokens"]))
        self.proposed.append(int(block["num_draft_tokens"]))

    def rewind(self, step: int) -> None:
        """Forget step means at or after `step` (a run resumed from an earlier checkpoint)."""
        keep = sum(s < step for s in self.step)
        for xs in (self.step, self.entropy, self.acceptance, self.accepted, self.proposed):
            del xs[keep:]

    def window_acceptance(self, window: int) -> float:
        """Pooled accepted / proposed over the last `window` steps of this group."""
        proposed = sum(self.proposed[-window:])
        return sum(self.accepted[-window:]) / proposed if proposed else float("nan")


# ---------------------------------------------------------------------------------------------
# The monitor
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MonitorConfig:
    """Where the monitor writes and when it alerts. Plain values only: picklable for Ray."""

    out_dir: str                     # monitor output directory (follows `out_dir` in a run)
    window: int = 20                 # steps in the rolling slope / acceptance window
    n_bins: int = 10                 # quantile entropy bins of the per-position slope
    n_boot: int = 1000               # bootstrap resamples per slope interval
    min_acceptance: float = 0.5      # alert when the windowed acceptance rate falls below
    min_slope: float = -0.5          # alert when the windowed slope's CI is entirely below (per nat)
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


class AcceptanceMonitor:
    """Per-RL-step acceptance/entropy statistics, slope fits, drift alerts and their files.

    Files under config.out_dir: monitor.jsonl (append-only, one record per step or event),
    monitor_state.json (cumulative histograms, for re-opening), summary.csv, tb/,
    acceptance_vs_entropy.png, over_steps.png. Re-opening an existing out_dir continues
    the run: records are read back (a truncated last line is cut) and appended to.
    """

    JSONL = "monitor.jsonl"
    STATE = "monitor_state.json"
    CSV = "summary.csv"
    PNG_SCATTER = "acceptance_vs_entropy.png"
    PNG_STEPS = "over_steps.png"

    def __init__(self, config: MonitorConfig):
        self.config = config
        self.out_dir = Path(config.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._all = self._new_group()
        self._domains: dict[str, _GroupHistory] = {}
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
        rec: dict[str, Any] = {
            "step": int(step),
            "time": time.time(),
            "tokens_per_s": batch.tokens_per_s if tokens_per_s is None else tokens_per_s,
            "wall_time_s": batch.wall_time_s,
            **_versions(comps),
            "head_staleness": self._staleness(step) if staleness is None else staleness,
            **self._update_group(self._all, comps, step),
            "domains": {d: self._update_group(self._domain(d), cs, step)
                        for d, cs in _by_domain(comps).items()},
        }
        rec["alerts"] = self._check_alerts(rec)
        rec["extra"] = dict(extra or {})
        rec = _json_safe(rec)
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
        rec = _json_safe({"event": kind, "step": int(step), "time": time.time(), "detail": dict(detail or {})})
        self._append(rec)
        self._note_event(rec)
        return rec

    def summary_csv(self) -> Path:
        """Write <out_dir>/summary.csv: one row per step, flat columns (see flatten_record)."""
        rows = [flatten_record(r) for r in self._records]
        cols = list(dict.fromkeys(k for r in rows for k in r))
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)
        return atomic_write(self.out_dir / self.CSV, buf.getvalue())

    def plot(self) -> list[Path]:
        """Write acceptance_vs_entropy.png and over_steps.png from the records so far."""
        a = self.out_dir / self.PNG_SCATTER
        b = self.out_dir / self.PNG_STEPS
        last = self._records[-1] if self._records else {}
        _plot_acceptance_vs_entropy(a, self._all.hist.bins(self.config.n_bins),
                                    _fit_from(last.get("slope_position_cum")), self._records,
                                    _fit_from(last.get("slope_step_run")))
        _plot_over_steps(b, self._records, self._events, self.config)
        return [a, b]

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
        """All records (steps and events) of a JSONL, or of <path>/monitor.jsonl for a directory.

        A last line that does not parse (crash mid-write) is skipped with a warning; a bad
        line anywhere else is corruption and raises ValueError.
        """
        path = Path(path)
        if path.is_dir():
            path = path / AcceptanceMonitor.JSONL
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
        out = []
        for idx, (lineno, line) in enumerate(numbered):
            try:
                out.append(json.loads(line))
            except ValueError as e:
                if idx == len(numbered) - 1:
                    logger.warning("%s:%d: skipping a truncated last line (%s)", path, lineno, e)
                else:
                    raise ValueError(f"{path}:{lineno}: corrupt record: {e}") from e
        return out

    # -- per-group statistics ---------------------------------------------------------------

    def _new_group(self) -> _GroupHistory:
        return _GroupHistory(EntropyHistogram(self.config.hist_width, self.config.max_entropy))

    def _domain(self, name: str) -> _GroupHistory:
        if name not in self._domains:
            self._domains[name] = self._new_group()
        return self._domains[name]

    def _update_group(self, g: _GroupHistory, comps: Sequence[Completion], step: int) -> dict[str, Any]:
        """Step means + all four slopes of one group; updates its history first."""
        cfg = self.config
        block, pts = _group_stats(comps)
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
                **{k: f.to_dict() for k, f in fits.items()}, "bins_step": bins_now.to_dict()}

    def _staleness(self, step: int) -> int:
        """Steps since the last head_refresh event, or since the first step if none yet."""
        ref = self._last_refresh if self._last_refresh is not None else self._first_step
        return int(step) - int(ref)

    # -- alerts ---------------------------------------------------------------------------------

    def _check_alerts(self, rec: dict) -> list[dict]:
        """Drift conditions that hold at this step (an alert stays listed while it holds)."""
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
        _repair_tail(path)
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
                 "domains": {d: g.hist.to_dict() for d, g in self._domains.items()}}
        atomic_write(self.out_dir / self.STATE, json.dumps(state))  # dumps: C encoder

    def _load_state(self) -> None:
        path = self.out_dir / self.STATE
        if not path.exists():
            if self._records:
                logger.warning("%s missing: cumulative per-position slope restarts from zero", path)
            return
        state = json.loads(path.read_text(encoding="utf-8"))
        self._all.hist = EntropyHistogram.from_dict(state["all"])
        for d, h in state["domains"].items():
            self._domain(d).hist = EntropyHistogram.from_dict(h)
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


def _versions(comps: Sequence[Completion]) -> dict[str, int | None]:
    """Policy and head version range over a batch (workers may lag each other)."""
    pv = [c.policy_version for c in comps]
    hv = [c.head_version for c in comps]
    return {"policy_version_min": min(pv, default=None), "policy_version_max": max(pv, default=None),
            "head_version_min": min(hv, default=None), "head_version_max": max(hv, default=None)}


# ---------------------------------------------------------------------------------------------
# Figures (matplotlib's object API on Agg: no pyplot, no global backend switch)
# ---------------------------------------------------------------------------------------------


def _new_figure(rows: int, cols: int, size: tuple[float, float], margins: dict, **kw):
    """Fixed margins, not constrained layout: layout solving was ~40% of the plotting time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    fig.subplots_adjust(**margins)
    return fig, axes


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write(path, buf.getvalue())


def _column(records: list[dict], key: str) -> np.ndarray:
    return np.array([_num(r.get(key)) for r in records], dtype=np.float64)


def _fit_label(name: str, fit: SlopeFit) -> str:
    return (f"{name}: slope {fit.slope:+.3f}/nat, 95% CI [{fit.ci_low:+.3f}, {fit.ci_high:+.3f}], "
            f"R² {fit.r2:.2f}, n={fit.n}")


def _draw_fit(ax, fit: SlopeFit, x: np.ndarray, w: np.ndarray, color: str, name: str) -> None:
    """Fitted line over the data's x range; band = lines through the centroid with the CI slopes."""
    if not (math.isfinite(fit.slope) and x.size):
        return
    xs = np.linspace(x.min(), x.max(), 50)
    xc = float(np.average(x, weights=w))
    ax.plot(xs, fit.intercept + fit.slope * xs, color=color, label=_fit_label(name, fit))
    if math.isfinite(fit.ci_low) and math.isfinite(fit.ci_high):
        yc, dx = fit.intercept + fit.slope * xc, xs - xc
        lo = yc + np.minimum(fit.ci_low * dx, fit.ci_high * dx)
        hi = yc + np.maximum(fit.ci_low * dx, fit.ci_high * dx)
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, label="95% CI of the slope")


def _plot_acceptance_vs_entropy(path: Path, bins: EntropyBins, fit_pos: SlopeFit,
                                records: list[dict], fit_step: SlopeFit) -> None:
    """Left: cumulative per-position bins (size ~ count) + fit. Right: one point per RL step + fit."""
    fig, axes = _new_figure(1, 2, (12.5, 4.8), dict(left=0.06, right=0.99, bottom=0.11, top=0.93, wspace=0.16),
                            sharey=True)
    ax_pos, ax_step = axes[0]
    if bins.count.size:
        size = 20 + 180 * bins.count / bins.count.max()
        ax_pos.scatter(bins.entropy, bins.acceptance, s=size, color="tab:blue", alpha=0.8,
                       label=f"entropy bins ({int(bins.count.sum())} reached positions)")
        _draw_fit(ax_pos, fit_pos, bins.entropy, bins.count.astype(float), "tab:blue", "per position")
    ax_pos.set(title="per draft position, cumulative over the run",
               xlabel="entropy H(p) at the draft position (nats)",
               ylabel="conditional acceptance (accepted / reached)")
    x, y = _column(records, "entropy_drafted"), _column(records, "acceptance_rate")
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.any():
        steps = _column(records, "step")[ok]
        sc = ax_step.scatter(x[ok], y[ok], c=steps, cmap="viridis", s=18, label="RL steps")
        fig.colorbar(sc, ax=ax_step, label="RL step", pad=0.01)
        _draw_fit(ax_step, fit_step, x[ok], np.ones(ok.sum()), "tab:red", "per step")
    ax_step.set(title="per RL step (step means)", xlabel="mean entropy at drafted positions (nats)",
                ylabel="acceptance rate (accepted / proposed)")
    ax_step.yaxis.set_tick_params(labelleft=True)
    for ax in (ax_pos, ax_step):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower left")
    _save(fig, path)


def _mark_events(ax, events: list[dict], legend: bool) -> None:
    """Dashed lines at head refreshes, dotted at other operational events (alerts are not lines)."""
    refresh = [e["step"] for e in events if e["event"] == "head_refresh"]
    other = [e["step"] for e in events if e["event"] not in ("head_refresh", "alert", "alert_cleared")]
    for i, s in enumerate(refresh):
        ax.axvline(s, color="tab:green", ls="--", lw=1, label="head refresh" if legend and i == 0 else None)
    for i, s in enumerate(other):
        ax.axvline(s, color="tab:orange", ls=":", lw=1,
                   label="co-trainer / worker event" if legend and i == 0 else None)


def _plot_over_steps(path: Path, records: list[dict], events: list[dict], cfg: MonitorConfig) -> None:
    """Acceptance, entropy and tau against RL step, with refresh events and alert steps marked."""
    fig, axes = _new_figure(3, 1, (10, 8), dict(left=0.08, right=0.98, bottom=0.06, top=0.98, hspace=0.08),
                            sharex=True)
    ax_acc, ax_ent, ax_tau = axes[:, 0]
    steps = _column(records, "step")
    acc = _column(records, "acceptance_rate")
    ax_acc.plot(steps, acc, "o-", ms=3, color="tab:blue", label="acceptance rate")
    ax_acc.plot(steps, _column(records, "acceptance_window"), "--", color="tab:blue",
                label=f"pooled over {cfg.window} steps")
    for d in sorted({d for r in records for d in r.get("domains", {})}):
        rows = [(r["step"], _num(r["domains"][d]["acceptance_rate"])) for r in records if d in r.get("domains", {})]
        ax_acc.plot(*zip(*rows), lw=0.8, alpha=0.6, label=f"{d}")
    ax_acc.axhline(cfg.min_acceptance, color="tab:red", ls=":", lw=1, label="alert threshold")
    alerted = np.array([bool(r.get("alerts")) for r in records], dtype=bool)
    if alerted.any():
        ax_acc.plot(steps[alerted], acc[alerted], "x", color="tab:red", ms=7, label="alert active")
    ax_acc.set(ylabel="accepted / proposed")
    ax_ent.plot(steps, _column(records, "entropy_drafted"), "o-", ms=3, label="at drafted positions")
    ax_ent.plot(steps, _column(records, "entropy_token"), "s-", ms=3, alpha=0.7, label="per emitted token")
    ax_ent.set(ylabel="entropy (nats)")
    ax_tau.plot(steps, _column(records, "acceptance_length"), "o-", ms=3, color="tab:purple", label="tau")
    ax_tau.set(ylabel="tokens / verification (tau)", xlabel="RL step")
    for i, ax in enumerate((ax_acc, ax_ent, ax_tau)):
        _mark_events(ax, events, legend=i == 0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    _save(fig, path)
