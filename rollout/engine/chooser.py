"""Per row and per round: draft from the heads, from rollout history, or not at all, and how many.

A drafted token pays where the tokens it is expected to add beat what the same time buys in plain
decoding. A plain round of `bucket` rows makes `active` tokens in P seconds (timed; less where
finished rows are not computed, RowView.computed_rows); a drafting round costs V(tokens verified) +
c * (head steps) (rollout.engine.round_cost: V a measured curve around the line a + b * n), so a
candidate token whose expected contribution (the product of the predicted acceptances up to it,
rollout.engine.predictor) is at least b * active / P is wanted by its row. That threshold is fixed
before any drafting, and each row wants the leading drafts above it: whether position j is wanted
depends on features known by the time position j was drafted (the distribution it came from, never
the sampled token, and nothing drafted after it), which keeps verification lossless (see
rollout.engine.predictor). The round then keeps a budget of the wanted drafts, position by position
(every row's first before any row's second; `_keep_within`), the budget that promises the most tokens
per second on V, where 0 runs the round plain: a drafting round costs more than a plain one at the
same width (the packed verification's index, rejection sampling), and V can step (AMX computes 16
rows per tile: at batch 8, 16 verified tokens cost about a plain round, 32 up to 1.6 of one). The
budget is chosen on what was known before any row's first draft was drawn (the first position's
feature, the levels after it, history counts), so cutting a row's drafts depends on its wants and
the other rows' only: lossless too.

What a row's token is worth: a call ends when its last row does, and a plain round is worth its active
tokens because it ends the call a round sooner and computes every row's token (P = a + b * rows). One
more token of a row saves that row's verification (b) and, only if it ends the call a round sooner, a
whole round (a): so a drafted token is worth (b + a) / (P / active) of a plain round's token where it
surely does and b / (P / active) where it does not (`row_values`). Where no row can stop early (no stop
token: ignore_eos), the rows with the most tokens left hold the call back, by their lead over the next
row (RowView.ends_sooner). One such row alone ends the call a round sooner with each accepted draft
within its lead: b + a. Rows tied for it do so only if all of them are accepted, which per-row estimates
tell badly (their product, with the predictor's estimates shrunk towards its prior, priced nearly sure
drafts out and rows that kept together stopped drafting): they are valued as rows alike, b + a /
active. Rows ahead of them are valued b: they would only finish sooner and wait. Valued alike, rows
drafting apart finished apart and the call's last rounds ran with few rows, each paying a full round's
a (measured in experiments/LOG.md, "What a row's token is worth" in docs/engine.md). Where rows stop on
EOS, which row ends last is not known; estimating it from earlier rows' lengths lost on such calls (the
LOG), so there every row is valued alike (ends_sooner None).

Head steps run for the whole batch, so their number h is chosen once per round before drafting, as
the h whose best budget promises the most tokens per modelled second: at first under the predictor's
per-position levels, then on what recent rounds with h head steps wanted per row and position (the
expected tokens of the head drafts wanted, rows whose drafts were not worth it counting zero). The levels alone assume every row
drafts at the average level; when rows' own features split around the threshold, many rounds ran the
head steps and then verified nothing, each dearer than a plain round. Head steps must promise the
bucket's margin over a plain round, as the round's drafts must (below): without it, a margin raised
by losing rounds priced the rows' drafts out while the record of earlier rounds still bought head
steps, and most rounds ran head steps to verify nothing.
Every `probe_every` drafting rounds one round runs plain (`plain_round`, without history lookups),
so that the plain price stays measured.

What drafting rounds actually returned closes the loop (`settle`): per bucket, the tokens they made
against what plain decoding makes in the same time. While that falls short, the margin drafting
must promise over plain decoding (`margin`, >= 1) rises; while it exceeds it, the margin falls back
towards 1. The predictor and the cost model can each be right on average and the rounds chosen on
them still lose (the rows and sources chosen are those whose estimates came out high), and at large
batches a few percent of error decides whether drafting pays; the margin is decided from past
rounds only, so it keeps verification lossless. Rounds that do not draft bring no such evidence, and
the margin relaxes towards 1 over them (halflife MARGIN_HALFLIFE rounds of the bucket, paused ones
included): raised by a stretch of losing rounds (on a shared machine, often rounds timed while it ran
slow against a plain price timed while it ran fast), it otherwise stopped drafting for the engine's
life, however well drafting would pay afterwards.
Where nothing is worth drafting the choosing itself costs (the history lookups, the choice and its
learning: ~1 ms of a 22-30 ms round at batch 8-16 on 2 CPU cores): after PAUSE_AFTER chosen rounds of a
bucket that drafted nothing, its next rounds run plain without looking (`plain_round`), for a stretch that
starts at probe_every rounds and doubles, up to PROBE_BACKOFF_MAX times, while the rounds between
stretches still choose nothing; a chosen round that drafts resets it. Paused rounds count towards the
probes' waits, so a source is still tested now and then.
Rows whose history draft is worth more than the heads' take the history draft. When a source has
not been verified for `probe_every` rounds (it looked not worth it), one round verifies it anyway:
one head token per row, or the history drafts of the rows that have one. Estimates that are never
tested cannot recover: improved heads (a co-trainer refresh), or history once the policy's
entropy falls and its rollouts repeat. A probe costs more than a plain round, so while probes of a
source are not followed by rounds that choose it, the wait before its next probe doubles (up to
PROBE_BACKOFF_MAX times `probe_every`); a round that chooses it, or new head weights, resets it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import math

import numpy as np

from rollout.engine.predictor import HEADS, HISTORY, AcceptancePredictor
from rollout.engine.round_cost import RoundCostModel

NONE = -1
MARGIN_STEP = 0.05          # log-margin change per drafting round per unit of shortfall
MARGIN_MAX = 2.0
MARGIN_HALFLIFE = 128.0      # rounds of a bucket that did not draft, over which its log-margin halves
RETURNS_HALFLIFE = 32.0     # drafting rounds
HEAD_ROUNDS_HALFLIFE = 32.0  # rounds with head steps
HEAD_ROUNDS_MIN = 4.0        # such rounds before their record replaces the per-position levels
PROBE_BACKOFF_MAX = 8        # the longest wait between probes of a source, in units of probe_every
PAUSE_AFTER = 32             # chosen rounds of a bucket that drafted nothing before its choosing pauses


@dataclass
class RowView:
    """What the chooser knows about the batch's rows at the start of a round (host arrays)."""

    active: np.ndarray                       # [B] bool
    entropy: np.ndarray                      # [B] nats where each row's last token was sampled
    row_ids: np.ndarray | None = None        # [B] prompt index of each slot (-1 = padding)
    history_tokens: list[list[int]] = field(default_factory=list)   # per row (empty: no history draft)
    history_cond: list[np.ndarray] = field(default_factory=list)    # per row: P(token j | tokens < j) from counts
    history_match: np.ndarray | None = None  # [B] match length
    computed_rows: int | None = None         # rows a plain round computes (None: the whole bucket)
    room: np.ndarray | None = None           # [B] the most drafts each row can still emit (None: no bound)
    ends_sooner: np.ndarray | None = None    # [B] how many of each row's drafts would each end the call a round
                                             # sooner if accepted (call_lead; None: unknown, every row alike)

    def plain_rows(self, bucket: int) -> int:
        return bucket if self.computed_rows is None else self.computed_rows

    def draft_room(self, rows: np.ndarray, k: int) -> np.ndarray:
        """[R] the drafts each of `rows` can use, at most k: a round emits its accepted drafts and one
        more token, so a row with n tokens left to its max_new_tokens uses at most n - 1 drafts (a
        verified draft past that is cut before it is committed)."""
        if self.room is None:
            return np.full(rows.size, k, dtype=np.int64)
        return np.minimum(np.maximum(self.room[rows], 0), k).astype(np.int64)    # (np.clip's checks cost more)


