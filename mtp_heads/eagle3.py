"""An EAGLE-3 drafter for our policies, computing what vLLM 0.32's `eagle3` method computes.

EAGLE-3 (Li et al., arXiv 2503.01840) drafts from several of the policy's layers instead of its
last hidden state: the residual-stream states after layers l_1 < l_2 < l_3 (low / middle / high;
id 0 = the embeddings, id L = the last layer before the final norm) are concatenated and fused by
one projection `fc`. One Llama decoder layer (`midlayer`) whose attention reads the normed token
embedding and the normed hidden state side by side ([2d] input) then gives, at position i,

    a_i = fc([s^{l_1}_i, s^{l_2}_i, s^{l_3}_i])                       (first draft step only)
    x   = [input_layernorm(emb(x_{i+1})), hidden_norm(a_i)]            [2d]
    r   = a_i + self_attn(x);  r = r + mlp(post_attention_layernorm(r))
    q(. | x_<=i+1) = softmax(lm_head(norm(r)))  over the draft vocabulary, mapped by d2t

and the pre-norm r is the hidden state fed back at the next draft position (vLLM's recurrence:
`aux_output = hidden_prenorm`). The LM head has `draft_vocab_size` rows; draft id j is target token
j + d2t[j] (vLLM's `draft_id_to_target_id`), and t2d [V] marks the target tokens the drafter can
propose. The embedding is the policy's unless the checkpoint brings its own.

Aux states come from forward hooks on the policy's embedding and decoder layers (decoder.py is not
changed); vLLM collects the same tensors (`EagleModelMixin._maybe_add_hidden_state`: hidden +
residual after each listed layer).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from rollout.models.config import ModelConfig
from rollout.models.decoder import MLP, Attention, Cache, CausalLM, RMSNorm, Rotary, new_kv_cache, rope_inv_freq
from rollout.models.fast_linear import Linear, linear


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default (2, L // 2, L - 3) where it is three distinct ids in [0, L]; else evenly spread."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    return tuple(sorted({max(0, round(num_layers * f)) for f in (0.25, 0.5, 1.0)}))


def check_aux_layer_ids(ids, num_layers: int) -> tuple[int, ...]:
    """Sorted, distinct ids in [0, num_layers] (vLLM sorts them and concatenates in that order)."""
    ids = tuple(int(i) for i in ids)
    if not ids or len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        raise ValueError(f"aux layer ids must be distinct and ascending, got {list(ids)}")
    if ids[0] < 0 or ids[-1] > num_layers:
        raise ValueError(f"aux layer ids {list(ids)} out of range for a {num_layers}-layer policy "
                         f"(valid: 0 = embeddings .. {num_layers} = last layer)")
    return ids


def layer_config_for(policy_config: ModelConfig) -> ModelConfig:
    """The draft layer's shape: a Llama layer of the policy's dimensions (vLLM builds a Llama layer
    for every Llama-family target: no q/k/v bias, no q/k norm)."""
    return replace(policy_config, num_hidden_layers=1, architecture="llama", attention_bias=False, qk_norm=False)


class Eagle3Layer(nn.Module):
    """vLLM's llama_eagle3 LlamaDecoderLayer with layer_idx 0: attention over [emb ; hidden] (2d)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.dim_per_head
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.self_attn.q_proj = Linear(2 * d, cfg.num_attention_heads * hd, bias=False)
        self.self_attn.k_proj = Linear(2 * d, cfg.num_key_value_heads * hd, bias=False)
        self.self_attn.v_proj = Linear(2 * d, cfg.num_key_value_heads * hd, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope, positions: torch.Tensor,
                cache: Cache | None) -> torch.Tensor:
        # embeds, hidden [B, T, d]; positions [B, T] -> pre-norm output [B, T, d]
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        r = hidden + self.self_attn(x, rope, positions, cache, 0)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Drafter(nn.Module):
    """fc + one layer + norm + draft LM head; state-dict names are the checkpoint's (SpecForge / vLLM)."""

    def __init__(self, layer_config: ModelConfig, aux_layer_ids: tuple[int, ...], draft_vocab_size: int | None = None,
                 own_embedding: bool = False):
        super().__init__()
        d, V = layer_config.hidden_size, layer_config.vocab_size
        dv = V if draft_vocab_size is None else int(draft_vocab_size)
        if not 0 < dv <= V:
            raise ValueError(f"draft_vocab_size must be in [1, {V}], got {dv}")
        self.config = layer_config
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.fc = Linear(len(self.aux_layer_ids) * d, d, bias=False)
        self.midlayer = Eagle3Layer(layer_config)
        self.norm = RMSNorm(d, layer_config.rms_norm_eps)
        self.lm_head = Linear(d, dv, bias=False)
        self.embed_tokens = nn.Embedding(V, d) if own_embedding else None
        self.rotary = Rotary(layer_config)
        if dv < V:
            # d2t [dv]: target id - draft id; t2d [V]: target ids the drafter can propose
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft id j <-> target_ids[j] (sorted ascending, as EAGLE-3's vocabulary mapping is)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten().sort().values
        if self.d2t is None or ids.numel() != self.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.draft_vocab_size} distinct target ids for a reduced draft vocabulary")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # draft_ids [...] -> target token ids [...]
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def to_policy(self, policy: CausalLM) -> "Eagle3Drafter":
        """On the policy's device and dtype."""
        p = policy.model.embed_tokens.weight
        return self.to(device=p.device, dtype=p.dtype)

    def _apply(self, fn, recurse: bool = True):
        # .to(dtype) / .half() / .cuda() on the drafter or a module holding it: the RoPE table stays float32
        # (as build_model keeps the policy's), on the weights' device
        out = super()._apply(fn, recurse)
        self.rotary.inv_freq = rope_inv_freq(self.config).to(self.fc.weight.device)
        return out

    # ------------------------------------------------------------------ forward pieces
    def embed(self, policy: CausalLM, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> [B, T, d] in the drafter's dtype (a co-trainer's float32 drafter reads a bf16
        policy copy's embedding)."""
        out = (policy.model.embed_tokens if self.embed_tokens is None else self.embed_tokens)(tokens)
        return out.to(self.fc.weight.dtype)

    def prenorm(self, policy: CausalLM, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: Cache | None) -> torch.Tensor:
        """tokens [B, T] (x_{i+1}); hidden [B, T, d] (fc(aux_i) or the previous step's pre-norm output);
        positions [B, T] (i) -> the layer's pre-norm output [B, T, d], the state fed back at the next step."""
        return self.midlayer(self.embed(policy, tokens), hidden, self.rotary(positions), positions, cache)

    def step(self, policy: CausalLM, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             cache: Cache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As `prenorm` -> (post-norm [B, T, d] for logits, pre-norm [B, T, d] fed back)."""
        pre = self.prenorm(policy, tokens, hidden, positions, cache)
        return self.norm(pre), pre

    def draft_logits(self, post: torch.Tensor) -> torch.Tensor:
        """post [..., d] -> logits [..., V] float32, -inf outside the draft vocabulary."""
        logits = linear(post, self.lm_head.weight).float()
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.target_ids(torch.arange(self.draft_vocab_size, device=logits.device))] = logits
        return full

    def greedy_tokens(self, post: torch.Tensor) -> torch.Tensor:
        """post [..., d] -> argmax target ids [...] (vLLM: argmax over draft ids, then d2t)."""
        return self.target_ids(linear(post, self.lm_head.weight).argmax(-1))

    def new_cache(self, batch: int, max_len: int) -> Cache:
        cfg = self.config
        w = self.fc.weight
        return new_kv_cache(1, batch, max_len, cfg.num_key_value_heads, cfg.dim_per_head, w.dtype, w.device,
                            paged=False)


@torch.no_grad()
@contextmanager
def layer_outputs(policy: CausalLM, layer_ids: tuple[int, ...]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, each forward of `policy` leaves in the yielded dict the residual stream after
    each listed layer (0 = the embeddings) by layer id, [B, T, d]; no hooks are set for no ids."""
    found: dict[int, torch.Tensor] = {}
    modules = [(0, policy.model.embed_tokens)] + [(i + 1, m) for i, m in enumerate(policy.model.layers)]
    hooks = [module.register_forward_hook(lambda _m, _inp, out, layer_id=layer_id: found.__setitem__(layer_id, out))
             for layer_id, module in modules if layer_id in layer_ids]
    try:
        yield found
    finally:
        for h in hooks:
            h.remove()


def policy_states(policy: CausalLM, tokens: torch.Tensor,
                  layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (final-norm states [B, T, d], aux states [B, T, len(layer_ids) * d]: the residual
    stream after each listed layer, 0 = the embeddings, concatenated in ascending id order) from one
    teacher-forced policy forward."""
    with layer_outputs(policy, layer_ids) as found:
        hidden = policy.hidden_states(tokens)
    return hidden, torch.cat([found[i] for i in sorted(layer_ids)], dim=-1)


def aux_hidden_states(policy: CausalLM, tokens: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """tokens [B, T] -> the aux states of `policy_states`, [B, T, len(layer_ids) * d]."""
    return policy_states(policy, tokens, layer_ids)[1]


@torch.no_grad()
def draft_greedy(policy: CausalLM, drafter: Eagle3Drafter, sequence: list[int], k: int) -> list[int]:
    """The k tokens vLLM's EAGLE-3 proposer drafts greedily after `sequence`.

    `sequence` is every committed token, its last one just emitted by the target (not yet run through
    it). The drafter's KV at every committed position i is the teacher-forced one (token x_{i+1}, aux
    states at i), as vLLM's first pass rewrites it each step; then it recurs k - 1 times on its own
    pre-norm output, one position further each time."""
    n = len(sequence)
    if n < 2 or k < 1:
        raise ValueError(f"need a sequence of at least 2 tokens and k >= 1, got {n}, {k}")
    device = policy.model.embed_tokens.weight.device
    seq = torch.tensor([sequence], dtype=torch.long, device=device)                       # [1, n]
    hidden = drafter.fc(aux_hidden_states(policy, seq[:, :-1], drafter.aux_layer_ids))     # [1, n-1, d]
    cache = drafter.new_cache(1, n + k)
    positions = torch.arange(n - 1, device=device)[None]
    post, pre = drafter.step(policy, seq[:, 1:], hidden, positions, cache)
    post, pre = post[:, -1:], pre[:, -1:]
    drafts: list[int] = []
    for j in range(k):
        token = drafter.greedy_tokens(post)                                               # [1, 1]
        drafts.append(int(token))
        if j + 1 < k:
            post, pre = drafter.step(policy, token, pre, torch.tensor([[n - 1 + j]], device=device), cache)
    return drafts


def init_eagle3(policy: CausalLM, aux_layer_ids: tuple[int, ...] | None = None,
                draft_vocab: torch.Tensor | None = None, seed: int = 0) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for `policy` (tests, a start for training): weights ~ N(0, 1/fan_in),
    norms at 1; `draft_vocab` (target ids) makes a reduced draft vocabulary."""
    cfg = policy.config
    ids = check_aux_layer_ids(aux_layer_ids or default_aux_layer_ids(cfg.num_hidden_layers), cfg.num_hidden_layers)
    drafter = Eagle3Drafter(layer_config_for(cfg), ids, None if draft_vocab is None else len(draft_vocab))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        if draft_vocab is not None:
            drafter.set_draft_vocab(draft_vocab)
    return drafter.to_policy(policy).eval()
