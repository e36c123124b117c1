"""The entropy sweep's measurement: draft acceptance against entropy at a fixed policy and fixed
heads, with the entropy moved by the sampling temperature.

Why: during RL the entropy rises slowly and the heads change with it, so one acceptance-entropy
curve costs a whole run. Temperature moves the entropy of the target p (and, through the same
`process_logits`, of the draft q) with nothing trained, so each (draft mode, heads) cell's curve
is a few decoding passes.

    settings = SweepSettings(num_draft_tokens=3, max_new_tokens=96, batch_size=8)
    records, points = [], []
    for t in check_temperatures([0.5, 1.0, 1.5]):                 # one cell: engine's heads, one mode
        record, pts = temperature_record(decode_at(engine, prompts, "rejection", t, settings), settings)
        records.append(record), points.append(pts)
    add_cell_slopes(records, points, settings)

One record per temperature: the monitor's group statistics (acceptance rate, tau, conditional
acceptance per position, mean entropy at reached draft positions, ...), the reached counts and
binomial standard errors per position, the binned per-position slope at that temperature (all
positions, and each position alone), and the cell's two slopes over all its temperatures.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rollout.monitor.positions import PositionPoints, per_position_slope
from rollout.monitor.slope import per_step_slope
from rollout.monitor.step_stats import group_stats
from rollout.torch_engine import TorchEngine
from rollout.types import Completion, SamplingParams

Progress = Callable[[int, int, int], None]     # (new tokens, accepted drafts, proposed drafts) per round


def check_temperatures(temperatures: Sequence[float]) -> list[float]:
    """The scanned temperatures as floats; ValueError naming `temperatures` when the list is
    empty or holds a value that is not a finite number > 0 (T = 0 is greedy decoding: no entropy)."""
    temps = list(temperatures)
    if not temps:
        raise ValueError("temperatures is empty: give at least one sampling temperature > 0, e.g. [0.5, 1.0, 1.5]")
    for t in temps:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperatures must be finite numbers > 0 (T = 0 is greedy decoding, entropy 0), "
                             f"got {t!r} in {temps}")
    return [float(t) for t in temps]


@dataclass(frozen=True)
class SweepSettings:
    """What every cell decodes with; the cell adds the draft mode and heads, the scan the temperature."""

    num_draft_tokens: int = 3   # drafts per round (fixed: adaptive k would change what is measured)
    max_new_tokens: int = 96    # tokens per completion at most
    batch_size: int = 8         # prompts decoded together
    seed: int = 0               # batch b of every temperature and cell is sampled with seed + b
    n_bins: int = 10            # quantile entropy bins of the per-position slopes
    n_boot: int = 1000          # bootstrap resamples per slope interval

    def __post_init__(self) -> None:
        for name, low in (("num_draft_tokens", 1), ("max_new_tokens", 1), ("batch_size", 1), ("n_bins", 3), ("n_boot", 0),
                          ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")


@dataclass
class TemperatureRun:
    """The completions of one cell at one temperature."""

    draft_mode: str
    temperature: float
    completions: list[Completion]
    wall_time_s: float

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)


def decode_at(engine: TorchEngine, prompts: list[list[int]], draft_mode: str, temperature: float,
              settings: SweepSettings, progress: Progress | None = None) -> TemperatureRun:
    """Every prompt once through speculative decoding at this temperature, in batches."""
    completions, t0 = [], time.perf_counter()
    for b, start in enumerate(range(0, len(prompts), settings.batch_size)):
        sp = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=temperature,
                            num_draft_tokens=settings.num_draft_tokens, draft_mode=draft_mode, seed=settings.seed + b)
        completions += engine.generate(prompts[start:start + settings.batch_size], sp, progress).completions
    return TemperatureRun(draft_mode, temperature, completions, time.perf_counter() - t0)


def _slope_dict(points: PositionPoints, settings: SweepSettings) -> dict:
    fit, _ = per_position_slope(points, n_bins=settings.n_bins, n_boot=settings.n_boot, seed=settings.seed)
    return fit.to_dict()


def _subset(points: PositionPoints, keep: np.ndarray) -> PositionPoints:
    return PositionPoints(points.entropy[keep], points.position[keep], points.reached[keep], points.accepted[keep])


def temperature_record(run: TemperatureRun, settings: SweepSettings) -> tuple[dict, PositionPoints]:
    """One temperature's record and its per-position points (add_cell_slopes pools them)."""
    block, points = group_stats(run.completions)
    k = settings.num_draft_tokens
    reached = np.bincount(points.position[points.reached], minlength=k)[:k]              # [k]
    accepted = np.bincount(points.position[points.accepted], minlength=k)[:k]            # [k]
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = accepted / reached
        se = np.sqrt(rate * (1 - rate) / reached)
    record = {
        "draft_mode": run.draft_mode, "temperature": run.temperature, "k": k, **block,
        "reached_per_pos": reached.tolist(), "cond_acceptance_se": se.tolist(),
        "slope_position": _slope_dict(points, settings),
        "slope_by_position": [_slope_dict(_subset(points, points.position == j), settings) for j in range(k)],
        "wall_time_s": run.wall_time_s,
        "tokens_per_s": run.num_tokens / run.wall_time_s if run.wall_time_s > 0 else float("nan"),
    }
    return record, points


def add_cell_slopes(records: list[dict], points: list[PositionPoints], settings: SweepSettings) -> list[dict]:
    """The cell's slopes over all its temperatures, written into each of its records:
    `slope_temperature` (acceptance rate on mean entropy, one point per temperature: the
    figure's line; needs >= 3 temperatures) and `slope_position_cell` (conditional acceptance
    on entropy over the reached positions of every temperature, in quantile bins)."""
    over_t = per_step_slope([r["entropy_drafted"] for r in records], [r["acceptance_rate"] for r in records],
                            n_boot=settings.n_boot, seed=settings.seed).to_dict()
    pooled = PositionPoints(*(np.concatenate([getattr(p, f) for p in points])
                              for f in ("entropy", "position", "reached", "accepted")))
    cell = _slope_dict(pooled, settings)
    for r in records:
        r["slope_temperature"], r["slope_position_cell"] = over_t, cell
    return records