def call_lead(room: np.ndarray, active: np.ndarray) -> np.ndarray:
    """[B] where no row can stop early: for each of the `active` [B] rows with the most tokens left
    (`room` [B]), their lead over the next row (as many accepted drafts of all of them end the call as
    many rounds sooner; no row behind them: unbounded); 0 for every other row. RowView.ends_sooner."""
    lead = np.zeros(room.size, dtype=np.int64)
    if not active.any():
        return lead
    most = room[active].max()
    below = room[active & (room < most)]
    lead[active & (room == most)] = most - below.max() if below.size else np.iinfo(np.int32).max
    return lead


@dataclass
class RoundPlan:
    """The round's drafting: per row its source and how many drafts are verified."""

    head_steps: int
    source: np.ndarray                       # [B] int: HEADS, HISTORY or NONE
    num_drafts: np.ndarray                   # [B] int
    predicted: list[np.ndarray]              # per row: predicted conditional acceptance of each kept draft
    features: list[np.ndarray]               # per row: the feature of each kept draft (predictor input)
    reason: str = "chosen"                   # chosen | probe (heads) | probe_history | fixed
    value: np.ndarray | None = None          # [B, k] what each row's draft at each position is worth if accepted,
                                             # in plain rounds' tokens (DraftChooser.row_values; None: 1)

    def worth(self, made: np.ndarray) -> float:
        """The tokens `made` [B] per row (its first as a plain round's token, the rest as accepted drafts
        valued at `value`), in plain rounds' tokens."""
        if self.value is None:
            return float(made.sum())
        drafts = np.minimum(np.maximum(made - 1, 0), self.value.shape[1])                  # [B]
        cum = np.concatenate([np.zeros((made.size, 1)), self.value.cumsum(1)], axis=1)   # [B, k + 1]
        return float((made > 0).sum() + cum[np.arange(made.size), drafts].sum())

    @property
    def width(self) -> int:
        return int(self.num_drafts.max(initial=0))


