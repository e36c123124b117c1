"""How a generate() call decodes: speculating, plain, or plain until rows finish and speculating in its
tail. Where speculating calls of a batch size recently cost more than plain decoding would have, that batch
size's next calls run without speculating in the full batch, and now and then one speculates again to
re-check.

The chooser (rollout.engine.chooser) decides round by round on what a round costs. A call also pays
for speculating outside its rounds (the heads' caches at prefill, the history lookups and what the
chooser learns between rounds), and rounds that only break even then make the call a loss (measured:
docs/performance.md, "Calls that speculation would slow down run plain"). The engine prices each
speculating call's plain decoding on its own timed plain rounds (`RolloutBatch.plain_estimate_s`); this
gate reads those prices. vLLM's `speculative_disable_by_batch_size` answers the same loss with a fixed
batch size; here the measured cost decides, per batch bucket.

A call's modes (`mode`): SPECULATE from its first round; TAIL, plain in the call's full batch and
speculating once enough rows have finished for the rest to move into a smaller bucket (rows that stop at
EOS: half or more of a batch-16 call's plain time is spent there, and there drafting pays where the full
batch breaks even; the engine catches the heads' caches and the history up when it switches); PLAIN.
Each of SPECULATE and TAIL is judged on its own priced calls of the bucket: once MIN_CALLS have been
priced and their recent cost (decayed by DECAY per call) exceeds their plain price, the mode is left for a
stretch of `skip` calls, with `skip` starting at FIRST_SKIP and doubling, up to MAX_SKIP, while the
re-checking calls between stretches lose too; a re-check that pays resets it. A stretch away from
SPECULATE runs TAIL calls, or PLAIN ones while TAIL is in a stretch of its own. New head weights
(`heads_changed`) end every stretch: the next call re-checks at once, judged with the calls before it (an
RL run's co-trainer refreshes the heads every few steps, and judging each refresh afresh took MIN_CALLS
losing calls each time). Decided on earlier calls' timing only, before the call starts, so the tokens keep
their distribution (lossless).

The plain price is the cost model's (rollout.engine.round_cost), and a model of rounds misses what a
call pays around them: it priced plain calls a few percent above what they cost (experiments/LOG.md,
"the plain price, checked against plain calls"), enough to keep speculating calls that lost. So the
gate checks the price against plain calls of the bucket (PLAIN calls, and TAIL calls that never
switched): each is priced by the model too, and the ratio of its cost to that price (a geometric mean,
decayed by DECAY per such call) scales the bucket's later estimates (`calibration`) and the prices of the
calls already held, which are kept uncorrected. The model's error has either sign (4% high at batch 8 and
fixed length, 5% low at batch 16 stopping at EOS), so a bucket is judged only once its price has been
checked: its first check is due as soon as MIN_CALLS calls are priced, and judges them. Once a PLAIN call
has checked the price, the model learns its plain prices from that call's rounds too (TorchEngine.generate): the
plain rounds inside drafting calls are few per bucket, and prices built on them alone were off by -14% to +10%
at batch 16 stopping at EOS (experiments/LOG.md). After that, where the
mode a call would take recently paid by less than CALIBRATE_BELOW and no plain call has run for
CALIBRATE_EVERY of the bucket's priced calls, the next call runs plain to check. Where it paid by more than a
price's error could hide, no more calls are spent on checking; where it lost, the stretches check.
"""
from __future__ import annotations

import math

MIN_CALLS = 2        # priced calls of a bucket in a mode before the mode may be left
DECAY = 0.5          # weight of a bucket's earlier calls per later call
FIRST_SKIP = 2       # calls away from a mode after its first loss
MAX_SKIP = 16        # the longest stretch away from a mode between re-checks
CALIBRATE_EVERY = 8  # priced calls of a bucket between plain calls that check its plain price...
CALIBRATE_BELOW = 1.1  # ... while the mode's recent calls' price over cost is below this

SPECULATE, TAIL, PLAIN = "speculate", "tail", "plain"


