"""Our MTP heads as a vLLM drafter model: the same function as `mtp_heads.heads.MTPDepth`.

vLLM's EAGLE proposer calls a drafter k times per step: once over every newly committed
position (target hidden state h_i paired with token x_{i+1}, at position i) and then k-1
times on its own output (hidden of the last step, the draft token, position + 1), reusing
one module and one KV cache. That is exactly our torch engine with one depth (D = 1):

    h^1_i = norm(block(eh_proj([enorm(emb(x_{i+1})), hnorm(h_i)]))),   q = softmax(W h^1_i / T)

No in-tree vLLM drafter computes this: EAGLE-1 has no enorm/hnorm/final norm and drops the
block's input norm; MiMo/DeepSeek MTP zero the embedding at position 0, feed [h, e] and need
the target to ship MTP layers (MiMo: a Qwen2 block with q/k/v biases). So the heads are
registered as an out-of-tree model (`ModelRegistry.register_model`, vLLM's documented
mechanism) under an `Eagle...` architecture name so that the `eagle` method loads them, and
the hidden state fed back to the next step is the post-norm one, as in our engine.
Heads with D > 1 depths: vLLM reuses one module recursively, so only depth 1 is exported.
A reduced draft vocabulary is applied as a -inf mask on the full LM-head logits: the same q as
the torch engine, without its saving of LM-head rows.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

ARCHITECTURE = "EagleMtpRolloutDrafter"
DRAFT_VOCAB = "draft_vocab"              # checkpoint tensor [N] int64 (mtp_heads.checkpoint's name)   # "Eagle" prefix: vLLM's EAGLEConfig keeps the name as is

# HF names of a decoder layer -> (vLLM stacked parameter, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def _llama_block(vllm_config, config, prefix: str) -> nn.Module:
    from vllm.model_executor.models.llama import LlamaDecoderLayer
    return LlamaDecoderLayer(vllm_config, prefix=prefix, config=config)


def _qwen2_block(vllm_config, config, prefix: str) -> nn.Module:
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer
    return Qwen2DecoderLayer(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix)


def _qwen3_block(vllm_config, config, prefix: str) -> nn.Module:
    from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
    return Qwen3DecoderLayer(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix)


# HF model_type of the policy -> the vLLM decoder layer our head block is (same weights, same math)
BLOCK_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "llama": _llama_block,
    "qwen2": _qwen2_block,
    "qwen3": _qwen3_block,
}


class _Depth(nn.Module):
    """One MTP depth with vLLM layers; parameter names follow `MTPDepth` (blocks.i.* stacked)."""

    def __init__(self, vllm_config, config, block_prefixes: list[str]):
        super().__init__()
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import ReplicatedLinear

        d = config.hidden_size
        # the eagle method wraps the drafter's config.json in EAGLEConfig (model_type "eagle")
        model_type = getattr(getattr(config, "model", None), "model_type", config.model_type)
        if model_type not in BLOCK_BUILDERS:
            raise ValueError(f"no vLLM block for policy model_type {model_type!r}; "
                             f"supported: {sorted(BLOCK_BUILDERS)}")
        self.enorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * d, d, bias=False, params_dtype=vllm_config.model_config.dtype,
                                        prefix=f"{block_prefixes[0]}.eh_proj", return_bias=False)
        # one attention layer (and KV cache) per block; vLLM wants one layer index in each name
        self.blocks = nn.ModuleList(BLOCK_BUILDERS[model_type](vllm_config, config, p) for p in block_prefixes)
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        # embeds, prev_hidden [N, d] (flattened tokens); positions [N] -> post-norm hidden [N, d]
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        residual = None
        for block in self.blocks:           # vLLM layers pass (output, residual) on, fused-add norms
            x, residual = block(positions, x, residual)
        return self.norm(x + residual)


class _Body(nn.Module):
    """`embed_tokens` is not a parameter here: the proposer installs the target's module."""

    def __init__(self, vllm_config, config, prefix: str, first_layer: int):
        super().__init__()
        # the attention layer names must not collide with the target's layers 0..L-1
        inner = getattr(config, "model", None)      # EAGLEConfig may keep config.json's keys on .model
        layers = getattr(config, "mtp_rollout_num_layers", None) or getattr(inner, "mtp_rollout_num_layers", 1)
        prefixes = [f"{prefix}.layers.{first_layer + i}" for i in range(layers)]
        self.depths = nn.ModuleList([_Depth(vllm_config, config, prefixes)])


class MtpRolloutDrafter(nn.Module):
    """vLLM model class for the `eagle` method; forward returns (hidden for logits, hidden fed back)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        config = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = config
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = _Body(vllm_config, config, f"{prefix}.model" if prefix else "model", target_layers)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # reduced draft vocabulary (EAGLE-3 style): token ids [N]; q = 0 elsewhere. A plain attribute,
        # not a buffer, so vLLM's layerwise reload leaves it alone; set by load_weights (also on refresh).
        self.draft_vocab: torch.Tensor | None = None
        self._draft_bias: torch.Tensor | None = None
        # lm_head and model.embed_tokens are the target's, installed by the proposer's load_model
        # (no `has_own_lm_head` / `has_own_embed_tokens` attribute = shared, as for MTP drafters)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # input_ids [N]; positions [N]; hidden_states [N, d] -> ([N, d], [N, d])
        embeds = inputs_embeds if inputs_embeds is not None else self.model.embed_tokens(input_ids)
        out = self.model.depths[0](embeds, positions, hidden_states)
        return out, out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [N, d] -> [N, V]; with a draft vocabulary, -inf outside it (same q as MTPHeads.draft_logits)
        logits = self.logits_processor(self.lm_head, hidden_states)
        if self.draft_vocab is None or logits is None:
            return logits
        if self._draft_bias is None or self._draft_bias.device != logits.device:
            bias = torch.full((logits.shape[-1],), float("-inf"), dtype=logits.dtype, device=logits.device)
            self._draft_bias = bias.index_fill_(0, self.draft_vocab.to(logits.device), 0.0)
        return logits + self._draft_bias

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads `depths.0.*` names (our state dict); deeper depths are ignored (see module doc)."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == DRAFT_VOCAB:   # empty = full vocabulary (a refresh may clear it)
                ids = tensor.to(torch.long).flatten().cpu()
                self.draft_vocab, self._draft_bias = (ids if ids.numel() else None), None
                continue
            name = name.removeprefix("model.")
            if not name.startswith("depths.0."):
                continue
            name = "model." + name
            for hf, (stacked, shard) in _STACKED.items():
                if hf in name:
                    target = name.replace(hf, stacked)
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                target = name
                if target not in params:
                    raise ValueError(f"unexpected drafter weight {name!r}: not an MTP depth parameter")
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded


def register() -> None:
    """Make the architecture, and our CPU weight-transfer backend (rollout.vllm.weight_transfer), known
    to vLLM in this process (idempotent); vLLM runs it in every process it starts (general plugin)."""
    from vllm import ModelRegistry

    from rollout.vllm.weight_transfer import register_backend

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MtpRolloutDrafter)
    register_backend()
