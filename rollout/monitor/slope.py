"""Least-squares slope of acceptance on entropy, with a bootstrap 95% percentile interval.

Why a module of its own: both slopes the monitor reports (per RL step, over step means; per
draft position, over entropy bins) and the benchmarks use this one estimator, and it is the
public contract `rollout.monitor.fit_slope` (docs/design.md "Contracts"). The bootstrap is vectorised over
resamples (resample counts times per-point moments), in chunks that bound memory.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

_BOOT_CHUNK_ELEMS = 1_000_000  # resample-count matrix per chunk (n_boot rows x n points): ~8 MB


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

