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
~0.88x plain), but no further than where probes lose `probe_budget` of the time (`probe_loss`).
Probes cycle through k = k_max, ..., best + 1, so that a k priced out by one noisy round time is
timed again (without probes above the best k, a k = 1 that wins early leaves the deeper positions
at the prior and the larger ks never timed). A change of the best k, or new heads, restarts the
interval.

Costs are measured on the rounds that decode anyway: the engine reports each round's wall time
(`observe_time`), and the cost of k is the median, over recent pairs of adjacent rounds with k and
with no drafts (or with k and a k' whose cost is known), of their time ratio. Adjacent rounds see the
same machine: a shared VM's speed drifts by tens of percent within seconds, so ratios of separately
averaged times (plain rounds from one minute, probes from another) are far off. While drafting wins, a plain round
runs every `time_plain_every` rounds to keep pairs coming. Until `min_pairs` pairs exist a cost model
decides: by default `optimistic_costs` (verification nearly free, drafting cheap), so that each k that
could pay is drafted, timed and then judged by what it really cost. (Timing every forward up front
instead costs ~1 s per batch bucket, and a forward-only model misses a speculative round's accept and
commit work, enough to turn a predicted gain into a loss.)
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist, median


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
                 time_window: int = 9, time_plain_every: int = 32, min_gain: float = 0.05,
                 probe_budget: float = 0.01, min_pairs: int = 4):
        if len(costs.verify) < k_max + 1:
            raise ValueError(f"the cost model covers V(1..{len(costs.verify)}), k_max={k_max} needs V({k_max + 1})")
        self.k_max, self.costs, self.probe_every = k_max, costs, probe_every
        # drafting must beat plain decoding by this fraction of tokens per cost: round times leave out what
        # drafting costs once per call (the heads' prefill and caches), and near break-even their noise
        # flips k between 0 and 1
        self.min_gain = min_gain
        self.max_probe_every = max(max_probe_every, probe_every)
        self.probe_budget = probe_budget      # backoff stops where probes lose less than this share of time
        self.probe_interval = probe_every     # plain rounds before the next probe
        self.probes = 0                       # probes so far (they cycle through k_max, ..., 1)
        self.decay = 0.5 ** (1.0 / halflife)
        # decayed counts of rows that reached / accepted each draft position, and the prior they are shrunk to
        self.accepted = [0.0] * k_max
        self.reached = [0.0] * k_max
        self.prior, self.prior_weight = prior, prior_weight
        self.rounds = 0
        # per batch bucket, the argmax of its previous round (a call's last rounds run at smaller buckets,
        # where other ks win: one best k for all buckets restarted the probe interval every call, and weak
        # heads at batch 8 were probed every ~20 rounds instead of ~50-128)
        self.last_best: dict[int | None, int] = {}
        self.streak = 0                       # rounds below k_max since the last probe
        # (batch bucket, a, b), a < b -> log(t_b / t_a) of the last `time_window` adjacent rounds with a and b
        # drafts (either order); the previous timed round (bucket, k, seconds); the bucket of the current round
        self.log_ratios: dict[tuple[int, int, int], deque[float]] = {}
        self.time_window, self.min_pairs = time_window, min_pairs
        self.last_time: tuple[int, int, float] | None = None
        self.warmed_up: set[tuple[int, int]] = set()   # keys whose first round (not a cost sample) has run
        self.bucket: int | None = None
        self.time_plain_every = time_plain_every
        self.last_plain = 0                    # round index of the last plain round

    def measured_ratio(self, a: int, b: int) -> float | None:
        """Round time with b drafts over round time with a drafts at the current bucket: the median over
        recent pairs of adjacent rounds, or None before `min_pairs` of them. A probe between plain rounds
        makes two pairs that share its time, and with a mean one slow probe could price its k out for the
        rest of a run."""
        lo, hi = min(a, b), max(a, b)
        logs = self.log_ratios.get((self.bucket, lo, hi))
        if a == b or not logs or len(logs) < self.min_pairs:
            return 1.0 if a == b else None
        r = math.exp(median(logs))
        return r if a < b else 1.0 / r

    def acceptance(self) -> list[float]:
        """Conditional acceptance per draft position, each shrunk towards the one before it (the first towards
        `prior`) with `prior_weight` pseudo-rows. Deeper positions are measured only when every position
        before them accepted: at batch 1 a few rows per hundred rounds, too few for the prior or a few
        unlucky rows not to decide between k = 1, 2 and 3 on their own, while the positions' true rates
        are alike (0.37 / 0.39 / 0.39 for the shipped heads)."""
        out, prior = [], self.prior
        for a, r in zip(self.accepted, self.reached):
            prior = (a + self.prior_weight * prior) / (r + self.prior_weight)
            out.append(prior)
        return out

    def expected_tokens(self, k: int) -> float:
        return _tokens_per_round(self.acceptance()[:k])[0]

    def batch_tokens(self, k: int, rows: int, remaining: int) -> float:
        """Tokens per round that a batch gets out of k drafts: E(k) for one row; for `rows` rows with at most
        `remaining` tokens each to go, n / rounds where rounds is what the slowest row needs.

        A batch waits for its slowest row, and drafting spreads the rows' progress (plain decoding moves
        every row one token a round): after r rounds a row has ~N(r E, r Var) tokens, so reaching n takes
        n / E rounds give or take sqrt(n Var / E^3), and the slowest of `rows` rows is the expected maximum of
        as many standard normals (Blom) above that. Per-round E(k) alone overrates drafting for short calls
        at batch 8 (a gain where there is a loss)."""
        e, var = _tokens_per_round(self.acceptance()[:k])
        if k == 0 or rows <= 1 or remaining <= 0:
            return e
        z = NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))
        rounds = remaining / e + z * math.sqrt(remaining * var / e ** 3)
        return remaining / rounds

    def round_cost(self, k: int) -> float:
        """Cost of a k-draft round in plain rounds at this bucket: measured next to plain rounds, or next to
        rounds of a k' that was (probes run between rounds of the best k), else the cost model's."""
        direct = self.measured_ratio(0, k)
        if direct is not None:
            return direct
        for m in range(1, self.k_max + 1):
            via, step = self.measured_ratio(0, m), self.measured_ratio(m, k)
            if m != k and via is not None and step is not None:
                return via * step
        return self.costs.round_cost(k)

    def choose(self, bucket: int | None = None, rows: int = 1, remaining: int = 0) -> KChoice:
        """The k of the next round; `bucket` = its batch bucket (keys the measured round times), `rows` its
        unfinished rows and `remaining` the most tokens any of them may still emit (batch_tokens)."""
        self.bucket = bucket
        tokens = [self.batch_tokens(k, rows, remaining) for k in range(self.k_max + 1)]
        costs = [self.round_cost(k) for k in range(self.k_max + 1)]
        rates = [t / c for t, c in zip(tokens, costs)]
        best = max(range(self.k_max + 1), key=lambda k: (rates[k], -k))
        if best > 0 and rates[best] < rates[0] * (1 + self.min_gain):
            best = 0                           # near break-even: plain decoding (see min_gain)
        reason = "best"
        if best != self.last_best.setdefault(bucket, best):   # the choice moved: probe its alternatives soon again
            self.last_best[bucket], self.streak, self.probe_interval = best, 0, self.probe_every
        after_plain = self.last_time is not None and self.last_time[:2] == (bucket, 0)
        if (best > 0 and (bucket, best) in self.warmed_up and not after_plain
                and (self.measured_ratio(0, best) is None or self.rounds - self.last_plain >= self.time_plain_every)):
            best, reason = 0, "time_plain"     # a plain round next to rounds of the best k: its measured cost
        elif best < self.k_max:
            self.streak += 1
            if self.streak >= self.probe_interval:
                deeper = range(self.k_max, best, -1)            # the ks whose positions `best` never reaches
                best, reason = deeper[self.probes % len(deeper)], "probe"
                self.probes += 1
                self.streak = 0
                cheap = self.probe_loss(deeper[self.probes % len(deeper)], self.last_best[bucket], rows, remaining) \
                    / self.probe_budget                         # rounds over which the next probe's loss stays small
                self.probe_interval = min(2 * self.probe_interval, self.max_probe_every,
                                          max(self.probe_every, math.ceil(cheap)))
        if best == 0:
            self.last_plain = self.rounds
        choice = KChoice(self.rounds, best, reason, tokens[best], costs[best], rates[best], rates[0],
                         tuple(round(a, 4) for a in self.acceptance()))
        self.rounds += 1
        return choice

    def probe_loss(self, k: int, best: int, rows: int = 1, remaining: int = 0) -> float:
        """Time a round with k drafts loses against the best k, in plain rounds, under current estimates:
        its cost minus the time the best k takes for as many tokens. Backoff is for expensive probes
        (weak heads at batch 8: ~2.5 plain rounds for ~1.3 tokens); where drafting is near break-even a
        probe costs almost nothing and keeps acceptance and costs fresh (with rare probes one noisy
        stretch can hold adaptive k at plain decoding for half a run)."""
        rate = self.batch_tokens(best, rows, remaining) / self.round_cost(best)
        return max(0.0, self.round_cost(k) - self.batch_tokens(k, rows, remaining) / rate)

    def observe_time(self, k: int, seconds: float) -> None:
        """Wall time of the round just run with k drafts, at the bucket passed to choose(). The first
        round of each (bucket, k) is no sample: it pays for first use (oneDNN builds a kernel per new
        shape), and one such sample can make a k look several times dearer than it is, so that adaptive
        k never drafts it again."""
        if not (seconds > 0 and math.isfinite(seconds)) or self.bucket is None:
            self.last_time = None              # no sample, and the next round has no timed neighbour
            return
        key = (self.bucket, k)
        if key not in self.warmed_up:
            self.warmed_up.add(key)
            self.last_time = None
            return
        if self.last_time is not None and self.last_time[0] == self.bucket and self.last_time[1] != k:
            _, k_prev, t_prev = self.last_time
            lo, hi, ratio = (k_prev, k, seconds / t_prev) if k_prev < k else (k, k_prev, t_prev / seconds)
            self.log_ratios.setdefault((self.bucket, lo, hi), deque(maxlen=self.time_window)).append(math.log(ratio))
        self.last_time = (self.bucket, k, seconds)

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
