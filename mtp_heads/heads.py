"""DeepSeek-V3-style multi-token-prediction heads that draft for a frozen policy.

Depth j at position i reads the previous depth's hidden state at i (the policy's final-norm
hidden state for j = 1) and the embedding of token x_{i+j}, and predicts x_{i+j+1}:

    h^j_i = norm_j(blocks_j(eh_proj_j([enorm_j(emb(x_{i+j})), hnorm_j(h^{j-1}_i)]))),
    q_j(. | x_<=i+j) = softmax(W h^j_i / T)

`blocks_j` is one decoder layer (DeepSeek-V3, EAGLE) or a stack of `num_layers` of them (on
SmolLM2-135M a second layer buys nothing over one at equal data and steps). The embedding `emb`
and the LM head `W` are the policy's own (shared and frozen), so a head checkpoint only holds
the per-depth modules. Drafting k > D tokens reuses depth D.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from rollout.models.config import ModelConfig
from rollout.models.decoder import Cache, CausalLM, DecoderLayer, RMSNorm, new_kv_cache
from rollout.models.dtypes import parse_dtype
from rollout.models.fast_linear import Linear, linear
from rollout.models.flat_weights import FlatWeights, unpack


class MTPDepth(nn.Module):
    def __init__(self, cfg: ModelConfig, num_layers: int = 1):
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.blocks = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def input(self, prev_hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        # prev_hidden, token_embeds [B, T, d] -> the first block's input [B, T, d], in the depth's dtype (a
        # co-trainer's float32 heads read a bf16 policy's states: cast here, not mixed inside the norms)
        dtype = self.eh_proj.weight.dtype
        return self.eh_proj(torch.cat([self.enorm(token_embeds.to(dtype)), self.hnorm(prev_hidden.to(dtype))], dim=-1))

    def forward(self, prev_hidden: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], cache: Cache | None) -> torch.Tensor:
        # prev_hidden, token_embeds [B, T, d]; positions [B, T] -> hidden [B, T, d] (after norm);
        # cache holds one layer per block
        x = self.input(prev_hidden, token_embeds)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, positions, cache, i)
        return self.norm(x)


def layers_in_state_dict(state_dict: dict) -> int:
    """Decoder layers per depth of a head state dict (`depths.0.blocks.<i>.*`)."""
    found = {int(m.group(1)) for k in state_dict if (m := re.match(r"depths\.0\.blocks\.(\d+)\.", k))}
    return max(found) + 1 if found else 1


class MTPHeads(nn.Module):
    """D chained depths built against one policy architecture (see `policy_fingerprint`)."""

    def __init__(self, policy_config: ModelConfig, num_depths: int, num_layers: int = 1):
        super().__init__()
        if num_depths < 1 or num_layers < 1:
            raise ValueError(f"num_depths and num_layers must be >= 1, got {num_depths}, {num_layers}")
        self.policy_config = policy_config
        self.depths = nn.ModuleList(MTPDepth(policy_config, num_layers) for _ in range(num_depths))

    def set_draft_vocab(self, draft_vocab: torch.Tensor | None) -> None:
        """Restrict drafting to these token ids (None = full vocabulary). Part of the state dict,
        so it travels with the weights to workers, co-trainers and checkpoints."""
        if draft_vocab is None:
            self._buffers.pop("draft_vocab", None)
            return
        ids = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
        V = self.policy_config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"draft_vocab must be a non-empty set of token ids in [0, {V}), got {ids.numel()} ids")
        device = next(self.parameters()).device
        self.register_buffer("draft_vocab", torch.unique(ids).to(device), persistent=True)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        state_dict = dict(state_dict)                         # the caller's dict is left as it was
        self.set_draft_vocab(state_dict.get("draft_vocab"))  # its size may differ: re-register first
        if "draft_vocab" in state_dict:
            state_dict["draft_vocab"] = self.draft_vocab
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def num_depths(self) -> int:
        return len(self.depths)

    @property
    def num_layers(self) -> int:
        """Decoder layers per depth."""
        return len(self.depths[0].blocks)

    @property
    def policy_fingerprint(self) -> str:
        return self.policy_config.fingerprint()

    def check_compatible(self, policy: CausalLM) -> None:
        """Heads drafting for another policy give garbage (or index errors): refuse early."""
        mine, theirs = self.policy_config, policy.config
        if mine.hidden_size != theirs.hidden_size or mine.vocab_size != theirs.vocab_size:
            raise ValueError(
                f"MTP heads were built for hidden_size={mine.hidden_size}, vocab_size={mine.vocab_size} but the "
                f"policy has hidden_size={theirs.hidden_size}, vocab_size={theirs.vocab_size}; "
                "train or load heads for this policy (mtp-rollout train-heads)")

    def new_caches(self, batch: int, max_len: int, dtype: torch.dtype, device, paged: bool = True) -> list[Cache]:
        """One static cache per depth (decoder.new_kv_cache: paged where it can)."""
        cfg = self.policy_config
        return [new_kv_cache(self.num_layers, batch, max_len, cfg.num_key_value_heads, cfg.dim_per_head, dtype,
                             device, paged)
                for _ in self.depths]

    def depth_forward(self, j: int, policy: CausalLM, prev_hidden: torch.Tensor, tokens: torch.Tensor,
                      positions: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        # j in [0, D); prev_hidden [B, T, d]; tokens [B, T] (x_{i+j+1}); positions [B, T] -> [B, T, d]
        rope = policy.model.rotary(positions)
        return self.depths[j](prev_hidden, policy.model.embed_tokens(tokens), positions, rope, cache)

    def draft_logits_in_vocab(self, policy: CausalLM, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, d] -> (logits [B, |S|] float32 over the draft vocabulary S, its ids [|S|] or
        None when S is the whole vocabulary).

        With a draft vocabulary (buffer `draft_vocab`, set by mtp_heads.checkpoint.set_draft_vocab)
        only those rows of the LM head are computed: cheaper drafting (the LM head dominates a head's
        cost) and still lossless, since rejection sampling only needs q to be a distribution (zero
        outside S). The engine processes and samples q over S and scatters it into [B, V] once.
        """
        vocab = getattr(self, "draft_vocab", None)
        if vocab is None:
            return policy.compute_logits(hidden), None
        weight = policy.lm_head_weight
        key = (weight.data_ptr(), weight._version, vocab.data_ptr())
        if getattr(self, "_sub_head_key", None) != key:  # re-slice only after a policy update
            self._sub_head, self._sub_head_key = weight[vocab].contiguous(), key
        return linear(hidden, self._sub_head).float(), vocab

    def draft_logits(self, policy: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, d] -> logits [B, V] float32, -inf outside the draft vocabulary."""
        logits, vocab = self.draft_logits_in_vocab(policy, hidden)
        if vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], policy.config.vocab_size), float("-inf"))
        full[:, vocab] = logits
        return full

    def teacher_forced(self, policy: CausalLM, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Training forward over whole sequences.

        hidden [B, T, d] policy final-norm states of `tokens` [B, T]. Returns, for depth j = 1..D,
        student hidden states [B, T-j, d] at positions i = 0..T-1-j; their teacher is the policy's
        distribution at position i+j, softmax(W hidden[:, i+j]).
        """
        B, T, _ = hidden.shape
        outs, prev = [], hidden
        for j in range(1, self.num_depths + 1):
            n = T - j
            if n <= 0:
                break
            positions = torch.arange(n, device=hidden.device).expand(B, n)
            prev = self.depth_forward(j - 1, policy, prev[:, :n], tokens[:, j:j + n], positions, None)
            outs.append(prev)
        return outs


