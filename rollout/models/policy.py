"""Load a policy model ready to decode: weights from any loader into our decoder."""
from __future__ import annotations

from rollout.models.decoder import CausalLM, build_model
from rollout.models.dtypes import parse_dtype
from rollout.models.loaders import DEFAULT_MODEL, LoadedModel, load_model


def load_policy(spec: str = DEFAULT_MODEL, dtype: str = "float32") -> tuple[CausalLM, LoadedModel]:
    """spec: a named model (default SmolLM2-135M-Instruct), a .gguf file or an HF directory."""
    loaded = load_model(spec)
    return build_model(loaded.config, loaded.state_dict, parse_dtype(dtype)), loaded
