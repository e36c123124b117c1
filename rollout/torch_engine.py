"""The reference engine: batched, lossless MTP-head speculative decoding in plain torch.

One round per loop iteration, every row of the batch at its own position:

    draft (heads propose k tokens) -> verify (one target forward over k+1 tokens)
    -> accept (rejection_sample) -> commit (advance each row's length by its n+1 tokens)

k = 0 runs the same loop without drafts: plain autoregressive decoding, the baseline.
Invariants per row b, with c[b] = committed tokens (prompt + emitted):
  * seq[b, :c]   holds them; seq[b, c-1] (the pending token) is not yet in the target cache;
  * the target cache holds positions 0 .. c-2 and hidden[b, i] is the policy's state there;
  * head depth j's cache holds valid entries for positions < head_len[j][b].
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM, KVCache
from rollout.types import Completion, RolloutBatch, SamplingParams, validate_request
from rollout.verify import entropy, process_logits, rejection_sample, sample


@dataclass
class _DecodeState:
    """Per-batch tensors of one generate() call (B rows, L = buffer length)."""

    seq: torch.Tensor            # [B, L] int64 tokens (beyond c: drafts or scratch)
    committed: torch.Tensor      # [B] c
    prompt_len: torch.Tensor     # [B]
    hidden: torch.Tensor         # [B, L, d] policy final-norm states
    logprob: torch.Tensor        # [B, L] log p(raw) of each emitted token at its position
    token_entropy: torch.Tensor  # [B, L] H(processed p) each emitted token came from
    finished: torch.Tensor       # [B] bool
    stopped: torch.Tensor        # [B] bool, finished on a stop token


@dataclass
class _Caches:
    """The target's KV cache and, when drafting, each head depth's cache, valid length and outputs."""

    target: KVCache
    heads: list[KVCache]             # one per depth
    head_len: list[torch.Tensor]     # [B] per depth: entries valid for positions < head_len
    head_hidden: list[torch.Tensor]  # [B, L, d] per depth: the depth's output at each position


class TorchEngine:
    """generate(prompts, SamplingParams) -> RolloutBatch, with optional MTP heads."""

    def __init__(self, policy: CausalLM, heads: MTPHeads | None = None, *,
                 policy_version: int = 0, head_version: int = 0):
        self.policy = policy
        self.policy_version = policy_version
        self.heads: MTPHeads | None = None
        self.head_version = head_version
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

    def update_heads(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self.heads is None:
            raise ValueError("this engine has no heads to update; construct it with heads first")
        self.heads.load_state_dict({k: torch.as_tensor(v) for k, v in state_dict.items()})
        self.head_version = version

    def update_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        sd = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        if self.policy.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        _, unexpected = self.policy.load_state_dict(sd, strict=False)  # partial updates are fine
        if unexpected:
            raise ValueError(f"policy update has tensors this model does not have: {unexpected[:5]}")
        self.policy_version = version

    # ----------------------------------------------------------------- checks
    def _validate(self, prompts: list[list[int]], sp: SamplingParams) -> None:
        cfg = self.policy.config
        validate_request(prompts, sp, vocab_size=cfg.vocab_size, context_length=cfg.max_position_embeddings,
                         has_heads=self.heads is not None)

    # ----------------------------------------------------------------- decoding
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 progress: Callable[[int, int, int], None] | None = None) -> RolloutBatch:
        """`progress(new_tokens, accepted_drafts, proposed_drafts)` is called after every round."""
        self._validate(prompts, sampling)
        t0 = time.perf_counter()
        gen = torch.Generator(device=self._device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        state, caches = self._prefill(prompts, sampling, gen)
        rounds_accepted, rounds_entropy, rounds_active = [], [], []
        while not bool(state.finished.all()):
            before = int(state.committed.sum())
            num_accepted, draft_entropy, active = self._round(state, caches, sampling, gen)
            if progress is not None:
                progress(int(state.committed.sum()) - before, int(num_accepted[active].sum()),
                         sampling.num_draft_tokens * int(active.sum()))
            if sampling.num_draft_tokens > 0:
                rounds_accepted.append(num_accepted)
                rounds_entropy.append(draft_entropy)
                rounds_active.append(active)
        batch = self._completions(prompts, state, sampling, rounds_accepted, rounds_entropy, rounds_active)
        batch.wall_time_s = time.perf_counter() - t0
        return batch

    @property
    def _device(self) -> torch.device:
        return self.policy.model.embed_tokens.weight.device

    def _stop_ids(self, sp: SamplingParams) -> torch.Tensor:
        ids = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            ids |= set(self.policy.config.eos_token_ids)
        return torch.tensor(sorted(ids) or [-2], dtype=torch.long, device=self._device)

    def _prefill(self, prompts, sp: SamplingParams, gen):
        B, dev = len(prompts), self._device
        k = sp.num_draft_tokens
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        max_len = int(lengths.max()) + sp.max_new_tokens + 2 * k + 4
        d = self.policy.config.hidden_size
        dtype = self.policy.model.embed_tokens.weight.dtype
        seq = torch.zeros(B, max_len, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):  # once per call, not in the decode loop
            seq[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        cache = self.policy.new_cache(B, max_len)
        P = int(lengths.max())
        hidden = torch.zeros(B, max_len, d, dtype=dtype, device=dev)
        hidden[:, :P] = self.policy.hidden_states(seq[:, :P], cache, torch.zeros(B, dtype=torch.long, device=dev))
        rows = torch.arange(B, device=dev)
        last_logits = self.policy.compute_logits(hidden[rows, lengths - 1])        # [B, V]
        probs = process_logits(last_logits, sp.temperature, sp.top_k, sp.top_p)
        first = sample(probs, gen)
        state = _DecodeState(
            seq=seq, committed=lengths.clone(), prompt_len=lengths, hidden=hidden,
            logprob=torch.zeros(B, max_len, device=dev), token_entropy=torch.zeros(B, max_len, device=dev),
            finished=torch.zeros(B, dtype=torch.bool, device=dev),
            stopped=torch.zeros(B, dtype=torch.bool, device=dev),
        )
        self._commit(state, first[:, None], torch.zeros(B, dtype=torch.long, device=dev),
                     last_logits[:, None], probs[:, None], sp)
        caches = _Caches(cache, [], [], [])
        if k > 0:
            caches.heads = self.heads.new_caches(B, max_len, dtype, dev)
            caches.head_len = [torch.zeros(B, dtype=torch.long, device=dev) for _ in caches.heads]
            caches.head_hidden = [torch.zeros_like(hidden) for _ in caches.heads]
        return state, caches

    def _round(self, state: _DecodeState, caches: _Caches, sp: SamplingParams, gen):
        """draft -> verify -> accept -> commit, for every unfinished row at once."""
        k, B = sp.num_draft_tokens, state.seq.shape[0]
        active = ~state.finished
        c = state.committed
        if k > 0:
            drafts, draft_probs = self._draft(state, caches, sp, gen)
        else:
            drafts = torch.zeros(B, 0, dtype=torch.long, device=c.device)
            draft_probs = None
        # verify: the pending token and the k drafts in one target forward at positions c-1 .. c-1+k
        verify_tokens = torch.cat([state.seq.gather(1, (c - 1)[:, None]), drafts], dim=1)   # [B, k+1]
        hidden = self.policy.hidden_states(verify_tokens, caches.target, c - 1)                       # [B, k+1, d]
        positions = (c - 1)[:, None] + torch.arange(k + 1, device=c.device)
        state.hidden[torch.arange(B, device=c.device)[:, None], positions] = hidden
        logits = self.policy.compute_logits(hidden)                                          # [B, k+1, V]
        target_probs = process_logits(logits, sp.temperature, sp.top_k, sp.top_p)
        if sp.draft_mode == "greedy":
            draft_probs = None
        output, num_accepted = rejection_sample(drafts, draft_probs, target_probs, gen)
        draft_entropy = entropy(target_probs[:, :k])                                         # [B, k]
        self._commit(state, output, num_accepted, logits, target_probs, sp)
        return num_accepted, draft_entropy, active

    def _draft(self, state: _DecodeState, caches: _Caches, sp: SamplingParams, gen):
        """k draft tokens per row from the heads; drafts are also written to seq[c .. c+k-1]."""
        head_caches, head_len, head_hidden = caches.heads, caches.head_len, caches.head_hidden
        heads, policy = self.heads, self.policy
        k, D = sp.num_draft_tokens, heads.num_depths
        c = state.committed
        B, dev = c.shape[0], c.device
        rows = torch.arange(B, device=dev)[:, None]
        draft_tokens, draft_probs = [], []
        prev_buffer = state.hidden
        for j in range(1, min(k, D) + 1):
            # window: positions whose depth-j entry is stale, up to c-2 (the drafting position)
            start = torch.minimum(head_len[j - 1], (c - 1 - j).clamp_min(0))
            width = c - 1 - start                                                          # [B] >= 1
            T = int(width.max())
            pos = (start[:, None] + torch.arange(T, device=dev)).clamp_max(state.seq.shape[1] - 1 - D)  # [B, T]
            out = heads.depth_forward(j - 1, policy, prev_buffer[rows, pos], state.seq[rows, pos + j], pos,
                                      head_caches[j - 1])
            head_hidden[j - 1][rows, pos] = out
            head_len[j - 1] = c - 1
            last = out[rows[:, 0], width - 1]                                               # [B, d]
            token, probs = self._draft_token(last, sp, gen)
            state.seq[rows[:, 0], c - 1 + j] = token
            draft_tokens.append(token)
            draft_probs.append(probs)
            prev_buffer = head_hidden[j - 1]
        for m in range(D + 1, k + 1):
            # past the last depth: reuse depth D one position further on (scratch cache entries)
            pos = (c - 2 + m - D)[:, None]
            out = heads.depth_forward(D - 1, policy, head_hidden[D - 1][rows, pos - 1], state.seq[rows, pos + D],
                                      pos, head_caches[D - 1])
            head_hidden[D - 1][rows, pos] = out
            token, probs = self._draft_token(out[:, 0], sp, gen)
            state.seq[rows[:, 0], c - 1 + m] = token
            draft_tokens.append(token)
            draft_probs.append(probs)
        return torch.stack(draft_tokens, 1), torch.stack(draft_probs, 1)

    def _draft_token(self, head_hidden: torch.Tensor, sp: SamplingParams, gen):
        # head_hidden [B, d] -> token [B], q [B, V] (q processed like p: temperature, top-k, top-p)
        q = process_logits(self.heads.draft_logits(self.policy, head_hidden), sp.temperature, sp.top_k, sp.top_p)
        token = q.argmax(-1) if sp.draft_mode == "greedy" else sample(q, gen)
        return token, q

    def _commit(self, state: _DecodeState, output, num_accepted, logits, target_probs, sp: SamplingParams):
        """Append each active row's n+1 emitted tokens, cut at a stop token or max_new_tokens."""
        B, width = output.shape
        dev = output.device
        c = state.committed
        idx = torch.arange(width, device=dev)[None]                                        # [1, k+1]
        emitted = idx <= num_accepted[:, None]                                              # [B, k+1]
        is_stop = torch.isin(output, self._stop_ids(sp)) & emitted
        first_stop = torch.where(is_stop, idx, width).min(1).values                         # [B]
        room = sp.max_new_tokens - (c - state.prompt_len)
        count = torch.minimum(torch.minimum(num_accepted + 1, first_stop + 1), room)
        count = torch.where(state.finished, 0, count)                                       # [B]
        keep = idx < count[:, None]
        pos = (c[:, None] + idx).clamp_max(state.seq.shape[1] - 1)
        rows = torch.arange(B, device=dev)[:, None]
        tokens = output.clamp_min(0)
        state.seq[rows, pos] = torch.where(keep, tokens, state.seq[rows, pos])
        logp = F.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
        state.logprob[rows, pos] = torch.where(keep, logp, state.logprob[rows, pos])
        ent = entropy(target_probs)
        state.token_entropy[rows, pos] = torch.where(keep, ent, state.token_entropy[rows, pos])
        state.committed = c + count
        hit_stop = first_stop < count
        state.stopped |= hit_stop & ~state.finished
        state.finished |= hit_stop | (state.committed - state.prompt_len >= sp.max_new_tokens)

    def _completions(self, prompts, state: _DecodeState, sp: SamplingParams,
                     rounds_accepted, rounds_entropy, rounds_active) -> RolloutBatch:
        k = sp.num_draft_tokens
        if rounds_accepted:
            acc = torch.stack(rounds_accepted, 1).cpu().numpy()       # [B, R]
            ent = torch.stack(rounds_entropy, 1).float().cpu().numpy()  # [B, R, k]
            act = torch.stack(rounds_active, 1).cpu().numpy()         # [B, R]
        seq, logprob = state.seq.cpu().numpy(), state.logprob.cpu().numpy()
        tok_ent = state.token_entropy.cpu().numpy()
        completions = []
        for b, prompt in enumerate(prompts):
            lo, hi = int(state.prompt_len[b]), int(state.committed[b])
            comp = Completion(
                prompt=list(map(int, prompt)), tokens=seq[b, lo:hi].tolist(),
                logprobs=logprob[b, lo:hi].tolist(), entropies=tok_ent[b, lo:hi].tolist(),
                num_draft_tokens=k, finish_reason="stop" if bool(state.stopped[b]) else "length",
                policy_version=self.policy_version, head_version=self.head_version,
            )
            if rounds_accepted:
                mask = act[b]
                comp.round_accepted = acc[b][mask].astype(int).tolist()
                comp.draft_entropies = ent[b][mask].tolist()
            if sp.return_hidden_states:
                # hidden_states[i] is the policy state that predicted tokens[i] (position lo-1+i)
                comp.hidden_states = state.hidden[b, lo - 1:hi - 1].float().cpu().numpy()
            completions.append(comp)
        return RolloutBatch(completions)
