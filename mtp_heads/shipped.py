"""The draft heads shipped inside the package, per default model: no training on first use.

mtp_heads/default_heads/<model>.safetensors (bf16, with a model card <model>.md beside it) is
made by `mtp-rollout train-heads heads_smollm2` (configs/heads_smollm2.yaml); load it with
`load_shipped_heads(policy, "smollm2-135m")`. Other policies get heads through the same preset
machinery (experiments.pretrain_heads.load_or_train_default_heads), trained on first use.
"""
from __future__ import annotations

from pathlib import Path

from mtp_heads.checkpoint import HeadMeta, load_heads
from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM

SHIPPED_DIR = Path(__file__).resolve().parent / "default_heads"
SHIPPED: dict[str, str] = {          # model spec -> file in SHIPPED_DIR
    "smollm2-135m": "smollm2-135m.safetensors",
}


def shipped_heads_path(model_spec: str) -> Path | None:
    """The shipped heads file for a model spec, or None when the package ships none for it."""
    name = SHIPPED.get(str(model_spec))
    path = SHIPPED_DIR / name if name else None
    return path if path is not None and path.is_file() else None


def load_shipped_heads(policy: CausalLM, model_spec: str) -> tuple[MTPHeads, HeadMeta] | None:
    """The shipped heads in the policy's dtype, or None when none are shipped for `model_spec`;
    ValueError when they exist but were trained for another architecture."""
    path = shipped_heads_path(model_spec)
    return None if path is None else load_heads(path, policy)
