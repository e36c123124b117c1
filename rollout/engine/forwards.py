"""The model forwards of a decode round, eager or compiled, with compile time kept apart.

What is compiled is one decoder layer (and one MTP depth), called with the layer module and its
cache tensors as arguments: the 30 layers of a policy and the D head blocks share one graph per
(batch bucket, width, cache length), so a new shape costs one layer's compile, not the model's.
Inductor, `dynamic=False`; the engine's buckets fix every shape, so nothing recompiles once seen.
Weights are graph inputs, so policy and head updates need no recompile. (Inductor `freezing`,
which turns weights into constants, was tried and rejected: it makes every layer its own graph,
30x the compile time, and any weight update would need a recompile.) On GPU,
`mode="reduce-overhead"` replays CUDA graphs over the static caches.
"""
from __future__ import annotations

import time

import torch

from mtp_heads.heads import MTPDepth, MTPHeads
from rollout.models.decoder import Cache, CausalLM, DecoderLayer, KVCache
from rollout.models.paged_attention import PagedKVCache

AUTO_COMPILE_MIN_PARAMS = 20_000_000


def _configure_dynamo() -> None:
    # (batch bucket x width x length) graphs per function exceed dynamo's default of 8
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def compiles(policy: CausalLM, compile: bool | None) -> bool:
    """Whether an engine compiles its forwards: `compile`, or for None (auto) only on a GPU and only for
    models of AUTO_COMPILE_MIN_PARAMS or more (on CPU eager was faster: EngineConfig.compile)."""
    if compile is not None:
        return bool(compile)
    device = policy.model.embed_tokens.weight.device
    return device.type == "cuda" and sum(p.numel() for p in policy.parameters()) >= AUTO_COMPILE_MIN_PARAMS


class Forwards:
    """target(tokens, start, cache) -> hidden and head(j, ...) -> hidden, compiled or eager.

    A target forward asked for `aux_layers` also keeps the residual-stream states after those layers
    (0 = the embeddings), concatenated in ascending order, in `aux_states` ([B, T, n d], packed [N, n d]):
    what an EAGLE-3 drafter reads. Forwards that ask for none do no extra work."""

    def __init__(self, policy: CausalLM, heads: MTPHeads | None, compile: bool | None):
        self.policy, self.heads = policy, heads
        self.device = policy.model.embed_tokens.weight.device
        self.compiled = compiles(policy, compile)
        self.compile_times: dict[tuple, float] = {}  # (graph, shapes) -> seconds of its first call
        self.aux_states: torch.Tensor | None = None   # of the last target forward that asked for aux layers
        if self.compiled:   # eager calls the modules on the real caches (target, head)
            _configure_dynamo()
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._layer = torch.compile(_layer_body, dynamic=False, mode=mode)
            self._depth = torch.compile(_depth_body, dynamic=False, mode=mode)

    def set_heads(self, heads: MTPHeads | None) -> None:
        self.heads = heads

    # ------------------------------------------------------------------ calls
    def target(self, tokens: torch.Tensor, start: torch.Tensor, cache: Cache,
               aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        # tokens [B, T] at positions start[b] .. start[b]+T-1 -> final-norm hidden [B, T, d]
        model = self.policy.model
        positions = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        rope = model.rotary(positions)
        x = model.embed_tokens(tokens)
        aux = [x] if 0 in aux_layers else []
        if not self.compiled:   # the cache itself: its layers share one attention plan and its read window
            for i, layer in enumerate(model.layers):
                x = layer(x, rope, positions, cache, i)
                if aux_layers and i + 1 in aux_layers:
                    aux.append(x)
        else:
            key = ("layer", tuple(tokens.shape), cache.max_len)
            cos, sin = rope
            for i, layer in enumerate(model.layers):
                x = self._call(key, self._layer, layer, x, cos, sin, positions, cache.k[i], cache.v[i])
                if aux_layers and i + 1 in aux_layers:
                    aux.append(x)
        self.aux_states = torch.cat(aux, dim=-1) if aux_layers else None
        return model.norm(x)

    def target_packed(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                      query_start: torch.Tensor, cache: PagedKVCache, aux_layers: tuple[int, ...] = (),
                      seqs: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions, rows [N]: each computed row's run of consecutive positions, runs in the
        order of `seqs` [S] (cache rows; None: every row in cache order), query_start [S+1] int32
        offsets -> final-norm hidden [N, d]. Eager, paged caches only: the variable per-row lengths
        go to the attention kernel as they are, without padding."""
        model = self.policy.model
        positions = positions[None]                                                   # [1, N]
        rope = model.rotary(positions)
        x = model.embed_tokens(tokens[None])
        aux = [x] if 0 in aux_layers else []
        with cache.packed(rows, query_start, seqs):
            for i, layer in enumerate(model.layers):
                x = layer(x, rope, positions, cache, i)
                if aux_layers and i + 1 in aux_layers:
                    aux.append(x)
        self.aux_states = torch.cat(aux, dim=-1)[0] if aux_layers else None
        return model.norm(x)[0]

    def head(self, j: int, prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             cache: Cache) -> torch.Tensor:
        # depth j (0-based); prev [B, T, d]; tokens, positions [B, T] -> [B, T, d]
        if not (self.compiled and isinstance(self.heads, MTPHeads) and type(self.heads.depths[j]) is MTPDepth):
            # another drafter (EAGLE-3, a test's): its own forward, eager
            return self.heads.depth_forward(j, self.policy, prev, tokens, positions, cache)
        depth = self.heads.depths[j]
        cos, sin = self.policy.model.rotary(positions)
        embeds = self.policy.model.embed_tokens(tokens)
        key = ("depth", tuple(tokens.shape), cache.max_len)
        return self._call(key, self._depth, depth, prev, embeds, cos, sin, positions, cache.k, cache.v)

    def _call(self, key, fn, *args):
        # a compiled graph: its first call per key compiles, and that time is kept apart
        if key in self.compile_times:
            out = fn(*args)
        else:
            t0 = time.perf_counter()
            out = fn(*args)
            self.compile_times[key] = time.perf_counter() - t0
        return out.clone() if self.device.type == "cuda" else out  # CUDA graphs reuse their outputs

    @property
    def compile_time_s(self) -> float:
        return sum(self.compile_times.values())


def _cache_of(k: list[torch.Tensor], v: list[torch.Tensor]) -> KVCache:
    cache = KVCache.__new__(KVCache)
    cache.k, cache.v, cache.max_len = list(k), list(v), k[0].shape[1]
    cache.read_len = cache.max_len        # compiled graphs read the whole buffer: one shape per cache
    cache._plan = None
    return cache


def _layer_body(layer: DecoderLayer, x, cos, sin, positions, k_cache, v_cache) -> torch.Tensor:
    # x [B, T, d]; cos, sin [B, 1, T, hd]; positions [B, T]; k_cache, v_cache [B, L, H_kv, hd]
    return layer(x, (cos, sin), positions, _cache_of([k_cache], [v_cache]), 0)


def _depth_body(depth: MTPDepth, prev, embeds, cos, sin, positions, k_caches, v_caches) -> torch.Tensor:
    # k_caches, v_caches: one [B, L, H_kv, hd] per block of the depth
    return depth(prev, embeds, positions, (cos, sin), _cache_of(k_caches, v_caches))
