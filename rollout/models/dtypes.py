"""The one parser of dtype names in configs (`float32`, `bfloat16`, `float16`, `auto`).

It sits at the bottom layer because loaders, weight shipping, workers and trainers all turn
a config string into a torch.dtype, and they must agree on the names and the error.
"""
from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"   # the hardware's best decoding dtype (preferred_dtype)


def preferred_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bfloat16 where the hardware computes it natively (CUDA with bf16, CPUs with AVX-512 bf16 /
    AMX, as oneDNN reports), float32 elsewhere: emulated bf16 is slower than float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float32


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """torch dtype of a config name (`auto` = preferred_dtype(device)); ValueError listing the choices otherwise."""
    if name == AUTO:
        return preferred_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted([*DTYPES, AUTO])}, got {name!r}")
    return DTYPES[name]


def dtype_name(name: str, device: str | torch.device = "cpu") -> str:
    """The concrete name a config name stands for (`auto` resolved), for logs and exports."""
    return str(parse_dtype(name, device)).removeprefix("torch.")