@dataclass(frozen=True)
class _Options:
    """One source's drafts for each active row of a round (R rows, k = k_max chain positions)."""

    acceptance: np.ndarray     # [R, k] predicted conditional acceptance of each draft (0 past the row's drafts)
    length: np.ndarray         # [R] drafts the row has
    count: np.ndarray          # [R] its leading drafts each expected to add at least the round's threshold
    reach: np.ndarray          # [R, k] the tokens each of those is expected to add, valued (0 past count)

    @classmethod
    def of(cls, acceptance: np.ndarray, length: np.ndarray, tau: float, value: np.ndarray | None = None) -> _Options:
        """value [R, k]: what each row's draft at each position is worth if accepted (DraftChooser.row_values;
        None: 1)."""
        positions = np.arange(acceptance.shape[1])
        reach = acceptance.cumprod(1)                       # non-increasing: the drafts above tau lead
        if value is not None:
            reach = reach * value
        count = ((reach >= tau) & (positions < length[:, None])).sum(1)
        return cls(acceptance, length, count, np.where(positions < count[:, None], reach, 0.0))

    @classmethod
    def none(cls, rows: int, k: int) -> _Options:
        return cls(np.zeros((rows, k)), np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64),
                   np.zeros((rows, k)))

    @property
    def wanted(self) -> np.ndarray:
        """[R, k] 1 where a row wants the draft at that position."""
        return (np.arange(self.reach.shape[1]) < self.count[:, None]).astype(np.float64)

    @property
    def expected(self) -> np.ndarray:
        """[R] the tokens a row's wanted drafts are expected to add."""
        return self.reach.sum(1)


