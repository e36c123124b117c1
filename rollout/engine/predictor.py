"""Predicted acceptance of each candidate draft token, from what is known before verification.

A draft token at chain position j (1-based) is accepted, given that the j-1 before it were, with a
probability that depends on its source and on features known before the target model sees it:

  * heads: the largest probability of the head's distribution q at j (a confident head is right
    more often: in greedy mode acceptance is p(argmax q), in rejection mode 1 - TV(p, q));
  * history: the suffix tree's conditional count ratio for the token (how often this continuation
    followed the matched context) and the match length;
  * both: the policy's entropy where the row's last token was sampled (low entropy, easy text).

Only features of distributions, never of a sampled draft token, may decide what is verified: a rule
that looked at the sampled token would verify a draft drawn from q restricted by that rule against
q itself, which is lossy (rollout.engine.chooser keeps to this).

Each (source, position, feature bin, entropy bin) keeps decayed counts of rows that reached and
accepted it; its estimate is shrunk towards the (source, position, feature bin) estimate, which is
shrunk towards the (source, position) estimate, which is shrunk towards a prior. Estimates follow the
policy as it moves (halflife in observations per cell) and are calibrated against what verification
observed, so a badly ranked feature costs accuracy of the ranking only, not of the level.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

SOURCES = ("heads", "history")
HEADS, HISTORY = 0, 1
FEATURE_BINS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)    # upper edges; the last bin is (0.9, 1]
ENTROPY_BINS = (0.5, 1.5, 3.0)                                   # nats; four bins
MATCH_BINS = (2, 4, 8)                                           # history: match length bins (four)


def feature_bin(x: np.ndarray) -> np.ndarray:
    """Feature values in [0, 1] -> bin indices 0..len(FEATURE_BINS)."""
    return np.searchsorted(FEATURE_BINS, np.asarray(x, dtype=np.float64), side="left")


def entropy_bin(h: np.ndarray) -> np.ndarray:
    return np.searchsorted(ENTROPY_BINS, np.asarray(h, dtype=np.float64), side="left")


def match_bin(m: np.ndarray) -> np.ndarray:
    return np.searchsorted(MATCH_BINS, np.asarray(m, dtype=np.float64), side="left")


@dataclass
class _Counts:
    accepted: float = 0.0
    reached: float = 0.0


class AcceptancePredictor:
    """P(accept | source, position, features), learnt online from verified rounds."""

    def __init__(self, k_max: int, *, prior: float = 0.4, prior_weight: float = 4.0, halflife: float = 256.0):
        self.k_max, self.prior, self.prior_weight = k_max, prior, prior_weight
        self.decay = 0.5 ** (1.0 / halflife)
        self._cells: dict[tuple, _Counts] = defaultdict(_Counts)

    # ------------------------------------------------------------------ keys
    @staticmethod
    def keys(source: int, position: int, feature: int, entropy: int, match: int = 0) -> tuple[tuple, tuple, tuple]:
        """(finest, middle, coarsest) cells; history's feature cell also carries the match-length bin."""
        return (source, position, feature, match, entropy), (source, position, feature, match), (source, position)

    def estimate(self, source: int, position: int, feature: int, entropy: int, match: int = 0) -> float:
        fine, mid, coarse = self.keys(source, position, feature, entropy, match)
        w = self.prior_weight
        level = self.prior
        for key in (coarse, mid, fine):
            c = self._cells.get(key)
            if c is not None:
                level = (c.accepted + w * level) / (c.reached + w)
        return level

    def predict(self, source: int, features: np.ndarray, entropy: float, match: int = 0) -> np.ndarray:
        """Conditional acceptance per chain position for one row: features [n] (feature of the
        token at position j+1) -> [n]."""
        # the chooser asks this for every row and round: bins of a few scalars by bisect, not numpy
        eb, mb = bisect_left(ENTROPY_BINS, float(entropy)), bisect_left(MATCH_BINS, float(match))
        return np.array([self.estimate(source, j + 1, bisect_left(FEATURE_BINS, f), eb, mb)
                         for j, f in enumerate(np.asarray(features, dtype=np.float64).tolist())])

    def predict_marginal(self, source: int, position: int) -> float:
        """Acceptance at `position` before the features are known (heads before drafting): the
        (source, position) level."""
        c = self._cells.get((source, position))
        return self.prior if c is None else (c.accepted + self.prior_weight * self.prior) / (c.reached + self.prior_weight)

    # ------------------------------------------------------------------ learning
    def observe(self, source: int, features: np.ndarray, entropy: float, match: int, num_verified: int,
                num_accepted: int) -> None:
        """One row of one round: `num_verified` drafts of `source` were verified, the first
        `num_accepted` accepted (position num_accepted + 1 was rejected when < num_verified)."""
        fb, eb, mb = feature_bin(features[:num_verified]), int(entropy_bin(entropy)), int(match_bin(match))
        for j in range(min(num_verified, num_accepted + 1)):      # positions that were reached
            hit = 1.0 if j < num_accepted else 0.0
            for key in self.keys(source, j + 1, int(fb[j]), eb, mb):
                c = self._cells[key]
                c.accepted = c.accepted * self.decay + hit
                c.reached = c.reached * self.decay + 1.0

    def reset(self, source: int | None = None) -> None:
        """Forget (one source's) estimates: new head weights start from their level again."""
        if source is None:
            self._cells.clear()
        else:
            for key in [k for k in self._cells if k[0] == source]:
                del self._cells[key]

    def levels(self) -> dict[str, list[float]]:
        """Per source, the (source, position) estimates: what the monitor shows."""
        return {name: [round(self.predict_marginal(s, j), 4) for j in range(1, self.k_max + 1)]
                for s, name in enumerate(SOURCES)}
