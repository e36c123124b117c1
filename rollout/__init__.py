"""mtp-rollout: speculative RL rollouts with MTP draft heads, a head co-trainer and an acceptance monitor.

The supported surface is what this module exports (`rollout.__all__`, docs/api.md); the internal
layout below it may move between versions. Names resolve lazily, so `import rollout` stays cheap
and a low layer (`import rollout.models`) never pulls in Ray, the engines or the trainers.

    from rollout import TorchEngine, SamplingParams, load_policy, load_shipped_heads, apply_chat_template
    policy, loaded = load_policy()                       # SmolLM2-135M-Instruct, the machine's fastest dtype
    heads, meta = load_shipped_heads(policy, "smollm2-135m")
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS = {
    # decoding
    "TorchEngine": "rollout.torch_engine",
    "EngineConfig": "rollout.engine.config",
    "SamplingParams": "rollout.types",
    "Completion": "rollout.types",
    "RolloutBatch": "rollout.types",
    "SpecDecodingStats": "rollout.types",
    "rejection_sample": "rollout.verify",
    # models
    "load_policy": "rollout.models.loaders",
    "load_model": "rollout.models.loaders",
    "apply_chat_template": "rollout.models.loaders",
    "DEFAULT_MODEL": "rollout.models.loaders",
    # draft heads
    "MTPHeads": "mtp_heads.heads",
    "init_heads": "mtp_heads.heads",
    "load_shipped_heads": "mtp_heads.shipped",
    "resolve_heads": "mtp_heads.shipped",
    "load_heads": "mtp_heads.checkpoint",
    "save_heads": "mtp_heads.checkpoint",
    # the runtime facade for your own RL loop, and the monitor
    "RolloutAccelerator": "rollout.accelerator",
    "AcceleratorConfig": "rollout.accelerator",
    "CoTrainerConfig": "mtp_heads.cotrainer",
    "AcceptanceMonitor": "rollout.monitor",
    "MonitorConfig": "rollout.monitor",
    "fit_slope": "rollout.monitor",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value          # resolved once
        return value
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
