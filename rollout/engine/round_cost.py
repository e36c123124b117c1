"""What a decode round costs, modelled online from the rounds that run anyway.

time = a + b * (tokens verified) + c * (head steps), per batch bucket, fitted by decayed least
squares to the measured wall time of recent rounds (each round is one sample; the machine's speed
drifts by tens of percent within minutes, so old rounds fade with `halflife`). Until a bucket has
seen enough rounds of different shapes to tell b and c apart, a prior fills in: the prior is
written in units of that bucket's plain round (measured first: every call starts with plain rounds
while the heads' caches fill and history is empty), and the fit is shrunk towards it (ridge) so a
few noisy rounds cannot price drafting out for good.
"""
from __future__ import annotations

import math

import numpy as np

# prior shares of a plain round: a verified token costs PRIOR_TOKEN / batch of it (a plain round
# verifies `batch` tokens), a head step PRIOR_HEAD of it. Optimistic against what 2-core CPUs
# measured (V(2) = 1.1-1.2 at batch 8, a head step 0.08-0.1), so drafting is tried and then priced
# by what it cost.
PRIOR_TOKEN = 0.15
PRIOR_HEAD = 0.05


class RoundCostModel:
    """Per batch bucket: seconds of a round verifying n tokens with h head steps."""

    def __init__(self, *, halflife: float = 64.0, prior_weight: float = 4.0):
        self.decay = 0.5 ** (1.0 / halflife)
        self.prior_weight = prior_weight
        self._xtx: dict[int, np.ndarray] = {}      # bucket -> decayed sum of x x^T, x = (1, n, h)
        self._xty: dict[int, np.ndarray] = {}
        self._plain: dict[int, float] = {}        # bucket -> decayed mean of plain-round seconds
        self._timed_plain: set[int] = set()       # buckets where a plain round itself was timed
        self._coef: dict[int, np.ndarray] = {}
        self._seen: set[tuple[int, int, int]] = set()

    def observe(self, bucket: int, tokens: int, head_steps: int, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        shape = (bucket, tokens, head_steps)
        if shape not in self._seen:      # first use of a shape pays for oneDNN's kernel set-up: no sample
            self._seen.add(shape)
            return
        x = np.array([1.0, tokens, head_steps])
        if bucket not in self._xtx:
            self._xtx[bucket], self._xty[bucket] = np.zeros((3, 3)), np.zeros(3)
        self._xtx[bucket] = self._xtx[bucket] * self.decay + np.outer(x, x)
        self._xty[bucket] = self._xty[bucket] * self.decay + x * seconds
        # the prior's unit, a plain round: timed where one ran, else read off this round through the prior
        unit = seconds / (1 + PRIOR_TOKEN * (tokens / bucket - 1) + PRIOR_HEAD * head_steps)
        plain_round = head_steps == 0 and tokens <= bucket
        if plain_round or bucket not in self._timed_plain:
            old = self._plain.get(bucket)
            self._plain[bucket] = unit if old is None else 0.9 * old + 0.1 * unit
        if plain_round:
            self._timed_plain.add(bucket)
        self._coef.pop(bucket, None)

    def known(self, bucket: int) -> bool:
        """Whether a round of this bucket has been timed (the prior's unit is known)."""
        return bucket in self._plain

    def coefficients(self, bucket: int) -> tuple[float, float, float]:
        """(a, b, c) in seconds: the ridge fit shrunk towards the prior."""
        if bucket in self._coef:
            return tuple(self._coef[bucket])
        plain = self._plain.get(bucket, 1.0)
        prior = np.array([plain * (1 - PRIOR_TOKEN), plain * PRIOR_TOKEN / bucket, plain * PRIOR_HEAD])
        scale = np.array([1.0, float(bucket), 1.0])     # a ridge penalty in units of each term's typical size
        ridge = self.prior_weight * np.diag(scale ** 2)
        xtx, xty = self._xtx.get(bucket, np.zeros((3, 3))), self._xty.get(bucket, np.zeros(3))
        coef = np.linalg.solve(xtx + ridge, xty + ridge @ prior)
        coef = np.maximum(coef, [0.0, plain * 0.01 / bucket, 0.0])   # a verified token is never free
        self._coef[bucket] = coef
        return tuple(coef)

    def seconds(self, bucket: int, tokens: int, head_steps: int) -> float:
        a, b, c = self.coefficients(bucket)
        return a + b * tokens + c * head_steps
