"""What a decode round costs, modelled online from the rounds that run anyway.

Per batch bucket: a plain round (no drafts, no head steps) costs what plain rounds measured (a
decayed mean); a round that drafts costs a + b * (tokens verified) + c * (head steps): c is what
its head steps took, timed apart by the engine (their time per step, decayed), and a + b * tokens is
fitted by decayed least squares to the rest of recent drafting rounds' time, each as a ratio to the
plain price of its moment (the machine's speed drifts by tens of percent within minutes, up to 1.7x
within a call on a shared Xeon: fitted in seconds, the line priced drafting at the old speed against a
plain price that had followed the machine; old rounds also fade with `halflife`). Fitted jointly from
round times alone, c was not identifiable: rounds with more head steps also verify more tokens, and
on a noisy machine the fit swung between c = 0 (head steps free: every round ran two) and twice
their real cost (no round ran one) within one process. The two are kept
apart because a drafting round pays fixed costs a plain round does not (the packed verification's
index, rejection sampling, the drafts' bookkeeping): extrapolating the drafting fit down to a plain
round overestimated it by ~20% at batch 16, which made drafting look cheaper than it was. Plain
rounds stop happening once drafting pays, so the chooser runs one now and then (`plain_due`) to
keep the plain price current. Until a bucket has seen enough drafting rounds of different shapes to
tell b and c apart, a prior fills in: written in units of that bucket's plain round (every call
starts with plain rounds while the heads' caches fill and history is empty), and the fit is shrunk
towards it (ridge) so a few noisy rounds cannot price drafting out for good. The slope b is shrunk
much harder than the intercept (SLOPE_PRIOR_ROUNDS): drafting rounds verify a narrow range of counts
(9-24 at batch 8) whose times scatter by tens of percent with the machine, and a verification's cost
steps at AMX's 16-row tiles where a line cannot follow it, so the fitted slope swung tenfold between
calls of one process (experiments/LOG.md, "the threshold's slope"); b sets the chooser's per-row
threshold, where such a swing decides whether any row wants a head draft.

A round computes the rows that have not finished (where verification packs them; a padded forward
computes the whole bucket), so a plain round with r of its bucket's rows computed is priced as the
bucket's timed plain round less b for each row left out, and timed such rounds are put back on the
full bucket's scale the same way.

Every round gets dearer as the rows' context grows (attention reads it all), so a plain round at the
end of a call costs more than one at its start. Rounds are priced at a common
context: each round's seconds are divided by 1 + kappa * context, kappa fitted (per bucket) on plain
rounds' seconds against their context. Unnormalised, a plain price timed late in one call made the
first rounds of the next look cheap to draft in, and drafting rounds, which time few plain rounds,
kept that stale price.

A verification's cost is not linear in its tokens everywhere: on Intel's AMX a matrix product
computes 16 rows per tile, so at batch 8 a packed verification of 16 tokens cost 2-4% more than a
plain round and one of 32 tokens 21-59% more, a step the line a + b * n cannot show (it priced the
32-token round cheap and the 16-token one dear). So each verified count n also keeps its own record:
the decayed mean of its rounds' time (less their head steps) over the plain price of the moment (a
ratio, so that the machine's drift, which the plain price follows, does not age it), shrunk towards
the line where n has few rounds, and made non-decreasing in n by isotonic regression weighted by
each count's rounds (`verify_curve`).

What drafting rounds taught (the line, the head steps' time, each count's record) fades once it goes
untested: IDLE_AFTER rounds of the bucket after the last round that measured it, it loses weight with a
halflife of IDLE_HALFLIFE rounds (`_freshness`). Kept until new drafting rounds replaced it, a stretch of
drafting rounds timed slow (a shared machine's slow spell, read against a plain price from before it)
priced drafting out for good, since no drafting round ran again to correct the price (experiments/LOG.md,
"drafting priced out for good"). A price that stops being tested returns towards the prior, which is
optimistic, until a few drafting rounds measure it again; a count priced above a step in the curve is
re-tried that way now and then.
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy.optimize import isotonic_regression

from rollout.engine.config import bucket, packed_tokens

# prior shares of a plain round: a plain round of `batch` rows costs what batch + PRIOR_STREAM_ROWS
# verified tokens would (its weights stream from memory whatever its rows), a verified token
# PRIOR_TOKEN / (batch + PRIOR_STREAM_ROWS) of it, a head step PRIOR_HEAD of it. Optimistic against
# what 2-core CPUs measured (V(2) = 1.1-1.2 at batch 8, a head step 0.08-0.1), so drafting is tried and
# then priced by what it cost. A token's share falls more slowly than 1 / batch: at batch 1 a verified
# token costs 0.03-0.05 of a plain round on 2-core CPUs (1 / batch would say 0.15), and where every
# drafting round verifies the same count (batch 1, one head step) the fitted slope stays on the prior.
PRIOR_TOKEN = 0.3
PRIOR_STREAM_ROWS = 8
PRIOR_HEAD = 0.05
CONTEXT_UNIT = 1000.0       # tokens: the context regressor's scale
CONTEXT_MIN_ROUNDS = 8.0    # plain rounds before kappa is fitted (0 before)
CURVE_HALFLIFE = 32.0       # rounds of one verified count, over which its record fades
IDLE_AFTER = 32             # rounds of a bucket without measuring a drafting price before it starts to fade
IDLE_HALFLIFE = 16.0        # ... and the rounds over which it then halves its weight
SLOPE_PRIOR_ROUNDS = 32.0   # the prior's weight on b: as many rounds as verify one draft per row


def prior_token_share(bucket: int) -> float:
    """A verified token's prior price, as a share of a plain round of `bucket` rows."""
    return PRIOR_TOKEN / (bucket + PRIOR_STREAM_ROWS)