def init_heads(policy: CausalLM, num_depths: int, seed: int = 0, num_layers: int = 1) -> MTPHeads:
    """Heads whose blocks are copies of the policy's last `num_layers` layers and whose projection
    passes the hidden state through: a better start than random (drafting = the policy's own next guess)."""
    torch.manual_seed(seed)
    heads = MTPHeads(policy.config, num_depths, num_layers)
    d = policy.config.hidden_size
    with torch.no_grad():
        for depth in heads.depths:
            for block, layer in zip(depth.blocks, policy.model.layers[-num_layers:]):
                block.load_state_dict(layer.state_dict())
            depth.eh_proj.weight.copy_(torch.cat([0.1 * torch.randn(d, d) / d ** 0.5, torch.eye(d)], dim=1))
            depth.norm.weight.copy_(policy.model.norm.weight)
    p = policy.model.embed_tokens.weight
    return heads.to(device=p.device, dtype=p.dtype)


def zero_residual_branches(block: DecoderLayer) -> None:
    """Make a decoder layer the identity: its attention and MLP outputs are zeroed (in place)."""
    with torch.no_grad():
        block.self_attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()


def grow_layers(heads: MTPHeads, policy: CausalLM, num_layers: int) -> MTPHeads:
    """The same drafter with `num_layers` layers per depth: the added layers (copies of the policy's
    last layer) have their residual branches zeroed, so they start as the identity and the grown
    heads draft exactly what `heads` drafted; training then uses the new capacity."""
    if num_layers < heads.num_layers:
        raise ValueError(f"cannot shrink heads from {heads.num_layers} to {num_layers} layers per depth")
    grown = MTPHeads(heads.policy_config, heads.num_depths, num_layers)
    p = next(heads.parameters())
    grown = grown.to(device=p.device, dtype=p.dtype)
    missing, _ = grown.load_state_dict(heads.state_dict(), strict=False)
    assert all(".blocks." in m for m in missing), missing
    for depth in grown.depths:
        for block in depth.blocks[heads.num_layers:]:
            block.load_state_dict(policy.model.layers[-1].state_dict())
            zero_residual_branches(block)
    return grown


def heads_from_flat(policy_config: ModelConfig, num_depths: int, flat: FlatWeights, dtype: str = "float32",
                    device: str = "cpu") -> MTPHeads:
    """MTPHeads for `policy_config` holding the shipped weights."""
    state = unpack(flat)
    heads = MTPHeads(policy_config, num_depths, layers_in_state_dict(state))
    heads.load_state_dict(state)
    return heads.to(device=device, dtype=parse_dtype(dtype))