class CallGate:
    def __init__(self) -> None:
        # (bucket, mode) -> (calls, decayed plain s, decayed spent s) of the mode's priced calls; the plain
        # seconds are (the part no correction applies to, the cost model's price), calibrated when judged
        self._priced: dict[tuple[int, str], tuple[int, tuple[float, float], float]] = {}
        self._skip: dict[tuple[int, str], int] = {}     # (bucket, mode) -> length of its next stretch away
        self._left: dict[tuple[int, str], int] = {}     # (bucket, mode) -> calls left in the current one
        self._since_plain: dict[int, int] = {}          # bucket -> priced calls since its last plain one
        # bucket -> decayed (plain calls, sum of log(cost / price)) of the plain calls that checked the price
        self._checks: dict[int, tuple[float, float]] = {}

    def mode(self, bucket: int, tail: bool = True) -> str:
        """How the next call of `bucket` rows decodes: SPECULATE, TAIL (only where `tail`: the engine can
        switch this call's drafting on mid-call) or PLAIN (in a stretch, or to check the plain price)."""
        if not self._away((bucket, SPECULATE)):
            return PLAIN if self._check_due(bucket, SPECULATE) else SPECULATE
        if tail and not self._away((bucket, TAIL)) and not self._check_due(bucket, TAIL):
            return TAIL
        return PLAIN

    def _away(self, key: tuple[int, str]) -> bool:
        """Whether the mode `key` is in a stretch away from it (counting this call down)."""
        left = self._left.get(key, 0)
        if left > 0:
            self._left[key] = left - 1
        return left > 0

    def _check_due(self, bucket: int, mode: str) -> bool:
        """Whether the bucket's next call should run plain to check the plain price: the mode has its
        priced calls, none of the bucket's calls has run plain for CALIBRATE_EVERY priced calls, and the
        price was never checked or the mode's calls barely paid."""
        return (self._priced.get((bucket, mode), (0,))[0] >= MIN_CALLS
                and self._since_plain.get(bucket, CALIBRATE_EVERY) >= CALIBRATE_EVERY
                and (bucket not in self._checks or 1.0 <= self.ratio(bucket, mode) < CALIBRATE_BELOW))

    def calibrate(self, bucket: int, priced_seconds: float, seconds: float) -> None:
        """A plain call of `bucket` rows took `seconds` where the cost model priced it at `priced_seconds`.
        The bucket's first check judges the calls priced before it (later ones are judged as they come)."""
        self._since_plain[bucket] = 0
        if not (priced_seconds > 0 and seconds > 0):
            return
        first = bucket not in self._checks
        calls, log_ratio = self._checks.get(bucket, (0.0, 0.0))
        self._checks[bucket] = (calls * DECAY + 1.0, log_ratio * DECAY + math.log(seconds / priced_seconds))
        for mode in (SPECULATE, TAIL):
            if first and (bucket, mode) in self._priced:
                self._judge(bucket, mode)

    def calibration(self, bucket: int) -> float:
        """What plain calls of `bucket` recently cost over the cost model's price for them (1: none checked)."""
        calls, log_ratio = self._checks.get(bucket, (0.0, 0.0))
        return math.exp(log_ratio / calls) if calls > 0 else 1.0

    def record(self, bucket: int, fixed_seconds: float, priced_seconds: float, seconds: float,
               mode: str = SPECULATE) -> None:
        """A call of `bucket` rows that drafted in `mode` (SPECULATE or TAIL) took `seconds` where plain
        decoding is estimated at fixed_seconds (as timed: the prefill) + priced_seconds (the cost model's
        price for the rest, before `calibration`), all on one clock."""
        if not (priced_seconds > 0 and seconds > 0 and fixed_seconds >= 0):
            return
        # before its first plain call a bucket counts as long unchecked: its first check is due once priced
        self._since_plain[bucket] = self._since_plain.get(bucket, CALIBRATE_EVERY) + 1
        key = (bucket, mode)
        calls, (fixed, priced), spent = self._priced.get(key, (0, (0.0, 0.0), 0.0))
        self._priced[key] = (calls + 1, (fixed * DECAY + fixed_seconds, priced * DECAY + priced_seconds),
                             spent * DECAY + seconds)
        self._judge(bucket, mode)

    def _judge(self, bucket: int, mode: str) -> None:
        """Leave `mode` for a stretch where its priced calls lose against the checked price (a bucket whose
        price was never checked is judged once it is: its first check is due first), else keep it."""
        key = (bucket, mode)
        if self._priced[key][0] >= MIN_CALLS and bucket in self._checks and self.ratio(bucket, mode) < 1.0:
            skip = self._skip.get(key, FIRST_SKIP)
            self._left[key] = skip
            self._skip[key] = min(2 * skip, MAX_SKIP)
        else:
            self._skip[key] = FIRST_SKIP

    def ratio(self, bucket: int, mode: str = SPECULATE) -> float:
        """The mode's recent calls' calibrated plain price over their cost (> 1: it paid; nan: none priced)."""
        _, (fixed, priced), spent = self._priced.get((bucket, mode), (0, (0.0, 0.0), 0.0))
        return (fixed + priced * self.calibration(bucket)) / spent if spent > 0 else float("nan")

    def heads_changed(self) -> None:
        """New head weights: the next call of every bucket speculates (a re-check), stretches start short."""
        self._skip.clear()
        self._left.clear()
