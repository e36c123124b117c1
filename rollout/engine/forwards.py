"""The model forwards of a decode round, eager or compiled, with compile time kept apart.

Compiled with inductor, `dynamic=False`: one graph per (function, batch bucket, width, cache
length), all fixed by the engine's buckets, so nothing recompiles once a shape has been seen.
On CPU `freezing` turns the weights into constants (oneDNN prepacks them); weight updates then
need `reset()`. On GPU `mode="reduce-overhead"` replays CUDA graphs over the static caches.
"""
from __future__ import annotations

import time

import torch

from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM, KVCache

AUTO_COMPILE_MIN_PARAMS = 20_000_000


def _configure_dynamo() -> None:
    # (batch bucket x width x length) graphs per function exceed dynamo's default of 8
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


class Forwards:
    """target(tokens, start, cache) -> hidden and head(j, ...) -> hidden, compiled or eager."""

    def __init__(self, policy: CausalLM, heads: MTPHeads | None, compile: bool | None, freeze: bool):
        self.policy, self.heads = policy, heads
        self.device = policy.model.embed_tokens.weight.device
        if compile is None:
            compile = sum(p.numel() for p in policy.parameters()) >= AUTO_COMPILE_MIN_PARAMS
        self.compiled = bool(compile)
        self.freeze = freeze and self.device.type == "cpu"
        self.compile_times: dict[tuple, float] = {}  # (function, shapes) -> seconds of its first call
        self._build()

    def _build(self) -> None:
        self._target, self._head = self._target_body, self._head_body
        if not self.compiled:
            return
        _configure_dynamo()
        if self.device.type == "cpu":
            torch._inductor.config.freezing = self.freeze
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self._target = torch.compile(self._target_body, dynamic=False, mode=mode)
        self._head = torch.compile(self._head_body, dynamic=False, mode=mode)

    def set_heads(self, heads: MTPHeads | None) -> None:
        self.heads = heads
        self.weights_changed()

    def weights_changed(self) -> None:
        """Frozen graphs hold the old weights as constants: drop them (the next call recompiles)."""
        if self.compiled and self.freeze:
            torch._dynamo.reset()
            self.compile_times.clear()
            self._build()

    # ------------------------------------------------------------------ bodies
    def _target_body(self, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.policy.hidden_states(tokens, cache, start)

    def _head_body(self, j: int, prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   cache: KVCache) -> torch.Tensor:
        return self.heads.depth_forward(j, self.policy, prev, tokens, positions, cache)

    # ------------------------------------------------------------------ calls
    def target(self, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache) -> torch.Tensor:
        # tokens [B, T] at positions start[b] .. start[b]+T-1 -> hidden [B, T, d]
        key = ("target", tuple(tokens.shape), cache.max_len)
        return self._call(key, self._target, tokens, start, cache)

    def head(self, j: int, prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             cache: KVCache) -> torch.Tensor:
        # depth j (0-based); prev [B, T, d]; tokens, positions [B, T] -> [B, T, d]
        key = (f"head{j}", tuple(tokens.shape), cache.max_len)
        return self._call(key, self._head, j, prev, tokens, positions, cache)

    def _call(self, key, fn, *args):
        if not self.compiled:
            return fn(*args)
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
