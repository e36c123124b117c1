"""The held-out rule shared by every source: decided per conversation or prompt key, by hash.

A key's side never depends on reading order, on how much data a build uses or on the model,
so the held-out conversations and prompts stay unseen by every training run.
"""
from __future__ import annotations

import hashlib


def is_heldout(key: str, fraction: float, salt: str = "heldout-v1") -> bool:
    """True iff hash(salt, key) falls in the first `fraction` of the hash range."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    h = int.from_bytes(hashlib.sha256(f"{salt}:{key}".encode()).digest()[:8], "big")
    return h < fraction * 2 ** 64


def split_of(key: str, fraction: float) -> str:
    return "heldout" if is_heldout(key, fraction) else "train"
