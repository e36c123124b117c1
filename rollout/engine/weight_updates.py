"""Loading new policy or head weights into an engine's torch modules, checked the same way in
both engines: a bad name or shape, or non-finite policy weights, are refused with a message naming
them, before anything changes. (Non-finite head weights are not refused: bad heads may only slow
decoding, never stop it; each engine drafts nothing, or nothing useful, from them and counts it.)"""
from __future__ import annotations

import torch

from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM
from rollout.models.hf_loader import check_finite

DRAFT_VOCAB = "draft_vocab"   # the heads' draft-vocabulary buffer: its length may change on a refresh


def load_policy_update(policy: CausalLM, state_dict: dict) -> dict[str, torch.Tensor]:
    """Load a full or partial policy state dict in place; returns the tensors that were loaded
    (a tied LM head is dropped: it is the embedding)."""
    sd = {k: torch.as_tensor(v) for k, v in state_dict.items()}
    if policy.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    own = policy.state_dict()
    unknown = [k for k in sd if k not in own]
    wrong = [k for k in sd if k in own and sd[k].shape != own[k].shape]
    if unknown or wrong:
        raise ValueError(f"policy weights do not match the {policy.config.architecture} config: unknown "
                         f"{unknown[:5]}, wrong shape {wrong[:5]}")
    check_finite(sd, "policy update")         # NaN weights would decode garbage silently
    policy.load_state_dict(sd, strict=False)   # partial updates are fine
    return sd


def load_heads_update(heads: MTPHeads | None, state_dict: dict) -> None:
    """Load a head state dict in place (the draft vocabulary may change size)."""
    if heads is None:
        raise ValueError("this engine has no heads to update; construct it with heads first")
    sd = {k: torch.as_tensor(v) for k, v in state_dict.items()}
    own = heads.state_dict()
    wrong = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in sd.items()
             if k in own and k != DRAFT_VOCAB and v.shape != own[k].shape}
    if wrong:
        raise ValueError(f"head weights do not fit this policy (name: given shape, expected): "
                         f"{dict(list(wrong.items())[:3])}; train or load heads for this policy")
    missing = sorted(set(own) - set(sd) - {DRAFT_VOCAB})
    unexpected = sorted(set(sd) - set(own) - {DRAFT_VOCAB})
    if missing or unexpected:       # checked before load_state_dict, which sets the draft vocabulary first
        raise ValueError(f"head weights do not match these heads ({heads.num_depths} depths, {heads.num_layers} "
                         f"layers per depth; a different layout needs a new engine): missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    heads.load_state_dict(sd)
