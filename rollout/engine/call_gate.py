"""Whether a generate() call speculates at all: where speculating calls of a batch size recently cost
more than plain decoding would have, that batch size's next calls run plain, and now and then one
speculates again to re-check.

The chooser (rollout.engine.chooser) decides round by round on what a round costs. A call also pays
for speculating outside its rounds (the heads' caches at prefill, the history lookups and what the
chooser learns between rounds), and rounds that only break even then make the call a loss (measured:
docs/performance.md, "Calls that speculation would slow down run plain"). The engine prices each
speculating call's plain decoding on its own timed plain rounds (`RolloutBatch.plain_estimate_s`); this
gate reads those prices. vLLM's `speculative_disable_by_batch_size` answers the same loss with a fixed
batch size; here the measured cost decides, per batch bucket.

A bucket is gated once MIN_CALLS of its speculating calls have been priced and their recent cost
(decayed by DECAY per call) exceeds their plain price: its next `skip` calls run plain (no head
caches, no chooser; their completions still enter the rollout history), with `skip` starting at
FIRST_SKIP and doubling, up to MAX_SKIP, while the re-checking calls between stretches lose too; a
re-check that pays resets it. New head weights (`heads_changed`) end a stretch: the next call re-checks
at once, judged with the calls before it (an RL run's co-trainer refreshes the heads every few steps,
and judging each refresh afresh took MIN_CALLS losing calls each time). Decided on earlier calls'
timing only, before the call starts, so the tokens keep their distribution (lossless).

The plain price is the cost model's (rollout.engine.round_cost), and a model of rounds misses what a
call pays around them: it priced plain calls a few percent above what they cost (experiments/LOG.md,
"the plain price, checked against plain calls"), enough to keep speculating calls that lost. So the
gate checks the price against plain calls of the bucket: each call it runs plain is priced by the model
too, and the ratio of its cost to that price (a geometric mean, decayed by DECAY per such call) scales
the bucket's later estimates (`calibration`). Where speculation recently paid by less than
CALIBRATE_BELOW and no plain call has run for CALIBRATE_EVERY of the bucket's speculating calls, the
next call runs plain to check (first once MIN_CALLS are priced). Where it paid by more than a price's
error could hide, no call is spent on checking; where it lost, the stretches' plain calls check.
"""
from __future__ import annotations

import math

MIN_CALLS = 2        # priced speculating calls of a bucket before it may be gated
DECAY = 0.5          # weight of a bucket's earlier calls per later call
FIRST_SKIP = 2       # plain calls after the first loss
MAX_SKIP = 16        # the longest stretch of plain calls between re-checks
CALIBRATE_EVERY = 8  # speculating calls of a bucket between plain calls that check its plain price...
CALIBRATE_BELOW = 1.1  # ... while its recent calls' price over cost is below this


class CallGate:
    def __init__(self) -> None:
        self._priced: dict[int, tuple[int, float, float]] = {}   # bucket -> (calls, decayed plain s, decayed spent s)
        self._skip: dict[int, int] = {}                          # bucket -> length of its next plain stretch
        self._left: dict[int, int] = {}                          # bucket -> plain calls left in the current one
        self._since_plain: dict[int, int] = {}                   # bucket -> speculating calls since its last plain one
        # bucket -> decayed (plain calls, sum of log(cost / price)) of the plain calls that checked the price
        self._checks: dict[int, tuple[float, float]] = {}

    def speculates(self, bucket: int) -> bool:
        """Whether the next call of `bucket` rows may speculate (False: it runs plain, in a stretch or as
        a check of the plain price)."""
        left = self._left.get(bucket, 0)
        if left > 0:
            self._left[bucket] = left - 1
        elif not self._check_due(bucket):
            return True
        self._since_plain[bucket] = 0
        return False

    def _check_due(self, bucket: int) -> bool:
        """Whether the bucket's next call should run plain to check the plain price: its priced calls
        barely paid and none of them has run plain for CALIBRATE_EVERY speculating calls."""
        return (self._priced.get(bucket, (0,))[0] >= MIN_CALLS and 1.0 <= self.ratio(bucket) < CALIBRATE_BELOW
                and self._since_plain[bucket] >= CALIBRATE_EVERY)

    def calibrate(self, bucket: int, priced_seconds: float, seconds: float) -> None:
        """A plain call of `bucket` rows took `seconds` where the cost model priced it at `priced_seconds`."""
        if not (priced_seconds > 0 and seconds > 0):
            return
        calls, log_ratio = self._checks.get(bucket, (0.0, 0.0))
        self._checks[bucket] = (calls * DECAY + 1.0, log_ratio * DECAY + math.log(seconds / priced_seconds))

    def calibration(self, bucket: int) -> float:
        """What plain calls of `bucket` recently cost over the cost model's price for them (1: none checked)."""
        calls, log_ratio = self._checks.get(bucket, (0.0, 0.0))
        return math.exp(log_ratio / calls) if calls > 0 else 1.0

    def record(self, bucket: int, plain_seconds: float, seconds: float) -> None:
        """A speculating call of `bucket` took `seconds` where plain decoding is estimated at `plain_seconds`
        (the same clock; calibrated)."""
        if not (plain_seconds > 0 and seconds > 0):
            return
        # before its first plain call a bucket counts as long unchecked: its first check is due once priced
        self._since_plain[bucket] = self._since_plain.get(bucket, CALIBRATE_EVERY) + 1
        calls, plain, spent = self._priced.get(bucket, (0, 0.0, 0.0))
        calls, plain, spent = calls + 1, plain * DECAY + plain_seconds, spent * DECAY + seconds
        self._priced[bucket] = (calls, plain, spent)
        if calls >= MIN_CALLS and spent > plain:
            skip = self._skip.get(bucket, FIRST_SKIP)
            self._left[bucket] = skip
            self._skip[bucket] = min(2 * skip, MAX_SKIP)
        else:
            self._skip[bucket] = FIRST_SKIP

    def ratio(self, bucket: int) -> float:
        """Recent speculating calls' plain price over their cost (> 1: speculation paid; nan: none priced)."""
        _, plain, spent = self._priced.get(bucket, (0, 0.0, 0.0))
        return plain / spent if spent > 0 else float("nan")

    def heads_changed(self) -> None:
        """New head weights: the next call of every bucket speculates (a re-check), stretches start short."""
        self._skip.clear()
        self._left.clear()
