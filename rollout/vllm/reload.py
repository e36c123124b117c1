"""In-place weight refreshes, run inside vLLM's worker through `llm.collective_rpc` (no restart)."""
from __future__ import annotations

import torch


def reload_drafter(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """New head weights (our `depths.0.*` names, plus the draft vocabulary) into the running drafter."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    drafter = worker.model_runner.drafter
    with set_current_vllm_config(worker.vllm_config):
        reload_weights(worker.vllm_config, drafter.model, iter(weights), None, is_checkpoint_format=True)
    return len(weights)


def reload_policy(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """worker.reload_weights, then re-derive a tied LM head's kernel: the loader skips `lm_head.*` when
    embeddings are tied, so on CPU its prepacked GEMM weight (built from the old embedding) stays stale."""
    from vllm.config import set_current_vllm_config

    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and getattr(model.config, "tie_word_embeddings", False):
        with set_current_vllm_config(worker.vllm_config):
            lm_head.quant_method.process_weights_after_loading(lm_head)
    return len(weights)
