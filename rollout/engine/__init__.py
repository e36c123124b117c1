"""The torch engine's parts: config, static-cache state, compiled forwards, the decode round,
adaptive k. `rollout.torch_engine.TorchEngine` puts them together."""
