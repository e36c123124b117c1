"""One entry point for every model source: a named model, a .gguf file or an HF directory.

Re-exports the loaders' public API so callers import from one place.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from rollout.models.decoder import CausalLM, build_model
from rollout.models.default_model import cache_dir, default_model_path
from rollout.models.dtypes import AUTO, parse_dtype
from rollout.models.gguf_loader import llama_cpp_permute, llama_cpp_unpermute, load_gguf
from rollout.models.hf_loader import (LoadedModel, config_from_hf, expected_tensor_shapes, export_hf_dir,
                                      load_hf_dir)
from rollout.models.tokenizer import apply_chat_template, bpe_tokenizer, render_chat

DEFAULT_MODEL = "smollm2-135m"

# name -> path of its file, fetched on first use
NAMED_MODELS: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: default_model_path,
}


def load_model(spec: str | os.PathLike = DEFAULT_MODEL) -> LoadedModel:
    """spec: a name in NAMED_MODELS, a path to a .gguf file, or a path to an HF directory."""
    if isinstance(spec, str) and spec in NAMED_MODELS:
        return load_gguf(NAMED_MODELS[spec]())
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir():
        return load_hf_dir(path)
    raise ValueError(f"unknown model {str(spec)!r}: expected one of {sorted(NAMED_MODELS)}, "
                     "a path to a .gguf file or a path to an HF model directory")


def load_policy(spec: str | os.PathLike = DEFAULT_MODEL, dtype: str = AUTO,
                device: str = "cpu") -> tuple[CausalLM, LoadedModel]:
    """A policy ready to decode, and what it was loaded from (tokenizer, chat template, source).

    spec: as load_model. dtype: "auto" (default) takes the machine's fastest decoding dtype
    (bfloat16 where the hardware computes it natively, else float32), as every command does;
    pass "float32" for exact-equality checks.
    """
    loaded = load_model(spec)
    return build_model(loaded.config, loaded.state_dict, parse_dtype(dtype, device), device), loaded


__all__ = [
    "DEFAULT_MODEL", "NAMED_MODELS", "LoadedModel", "apply_chat_template", "bpe_tokenizer", "cache_dir",
    "config_from_hf", "default_model_path", "expected_tensor_shapes", "export_hf_dir", "llama_cpp_permute",
    "llama_cpp_unpermute", "load_gguf", "load_hf_dir", "load_model", "load_policy", "render_chat",
]
