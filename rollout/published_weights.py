"""The latest policy and head weights as Ray object refs: what a fresh or respawned actor loads.

A sync may send only the trained tensors, but an actor started after it (a replacement for a
dead worker, a restarted co-trainer) needs the whole current policy. This keeps a CPU copy of
the full state dict, applies each partial update to it, and re-packs it into the object store
only when an actor actually has to be spawned (most runs never re-pack).
"""
from __future__ import annotations

import ray
import torch

from mtp_heads.drafters import DrafterSpec
from rollout.models.config import ModelConfig
from rollout.models.flat_weights import FlatWeights, pack


class PublishedWeights:
    """Versions and object refs of the newest policy and heads, and the spec that rebuilds the heads
    (their kind does not change in a run). Not thread-safe on its own: the facade calls it under its lock."""

    def __init__(self, policy_config: ModelConfig, policy_state: dict[str, torch.Tensor],
                 heads_state: dict[str, torch.Tensor], drafter: DrafterSpec, *,
                 policy_version: int = 0, head_version: int = 0):
        self.policy_config = policy_config
        self.drafter = drafter          # what rebuilds the heads from heads_ref (MTP heads or an EAGLE-3 drafter)
        self._policy_state = {k: v.detach().to("cpu", copy=True) for k, v in policy_state.items()}
        self._shapes = {k: tuple(v.shape) for k, v in self._policy_state.items()}
        self._full_ref: ray.ObjectRef | None = None
        self.policy_version = policy_version
        self.heads_ref: ray.ObjectRef = ray.put(pack(heads_state))
        self.head_version = head_version

    def check_policy_update(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """A sync must use the policy's own (HF) names and shapes; fail before anything is sent."""
        tied = self.policy_config.tie_word_embeddings
        unknown = [k for k in named_tensors if k not in self._shapes and not (tied and k == "lm_head.weight")]
        bad = [k for k, t in named_tensors.items() if k in self._shapes and tuple(t.shape) != self._shapes[k]]
        if unknown or bad:
            raise ValueError(f"sync_policy: names not in the policy {unknown[:5]}, wrong shapes {bad[:5]}; "
                             "send the policy's own state_dict names (HF naming)")

    def set_policy(self, named_tensors: dict[str, torch.Tensor], version: int) -> ray.ObjectRef:
        """Record a (partial) policy update; returns the ref of just these tensors, for broadcast."""
        self.check_policy_update(named_tensors)
        ref = ray.put(pack(named_tensors))
        with torch.no_grad():
            for k, t in named_tensors.items():
                if k in self._policy_state:
                    self._policy_state[k].copy_(t)
        self._full_ref = None          # re-packed only if an actor must be respawned
        self.policy_version = version
        return ref

    def full_policy_ref(self) -> ray.ObjectRef:
        """The whole current policy in the object store (packed on first need after a sync)."""
        if self._full_ref is None:
            self._full_ref = ray.put(pack(self._policy_state))
        return self._full_ref

    def set_heads(self, flat: FlatWeights, version: int) -> ray.ObjectRef:
        self.heads_ref = ray.put(flat)
        self.head_version = version
        return self.heads_ref
