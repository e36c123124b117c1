"""Speculative rollouts for RL: models, engines, workers, the monitor and the facade.

`rollout.RolloutAccelerator` is resolved lazily, so that `import rollout.verify` (or any
low layer) does not pull in Ray and the trainers.
"""
from __future__ import annotations

from typing import Any

__all__ = ["RolloutAccelerator"]


def __getattr__(name: str) -> Any:
    if name == "RolloutAccelerator":
        from rollout.accelerator import RolloutAccelerator

        return RolloutAccelerator
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
