"""Where `rollout.workers` imports the vLLM engine from; the engine lives in the rollout.vllm package."""
from rollout.vllm import VLLMEngine, VLLMEngineConfig

__all__ = ["VLLMEngine", "VLLMEngineConfig"]
