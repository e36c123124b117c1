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

The engine's prefill runs the policy outside rollout.engine.forwards, so the aux states of the prompt
come from forward hooks (`AuxStateTap`, attached by the engine's Forwards) on the embedding and the
aux layers: the last policy forward's states, by reference; a prompt the tap did not see is run again,
teacher-forced. Verification forwards capture the aux states themselves (rollout.engine.forwards).
"""
from __future__ import annotations

import torch
from torch import nn

from mtp_heads.eagle3 import Eagle3Drafter, aux_hidden_states
from rollout.models.decoder import Cache, CausalLM, new_kv_cache
from rollout.models.fast_linear import linear


class AuxStateTap:
    """The residual-stream states after the listed layers (0 = the embeddings) of the policy's last
    forward and the tokens it ran on, kept by reference until taken."""

    def __init__(self, policy: CausalLM, layer_ids: tuple[int, ...]):
        self.policy = policy
        self.layer_ids = tuple(layer_ids)
        self.tokens: torch.Tensor | None = None          # [U, P] of the last forward
        self.states: dict[int, torch.Tensor] = {}        # layer id -> [U, P, d]
        embed = policy.model.embed_tokens
        self._layer_of = {id(embed): 0} | {id(m): i + 1 for i, m in enumerate(policy.model.layers)
                                          if i + 1 in self.layer_ids}
        self._hooks = [embed.register_forward_hook(self._on_output)]
        self._hooks += [policy.model.layers[i - 1].register_forward_hook(self._on_output)
                        for i in self.layer_ids if i > 0]

    def _on_output(self, module: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        layer_id = self._layer_of.get(id(module))
        if layer_id is None:            # a deep copy of the policy carries the hooks, not the modules
            return
        if layer_id == 0:               # a new forward begins at the embedding; its input may be a view the
            self.tokens, self.states = inputs[0].clone(), {}    # engine writes into after the forward
            if 0 not in self.layer_ids:
                return
        self.states[layer_id] = out

    def take(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """tokens [B, P] -> their aux states [B, P, n d] (ascending layer ids) if the last forward ran on
        these rows or on their distinct rows (torch.unique(tokens, dim=0), as a prefill that runs each
        repeated prompt once does); else None. Releases what was kept either way."""
        seen, states = self.tokens, self.states
        self.tokens, self.states = None, {}
        if seen is None or set(states) != set(self.layer_ids) or seen.shape[1:] != tokens.shape[1:]:
            return None
        if seen.shape == tokens.shape and torch.equal(seen, tokens):
            rows = None
        else:
            distinct, rows = torch.unique(tokens, dim=0, return_inverse=True)
            if distinct.shape != seen.shape or not torch.equal(distinct, seen):
                return None
        aux = torch.cat([states[i] for i in self.layer_ids], dim=-1)
        return aux if rows is None else aux[rows]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.tokens, self.states = [], None, {}


class Eagle3Heads(nn.Module):
    """What the engine calls on its drafter (num_depths, check_compatible, new_caches, depth_forward,
    draft_logits_in_vocab), computed by one Eagle3Drafter, plus what only a drafter of the policy's
    intermediate layers needs: `aux_layer_ids`, `draft_states` and `prompt_draft_states`."""

    num_depths = 1
    num_layers = 1

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter
        self._tap: AuxStateTap | None = None

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
    def attach(self, policy: CausalLM) -> None:
        """Keep the aux states of `policy`'s forwards (the engine's prefill) for prompt_draft_states."""
        if self._tap is not None and self._tap.policy is policy:
            return
        self.release()
        self._tap = AuxStateTap(policy, self.aux_layer_ids)

    def release(self) -> None:
        """Stop keeping the policy's states (the engine changed drafters)."""
        if self._tap is not None:
            self._tap.remove()
            self._tap = None

    def draft_states(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n d] (the policy's states after each aux layer at a position) -> [..., d], what the
        drafter reads there: fc of them."""
        return self.drafter.fc(aux)

    def prompt_draft_states(self, policy: CausalLM, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, P] (the prompts as the prefill ran them, zero-padded) -> draft states [B, P, d]: from
        the prefill's aux states where the tap kept them, else from a teacher-forced forward."""
        aux = self._tap.take(tokens) if self._tap is not None and self._tap.policy is policy else None
        if aux is None:
            aux = aux_hidden_states(policy, tokens, self.aux_layer_ids)
        return self.draft_states(aux)

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
