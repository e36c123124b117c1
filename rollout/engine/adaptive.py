"""Adaptive k: per round, the number of drafts with the most expected tokens per unit of cost.

With conditional acceptance a_j at draft position j (smoothed over past rounds), a round with k
drafts emits E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i tokens on average (bonus/recovered included)
and costs k * c_head + V(k+1) in units of a 1-token target forward (or its measured round time).
A batch is worth what its slowest row gets (`AdaptiveK.batch_tokens`): drafting spreads the rows'
progress, and the batch waits for the last of them.
k = 0 (plain decoding, E = 1, cost 1) wins whenever the heads do not pay for themselves, so weak
or stale heads fall back to plain decoding. While a k below k_max wins, a probe round drafts more
anyway, so that acceptance at the positions that k never reaches and the round times of the longer
ks keep being measured and improved heads are noticed: the first after `probe_every` rounds, then
after twice as many each time a probe changes nothing, up to `max_probe_every` (a probe with weak
heads costs ~2.5 plain rounds for ~1.3 tokens, so fixed probes every 8 rounds held weak heads at
~0.88x plain). Probes cycle through k = k_max, ..., best + 1, so that a k priced out by one noisy
round time is timed again (without probes above the best k, k = 1 winning early at batch 1 left
positions 2-3 at the prior and k = 3 never timed: session 8). A change of the best k, or new heads,
restarts the interval.

Costs are measured on the rounds that decode anyway: the engine reports each round's wall time
(`observe_time`), and once rounds with k drafts and plain rounds have both been timed at the current
batch bucket, their measured ratio is the cost of k; while drafting wins, a plain round is timed every
`time_plain_every` rounds to keep that ratio current. Until then a cost model decides: by default
`optimistic_costs` (verification nearly free, drafting cheap), so that each k that could pay is
drafted once, timed and then judged by what it really cost. (The engine used to time every forward
up front instead: ~1 s per batch bucket, 10% of the main job's ten RL steps; and a forward-only
model missed a speculative round's extra accept and commit work, which at batch 8 in bf16 turned
k = 1's predicted +8% into -6%: experiments/LOG.md session 5.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class CostModel:
    """Measured costs in units of one 1-token target forward at the same batch bucket."""

    head: float                     # one draft step (head forward + draft LM head + sampling)
    verify: tuple[float, ...]       # verify[n-1] = V(n), the cost of an n-token target forward

    def round_cost(self, k: int) -> float:
        return k * self.head + self.verify[k]


def optimistic_costs(k_max: int) -> CostModel:
    """The prior cost model: a head step at 0.1 and V(n) = 1 + 0.05 (n - 1), below what any CPU or GPU
    measured here, so that drafting is tried (and timed) before measured round times take over."""
    return CostModel(head=0.1, verify=tuple(1.0 + 0.05 * n for n in range(k_max + 1)))


@dataclass(frozen=True)
class KChoice:
    """One round's choice, for the monitor: what was chosen and why."""

    round: int
    k: int
    reason: str                     # "best": argmax of tokens per cost; "probe": drafting more than the best k;
                                    # "time_plain": a plain round timed so that measured costs stay current
    expected_tokens: float          # tokens per round under the current acceptance estimate (batch_tokens)
    cost: float                     # k * c_head + V(k+1), or the measured round-time ratio
    tokens_per_cost: float
    plain_tokens_per_cost: float    # 1 / V(1) = 1: the k = 0 alternative
    acceptance: tuple[float, ...]   # smoothed conditional acceptance per draft position


