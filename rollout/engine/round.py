"""One decode round for every unfinished row at once: draft -> verify -> accept -> commit.

Each row drafts its own number of tokens from its own source (rollout.engine.chooser: the heads,
rollout history, or nothing); a plan with no drafts is a plain decoding step. Verification is one
target forward over every unfinished row's pending token and drafts: packed (each row's tokens
only, the paged attention kernel takes per-row query lengths; rows that finished are left out) where
the cache is paged and a row drafted or finished, else padded to the longest row's width. The
round's host synchronisations are the heads' draft features (when heads drafted) and the engine's
stop check after it.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from mtp_heads.heads import MTPHeads
from rollout.engine.chooser import HEADS, HISTORY, DraftChooser, RoundPlan, RowView, fixed_plan
from rollout.engine.config import PACK_MULTIPLE, bucket, packed_tokens
from rollout.engine.forwards import Forwards
from rollout.engine.state import DecodeState
from rollout.models.decoder import CausalLM, set_read_len
from rollout.models.paged_attention import PagedKVCache
from rollout.types import SamplingParams
from rollout.verify import (DRAFT, KeyedDraws, process_logits, process_logits_with_stats, raw_log_normalizer,
                            rejection_sample, sample)

# "host": the engine's work around a round (the row view, what the chooser, the cost model and the history learn
# from it), timed by TorchEngine.generate
PHASES = ("draft", "verify", "accept", "commit", "host")


@dataclass
class PhaseTimes:
    """Seconds per phase summed over rounds (perf_counter; on GPU each phase is synchronised)."""

    enabled: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    rounds: int = 0

    @contextmanager
    def phase(self, name: str, device: torch.device):
        if not self.enabled:
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds[name] += time.perf_counter() - t0


@dataclass
class RoundContext:
    """What every round of one generate() call shares."""

    policy: CausalLM
    heads: MTPHeads | None
    forwards: Forwards
    sampling: SamplingParams
    seed: int                         # with each row's identity and position, keys every random draw
    stop_ids: torch.Tensor            # [S] int64
    verify_widths: tuple[int, ...]
    head_width: int                   # positions per head-cache update chunk: max(k_max + 1, D)
    times: PhaseTimes
    k_max: int = 0                    # the most drafts a row may verify in one round
    draft_keys: KeyedDraws | None = None   # draws of the head token being drafted (set by draft())
    clock: Callable[[], float] = time.perf_counter   # the cost model's clock (round_cost.cost_clock)
    head_prefill_seconds: float = 0.0  # of the prefill, filling the heads' caches (on clock): not plain decoding's


@dataclass
class RoundResult:
    k: int                            # the longest row's drafts (the verified width - 1)
    row_ids: torch.Tensor             # [B] prompt index of each slot (-1 = padding)
    active: torch.Tensor              # [B] bool: rows that were unfinished when the round began
    num_accepted: torch.Tensor        # [B]
    num_drafts: torch.Tensor          # [B] drafts verified per row (0: no drafts, or q was not finite)
    draft_entropy: torch.Tensor       # [B, k] H(p) at each draft position
    plan: RoundPlan                   # sources and the predictor's view of each row's drafts
    emitted: torch.Tensor             # [B, k+1] the round's output tokens (-1 after each row's last)
    nonfinite: torch.Tensor | None = None   # [B] bool: heads rows whose q had NaN/inf (no drafts verified)
    verified_tokens: int = 0          # tokens the target forward computed (cost model input)
    head_seconds: float = 0.0         # what the head steps took on ctx.clock, up to the chooser's read of q


READ_WINDOW_STEP = 32   # the caches' read window grows in steps of this many positions


def round_slack(k: int, verify_widths: tuple[int, ...], head_width: int, num_depths: int) -> int:
    """Positions a round with k drafts may touch beyond the longest row's length: the padded
    verification, head-cache chunks of head_width and their scratch entries (none when k = 0).
    The engine allocates its caches for k_max's slack; each round reads only its own."""
    if k == 0:
        return 2 * bucket(1, verify_widths) + 4
    return 2 * max(bucket(k + 1, verify_widths), head_width) + num_depths + PACK_MULTIPLE + 4


