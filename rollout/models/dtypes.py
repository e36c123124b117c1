"""The one parser of dtype names in configs (`float32`, `bfloat16`, `float16`).

It sits at the bottom layer because loaders, weight shipping, workers and trainers all turn
a config string into a torch.dtype, and they must agree on the names and the error.
"""
from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """torch dtype of a config name; ValueError listing the choices otherwise."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