class AdaptiveK:
    """Per-position acceptance estimate + the cost model -> k per round."""

    def __init__(self, k_max: int, costs: CostModel, *, halflife: float = 32.0, probe_every: int = 8,
                 max_probe_every: int = 128, prior: float = 0.5, prior_weight: float = 2.0,
                 time_halflife: float = 8.0, time_plain_every: int = 32, min_gain: float = 0.05):
        if len(costs.verify) < k_max + 1:
            raise ValueError(f"the cost model covers V(1..{len(costs.verify)}), k_max={k_max} needs V({k_max + 1})")
        self.k_max, self.costs, self.probe_every = k_max, costs, probe_every
        # drafting must beat plain decoding by this fraction of tokens per cost: round times leave out what
        # drafting costs once per call (the heads' prefill and caches), and near break-even their noise
        # flipped k between 0 and 1 (main job at batch 8: k = 1 predicted +6%, measured -6%; LOG session 7)
        self.min_gain = min_gain
        self.max_probe_every = max(max_probe_every, probe_every)
        self.probe_interval = probe_every     # plain rounds before the next probe
        self.probes = 0                       # probes so far (they cycle through k_max, ..., 1)
        self.decay = 0.5 ** (1.0 / halflife)
        # pseudo-counts: a prior of `prior` worth `prior_weight` reached rows per position
        self.accepted = [prior * prior_weight] * k_max
        self.reached = [prior_weight] * k_max
        self.rounds = 0
        self.last_best = 0                    # the previous round's argmax, and rounds it has held since the
        self.streak = 0                       # last probe
        # (batch bucket, k) -> smoothed wall seconds of such a round; the bucket of the current round
        self.seconds: dict[tuple[int, int], float] = {}
        self.warmed_up: set[tuple[int, int]] = set()   # keys whose first round (not a cost sample) has run
        self.bucket: int | None = None
        self.time_decay = 0.5 ** (1.0 / time_halflife)
        self.time_plain_every = time_plain_every
        self.last_plain = 0                    # round index of the last plain round

    def acceptance(self) -> list[float]:
        return [a / r if r > 0 else 0.0 for a, r in zip(self.accepted, self.reached)]

    def expected_tokens(self, k: int) -> float:
        return _tokens_per_round(self.acceptance()[:k])[0]

    def batch_tokens(self, k: int, rows: int, remaining: int) -> float:
        """Tokens per round that a batch gets out of k drafts: E(k) for one row; for `rows` rows with at most
        `remaining` tokens each to go, n / rounds where rounds is what the slowest row needs.

        A batch waits for its slowest row, and drafting spreads the rows' progress (plain decoding moves
        every row one token a round): after r rounds a row has ~N(r E, r Var) tokens, so reaching n takes
        n / E rounds give or take sqrt(n Var / E^3), and the slowest of `rows` rows is the expected maximum of
        as many standard normals (Blom) above that. Per-round E(k) alone made k = 1 look like +4% in the
        main job's 24-token batch-8 calls, where it was -11% (experiments/LOG.md, session 8)."""
        e, var = _tokens_per_round(self.acceptance()[:k])
        if k == 0 or rows <= 1 or remaining <= 0:
            return e
        z = NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))
        rounds = remaining / e + z * math.sqrt(remaining * var / e ** 3)
        return remaining / rounds

    def round_cost(self, k: int) -> float:
        """Cost of a k-draft round in plain rounds: measured when both are timed at this bucket."""
        t_k, t_0 = self.seconds.get((self.bucket, k)), self.seconds.get((self.bucket, 0))
        if k > 0 and t_k is not None and t_0 is not None and t_0 > 0:
            return t_k / t_0
        return self.costs.round_cost(k)

    def choose(self, bucket: int | None = None, rows: int = 1, remaining: int = 0) -> KChoice:
        """The k of the next round; `bucket` = its batch bucket (keys the measured round times), `rows` its
        unfinished rows and `remaining` the most tokens any of them may still emit (batch_tokens)."""
        self.bucket = bucket
        rates = [self.batch_tokens(k, rows, remaining) / self.round_cost(k) for k in range(self.k_max + 1)]
        best = max(range(self.k_max + 1), key=lambda k: (rates[k], -k))
        if best > 0 and rates[best] < rates[0] * (1 + self.min_gain):
            best = 0                           # near break-even: plain decoding (see min_gain)
        reason = "best"
        timed = any(b == bucket for b, _ in self.seconds)
        if best != self.last_best:             # the choice moved: probe its alternatives soon again
            self.last_best, self.streak, self.probe_interval = best, 0, self.probe_every
        if best > 0 and timed and ((bucket, 0) not in self.seconds
                                   or self.rounds - self.last_plain >= self.time_plain_every):
            best, reason = 0, "time_plain"     # refresh the plain round time the measured costs divide by
        elif best < self.k_max:
            self.streak += 1
            if self.streak >= self.probe_interval:
                deeper = range(self.k_max, best, -1)            # the ks whose positions `best` never reaches
                best, reason = deeper[self.probes % len(deeper)], "probe"
                self.probes += 1
                self.streak = 0
                self.probe_interval = min(2 * self.probe_interval, self.max_probe_every)
        if best == 0:
            self.last_plain = self.rounds
        choice = KChoice(self.rounds, best, reason, self.batch_tokens(best, rows, remaining), self.round_cost(best),
                         rates[best], rates[0], tuple(round(a, 4) for a in self.acceptance()))
        self.rounds += 1
        return choice

    def observe_time(self, k: int, seconds: float) -> None:
        """Wall time of the round just run with k drafts, at the bucket passed to choose(). The first
        round of each (bucket, k) is no sample: it pays for first use (oneDNN builds a kernel per new
        shape), and one such sample made k = 2 look several times dearer than it is, so adaptive k
        never drafted again at batch 1 (experiments/LOG.md, session 7)."""
        if not (seconds > 0 and math.isfinite(seconds)) or self.bucket is None:
            return
        key = (self.bucket, k)
        if key not in self.warmed_up:
            self.warmed_up.add(key)
            return
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old * self.time_decay + seconds * (1 - self.time_decay)

    def heads_changed(self) -> None:
        """New head weights (a co-trainer refresh): probe them soon instead of after a long backoff."""
        self.probe_interval = self.probe_every
        self.streak = min(self.streak, self.probe_every - 1)

    def observe(self, accepted: list[float], reached: list[float]) -> None:
        """accepted[j] / reached[j]: rows of the last round that accepted / reached draft j."""
        for j, (a, r) in enumerate(zip(accepted, reached)):
            if r > 0:
                self.accepted[j] = self.accepted[j] * self.decay + a
                self.reached[j] = self.reached[j] * self.decay + r
        assert all(math.isfinite(x) for x in self.accepted)


def _tokens_per_round(acceptance: list[float]) -> tuple[float, float]:
    """Mean and variance of the tokens one row emits in a round with len(acceptance) drafts, for
    conditional acceptance a_j per position: T = 1 + the number of leading accepted drafts."""
    mean, second, run = 1.0, 1.0, 1.0     # E[T], E[T^2] accumulated over P(T >= m + 1) = prod_{j<=m} a_j
    for m, a in enumerate(acceptance, start=1):
        run *= a
        mean += run
        second += (2 * m + 1) * run        # E[T^2] = sum_m (2m - 1) P(T >= m) over m >= 1
    return mean, max(second - mean * mean, 0.0)
