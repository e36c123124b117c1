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

Each (source, position, feature bin, match bin, entropy bin) keeps decayed counts of rows that reached
and accepted it; its estimate is shrunk towards the (source, position, feature bin, match bin) estimate,
which is shrunk towards the (source, position) estimate, which is shrunk towards a prior. Estimates
follow the policy as it moves (halflife in observations per cell) and are calibrated against what
verification observed, so a badly ranked feature costs accuracy of the ranking only, not of the level.
The counts are dense arrays and every cell's estimate one table, rebuilt once after a round's
observations: the chooser reads it for all rows of a round at once (host time is round time).
"""
from __future__ import annotations

import numpy as np

SOURCES = ("heads", "history")
HEADS, HISTORY = 0, 1
FEATURE_BINS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)    # upper edges; the last bin is (0.9, 1]
ENTROPY_BINS = (0.5, 1.5, 3.0)                                   # nats; four bins
MATCH_BINS = (2, 4, 8)                                           # history: match length bins (four)


_FEATURE_EDGES, _ENTROPY_EDGES, _MATCH_EDGES = (np.array(bins, dtype=np.float64)
                                                for bins in (FEATURE_BINS, ENTROPY_BINS, MATCH_BINS))


def feature_bin(x: np.ndarray) -> np.ndarray:
    """Feature values in [0, 1] -> bin indices 0..len(FEATURE_BINS)."""
    return np.searchsorted(_FEATURE_EDGES, np.asarray(x, dtype=np.float64), side="left")


def entropy_bin(h: np.ndarray) -> np.ndarray:
    return np.searchsorted(_ENTROPY_EDGES, np.asarray(h, dtype=np.float64), side="left")


def match_bin(m: np.ndarray) -> np.ndarray:
    return np.searchsorted(_MATCH_EDGES, np.asarray(m, dtype=np.float64), side="left")


class AcceptancePredictor:
    """P(accept | source, position, features), learnt online from verified rounds."""

    def __init__(self, k_max: int, *, prior: float = 0.4, prior_weight: float = 4.0, halflife: float = 256.0):
        self.k_max, self.prior, self.prior_weight = k_max, prior, prior_weight
        self.decay = 0.5 ** (1.0 / halflife)
        self._shape = (len(SOURCES), k_max, len(FEATURE_BINS) + 1, len(MATCH_BINS) + 1, len(ENTROPY_BINS) + 1)
        # decayed counts per cell, coarsest first: [S, k], [S, k, F, M], [S, k, F, M, E], views of one
        # buffer each (accepted, reached) so that a round's observations update all three in one pass
        sizes = [int(np.prod(self._shape[:n])) for n in (2, 4, 5)]
        self._offsets = tuple(int(o) for o in np.cumsum([0] + sizes[:-1]))
        self._counts = np.zeros((2, sum(sizes)))                     # [accepted, reached] of every cell
        self._accepted, self._reached = ([row[o:o + n].reshape(self._shape[:d])
                                          for o, n, d in zip(self._offsets, sizes, (2, 4, 5))] for row in self._counts)
        self._table: np.ndarray | None = None      # [S, k, F, M, E] estimates; None after new counts
        self._levels: np.ndarray | None = None     # [S, k] (source, position) estimates; None after new counts

    def _estimates(self) -> np.ndarray:
        """[S, k, F, M, E]: every cell's estimate, each level shrunk towards the coarser one's."""
        if self._table is None:
            w = self.prior_weight
            level = (self._accepted[0] + w * self.prior) / (self._reached[0] + w)                   # [S, k]
            level = (self._accepted[1] + w * level[:, :, None, None]) / (self._reached[1] + w)      # [S, k, F, M]
            self._table = (self._accepted[2] + w * level[..., None]) / (self._reached[2] + w)      # [S, k, F, M, E]
        return self._table

    def predict(self, source: int, features: np.ndarray, entropy: float, match: int = 0) -> np.ndarray:
        """Conditional acceptance per chain position for one row: features [n] (feature of the
        token at position j+1) -> [n]."""
        return self.predict_rows(source, np.asarray(features, dtype=np.float64)[None], np.array([entropy]),
                                 np.array([match]))[0]

    def predict_rows(self, source: int, features: np.ndarray, entropy: np.ndarray,
                     match: np.ndarray | None = None) -> np.ndarray:
        """predict for R rows of one source at once: features [R, n], entropy [R], match [R] (None: 0) -> [R, n]."""
        n = features.shape[1]
        mb = match_bin(match)[:, None] if match is not None else 0
        return self._estimates()[source, np.arange(n)[None], feature_bin(features), mb, entropy_bin(entropy)[:, None]]

    def position_levels(self, source: int) -> np.ndarray:
        """[k] the (source, position) levels of positions 1..k: acceptance before the features are known
        (heads before drafting). Read-only; kept until new counts."""
        if self._levels is None:
            w = self.prior_weight
            self._levels = (self._accepted[0] + w * self.prior) / (self._reached[0] + w)      # [S, k]
        return self._levels[source]

    # ------------------------------------------------------------------ learning
    def observe(self, source: int, features: np.ndarray, entropy: float, match: int, num_verified: int,
                num_accepted: int) -> None:
        """One row of one round: `num_verified` drafts of `source` were verified, the first
        `num_accepted` accepted (position num_accepted + 1 was rejected when < num_verified)."""
        self.observe_rows(np.array([source]), np.asarray(features, dtype=np.float64)[None, :max(num_verified, 1)],
                          np.array([entropy]), np.array([match]), np.array([num_verified]), np.array([num_accepted]))

    def observe_rows(self, source: np.ndarray, features: np.ndarray, entropy: np.ndarray, match: np.ndarray,
                     num_verified: np.ndarray, num_accepted: np.ndarray) -> None:
        """observe for the R rows of one round at once: source, entropy, match, num_verified,
        num_accepted [R]; features [R, n] (n >= every row's num_verified; values past it unused)."""
        n = features.shape[1]
        reached = np.arange(n)[None] < np.minimum(num_verified, num_accepted + 1)[:, None]     # [R, n]
        r, j = np.nonzero(reached)
        if r.size == 0:
            return
        hit = (j < num_accepted[r]).astype(np.float64)
        _, k, F, M, E = self._shape
        by_position = source[r] * k + j                                       # row-major cell indices, per level
        by_features = (by_position * F + feature_bin(features[r, j])) * M + match_bin(match)[r]
        by_entropy = by_features * E + entropy_bin(entropy)[r]
        cells = np.concatenate([by_position + self._offsets[0], by_features + self._offsets[1],
                                by_entropy + self._offsets[2]])
        self._add_round(cells, np.tile(hit, 3))
        self._table = self._levels = None

    def _add_round(self, cells: np.ndarray, hit: np.ndarray) -> None:
        """A round's events (cell, accepted or not): a cell with m of them keeps decay^m of its counts
        and adds them (a round's rows are verified at once, so none of its events ages another)."""
        m = np.bincount(cells, minlength=self._counts.shape[1])
        self._counts *= self.decay ** m
        self._counts[0] += np.bincount(cells, weights=hit, minlength=self._counts.shape[1])
        self._counts[1] += m

    def reset(self, source: int | None = None) -> None:
        """Forget (one source's) estimates: new head weights start from their level again."""
        for counts in (*self._accepted, *self._reached):
            counts[slice(None) if source is None else source] = 0.0       # views of self._counts
        self._table = self._levels = None

    def levels(self) -> dict[str, list[float]]:
        """Per source, the (source, position) estimates: what the monitor shows."""
        return {name: [round(level, 4) for level in self.position_levels(s).tolist()]
                for s, name in enumerate(SOURCES)}