class DraftChooser:
    def __init__(self, k_max: int, sources: tuple[str, ...], *, predictor: AcceptancePredictor | None = None,
                 costs: RoundCostModel | None = None, probe_every: int = 16):
        self.k_max = k_max
        self.use_heads, self.use_history = "heads" in sources, "history" in sources
        self.predictor = predictor or AcceptancePredictor(k_max)
        self.costs = costs or RoundCostModel()
        self.probe_every = probe_every
        self.rounds_without_heads = 0
        self.rounds_without_history = 0
        self.probe_wait = {HEADS: probe_every, HISTORY: probe_every}   # rounds without a source before its probe
        self._history_cache: tuple | None = None     # (view, (acceptance, lengths)) of the round's history drafts
        self._head_rounds: dict[tuple[int, int], tuple[float, float, float]] = {}   # (bucket, h) -> decayed
                                                   # (rounds, head tokens expected per row, head drafts per row)
        self.margin: dict[int, float] = {}         # bucket -> factor drafting must promise over plain
        self._returns: dict[int, tuple[float, float]] = {}   # bucket -> decayed (tokens made, plain's tokens)
        self._idle: dict[int, int] = {}            # bucket -> chosen rounds in a row that drafted nothing
        self._pause: dict[int, int] = {}           # bucket -> length of its next pause (rounds)
        self._paused: dict[int, int] = {}          # bucket -> rounds left in its current pause

    # ------------------------------------------------------------------ threshold
    def threshold(self, bucket: int, active: int, rows: int | None = None) -> float:
        """Expected tokens a verified draft must add to beat plain decoding for its time (a plain
        round computing `rows` rows; None: the whole bucket)."""
        _, b, _ = self.costs.coefficients(bucket)
        return self.margin.get(bucket, 1.0) * b * active / self.costs.plain_seconds(bucket, rows)

    def row_values(self, bucket: int, view: RowView, active: np.ndarray, rows: int) -> np.ndarray | None:
        """[R, k] what each active row's draft at each chain position is worth if accepted, in units of a
        plain round's tokens (P / active; None where every row is alike), a plain round of `rows`
        computed rows costing P = a + b * rows (the module docstring): b + a within its lead for a row
        that alone is furthest behind (RowView.ends_sooner), b + a / active within their lead for rows
        tied for furthest behind (every row alike, as without ends_sooner), b for every other row."""
        if view.ends_sooner is None or active.size == 0:
            return None
        k = self.k_max
        _, b, _ = self.costs.coefficients(bucket)
        plain = self.costs.plain_seconds(bucket, rows)
        a = max(plain - b * rows, 0.0)
        lead = view.ends_sooner[active]                                                 # [R]
        behind = lead > 0
        share = a if behind.sum() == 1 else a / active.size
        within = np.arange(k)[None] < lead[:, None]                                     # [R, k]; 0 past the rows behind
        return (b + share * within) * (active.size / plain)

    def _history_options(self, view: RowView, active: np.ndarray, tau: float,
                         value: np.ndarray | None = None) -> _Options:
        """Each active row's history draft: what of it is worth verifying under threshold `tau`. The
        drafts' predicted acceptance is computed once per round (head_steps() and assign() both read it;
        host time is round time). A history draft is fixed before the round, so all of it is known before."""
        if not (self.use_history and any(view.history_tokens)):   # no row has a history draft: nothing to predict
            return _Options.none(active.size, self.k_max)
        cached = self._history_cache
        if cached is None or cached[0] is not view:
            cached = self._history_cache = (view, self._history_drafts(view, active))
        return _Options.of(*cached[1], tau, value)

    def _history_drafts(self, view: RowView, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[R, k] the predicted conditional acceptance of each active row's history draft tokens (0 past
        them) and [R] their number, for a round where some rows have a history draft."""
        A, k = active.size, self.k_max
        lengths = np.zeros(A, dtype=np.int64)
        cond = np.zeros((A, k))
        limit = view.draft_room(active, k).tolist()
        for i, b in enumerate(active.tolist()):
            if view.history_tokens[b] and limit[i]:
                c = view.history_cond[b][:limit[i]]
                lengths[i], cond[i, :c.size] = c.size, c
        acc = np.zeros((A, k))
        has = lengths > 0
        if has.any():
            acc[has] = self.predictor.predict_rows(HISTORY, cond[has], view.entropy[active[has]],
                                                   view.history_match[active[has]])
        return np.where(np.arange(k) < lengths[:, None], acc, 0.0), lengths

    def _heads_levels(self, h: int) -> np.ndarray:
        """The heads' (source, position) levels for positions 1..h: the same for every row of a round."""
        return self.predictor.position_levels(HEADS)[:h]

    def _best_budget(self, bucket: int, rows: int, active: int, head_steps: int, wanted: np.ndarray,
                     value: np.ndarray) -> tuple[int, float]:
        """The round's budget of verified drafts. wanted [k], value [k]: the drafts the rows want at
        chain positions 1..k (summed over rows; may be expected counts) and the tokens they are
        expected to add. Drafts are kept position by position (every row's first before any row's
        second; rows in order within a position), so budget D keeps the D best-placed; -> (D, the
        round's tokens per second), D = 0: nothing verified (the head steps spent all the same).
        Drafting must beat plain by the bucket's margin. The verification's price is the cost
        model's curve, so a budget stops short of a step in it (AMX's 16-row tiles) where the drafts
        past the step would not pay for it."""
        best, rate = self._best_budgets(bucket, rows, active, np.array([head_steps]), wanted[None], value[None])
        return int(best[0]), float(rate[0])

    def _best_budgets(self, bucket: int, rows: int, active: int, head_steps: np.ndarray, wanted: np.ndarray,
                      value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """_best_budget for H candidate rounds at once: head_steps [H], wanted and value [H, k] -> the
        best budget [H] and its tokens per second [H]."""
        c = self.costs.coefficients(bucket)[2] * head_steps                     # [H]
        plain = active / (self.costs.plain_seconds(bucket, rows) + c)           # [H]
        total = wanted.sum(1)                                                   # [H]
        budgets = np.arange(int(math.ceil(max(total.max(), 0.0))) + 1, dtype=np.float64)    # [D]
        kept = np.minimum(budgets[None], total[:, None])                        # [H, D]
        before = np.zeros_like(wanted)                                          # [H, k] drafts ahead of j
        before[:, 1:] = wanted.cumsum(1)[:, :-1]
        share = (kept[:, :, None] - before[:, None]) / np.maximum(wanted, 1e-12)[:, None]        # [H, D, k]
        share = np.minimum(np.maximum(share, 0.0, out=share), 1.0, out=share)   # clipped to [0, 1]
        tokens = active + np.einsum("hdk,hk->hd", share, value)
        curve = self.costs.verify_curve(bucket, rows + budgets.size)
        seconds = np.interp(rows + kept, np.arange(curve.size), curve) + c[:, None]
        rate = tokens / seconds / self.margin.get(bucket, 1.0)
        rate[:, 0] = plain
        rate[total <= 0] = plain[total <= 0, None]
        # the smallest budget within rounding of the best (budgets past a candidate's total repeat its last)
        best = (rate > rate.max(1, keepdims=True) * (1 - 1e-9)).argmax(1)
        return best, rate[np.arange(best.size), best]

    # ------------------------------------------------------------------ before drafting
    def head_steps(self, bucket: int, view: RowView) -> int:
        """How many head steps this round runs (0 = none): the h whose best budget promises the most
        tokens per second, the heads' drafts valued at their per-position levels, or at what recent
        rounds with h head steps wanted."""
        active = np.flatnonzero(view.active)
        if not self.use_heads or self.k_max == 0 or active.size == 0:
            return 0
        if self.rounds_without_heads >= self.probe_wait[HEADS]:
            return 1
        rows, k, R = view.plain_rows(bucket), self.k_max, active.size
        tau = self.threshold(bucket, R, rows)
        worth = self.row_values(bucket, view, active, rows)
        hist = self._history_options(view, active, tau, worth)
        # per candidate h = 0..k and row: the heads' drafts wanted and their expected tokens (valued) per
        # chain position (zeros past h), at the per-position levels or at what such rounds' rows wanted
        reach = self._heads_levels(k).cumprod()[None] * (1.0 if worth is None else worth)    # [R, k]
        head_wanted, head_value = np.zeros((k + 1, R, k)), np.zeros((k + 1, R, k))
        for h in range(1, k + 1):
            realized = self._heads_per_row(bucket, h)
            if realized is not None:    # rows below the threshold included
                head_value[h, :, :h], head_wanted[h, :, :h] = realized
            else:                       # levels decrease along the chain
                head_wanted[h, :, :h] = reach[:, :h] >= tau
                head_value[h, :, :h] = np.where(head_wanted[h, :, :h] > 0, reach[:, :h], 0.0)
        can_draft = view.draft_room(active, k) > 0                              # [R]
        by_history = ~(head_value.sum(2) > hist.expected[None]) | ~can_draft[None]   # [H, R] rows keeping their history option
        by_heads = (~by_history).astype(np.float64)
        wanted = by_history @ hist.wanted + np.einsum("hr,hrk->hk", by_heads, head_wanted)   # [H, k]
        value = by_history @ hist.reach + np.einsum("hr,hrk->hk", by_heads, head_value)
        _, rates = self._best_budgets(bucket, rows, R, np.arange(k + 1), wanted, value)
        best_h, best_rate = 0, R / self.costs.plain_seconds(bucket, rows)    # a plain round
        for h, rate in enumerate(rates.tolist()):
            if rate > best_rate * (1 + 1e-9):
                best_h, best_rate = h, rate
        return best_h

    # ------------------------------------------------------------------ after drafting
    def assign(self, bucket: int, view: RowView, head_steps: int, head_feature: np.ndarray | None) -> RoundPlan:
        """Per row: source and drafts kept. head_feature [B, head_steps]: the max probability of
        the heads' distribution at each drafted position (None without head steps).

        What a row wants is decided position by position on what was known when that position was
        drafted (its distribution's feature; never the sampled token or anything drafted after it).
        The source of each row, and the round's budget, are decided on what was known before any
        row's first head token was drawn: the first position's feature and the levels of the
        positions after it. Both keep verification lossless."""
        B = view.active.shape[0]
        active = np.flatnonzero(view.active)
        probe = head_steps > 0 and self.rounds_without_heads >= self.probe_wait[HEADS]
        probe_history = (not probe and self.use_history and self.rounds_without_history >= self.probe_wait[HISTORY]
                         and bool(view.history_tokens) and any(view.history_tokens[int(b)] for b in active))
        rows, A, k = view.plain_rows(bucket), active.size, self.k_max
        tau = self.threshold(bucket, max(A, 1), rows)
        worth = self.row_values(bucket, view, active, rows)
        hist = self._history_options(view, active, tau, worth)
        heads = before = _Options.none(A, k)
        if head_steps:
            acc = np.zeros((A, k))
            acc[:, :head_steps] = self.predictor.predict_rows(HEADS, head_feature[active], view.entropy[active])
            drafted = view.draft_room(active, head_steps)    # [R] head steps, or fewer near max_new_tokens
            heads = _Options.of(acc, drafted, tau, worth)    # wanted position by position, as drafted
            known = np.zeros((A, k))                         # known before the first draft was drawn
            known[:, 0], known[:, 1:head_steps] = acc[:, 0], self._heads_levels(head_steps)[1:]
            before = _Options.of(known, drafted, tau, worth)
        plan, by_heads, by_history = self._plan(B, view, active, head_steps, head_feature, hist, heads.acceptance,
                                                heads.count, before.expected)
        value_of_rows = None                                          # [B, k] for _keep_within and settle
        if worth is not None:
            value_of_rows = np.zeros((B, k))
            value_of_rows[active] = worth
        plan.value = value_of_rows
        wanted = before.wanted[by_heads].sum(0) + hist.wanted[by_history].sum(0)
        value = before.reach[by_heads].sum(0) + hist.reach[by_history].sum(0)
        budget, _ = self._best_budget(bucket, rows, A, head_steps, wanted, value)
        if head_steps:       # what the heads' drafts were wanted for: head_steps() prices the next rounds' on it
            self._record_head_round(bucket, head_steps, A, before.wanted[by_heads, :head_steps].sum(0),
                                    before.reach[by_heads, :head_steps].sum(0))
        _keep_within(plan, budget)
        if probe:            # verify the source anyway (its estimates are otherwise never tested)
            first = heads.acceptance[:, 0]
            plan, _, _ = self._plan(B, view, active, head_steps, head_feature, hist, heads.acceptance,
                                    np.minimum(np.maximum(heads.count, 1), heads.length),
                                    np.maximum(before.expected, first), prefer_heads=True)
        elif probe_history:
            has = hist.length > 0
            forced = replace(hist, count=np.where(has, np.maximum(hist.count, 1), hist.count))
            plan, _, _ = self._plan(B, view, active, head_steps, head_feature, forced, heads.acceptance,
                                    np.where(has, 0, heads.count), before.expected)
        for source, probed in ((HEADS, probe), (HISTORY, probe_history)):
            if probed:
                self.probe_wait[source] = min(2 * self.probe_wait[source], PROBE_BACKOFF_MAX * self.probe_every)
            elif (plan.source == source).any():
                self.probe_wait[source] = self.probe_every
        self.rounds_without_heads = (0 if (plan.source == HEADS).any() or not self.use_heads
                                     else self.rounds_without_heads + 1)
        self.rounds_without_history = (0 if (plan.source == HISTORY).any() or not self.use_history
                                       else self.rounds_without_history + 1)
        plan.reason = "probe" if probe else "probe_history" if probe_history else "chosen"
        plan.value = value_of_rows
        self._history_cache = None
        return plan

    @staticmethod
    def _plan(B: int, view: RowView, active: np.ndarray, head_steps: int, head_feature: np.ndarray | None,
              hist: _Options, head_acceptance: np.ndarray, head_count: np.ndarray, head_expected: np.ndarray,
              prefer_heads: bool = False) -> tuple[RoundPlan, np.ndarray, np.ndarray]:
        """Each active row's better option: its first head_count [R] head drafts (predicted acceptance
        head_acceptance [R, k]; worth head_expected [R] tokens as known before the first was drawn) or
        its history option; rows with neither draft nothing. -> the plan, and which active rows take
        the heads [R] and history [R]."""
        by_heads = (head_count > 0) & (head_expected > 0) & ((head_expected >= hist.expected) | prefer_heads)
        by_history = ~by_heads & (hist.count > 0)
        source, num = np.full(B, NONE), np.zeros(B, dtype=np.int64)
        source[active[by_heads]], num[active[by_heads]] = HEADS, head_count[by_heads]
        source[active[by_history]], num[active[by_history]] = HISTORY, hist.count[by_history]
        predicted, features = [np.zeros(0)] * B, [np.zeros(0)] * B
        for i in np.flatnonzero(by_heads | by_history).tolist():
            b, n = int(active[i]), int(num[active[i]])
            if by_heads[i]:
                predicted[b], features[b] = head_acceptance[i, :n], head_feature[b][:n]
            else:
                predicted[b], features[b] = hist.acceptance[i, :n], view.history_cond[b][:n]
        return RoundPlan(head_steps, source, num, predicted, features), by_heads, by_history

    def _record_head_round(self, bucket: int, h: int, active: int, wanted: np.ndarray, value: np.ndarray) -> None:
        """A round that ran h head steps: per chain position, the head drafts its rows wanted [h] and the
        tokens those were expected to add [h], per active row (rows whose drafts were not worth verifying
        count as zero), in the plan the chooser would have made without probing or a budget."""
        if active == 0:
            return
        weight, e, n = self._head_rounds.get((bucket, h), (0.0, np.zeros(h), np.zeros(h)))
        decay = 0.5 ** (1.0 / HEAD_ROUNDS_HALFLIFE)
        self._head_rounds[(bucket, h)] = (weight * decay + 1.0, e * decay + value / active, n * decay + wanted / active)

    def _heads_per_row(self, bucket: int, h: int) -> tuple[np.ndarray, np.ndarray] | None:
        """What rounds with h head steps recently wanted per active row, per chain position: (expected
        tokens from head drafts [h], head drafts [h]), or None before HEAD_ROUNDS_MIN such rounds."""
        weight, e, n = self._head_rounds.get((bucket, h), (0.0, None, None))
        return (e / weight, n / weight) if weight >= HEAD_ROUNDS_MIN else None

    def settle(self, bucket: int, plan: RoundPlan, active: int, tokens: int, seconds: float,
               context: float = 0.0, rows: int | None = None) -> None:
        """A chosen drafting round's outcome: `tokens` made by `active` rows in `seconds` (the cost
        clock's) at a mean context of `context` tokens, against the tokens plain rounds of this bucket
        make in that time at the same context (RoundCostModel.context_factor), a plain round computing
        `rows` rows (None: the bucket; RowView.plain_rows). A round that ran
        head steps and then verified nothing (no row's draft was worth it) counts: its head steps
        were spent on drafting."""
        drafted = plan.num_drafts.any() or plan.head_steps > 0
        if plan.reason != "chosen" or not drafted or not seconds > 0 or active == 0:
            return
        if not self.costs.plain_timed(bucket):
            # no plain round of this bucket timed yet (a shape's first use is not): against a placeholder
            # or a price read off drafting rounds through the prior, one round read as a gain of 20-50x
            # and held the margin at 1 for hundreds of rounds
            return
        decay = 0.5 ** (1.0 / RETURNS_HALFLIFE)
        made, plain = self._returns.get(bucket, (0.0, 0.0))
        made = made * decay + tokens
        seconds = seconds / self.costs.context_factor(bucket, context)    # priced as the model prices plain rounds
        plain = plain * decay + active * seconds / self.costs.plain_seconds(bucket, rows)
        self._returns[bucket] = (made, plain)
        step = MARGIN_STEP * (1.0 - made / plain)
        self.margin[bucket] = min(MARGIN_MAX, max(1.0, self.margin.get(bucket, 1.0) * math.exp(step)))

    def returns(self, bucket: int) -> float:
        """Recent chosen drafting rounds' tokens over what plain rounds make in their time (nan: none yet)."""
        made, plain = self._returns.get(bucket, (0.0, 0.0))
        return made / plain if plain > 0 else float("nan")

    def heads_changed(self) -> None:
        """New head weights: verify them next round instead of trusting the old estimates."""
        self.probe_wait[HEADS] = self.probe_every
        self.rounds_without_heads = self.probe_every
        self._head_rounds.clear()

    def observe(self, view: RowView, plan: RoundPlan, num_accepted: np.ndarray) -> None:
        """Verification's outcome for every row that drafted (the predictor learns from it), and
        whether the bucket's choosing should pause."""
        drafted = np.flatnonzero(plan.num_drafts > 0)
        if drafted.size:
            num = plan.num_drafts[drafted]
            features = np.zeros((drafted.size, int(num.max())))          # [R, n]: each row's features, 0 past them
            for i, b in enumerate(drafted.tolist()):
                features[i, :num[i]] = plan.features[b]
            source = plan.source[drafted]
            match = np.zeros_like(num)
            if view.history_match is not None:
                match = np.where(source == HISTORY, view.history_match[drafted], 0)
            self.predictor.observe_rows(source, features, view.entropy[drafted], match, num, num_accepted[drafted])
        if plan.reason == "chosen":          # probes were not choices; head steps that verified nothing drafted nothing
            self._count_idle(view.active.shape[0], bool(plan.num_drafts.any()))
            if not plan.num_drafts.any() and plan.head_steps == 0:
                self._relax_margin(view.active.shape[0])

    def _relax_margin(self, bucket: int) -> None:
        """A round of `bucket` that did not draft: no evidence for the margin, which relaxes towards 1."""
        margin = self.margin.get(bucket)
        if margin is not None and margin > 1.0:
            self.margin[bucket] = max(1.0, margin ** (0.5 ** (1.0 / MARGIN_HALFLIFE)))

    def _count_idle(self, bucket: int, drafted: bool) -> None:
        if drafted:
            self._idle[bucket], self._pause[bucket] = 0, self.probe_every
            return
        self._idle[bucket] = self._idle.get(bucket, 0) + 1
        if self._idle[bucket] >= PAUSE_AFTER:
            pause = self._pause.get(bucket, self.probe_every)
            self._paused[bucket] = pause
            self._pause[bucket] = min(2 * pause, PROBE_BACKOFF_MAX * self.probe_every)
            self._idle[bucket] = PAUSE_AFTER - 1      # one more round that drafts nothing pauses again

    def plain_round(self, bucket: int) -> bool:
        """Whether this round of `bucket` runs plain without looking at history or choosing (the
        engine still times it and appends its tokens to the history): the plain round the cost model
        is due every probe_every drafting rounds, or a pause (which counts as a round without either
        source for the probes). A timed plain round does no lookups, so its price is plain decoding's."""
        if self.costs.plain_due(bucket, self.probe_every):
            return True
        left = self._paused.get(bucket, 0)
        if left <= 0:
            return False
        self._paused[bucket] = left - 1
        self._relax_margin(bucket)
        self.rounds_without_heads += self.use_heads
        self.rounds_without_history += self.use_history
        return True


def _keep_within(plan: RoundPlan, budget: int) -> None:
    """Cut the plan's drafts to `budget`, position by position: every row's first draft before any
    row's second; within a position the rows whose tokens are worth most first (plan.value), else in
    order. Whether a row's draft at position j is kept depends on the row wanting it (its features up to
    j), on the other rows' wants and on what the rows' tokens are worth (known before the round), never
    on tokens a row drafted: verification stays lossless."""
    num = plan.num_drafts
    if int(num.sum()) <= budget:
        return
    order = np.arange(num.size) if plan.value is None else np.argsort(-plan.value[:, 0], kind="stable")   # [B]
    wants = np.arange(int(num.max()))[:, None] < num[order][None, :]          # [k, B] position-major, in order
    kept = np.empty_like(num)
    kept[order] = (wants & (np.cumsum(wants.ravel()).reshape(wants.shape) <= budget)).sum(0)     # [B]
    for b in np.flatnonzero(kept < num):
        plan.predicted[b], plan.features[b] = plan.predicted[b][:kept[b]], plan.features[b][:kept[b]]
    plan.num_drafts = kept.astype(np.int64)
    plan.source = np.where(kept > 0, plan.source, NONE)


def fixed_plan(view: RowView, k: int) -> RoundPlan:
    """Every unfinished row drafts k tokens from the heads (studies, fixed-k benchmarks), as vLLM's
    drafter does: also in a row's last rounds, where drafts past what it can emit are verified and cut."""
    B = view.active.shape[0]
    num = np.where(view.active, k, 0).astype(np.int64)
    source = np.where(view.active & (k > 0), HEADS, NONE)
    return RoundPlan(k, source, num, [np.zeros(0)] * B, [np.zeros(0)] * B, "fixed")
