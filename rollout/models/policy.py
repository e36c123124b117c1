"""Load a policy model ready to decode: weights from any loader into our decoder."""
from __future__ import annotations

import torch

from rollout.models.decoder import CausalLM, build_model
from rollout.models.loaders import DEFAULT_MODEL, LoadedModel, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_policy(spec: str = DEFAULT_MODEL, dtype: str = "float32") -> tuple[CausalLM, LoadedModel]:
    """spec: a named model (default SmolLM2-135M-Instruct), a .gguf file or an HF directory."""
    loaded = load_model(spec)
    return build_model(loaded.config, loaded.state_dict, parse_dtype(dtype)), loaded
