"""The two drafter kinds, MTP heads and an EAGLE-3 drafter, rebuilt from flat weights wherever weights are
shipped (rollout workers, the co-trainer, a resumed run): the one place that tells them apart.

A flat buffer holds tensors only; what rebuilding a drafter also needs travels beside it as a DrafterSpec:
MTP heads' depth count, or an EAGLE-3 drafter's config.json (its layer's shape, the policy layers its fc
reads, its draft vocabulary size). The spec is plain data (ints, lists, dicts), so it goes into Ray
calls and checkpoints as it is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mtp_heads.eagle3 import Eagle3Drafter
from mtp_heads.eagle3_checkpoint import config_dict, eagle3_from_tensors
from mtp_heads.eagle3_drafter import Eagle3Heads
from mtp_heads.heads import MTPHeads, heads_from_flat
from rollout.models.config import ModelConfig
from rollout.models.dtypes import parse_dtype
from rollout.models.flat_weights import FlatWeights, unpack

EAGLE3_WEIGHT = "fc.weight"     # the tensor only an EAGLE-3 drafter has (it fuses the aux states)


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter's flat weights do not say: MTP heads' depths, or an EAGLE-3 drafter's config.json."""

    num_depths: int = 1                 # MTP heads: depths D (an EAGLE-3 drafter has one recurrent layer)
    eagle3_config: dict | None = None   # EAGLE-3: its config.json (eagle3_checkpoint.config_dict); None = MTP heads

    @property
    def kind(self) -> str:
        return "mtp" if self.eagle3_config is None else "eagle3"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterSpec":
        return cls(**d)


def drafter_spec(drafter: MTPHeads | Eagle3Heads | Eagle3Drafter) -> DrafterSpec:
    """The spec that rebuilds `drafter` from its state dict (drafter_from_flat)."""
    inner = drafter.drafter if isinstance(drafter, Eagle3Heads) else drafter
    if isinstance(inner, Eagle3Drafter):
        return DrafterSpec(num_depths=1, eagle3_config=config_dict(inner))
    return DrafterSpec(num_depths=drafter.num_depths)


def drafter_from_flat(policy_config: ModelConfig, spec: DrafterSpec, flat: FlatWeights, dtype: str = "float32",
                      device: str = "cpu", where: str = "shipped drafter weights") -> MTPHeads | Eagle3Heads:
    """The drafter the engines draft with (MTPHeads or Eagle3Heads) holding the shipped weights; weights of
    the other kind than the spec's, or that do not fit it, are refused naming `where`."""
    state = unpack(flat)
    if (EAGLE3_WEIGHT in state) != (spec.kind == "eagle3"):
        has = "hold" if EAGLE3_WEIGHT in state else "lack"
        raise ValueError(f"{where}: the spec is {spec.kind} but the weights {has} {EAGLE3_WEIGHT} (EAGLE-3's)")
    if spec.kind == "mtp":
        return heads_from_flat(policy_config, spec.num_depths, flat, dtype, device)
    drafter = eagle3_from_tensors(spec.eagle3_config, state, policy_config, where)
    return Eagle3Heads(drafter.to(device=device, dtype=parse_dtype(dtype)))


def trained_module(drafter: MTPHeads | Eagle3Heads) -> MTPHeads | Eagle3Drafter:
    """The module a trainer optimises and computes losses with: Eagle3Heads is the engine's view of an
    Eagle3Drafter, whose own methods the EAGLE-3 losses call."""
    return drafter.drafter if isinstance(drafter, Eagle3Heads) else drafter