def cost_clock(device: torch.device) -> Callable[[], float]:
    """The clock rounds are priced by. An engine computing on the CPU in one thread: that thread's CPU
    time. In an RL job the trainer and the co-trainer share the machine's cores with the rollout
    worker and take wall time from its rounds at moments of their own, so plain rounds timed now and
    then and drafting rounds timed between them were priced at different speeds; a round's CPU time
    is what the round itself costs. With several threads (idle ones spin) or on a GPU: wall time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


@functools.lru_cache(maxsize=None)
def _verified_shapes(max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For n = 0..max_tokens verified tokens: the tokens computed (packed_tokens) [n], the distinct
    such counts (the shapes a verification runs at) [c], and each n's index among them [n]."""
    packed = np.array([packed_tokens(n) for n in range(max_tokens + 1)])
    counts = np.unique(packed)
    return packed, counts, np.searchsorted(counts, packed)


def _solve2(m00: float, m01: float, m10: float, m11: float, y0: float, y1: float) -> tuple[float, float]:
    """x with m x = y, for m (a ridge-regularised x^T x: positive definite) in closed form."""
    det = m00 * m11 - m01 * m10
    return (m11 * y0 - m01 * y1) / det, (m00 * y1 - m10 * y0) / det


class RoundCostModel:
    """Per batch bucket: seconds of a round verifying n tokens with h head steps."""

    def __init__(self, *, halflife: float = 64.0, prior_weight: float = 4.0):
        self.decay = 0.5 ** (1.0 / halflife)
        self.prior_weight = prior_weight
        self._xtx: dict[int, np.ndarray] = {}      # bucket -> decayed sum of x x^T, x = (1, n - bucket)
        self._xty: dict[int, np.ndarray] = {}      # ... of x * (seconds less the head steps') / the plain price
        self._heads: dict[int, np.ndarray] = {}    # bucket -> decayed (head steps' seconds, head steps)
        self._plain: dict[int, float] = {}        # bucket -> decayed mean of plain-round seconds
        self._timed_plain: set[int] = set()       # buckets where a plain round itself was timed
        self._coef: dict[int, tuple[float, float, float]] = {}
        self._seen: set[tuple[int, int, int]] = set()
        self._since_plain: dict[int, int] = {}    # bucket -> drafting rounds since its last timed plain round
        self._ctx_sums: dict[int, tuple[float, ...]] = {}   # bucket -> plain rounds' decayed sums (_observe_context)
        self._kappa: dict[int, float] = {}
        self._by_count: dict[int, np.ndarray] = {}   # bucket -> [2, n] decayed (sum of ratios to plain, rounds) per count
        self._curve: dict[int, np.ndarray] = {}
        self._rounds: dict[int, int] = {}            # bucket -> its rounds observed so far
        self._drafted_at: dict[int, int] = {}        # bucket -> its last drafting round (line, head steps)
        self._count_at: dict[int, np.ndarray] = {}   # bucket -> [n] the last round that verified each count

    def observe(self, bucket: int, tokens: int, head_steps: int, seconds: float, context: float = 0.0,
                head_seconds: float | None = None) -> None:
        """A round of `bucket` slots that verified `tokens` tokens after `head_steps` head steps took
        `seconds`, of which its head steps `head_seconds` (required with head steps); `context`: the
        mean length of its rows' sequences before it."""
        if head_steps and head_seconds is None:
            raise ValueError(f"a round with head_steps={head_steps} needs head_seconds (the time its head steps took)")
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        shape = (bucket, tokens, head_steps)
        if shape not in self._seen:      # first use of a shape pays for oneDNN's kernel set-up: no sample
            self._seen.add(shape)
            return
        now = self._rounds[bucket] = self._rounds.get(bucket, 0) + 1
        plain_round = head_steps == 0 and tokens <= bucket
        if plain_round and tokens == bucket:
            self._observe_context(bucket, context, seconds)
        seconds = seconds / self.context_factor(bucket, context)
        self._since_plain[bucket] = 0 if plain_round else self._since_plain.get(bucket, 0) + 1
        if plain_round and tokens < bucket:   # rows that finished were not computed: on the full bucket's scale
            seconds = seconds + self.coefficients(bucket)[1] * (bucket - tokens)
        # the prior's unit, a plain round: timed where one ran, else read off this round through the prior
        unit = seconds / (1 + prior_token_share(bucket) * (max(tokens, bucket) - bucket) + PRIOR_HEAD * head_steps)
        if plain_round or bucket not in self._timed_plain:
            old = self._plain.get(bucket)
            self._plain[bucket] = unit if old is None else 0.9 * old + 0.1 * unit
        self._coef.pop(bucket, None)
        self._curve.pop(bucket, None)
        if plain_round:
            self._timed_plain.add(bucket)
            return
        fresh = self._freshness(bucket, self._drafted_at.get(bucket, now))
        self._drafted_at[bucket] = now
        if bucket in self._heads:
            self._heads[bucket] = self._heads[bucket] * fresh
        if head_steps:
            head_seconds = min(max(head_seconds, 0.0) / self.context_factor(bucket, context), seconds)
            old = self._heads.get(bucket, np.zeros(2))
            self._heads[bucket] = old * self.decay + np.array([head_seconds, head_steps])
            seconds -= head_seconds
        if bucket in self._timed_plain:
            self._observe_count(bucket, tokens, seconds / self._plain[bucket])
        x = np.array([1.0, tokens - bucket])     # centred: the intercept is a round verifying the bucket's tokens
        if bucket not in self._xtx:
            self._xtx[bucket], self._xty[bucket] = np.zeros((2, 2)), np.zeros(2)
        self._xtx[bucket] = self._xtx[bucket] * fresh * self.decay + np.outer(x, x)
        self._xty[bucket] = self._xty[bucket] * fresh * self.decay + x * (seconds / self._plain[bucket])

    def _freshness(self, bucket: int, measured_at):
        """The weight left to what was last measured at round `measured_at` (int or [n]) of the bucket:
        1 for IDLE_AFTER rounds, then halving every IDLE_HALFLIFE rounds."""
        if isinstance(measured_at, int):        # one round: in floats (a numpy scalar costs more than the arithmetic)
            return 0.5 ** (max(self._rounds.get(bucket, 0) - measured_at - IDLE_AFTER, 0) / IDLE_HALFLIFE)
        idle = np.maximum(self._rounds.get(bucket, 0) - np.asarray(measured_at) - IDLE_AFTER, 0)
        return 0.5 ** (idle / IDLE_HALFLIFE)

    def _observe_count(self, bucket: int, tokens: int, ratio: float) -> None:
        n = packed_tokens(tokens)
        record = self._by_count.get(bucket)
        if record is None or record.shape[1] <= n:
            width = max(n + 1, 2 * (record.shape[1] if record is not None else bucket))
            grown, at = np.zeros((2, width)), np.zeros(width, dtype=np.int64)
            if record is not None:
                grown[:, :record.shape[1]], at[:record.shape[1]] = record, self._count_at[bucket]
            self._by_count[bucket], self._count_at[bucket] = grown, at
            record = grown
        at = self._count_at[bucket]
        record[:, n] = record[:, n] * self._freshness(bucket, at[n]) * 0.5 ** (1.0 / CURVE_HALFLIFE) + (ratio, 1.0)
        at[n] = self._rounds[bucket]

    def _observe_context(self, bucket: int, context: float, seconds: float) -> None:
        # in floats, as coefficients(): every plain round comes here, and numpy's 2x2 calls cost more
        # than the arithmetic (sums of 1, x, x^2, y, x y for x = context / CONTEXT_UNIT)
        x, d = context / CONTEXT_UNIT, self.decay
        n, sx, sxx, sy, sxy = self._ctx_sums.get(bucket, (0.0, 0.0, 0.0, 0.0, 0.0))
        self._ctx_sums[bucket] = (n * d + 1.0, sx * d + x, sxx * d + x * x, sy * d + seconds, sxy * d + x * seconds)
        self._kappa.pop(bucket, None)

    def context_factor(self, bucket: int, context: float) -> float:
        """What a round at `context` costs over one at context 0 (1 + kappa * context): divide a
        measured round by it to compare it with the model's prices."""
        if bucket not in self._kappa:
            kappa = 0.0
            n, sx, sxx, sy, sxy = self._ctx_sums.get(bucket, (0.0, 0.0, 0.0, 0.0, 0.0))
            if n >= CONTEXT_MIN_ROUNDS:
                # a weak ridge on the slope: flat until plain rounds at different contexts say otherwise
                alpha, beta = _solve2(n, sx, sx, sxx + 1e-3 * n, sy, sxy)
                kappa = max(0.0, beta / alpha) if alpha > 0 else 0.0
            self._kappa[bucket] = kappa
        return 1.0 + self._kappa[bucket] * context / CONTEXT_UNIT

    def plain_due(self, bucket: int, every: int) -> bool:
        """Whether `every` drafting rounds of this bucket ran since a plain round was last timed."""
        return self._since_plain.get(bucket, 0) >= every

    def plain_seconds(self, bucket: int, rows: int | None = None) -> float:
        """A plain round of this bucket computing `rows` rows (None: all of them): as timed (or, before
        one was, read off drafting rounds), less b for each row left out."""
        full = self._plain.get(bucket, 1.0)
        if rows is None or rows >= bucket:
            return full
        return max(full - self.coefficients(bucket)[1] * (bucket - rows), 0.1 * full)

    def known(self, bucket: int) -> bool:
        """Whether a round of this bucket has been timed (the prior's unit is known)."""
        return bucket in self._plain

    def plain_timed(self, bucket: int) -> bool:
        """Whether a plain round of this bucket has been timed (not only read off drafting rounds)."""
        return bucket in self._timed_plain

    def coefficients(self, bucket: int) -> tuple[float, float, float]:
        """(a, b, c) in seconds: the ridge fit of (a, b) and the head steps' mean time c, each shrunk
        towards the prior. In floats: it is recomputed after every round, and on 2x2 systems numpy's
        calls cost more than the arithmetic."""
        coef = self._coef.get(bucket)
        if coef is not None:
            return coef
        plain = self._plain.get(bucket, 1.0)
        prior_at, prior_b = 1.0, prior_token_share(bucket)      # (a + b * bucket, b) in plain rounds
        # a ridge penalty in units of each term's typical size: for a + b * bucket prior_weight rounds, for b
        # SLOPE_PRIOR_ROUNDS rounds verifying one draft per row (see the module docstring)
        ridge_at, ridge_b = float(self.prior_weight), SLOPE_PRIOR_ROUNDS * float(bucket) ** 2
        fresh = self._freshness(bucket, self._drafted_at.get(bucket, 0))
        xtx, xty = self._xtx.get(bucket), self._xty.get(bucket)
        (m00, m01), (m10, m11) = ((0.0, 0.0), (0.0, 0.0)) if xtx is None else (xtx * fresh).tolist()
        y0, y1 = (0.0, 0.0) if xty is None else (xty * fresh).tolist()
        at_bucket, b = _solve2(m00 + ridge_at, m01, m10, m11 + ridge_b, y0 + ridge_at * prior_at, y1 + ridge_b * prior_b)
        at_bucket, b = plain * at_bucket, plain * b
        b = max(b, plain * 0.01 / bucket)                             # a verified token is never free
        a = at_bucket - b * bucket
        head_s, steps = (0.0, 0.0) if bucket not in self._heads else (self._heads[bucket] * fresh).tolist()
        c = (head_s + self.prior_weight * plain * PRIOR_HEAD) / (steps + self.prior_weight)
        coef = (max(a, 0.0), b, c)
        self._coef[bucket] = coef
        return coef

    def verify_curve(self, bucket: int, max_tokens: int) -> np.ndarray:
        """[max_tokens + 1]: seconds of a drafting round of this bucket verifying n tokens, less its
        head steps: each packed count's own record shrunk towards the line a + b * n, non-decreasing in n."""
        curve = self._curve.get(bucket)
        if curve is not None and curve.size > max_tokens:
            return curve[:max_tokens + 1]
        a, b, _ = self.coefficients(bucket)
        plain = self._plain.get(bucket, 1.0)
        packed, counts, slot = _verified_shapes(max(max_tokens, 4 * bucket))
        ratios, rounds = np.zeros(counts.size), np.zeros(counts.size)
        record = self._by_count.get(bucket)
        if record is not None:
            seen = counts < record.shape[1]
            fresh = self._freshness(bucket, self._count_at[bucket][counts[seen]])
            ratios[seen], rounds[seen] = record[0, counts[seen]] * fresh, record[1, counts[seen]] * fresh
        shrunk = (ratios * plain + self.prior_weight * (a + b * counts)) / (rounds + self.prior_weight)
        # non-decreasing in n, each count weighted by its rounds: a count without any (below the
        # bucket's width, where no drafting round verifies) is pooled into the measured ones next to it
        # rather than raising every count after it
        if (shrunk[1:] >= shrunk[:-1]).all():      # already non-decreasing (most rounds): the regression's answer
            curve = shrunk[slot]
        else:
            weight = np.where(rounds > 0, rounds + self.prior_weight, 1e-3)
            curve = isotonic_regression(shrunk, weights=weight).x[slot]
        self._curve[bucket] = curve
        return curve[:max_tokens + 1]

    def seconds(self, bucket: int, tokens: int, head_steps: int) -> float:
        """A round verifying `tokens` tokens after `head_steps` head steps (a plain round: tokens <= bucket, 0)."""
        if head_steps == 0 and tokens <= bucket:
            return self.plain_seconds(bucket, tokens)
        c = self.coefficients(bucket)[2]
        low = int(tokens)       # tokens may be an expected count: between two counts, interpolated
        curve = self.verify_curve(bucket, low + 1)
        return float(curve[low] + (tokens - low) * (curve[low + 1] - curve[low])) + c * head_steps

    def plain_decode_seconds(self, rounds: Sequence[int], buckets: tuple[int, ...], context: float = 0.0,
                             packed: bool = False) -> float:
        """What plain decoding of the same rows would have taken: row i needs rounds[i] one-token
        rounds, the rows decode together and leave as they finish (the engine then moves the rest
        into a smaller bucket; `packed`: until then finished rows are not computed), at a mean context
        of `context` tokens. Priced by this model's plain rounds; nan where a bucket the rows pass
        through was never timed."""
        need = np.sort(np.asarray(rounds, np.int64))[::-1]       # [B] descending
        total = 0.0
        for n in range(len(need), 0, -1):                         # n rows active for these rounds
            span = int(need[n - 1]) - (int(need[n]) if n < len(need) else 0)
            if span <= 0:
                continue
            b = bucket(n, buckets)
            if not self.known(b):
                return float("nan")
            total += span * self.seconds(b, n if packed else b, 0) * self.context_factor(b, context)
        return total
