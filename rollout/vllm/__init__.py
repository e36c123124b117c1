"""The vLLM engine: our policy and MTP heads on real vLLM (see engine.py for the map of modules).

Importing this package does not import vLLM; starting an engine does.
"""
from rollout.vllm.engine import DRAFT_METHODS, DRAFT_SAMPLE_METHODS, VLLMEngine, VLLMEngineConfig
from rollout.vllm.install import VLLM_FIX, require_vllm

__all__ = ["DRAFT_METHODS", "DRAFT_SAMPLE_METHODS", "VLLMEngine", "VLLMEngineConfig", "VLLM_FIX", "require_vllm"]
