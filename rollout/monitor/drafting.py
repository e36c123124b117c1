"""Where one RL step's drafts came from and how well the engine predicted their acceptance.

Each row, each round, drafts 0..k tokens from one source: the MTP "heads" or "history" (tokens
copied from earlier rollouts). Per source this gives rounds, drafts, acceptance, conditional
acceptance per position and the share of emitted tokens its accepted drafts supplied; over
all rounds, the distribution of draft lengths; and, from the engine's per-draft predictions,
a calibration table (predicted vs observed conditional acceptance in fixed probability bins).
Calibration is kept as per-bin sums so that a run's worth merges, saves and resumes.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from rollout.types import Completion

SOURCES = ("heads", "history")
CALIBRATION_BINS = 10        # [0, .1), [.1, .2), ..., [.9, 1]


def round_sources(c: Completion) -> list[str]:
    """Source of each listed round; an engine that records none (vLLM, older runs) drafted from heads."""
    if not c.round_sources:
        return [SOURCES[0]] * len(c.round_accepted)
    if len(c.round_sources) != len(c.round_accepted):
        raise ValueError(f"round_sources has {len(c.round_sources)} rounds, round_accepted has "
                         f"{len(c.round_accepted)}")
    return list(c.round_sources)


def _round_lengths(c: Completion) -> np.ndarray:
    """Drafts verified per listed round: each round's own count, or k for every round."""
    if c.round_draft_tokens:
        if len(c.round_draft_tokens) != len(c.round_accepted):
            raise ValueError(f"round_draft_tokens has {len(c.round_draft_tokens)} rounds, round_accepted has "
                             f"{len(c.round_accepted)}")
        return np.asarray(c.round_draft_tokens, np.int64)
    return np.full(len(c.round_accepted), c.num_draft_tokens, np.int64)


def _emitted_accepted(acc: np.ndarray, num_tokens: int) -> np.ndarray:
    """Accepted drafts that are in the emitted tokens. A stop token or max_new_tokens can cut a row's
    last round after verification while round_accepted keeps the uncut count: the excess over the
    completion's tokens is taken off its last listed round."""
    out = acc.copy()
    over = int((acc + 1).sum()) - num_tokens
    if over > 0 and out.size:
        out[-1] = max(0, int(out[-1]) - over)
    return out


class Calibration:
    """Predicted vs observed conditional acceptance of reached draft positions, in CALIBRATION_BINS
    fixed bins of the predicted probability. Sums only, so that steps merge and a run resumes."""

    def __init__(self, n_bins: int = CALIBRATION_BINS):
        self.predicted_sum = np.zeros(n_bins, np.float64)   # [bins]
        self.accepted = np.zeros(n_bins, np.int64)          # [bins]
        self.count = np.zeros(n_bins, np.int64)             # [bins] reached positions

    @property
    def n_bins(self) -> int:
        return int(self.count.size)

    def add(self, predicted: np.ndarray, accepted: np.ndarray) -> "Calibration":
        """predicted [P] in [0, 1], accepted [P] bool, one entry per reached draft position."""
        p = np.clip(np.asarray(predicted, np.float64), 0.0, 1.0)
        # the epsilon keeps 0.3 (stored as 0.29999...) in [.3, .4); 1 falls in the top bin
        idx = np.clip(np.floor(p * self.n_bins + 1e-9).astype(np.int64), 0, self.n_bins - 1)
        self.predicted_sum += np.bincount(idx, weights=p, minlength=self.n_bins)
        self.accepted += np.bincount(idx, weights=np.asarray(accepted, np.float64),
                                     minlength=self.n_bins).astype(np.int64)
        self.count += np.bincount(idx, minlength=self.n_bins)
        return self

    def merge(self, other: "Calibration") -> "Calibration":
        self.predicted_sum += other.predicted_sum
        self.accepted += other.accepted
        self.count += other.count
        return self

    def table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean predicted [bins], observed acceptance [bins], count [bins]); NaN for empty bins."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.predicted_sum / self.count, self.accepted / self.count, self.count.copy()

    def error(self) -> float:
        """Count-weighted mean |mean predicted - observed| over bins (expected calibration error); NaN if empty."""
        total = int(self.count.sum())
        if not total:
            return float("nan")
        pred, obs, cnt = self.table()
        nz = cnt > 0
        return float((cnt[nz] * np.abs(pred[nz] - obs[nz])).sum() / total)

    def to_record(self) -> dict[str, list]:
        pred, obs, cnt = self.table()
        return {"predicted": pred.tolist(), "observed": obs.tolist(), "count": cnt.tolist()}

    def to_dict(self) -> dict[str, list]:
        return {"predicted_sum": self.predicted_sum.tolist(), "accepted": self.accepted.tolist(),
                "count": self.count.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, list]) -> "Calibration":
        c = cls(len(d["count"]))
        c.predicted_sum[:] = d["predicted_sum"]
        c.accepted[:] = d["accepted"]
        c.count[:] = d["count"]
        return c


