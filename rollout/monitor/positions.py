"""Completions -> per-draft-position points -> entropy bins -> the per-position slope.

A draft position is "reached" when verification got to it; it is "accepted" when its draft
token was kept. Binning reached positions by the target entropy there and fitting
conditional acceptance (accepted / reached) per bin gives the per-position slope; the
cumulative histogram keeps those counts across a whole run in fixed-width cells so that it
can be saved, resumed and re-binned.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from rollout.monitor.drafting import round_sources
from rollout.monitor.slope import SlopeFit, fit_slope
from rollout.types import Completion


@dataclass(frozen=True)
class PositionPoints:
    """One row per draft position that has an entropy. M rows."""

    entropy: np.ndarray    # [M] float64, H(p) at the draft position (nats)
    position: np.ndarray   # [M] int64, draft position j in its round (0-based)
    reached: np.ndarray    # [M] bool, j <= accepted in that round (its verdict was decided)
    accepted: np.ndarray   # [M] bool, j < accepted in that round
    source: np.ndarray | None = None   # [M] str, where that round's drafts came from (heads | history)

    def __len__(self) -> int:
        return int(self.entropy.size)


def _completion_points(c: Completion) -> PositionPoints | None:
    """Rows of one completion, vectorised over its rounds (ragged rounds allowed); None if
    the engine recorded counts but no entropies (nothing to place on the x-axis)."""
    if not c.draft_entropies:
        return None
    if len(c.draft_entropies) != len(c.round_accepted):
        raise ValueError(f"draft_entropies has {len(c.draft_entropies)} rounds, "
                         f"round_accepted has {len(c.round_accepted)}")
    acc = np.asarray(c.round_accepted, np.int64)                         # [R]
    # drafts per round: num_draft_tokens, or each round's own count (rows draft 0..k per round)
    k = np.asarray(c.round_draft_tokens, np.int64) if c.round_draft_tokens else np.full(acc.size, c.num_draft_tokens)
    if k.size != acc.size:
        raise ValueError(f"round_draft_tokens has {k.size} rounds, round_accepted has {acc.size}")
    lens = np.fromiter(map(len, c.draft_entropies), np.int64, acc.size)  # [R]
    bad = np.flatnonzero((acc < 0) | (acc > k))
    if bad.size:
        raise ValueError(f"round {bad[0]}: accepted {acc[bad[0]]} outside [0, k={k[bad[0]]}]")
    bad = np.flatnonzero((lens < np.minimum(acc + 1, k)) | (lens > k))
    if bad.size:
        r = bad[0]
        raise ValueError(f"round {r}: {lens[r]} draft entropies for k={k[r]} with {acc[r]} accepted "
                         f"(need every reached position, at most k)")
    ent = np.fromiter(chain.from_iterable(c.draft_entropies), np.float64, int(lens.sum()))  # [M]
    pos = np.arange(ent.size) - np.repeat(np.cumsum(lens) - lens, lens)  # [M] j within its round
    acc_rep = np.repeat(acc, lens)                                       # [M]
    src = np.repeat(np.asarray(round_sources(c), dtype=object), lens)    # [M]
    return PositionPoints(ent, pos, pos <= acc_rep, pos < acc_rep, src)


def position_points(completions: Iterable[Completion]) -> PositionPoints:
    """Per-position (entropy, reached, accepted) rows from Completion.draft_entropies/round_accepted.

    Position j of round r is reached iff j <= round_accepted[r] and accepted iff
    j < round_accepted[r]. Unreached positions are kept (reached=False) when the engine
    recorded their entropy. Completions without draft_entropies contribute no rows. `source`
    is the round's Completion.round_sources entry ("heads" when the engine records none).
    """
    parts = [p for p in map(_completion_points, completions) if p is not None]
    if not parts:
        return PositionPoints(np.empty(0), np.empty(0, np.int64), np.empty(0, bool), np.empty(0, bool),
                              np.empty(0, object))

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    pts = PositionPoints(cat("entropy"), cat("position"), cat("reached"), cat("accepted"), cat("source"))
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


MIN_BINS = 3   # non-empty entropy bins a per-position fit needs (fit_slope's minimum of points)


def binned_slope(bins: EntropyBins, *, n_boot: int = 1000, seed: int = 0) -> SlopeFit:
    """fit_slope over bin centres weighted by reached counts; empty fit if < MIN_BINS bins.

    The bootstrap resamples bins, so the CI reflects scatter between bins, not the
    binomial noise inside each bin.
    """
    if bins.entropy.size < MIN_BINS:
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