def set_read_window(ctx: RoundContext, st: DecodeState, k: int) -> None:
    """Attention of the coming round reads cache positions < longest + its slack only (rounded up),
    the most any valid query can see: at batch 8 a step with ~100 tokens of context no longer pays
    for the whole buffer (~2.5x as long), and a plain round no more than plain decoding."""
    D = ctx.heads.num_depths if ctx.heads is not None else 0
    need = st.longest + round_slack(k, ctx.verify_widths, ctx.head_width, D)
    window = min(st.max_len, -(-need // READ_WINDOW_STEP) * READ_WINDOW_STEP)
    for cache in (st.target, *st.heads):
        set_read_len(cache, window)


def run_round(ctx: RoundContext, st: DecodeState, view: RowView, chooser: DraftChooser | None,
              k_fixed: int) -> RoundResult:
    """One round; `chooser` None = every unfinished row drafts k_fixed tokens from the heads."""
    sp, dev = ctx.sampling, st.seq.device
    B = st.batch
    set_read_window(ctx, st, ctx.k_max if chooser is not None else k_fixed)   # a plain round: plain decoding's window
    c = st.committed
    active = ~st.finished
    keys = KeyedDraws(ctx.seed, st.row_ids, c)      # column j: the token at position c + j
    with ctx.times.phase("draft", dev):
        h = chooser.head_steps(B, view) if chooser is not None else k_fixed
        head_tokens = q = q_vocab = nonfinite = feature = None
        head_seconds = 0.0
        if h > 0:
            t_heads = ctx.clock()
            head_tokens, q, nonfinite, q_vocab = draft(ctx, st, h)                        # [B, h], [B, h, S], [B], [S]
            feature = q.amax(-1).float().cpu().numpy() if chooser is not None else None   # [B, h] (a host sync)
            head_seconds = ctx.clock() - t_heads
        plan = chooser.assign(B, view, h, feature) if chooser is not None else fixed_plan(view, k_fixed)
        k = plan.width
        drafts, num_drafts, point_mass = _draft_tensors(plan, view, head_tokens, sp.draft_mode, dev)
        if nonfinite is not None:
            num_drafts = torch.where(nonfinite & (torch.as_tensor(plan.source, device=dev) == HEADS), 0, num_drafts)
    with ctx.times.phase("verify", dev):
        pending = st.seq.gather(1, (c - 1)[:, None])                                       # [B, 1]
        tokens = torch.cat([pending, drafts], dim=1)                                       # [B, k+1]
        live = np.flatnonzero(view.active)                                                 # [S] host
        packs = isinstance(st.target, PagedKVCache) and not ctx.forwards.compiled
        packed = packs and 0 < live.size and (k > 0 or live.size < B)   # else row b's position j at b*(k+1)+j
        if packed:
            hidden, index, verified = _verify_packed(ctx, st, tokens, num_drafts, live)   # [N, d], [B, k+1]
        else:
            width = bucket(k + 1, ctx.verify_widths)
            padded = torch.cat([tokens, tokens.new_zeros(B, width - k - 1)], dim=1)        # [B, width]
            hidden = ctx.forwards.target(padded, c - 1, st.target, _aux_layers(ctx, st))[:, :k + 1]  # [B, k+1, d]
            positions = (c - 1)[:, None] + torch.arange(k + 1, device=dev)
            rows = torch.arange(B, device=dev)[:, None]
            st.hidden[rows, positions] = hidden
            if st.draft_states is not None:
                st.draft_states[rows, positions] = ctx.heads.draft_states(ctx.forwards.aux_states[:, :k + 1])
            hidden = hidden.reshape(B * (k + 1), -1)
            index = torch.arange(B * (k + 1), device=dev).view(B, k + 1)
            verified = B * width
        logits = ctx.policy.compute_logits(hidden)                                         # [N, V]
        target_probs, ent, p_max = process_logits_with_stats(logits, sp.temperature, sp.top_k, sp.top_p)
    with ctx.times.phase("accept", dev):
        if k == 0:   # a plain step: nothing to verify, the token is a draw from p
            num_accepted = torch.zeros(B, dtype=torch.long, device=dev)
            output = sample(target_probs.index_select(0, index[:, 0]) if packed else target_probs, keys)[:, None]
        else:
            heads_q = None if (q is None or sp.draft_mode == "greedy") else q[:, :k]
            output, num_accepted = _accept_unfinished(ctx, st, live, drafts, heads_q, q_vocab, target_probs,
                                                      num_drafts, index, point_mass, keys)
    with ctx.times.phase("commit", dev):
        emitted = output.clamp_min(0)
        log_z = raw_log_normalizer(logits, sp.temperature, sp.top_k, sp.top_p, p_max)      # [N]
        logp = logits[index, emitted] - log_z[index]                                       # [B, k+1]
        commit(ctx, st, output, num_accepted, logp, ent[index], p_max[index])
    ctx.times.rounds += 1
    # the most tokens any row emitted, often fewer than the k+1 verified (a host read; the engine reads the
    # round's counts right after anyway). The next head-cache update recomputes that many positions per
    # row: at batch 8 a window of 4 is 32 tokens through the head, past AMX's 16-row tile
    advance = int((st.committed - c).max())
    for j in range(len(st.head_lag)):
        st.head_lag[j] += advance
    st.longest = min(st.longest + advance, st.max_len)
    return RoundResult(k, st.row_ids, active, num_accepted, num_drafts, ent[index[:, :k]] if k else ent.new_zeros(B, 0),
                       plan, output, nonfinite, verified, head_seconds)


def _accept_unfinished(ctx: RoundContext, st: DecodeState, live: np.ndarray, drafts, heads_q, q_vocab, target_probs,
                       num_drafts, index, point_mass, keys: KeyedDraws) -> tuple[torch.Tensor, torch.Tensor]:
    """rejection_sample over the unfinished rows `live` only: a finished row left out of a packed
    forward has no entries of its own (its index points into another row's), and its draws must not
    land on them. -> output [B, k+1] (-1 for finished rows), num_accepted [B]."""
    B = drafts.shape[0]
    if live.size == B:
        return rejection_sample(drafts, heads_q, target_probs, keys, num_drafts, index=index, point_mass=point_mass,
                                draft_vocab=q_vocab)
    sel = torch.as_tensor(live, device=drafts.device)
    out, acc = rejection_sample(drafts[sel], None if heads_q is None else heads_q[sel], target_probs,
                                KeyedDraws(ctx.seed, st.row_ids[sel], st.committed[sel]), num_drafts[sel],
                                index=index[sel], point_mass=None if point_mass is None else point_mass[sel],
                                draft_vocab=q_vocab)
    output = out.new_full((B, out.shape[1]), -1)
    output[sel] = out
    num_accepted = acc.new_zeros(B)
    num_accepted[sel] = acc
    return output, num_accepted


def _draft_tensors(plan: RoundPlan, view: RowView, head_tokens: torch.Tensor | None, draft_mode: str,
                   dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The plan's drafts as tensors: tokens [B, k] (heads' or history's per row, 0 past a row's
    count), counts [B] and point_mass [B] (history rows, and every row in greedy mode; None if none)."""
    B, k = plan.source.shape[0], plan.width
    drafts = torch.zeros(B, k, dtype=torch.long, device=dev)
    source = torch.as_tensor(plan.source, device=dev)
    if head_tokens is not None and k:
        n = min(k, head_tokens.shape[1])
        drafts[:, :n] = torch.where((source == HEADS)[:, None], head_tokens[:, :n], 0)
    history_rows = np.flatnonzero(plan.source == HISTORY)
    if history_rows.size:
        copied = np.zeros((history_rows.size, k), dtype=np.int64)
        for i, b in enumerate(history_rows):
            n = int(plan.num_drafts[b])
            copied[i, :n] = view.history_tokens[b][:n]
        drafts[torch.as_tensor(history_rows, device=dev)] = torch.as_tensor(copied, device=dev)
    num_drafts = torch.as_tensor(plan.num_drafts, dtype=torch.long, device=dev)
    if draft_mode == "greedy" or history_rows.size:
        return drafts, num_drafts, (source == HISTORY) | (draft_mode == "greedy")
    return drafts, num_drafts, None      # no point masses: verification draws no token per position


def _verify_packed(ctx: RoundContext, st: DecodeState, tokens: torch.Tensor, num_drafts: torch.Tensor,
                   live: np.ndarray):
    """Each unfinished row's pending token and its num_drafts[b] drafts, the runs back to back in
    one [1, N] forward (N above PACK_MULTIPLE padded up to a multiple of it by extending the last run
    with scratch positions, rewritten before anything reads them). Finished rows are not computed: a bucket
    keeps them until enough rows finish to move into a smaller one.

    tokens [B, k+1], live [S] (host: the unfinished rows) -> hidden [N, d], index [B, k+1] (row b's
    position j -> its run's min(j, n_b); 0 for finished rows, whose outputs are never committed), N."""
    B, width = tokens.shape
    dev = tokens.device
    every_row = live.size == B
    seqs = torch.arange(B, device=dev) if every_row else torch.as_tensor(live, device=dev)    # [S]
    drafts = num_drafts[seqs]                                                             # [S]
    counts = drafts + 1
    run, rows, offset, starts = _packed_runs(seqs, counts)
    N = rows.numel()
    positions = st.committed[rows] - 1 + offset
    flat_tokens = tokens[rows, offset.clamp_max(width - 1)]
    flat_tokens = torch.where(offset < counts[run], flat_tokens, 0)
    positions = positions.clamp_max(st.max_len - 1)
    hidden = ctx.forwards.target_packed(flat_tokens, positions, rows, starts.to(torch.int32), st.target,
                                        _aux_layers(ctx, st), seqs=None if every_row else seqs)
    st.hidden[rows, positions] = hidden
    if st.draft_states is not None:
        st.draft_states[rows, positions] = ctx.heads.draft_states(ctx.forwards.aux_states)
    index = torch.zeros(B, width, dtype=torch.long, device=dev)
    index[seqs] = starts[:-1, None] + torch.minimum(torch.arange(width, device=dev)[None], drafts[:, None])
    return hidden, index, N


def _packed_runs(seqs: torch.Tensor, counts: torch.Tensor):
    """Runs of counts[s] consecutive tokens for the cache rows seqs [S], back to back; above PACK_MULTIPLE
    tokens the last run is extended to a multiple of it (scratch positions: fewer new shapes for oneDNN).
    -> run [N] (the run of each token), rows [N] (its cache row), offset [N] (its place in the run),
    starts [S+1] (the runs' offsets; the query offsets of a packed forward). One host read (N)."""
    total = int(counts.sum())
    padded = counts.clone()
    padded[-1] += packed_tokens(total) - total
    starts = torch.zeros(seqs.numel() + 1, dtype=torch.long, device=seqs.device)
    starts[1:] = padded.cumsum(0)
    run = torch.repeat_interleave(torch.arange(seqs.numel(), device=seqs.device), padded)
    offset = torch.arange(run.numel(), device=seqs.device) - starts[run]
    return run, seqs[run], offset, starts


def _aux_layers(ctx: RoundContext, st: DecodeState) -> tuple[int, ...]:
    """The policy layers a target forward keeps states of: those the drafter reads when it does not read
    the final state (EAGLE-3), else none."""
    return ctx.heads.aux_layer_ids if st.draft_states is not None else ()


# --------------------------------------------------------------------------------- draft
def draft(ctx: RoundContext, st: DecodeState, k: int):
    """k draft tokens per row from the heads, also written to seq[c .. c+k-1] (draft j is drawn
    with the keys of its position, c-1+j).

    -> drafts [B, k] int64, q [B, k, S] over the drafter's vocabulary, nonfinite [B] bool (q had NaN/inf
    somewhere), the vocabulary's ids [S] (None: S is the whole vocabulary)."""
    heads, fwd = ctx.heads, ctx.forwards
    D = heads.num_depths
    c = st.committed
    rows = torch.arange(st.batch, device=c.device)
    tokens, probs, bad, vocab = [], [], torch.zeros_like(st.finished), None
    keys = KeyedDraws(ctx.seed, st.row_ids, c)
    prev_buffer = st.drafter_input
    for j in range(1, min(k, D) + 1):
        update_head_cache(ctx, st, j, prev_buffer)
        ctx.draft_keys = keys.at(j - 1)
        token, q, vocab, nonfinite = draft_token(ctx, st.head_hidden[j - 1][rows, c - 2])   # depth j at c-2
        st.seq[rows, c - 1 + j] = token
        tokens.append(token), probs.append(q)
        bad |= nonfinite
        prev_buffer = st.head_hidden[j - 1]
    for m in range(D + 1, k + 1):
        # past the last depth: reuse depth D one position further on (scratch cache entries)
        pos = (c - 2 + m - D)[:, None]
        out = fwd.head(D - 1, st.head_hidden[D - 1][rows[:, None], pos - 1], st.seq[rows[:, None], pos + D], pos,
                       st.heads[D - 1])
        st.head_hidden[D - 1][rows[:, None], pos] = out
        ctx.draft_keys = keys.at(m - 1)
        token, q, vocab, nonfinite = draft_token(ctx, out[:, 0])
        st.seq[rows, c - 1 + m] = token
        tokens.append(token), probs.append(q)
        bad |= nonfinite
    return torch.stack(tokens, 1), torch.stack(probs, 1), bad, vocab


def update_head_cache(ctx: RoundContext, st: DecodeState, j: int, prev_buffer: torch.Tensor) -> None:
    """Recompute depth j (1-based) at its stale positions start .. c-2 of every unfinished row.

    On a paged cache (eager) with more than one row, the rows' own positions go in one packed forward,
    finished rows left out: padding every row to the widest row's window computes up to twice the
    positions the rows need at batch 16. One row wastes at most the window's rounding up to a power of
    two, less than packing's index work costs. Elsewhere (SDPA caches, compiled forwards, one row) every
    row computes the same window in fixed-width chunks: the stale window is max(advance since the
    depth's last update, j) wide, `head_lag` bounds it on the host, so the number of chunks is known
    without reading lengths back from the device; eager forwards take a window narrower than head_width
    in one chunk of the next power of two, compiled ones keep head_width, one graph. Positions past c-2
    (chunks, packing's padding) write scratch entries that are rewritten before anything reads them."""
    c, W, L, D = st.committed, ctx.head_width, st.max_len, ctx.heads.num_depths
    start = torch.minimum(st.head_len[j - 1], (c - 1 - j).clamp_min(0))
    cache = st.heads[j - 1]
    if isinstance(cache, PagedKVCache) and not ctx.forwards.compiled and st.batch > 1:
        _catch_up_packed(ctx, st, j, prev_buffer, start)
    else:
        rows = torch.arange(st.batch, device=c.device)[:, None]
        stale = max(st.head_lag[j - 1], j)
        if not ctx.forwards.compiled and stale < W:
            W = 1 << (stale - 1).bit_length()
        for i in range(-(-stale // W)):
            pos = (start[:, None] + i * W + torch.arange(W, device=c.device)).clamp_max(L - 1 - D)  # [B, W]
            out = ctx.forwards.head(j - 1, prev_buffer[rows, pos], st.seq[rows, pos + j], pos, cache)
            st.head_hidden[j - 1][rows, pos] = out
    st.head_len[j - 1] = c - 1
    st.head_lag[j - 1] = 0


def _catch_up_packed(ctx: RoundContext, st: DecodeState, j: int, prev_buffer: torch.Tensor,
                     start: torch.Tensor) -> None:
    """Depth j over each unfinished row's positions start[b] .. c[b]-2 (start [B]), packed into one [1, N] forward."""
    c, cache = st.committed, st.heads[j - 1]
    live = (~st.finished).nonzero().squeeze(1)                                      # [S]
    if live.numel() == 0:
        return
    every_row = live.numel() == st.batch
    _, rows, offset, starts = _packed_runs(live, (c - 1 - start)[live])
    pos = (start[rows] + offset).clamp_max(st.max_len - 1 - ctx.heads.num_depths)  # [N]
    with cache.packed(rows, starts.to(torch.int32), None if every_row else live):
        out = ctx.forwards.head(j - 1, prev_buffer[rows, pos][None], st.seq[rows, pos + j][None], pos[None], cache)
    st.head_hidden[j - 1][rows, pos] = out[0]


def fill_head_caches(heads: MTPHeads, policy: CausalLM, st: DecodeState,
                     prompt_aux: torch.Tensor | None = None) -> None:
    """After prefill: depth j's cache over the committed tokens, positions 0 .. c-1-j (eager,
    once per call); leaves head_len = c-j and a lag bound of j-1 for the first round.

    A drafter that reads the policy's intermediate layers (`aux_layer_ids`: EAGLE-3) gets its own
    states buffer, filled here over the prompts from the prefill's aux states (prompt_aux [B, P, n d])
    and by every verification after (run_round); other drafters read the policy's final states, `hidden`."""
    c = st.committed
    rows = torch.arange(st.batch, device=c.device)[:, None]
    if getattr(heads, "aux_layer_ids", ()):
        st.draft_states = torch.zeros_like(st.hidden)
        st.draft_states[:, :prompt_aux.shape[1]] = heads.draft_states(prompt_aux)
    prev_buffer = st.drafter_input
    for j in range(1, heads.num_depths + 1):
        width = int((c - j).clamp_min(1).max())
        pos = torch.arange(width, device=c.device).expand(st.batch, width)
        out = heads.depth_forward(j - 1, policy, prev_buffer[rows, pos], st.seq[rows, pos + j], pos, st.heads[j - 1])
        st.head_hidden[j - 1][rows, pos] = out
        st.head_len[j - 1] = (c - j).clamp_min(0)
        prev_buffer = st.head_hidden[j - 1]
    st.head_lag = [j - 1 for j in range(1, heads.num_depths + 1)]


def draft_token(ctx: RoundContext, head_hidden: torch.Tensor):
    # head_hidden [B, d] -> token [B], q [B, |S|], S's ids [|S|] (None: all V), nonfinite [B] bool
    # q is processed, sampled and verified over the draft vocabulary S only (4k of 49k ids for SmolLM2): the
    # same distribution as over V with 0 outside S (top-k / top-p keep the same ids), never built over V
    sp = ctx.sampling
    logits, vocab = ctx.heads.draft_logits_in_vocab(ctx.policy, head_hidden)          # [B, |S|]
    nonfinite = ~logits.amax(-1).isfinite()      # NaN or +inf anywhere, or no finite logit: one pass
    q = process_logits(logits, sp.temperature, sp.top_k, sp.top_p)
    token = q.argmax(-1) if sp.draft_mode == "greedy" else sample(q, ctx.draft_keys, DRAFT)
    return (token if vocab is None else vocab[token]), q, vocab, nonfinite


# --------------------------------------------------------------------------------- commit
def commit(ctx: RoundContext, st: DecodeState, output, num_accepted, logp, ent, p_max) -> None:
    """Append each active row's n+1 emitted tokens, cut at a stop token or max_new_tokens.

    output [B, k+1] (-1 after the last); num_accepted [B]; logp (log p of each output token under the
    raw logits), ent, p_max [B, k+1]."""
    sp = ctx.sampling
    B, width = output.shape
    dev = output.device
    c = st.committed
    idx = torch.arange(width, device=dev)[None]                                        # [1, k+1]
    emitted = idx <= num_accepted[:, None]                                              # [B, k+1]
    is_stop = torch.isin(output, ctx.stop_ids) & emitted
    first_stop = torch.where(is_stop, idx, width).min(1).values                         # [B]
    room = sp.max_new_tokens - (c - st.prompt_len)
    count = torch.minimum(torch.minimum(num_accepted + 1, first_stop + 1), room)
    count = torch.where(st.finished, 0, count)                                          # [B]
    keep = idx < count[:, None]
    pos = (c[:, None] + idx).clamp_max(st.max_len - 1)
    rows = torch.arange(B, device=dev)[:, None]
    tokens = output.clamp_min(0)
    st.seq[rows, pos] = torch.where(keep, tokens, st.seq[rows, pos])
    st.logprob[rows, pos] = torch.where(keep, logp, st.logprob[rows, pos])
    st.token_entropy[rows, pos] = torch.where(keep, ent, st.token_entropy[rows, pos])
    st.token_max_prob[rows, pos] = torch.where(keep, p_max.float(), st.token_max_prob[rows, pos])
    st.committed = c + count
    hit_stop = first_stop < count
    st.stopped |= hit_stop & ~st.finished
    st.finished |= hit_stop | (st.committed - st.prompt_len >= sp.max_new_tokens)