def _calibration_points(c: Completion, acc: np.ndarray, k: np.ndarray,
                        src: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source [P], predicted [P], accepted [P]) of one completion's reached, predicted draft positions.
    Rounds with an empty prediction list (fixed-k rounds) give none."""
    if not c.round_predicted:
        return np.empty(0, str), np.empty(0), np.empty(0, bool)
    if len(c.round_predicted) != acc.size:
        raise ValueError(f"round_predicted has {len(c.round_predicted)} rounds, round_accepted has {acc.size}")
    lens = np.fromiter(map(len, c.round_predicted), np.int64, acc.size)                       # [R]
    bad = np.flatnonzero(lens > k)
    if bad.size:
        raise ValueError(f"round {bad[0]}: {lens[bad[0]]} predictions for {k[bad[0]]} drafts")
    pred = np.fromiter(chain.from_iterable(c.round_predicted), np.float64, int(lens.sum()))   # [M]
    if not np.isfinite(pred).all():
        raise ValueError("round_predicted contains NaN or inf")
    pos = np.arange(pred.size) - np.repeat(np.cumsum(lens) - lens, lens)                      # [M]
    acc_rep = np.repeat(acc, lens)                                                             # [M]
    reached = pos <= acc_rep
    return (np.repeat(np.asarray(src, dtype=object), lens)[reached], pred[reached],
            (pos < acc_rep)[reached])


def drafting_stats(completions: Sequence[Completion]) -> tuple[dict[str, Any], dict[str, Calibration]]:
    """The step record's `drafting` block and this step's calibration per source.

    Per source (heads and history always, any other source an engine reports too): rounds,
    draft_tokens, accepted_tokens, acceptance_rate, cond_acceptance (per position), token_share
    (emitted tokens that were its accepted drafts / all emitted tokens), calibration and
    calibration_error. plain_token_share: the rest (bonus, recovered and plain-round tokens).
    draft_length: mean and row_rounds {length: row-rounds} over the rounds in which a row drafted.
    """
    names = list(SOURCES)
    acc_l, k_l, emit_l, src_l, cal_src, cal_p, cal_a = [], [], [], [], [], [], []
    num_tokens = 0
    for c in completions:
        num_tokens += len(c.tokens)
        if not c.round_accepted:
            continue
        acc = np.asarray(c.round_accepted, np.int64)
        k = _round_lengths(c)
        bad = np.flatnonzero((acc < 0) | (acc > k))
        if bad.size:
            raise ValueError(f"round {bad[0]}: accepted {acc[bad[0]]} outside [0, {k[bad[0]]} drafts]")
        src = round_sources(c)
        names += [s for s in dict.fromkeys(src) if s not in names]
        acc_l.append(acc)
        k_l.append(k)
        emit_l.append(_emitted_accepted(acc, len(c.tokens)))
        src_l.append(np.asarray(src, dtype=object))
        for parts, x in zip((cal_src, cal_p, cal_a), _calibration_points(c, acc, k, src)):
            parts.append(x)

    def cat(parts, dtype):
        return np.concatenate(parts) if parts else np.empty(0, dtype)

    acc, k, emit, src = cat(acc_l, np.int64), cat(k_l, np.int64), cat(emit_l, np.int64), cat(src_l, object)
    c_src, c_p, c_a = cat(cal_src, object), cat(cal_p, np.float64), cat(cal_a, bool)
    nan = float("nan")
    block: dict[str, Any] = {}
    calibration: dict[str, Calibration] = {}
    for name in names:
        m = src == name
        a_m, k_m = acc[m], k[m]
        drafted, accepted = int(k_m.sum()), int(a_m.sum())
        j = np.arange(int(k_m.max(initial=0)))                                   # [K] draft positions
        reached = ((k_m[:, None] > j) & (a_m[:, None] >= j)).sum(0)             # [K] (the SpecDecodingStats rule)
        with np.errstate(invalid="ignore", divide="ignore"):
            cond = (a_m[:, None] > j).sum(0) / reached                          # [K]
        cm = c_src == name
        calibration[name] = Calibration().add(c_p[cm], c_a[cm])
        block[name] = {
            "rounds": int(m.sum()),
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else nan,
            "cond_acceptance": cond.tolist(),
            "token_share": int(emit[m].sum()) / num_tokens if num_tokens else nan,
            "calibration": calibration[name].to_record(),
            "calibration_error": calibration[name].error(),
        }
    block["plain_token_share"] = (num_tokens - int(emit.sum())) / num_tokens if num_tokens else nan
    lengths, counts = np.unique(k, return_counts=True)
    block["draft_length"] = {"mean": float(k.mean()) if k.size else nan,
                             "row_rounds": {str(n): int(c) for n, c in zip(lengths, counts)}}
    return block, calibration
