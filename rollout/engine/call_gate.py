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
"""
from __future__ import annotations

MIN_CALLS = 2        # priced speculating calls of a bucket before it may be gated
DECAY = 0.5          # weight of a bucket's earlier calls per later call
FIRST_SKIP = 2       # plain calls after the first loss
MAX_SKIP = 16        # the longest stretch of plain calls between re-checks


class CallGate:
    def __init__(self) -> None:
        self._priced: dict[int, tuple[int, float, float]] = {}   # bucket -> (calls, decayed plain s, decayed spent s)
        self._skip: dict[int, int] = {}                          # bucket -> length of its next plain stretch
        self._left: dict[int, int] = {}                          # bucket -> plain calls left in the current one

    def speculates(self, bucket: int) -> bool:
        """Whether the next call of `bucket` rows may speculate (a False is one call of a plain stretch)."""
        left = self._left.get(bucket, 0)
        if left > 0:
            self._left[bucket] = left - 1
            return False
        return True

    def record(self, bucket: int, plain_seconds: float, seconds: float) -> None:
        """A speculating call of `bucket` took `seconds` where plain decoding is estimated at `plain_seconds`
        (the same clock)."""
        if not (plain_seconds > 0 and seconds > 0):
            return
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
