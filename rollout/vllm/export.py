"""Directories vLLM loads: the policy as an HF model, the MTP heads as our drafter model.

vLLM 0.32 reads neither GGUF nor in-memory modules, so both sides are written to disk once
per vLLM start; refreshes go through vLLM's weight-transfer API (weight_transfer.py), never
through these files.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM
from rollout.models.hf_loader import LoadedModel, export_hf_dir, hf_config_dict
from rollout.vllm.drafter import ARCHITECTURE, DRAFT_VOCAB


def export_policy_dir(policy: CausalLM, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """config.json + model.safetensors of the policy (no tokenizer: the engine passes token ids)."""
    loaded = LoadedModel(policy.config, dict(policy.state_dict()), None, None, "mtp-rollout policy")
    return export_hf_dir(loaded, out_dir, dtype=dtype, overwrite=True)


def drafter_state_dict(heads: MTPHeads | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Depth-1 tensors under our own names (`depths.0.*`): vLLM reuses one module for all k drafts."""
    sd = heads.state_dict() if isinstance(heads, MTPHeads) else heads
    return {k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in sd.items() if k.startswith("depths.0.")}


def finite_drafter_weights(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """NaN/inf entries of drafter weights replaced by 0, and the names of the tensors that had any.

    vLLM's samplers are not guarded against a non-finite q the way our engine's round is (which
    drafts nothing for such a row): zeroed weights still give a finite q, so verification stays
    lossless and only acceptance drops; the engine counts those rounds (nonfinite_draft_rounds)."""
    bad = [k for k, v in sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if not bad:
        return sd, []
    return {k: torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0) if k in bad else v for k, v in sd.items()}, bad


def export_drafter_dir(heads: MTPHeads, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """The policy's config.json with our drafter architecture and depth 1's layers, plus its weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(heads.policy_config, dtype)
    cfg.update(architectures=[ARCHITECTURE], num_hidden_layers=heads.num_layers,
               mtp_rollout_num_layers=heads.num_layers, mtp_rollout_num_depths=heads.num_depths,
               mtp_rollout_policy_fingerprint=heads.policy_fingerprint)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: v.to(dtype) for k, v in finite_drafter_weights(drafter_state_dict(heads))[0].items()}
    vocab = getattr(heads, DRAFT_VOCAB, None)
    if vocab is not None:
        tensors[DRAFT_VOCAB] = vocab.detach().to(device="cpu", dtype=torch.int64).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
