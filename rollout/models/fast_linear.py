"""Linear layers for bfloat16 inference on CPU through oneDNN's prepacked weights.

`F.linear` in bfloat16 on a CPU re-lays the weight out for oneDNN on every call: at decode
shapes (a few rows, SmolLM2's 576 x 1536 matrices) that costs as much as the product itself.
Packing each weight once (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's `freezing`
does inside compiled graphs) made those products ~2x faster and flat in the row count from 1 to
16 (measurements: docs/performance.md), so a k+1-token verification costs about one step, with
results bit-identical to `F.linear`. Large inputs (prefill, teacher forcing) keep
`F.linear`, which is faster there.

Packed copies sit in a cache keyed by the weight tensor (held weakly: a freed weight frees its
copy) and are rebuilt when the weight changes (its version counter moves on every in-place
update, e.g. a policy or head sync), so callers never invalidate anything by hand. Training (grad enabled on the input or weight) always takes
`F.linear`.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rollout.models.dtypes import preferred_dtype

PACKED_MAX_ROWS = 64   # inputs with more rows than this take F.linear (faster for prefill-sized inputs)


def _packing_supported() -> bool:
    return preferred_dtype("cpu") == torch.bfloat16     # oneDNN computes bf16 natively on this CPU


_SUPPORTED: bool | None = None


def _use_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    global _SUPPORTED
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if torch.compiler.is_compiling() or x.numel() // max(x.shape[-1], 1) > PACKED_MAX_ROWS:
        return False
    if _SUPPORTED is None:
        _SUPPORTED = _packing_supported()
    return _SUPPORTED


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:          # an inference tensor tracks no version: it is never updated in place here
        return -1


# ids of the weights -> (weak references to them, (data_ptr, version) of each when packed, packed copy)
_PACKED: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], tuple, torch.Tensor]] = {}


def packed_weight(*weights: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of `weights` [N_i, K] stacked along N ([sum N_i, K]), made on first use and
    after any in-place change of any of them."""
    ids = tuple(id(w) for w in weights)
    key = tuple((w.data_ptr(), _version(w)) for w in weights)
    entry = _PACKED.get(ids)
    if entry is not None and all(r() is w for r, w in zip(entry[0], weights)) and entry[1] == key:
        return entry[2]
    with torch.no_grad():
        stacked = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        packed = torch.ops.mkldnn._reorder_linear_weight(stacked, 1)
    refs = tuple(weakref.ref(w, lambda _, i=ids: _PACKED.pop(i, None)) for w in weights)
    _PACKED[ids] = (refs, key, packed)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K]; packed where that is faster."""
    if not _use_packed(x, weight):
        return F.linear(x, weight, bias)
    y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight(weight), None, "none", [], "")
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
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight(*weights), bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose inference forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
