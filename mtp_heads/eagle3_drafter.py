"""An EAGLE-3 drafter behind the interface the torch engine drafts through (the one MTPHeads has).

The engine drafts with `num_depths` chained modules, each with its own KV cache: depth 1 reads, at
committed position i, a state the engine stored from its target forwards and the token x_{i+1}; the
last depth is reused one position further on, on its own output, for every draft beyond it. EAGLE-3
is that with one depth:
  * the stored state is fc over the policy's aux-layer states at i (`draft_states`), where MTP heads
    read the policy's final-norm state;
  * the depth's output is the layer's pre-norm state, fed back unchanged at the next draft position
    (vLLM's recurrence), so `depth_forward` returns it and the norm moves into the logits;
  * the logits are the drafter's own LM head over its draft vocabulary, whose ids map to the
    policy's through d2t (`draft_logits_in_vocab` returns them, as MTP heads return theirs).
The state dict is the drafter's own (the names of vLLM's `eagle3` layout), so weight updates and
checkpoints use one set of names.

The engine collects the aux states in the forwards it runs anyway: the prefill's
(mtp_heads.eagle3.layer_outputs around it) and every verification's (rollout.engine.forwards).
"""
from __future__ import annotations

import torch
from torch import nn

from mtp_heads.eagle3 import Eagle3Drafter
from rollout.models.decoder import Cache, CausalLM, new_kv_cache
from rollout.models.fast_linear import linear


class Eagle3Heads(nn.Module):
    """What the engine calls on its drafter (num_depths, check_compatible, new_caches, depth_forward,
    draft_logits_in_vocab), computed by one Eagle3Drafter, plus what only a drafter of the policy's
    intermediate layers needs: `aux_layer_ids` and `draft_states`."""

    num_depths = 1
    num_layers = 1

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The policy layers whose states the drafter reads (0 = the embeddings), ascending."""
        return self.drafter.aux_layer_ids

    # ------------------------------------------------------------------ weights: the drafter's own names
    def state_dict(self, *args, **kwargs):
        return self.drafter.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.drafter.load_state_dict(state_dict, strict=strict, assign=assign)

    def check_compatible(self, policy: CausalLM) -> None:
        """A drafter of another policy would read states it was not trained on: refuse early."""
        mine, theirs = self.drafter.config, policy.config
        if (mine.hidden_size != theirs.hidden_size or mine.vocab_size != theirs.vocab_size
                or self.aux_layer_ids[-1] > theirs.num_hidden_layers):
            raise ValueError(
                f"EAGLE-3 drafter built for hidden_size={mine.hidden_size}, vocab_size={mine.vocab_size}, aux layers "
                f"{list(self.aux_layer_ids)} but the policy has hidden_size={theirs.hidden_size}, vocab_size="
                f"{theirs.vocab_size}, {theirs.num_hidden_layers} layers; load a drafter trained for this policy")

    # ------------------------------------------------------------------ what the engine stores
    def draft_states(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n d] (the policy's states after each aux layer at a position) -> [..., d], what the
        drafter reads there: fc of them."""
        return self.drafter.fc(aux)

    # ------------------------------------------------------------------ drafting
    def new_caches(self, batch: int, max_len: int, dtype: torch.dtype, device, paged: bool = True) -> list[Cache]:
        """The draft layer's one static cache (decoder.new_kv_cache: paged where it can)."""
        cfg = self.drafter.config
        return [new_kv_cache(1, batch, max_len, cfg.num_key_value_heads, cfg.dim_per_head, dtype, device, paged)]

    def depth_forward(self, j: int, policy: CausalLM, prev_hidden: torch.Tensor, tokens: torch.Tensor,
                      positions: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        # j = 0 (one depth); prev_hidden [B, T, d] (draft states or the last step's output); tokens [B, T]
        # (x_{i+1}); positions [B, T] (i) -> the pre-norm state [B, T, d]
        return self.drafter.prenorm(policy, tokens, prev_hidden, positions, cache)

    def draft_vocab(self, device) -> torch.Tensor | None:
        """Target ids of draft ids 0 .. dv-1 [dv], or None when the draft vocabulary is the policy's."""
        if self.drafter.d2t is None:
            return None
        return self.drafter.target_ids(torch.arange(self.drafter.draft_vocab_size, device=device))

    def draft_logits_in_vocab(self, policy: CausalLM, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, d] (pre-norm) -> (logits [B, dv] float32 over the draft vocabulary, its target ids
        [dv] or None when it is the whole vocabulary)."""
        logits = linear(self.drafter.norm(hidden), self.drafter.lm_head.weight).float()
        return logits, self.draft_vocab(hidden.device)

    def draft_logits(self, policy: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] (pre-norm) -> logits [..., V] float32, -inf outside the draft vocabulary."""
        return self.drafter.draft_logits(self.drafter.norm(hidden))
