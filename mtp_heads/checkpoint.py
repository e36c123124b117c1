"""MTP-head checkpoints: safetensors weights plus a JSON header naming the policy they draft for.

Heads only make sense for the policy architecture they were trained against, so every
checkpoint carries that policy's fingerprint, hidden size and vocabulary size and loading
refuses a mismatch with the command that fixes it. The header lives in the safetensors
metadata (authoritative) and in a sidecar ``<name>.json`` for people and shell tools.

A checkpoint may also hold ``draft_vocab`` [N] int64: the token ids the heads may propose
(q = 0 elsewhere, EAGLE-3's reduced draft vocabulary), the heads' own state-dict buffer.

Loading refuses weights holding NaN or inf, naming the file and the tensor.

Writes are atomic: each file goes to a temporary name in the same directory and is moved into
place with os.replace, weights first, so a crash leaves the previous checkpoint readable.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from mtp_heads.heads import MTPHeads
from rollout.fileio import atomic_write
from rollout.models.decoder import CausalLM
from rollout.models.default_model import cache_dir
from rollout.models.hf_loader import check_finite

META_KEY = "mtp_rollout_heads"
DRAFT_VOCAB_KEY = "draft_vocab"
FORMAT_VERSION = 2                       # what save_heads writes
SUPPORTED_FORMAT_VERSIONS = (FORMAT_VERSION,)   # what read_meta accepts (format 1 named `depths.j.block.*`)


@dataclass(frozen=True)
class HeadMeta:
    """What a head checkpoint was built for and how it was trained."""

    policy_fingerprint: str
    hidden_size: int
    vocab_size: int
    num_depths: int
    loss: str = "unknown"
    num_layers: int = 1                  # decoder layers per depth (checkpoints before it had one)
    steps: int = 0
    head_version: int = 0
    created: float = 0.0                 # unix time of the write; 0 = fill in on save
    model_spec: str = ""                 # e.g. "smollm2-135m" or a path
    draft_vocab_size: int = 0            # 0 = full vocabulary
    format_version: int = FORMAT_VERSION
    notes: str = ""                      # free text (training settings, data key)

    @classmethod
    def for_heads(cls, heads: MTPHeads, **kw) -> "HeadMeta":
        cfg = heads.policy_config
        return cls(policy_fingerprint=cfg.fingerprint(), hidden_size=cfg.hidden_size,
                   vocab_size=cfg.vocab_size, num_depths=heads.num_depths,
                   num_layers=heads.num_layers, **kw)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "HeadMeta":
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def draft_vocab_of(heads: MTPHeads) -> torch.Tensor | None:
    """The heads' draft vocabulary [N] int64 (sorted token ids), or None for the full vocabulary."""
    return getattr(heads, DRAFT_VOCAB_KEY, None)


def set_draft_vocab(heads: MTPHeads, draft_vocab: torch.Tensor | None) -> MTPHeads:
    """Attach (or clear with None) a draft vocabulary (MTPHeads.set_draft_vocab); returns the heads."""
    heads.set_draft_vocab(draft_vocab)
    return heads


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".json")


def save_heads(path: str | os.PathLike, heads: MTPHeads, meta: HeadMeta) -> HeadMeta:
    """Write heads (+ draft vocabulary) and meta atomically; returns the meta actually written."""
    path = Path(path)
    cfg = heads.policy_config
    expected = (cfg.fingerprint(), cfg.hidden_size, cfg.vocab_size, heads.num_depths, heads.num_layers)
    given = (meta.policy_fingerprint, meta.hidden_size, meta.vocab_size, meta.num_depths, meta.num_layers)
    if expected != given:
        raise ValueError(f"HeadMeta {given} does not describe these heads {expected} (fingerprint, hidden "
                         "size, vocab size, depths, layers per depth); build it with HeadMeta.for_heads")
    vocab = draft_vocab_of(heads)
    meta = _replace(meta, created=meta.created or time.time(), format_version=FORMAT_VERSION,
                    draft_vocab_size=0 if vocab is None else int(vocab.numel()))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    if vocab is not None:
        tensors[DRAFT_VOCAB_KEY] = vocab.to("cpu", torch.long).contiguous()
    header = meta.to_json()
    atomic_write(path, save(tensors, metadata={META_KEY: header}))
    atomic_write(sidecar_path(path), json.dumps(json.loads(header), indent=2, sort_keys=True) + "\n")
    return meta


def _replace(meta: HeadMeta, **changes) -> HeadMeta:
    return HeadMeta(**{**asdict(meta), **changes})


def read_meta(path: str | os.PathLike) -> HeadMeta:
    """The header of a head checkpoint, without loading the weights."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no head checkpoint at {path}; train one with `mtp-rollout train-heads`")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = (f.metadata() or {}).get(META_KEY)
    except Exception as e:  # noqa: BLE001 - safetensors' errors do not name the file
        raise ValueError(f"{path} is not a readable head checkpoint ({type(e).__name__}: {e})") from None
    if header is None:
        raise ValueError(f"{path} is a safetensors file without an MTP-head header ({META_KEY!r}); "
                         "it was not written by mtp_heads.checkpoint.save_heads")
    try:
        raw = json.loads(header)
        version = raw.get("format_version") if isinstance(raw, dict) else None
        meta = None if version not in SUPPORTED_FORMAT_VERSIONS else HeadMeta.from_json(header)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: the MTP-head header is not valid JSON metadata ({e})") from None
    if meta is None:
        supported = ", ".join(map(str, SUPPORTED_FORMAT_VERSIONS))
        raise ValueError(f"{path}: head checkpoint format_version {version!r} is not supported (this version of "
                         f"mtp-rollout reads format_version {supported}); re-train them with `mtp-rollout train-heads`")
    return meta


def check_meta(meta: HeadMeta, policy: CausalLM, where: str | os.PathLike = "?") -> None:
    """Refuse heads trained for another policy architecture, saying which property differs."""
    cfg = policy.config
    fix = "; run `mtp-rollout train-heads` for this policy"
    if meta.policy_fingerprint != cfg.fingerprint():
        raise ValueError(f"heads at {where} were trained for policy fingerprint {meta.policy_fingerprint}, "
                         f"this policy is {cfg.fingerprint()}{fix}")
    if meta.hidden_size != cfg.hidden_size:
        raise ValueError(f"heads at {where} have hidden size {meta.hidden_size}, this policy has "
                         f"{cfg.hidden_size}{fix}")
    if meta.vocab_size != cfg.vocab_size:
        raise ValueError(f"heads at {where} have vocabulary size {meta.vocab_size}, this policy has "
                         f"{cfg.vocab_size}{fix}")


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a head checkpoint, refusing NaN or inf (naming the file and the tensor): such
    heads would load silently and then draft nothing, every round."""
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    check_finite(tensors, f"heads at {path}")
    return tensors


def check_heads_file(path: str | os.PathLike) -> HeadMeta:
    """The header of a head checkpoint whose weights are all finite: a check that needs no policy,
    for a command to run before it starts anything."""
    meta = read_meta(path)
    read_tensors(path)
    return meta


def load_heads(path: str | os.PathLike, policy: CausalLM) -> tuple[MTPHeads, HeadMeta]:
    """Heads for `policy` (its device and dtype) and their header; ValueError on any mismatch."""
    meta = read_meta(path)
    check_meta(meta, policy, path)
    tensors = read_tensors(path)
    vocab = tensors.pop(DRAFT_VOCAB_KEY, None)
    heads = MTPHeads(policy.config, meta.num_depths, meta.num_layers)
    missing, unexpected = heads.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"heads at {path} do not match a {meta.num_depths}-depth, {meta.num_layers}-layer MTPHeads: "
                         f"missing {missing[:4]}, unexpected {unexpected[:4]}; re-train them")
    p = policy.model.embed_tokens.weight
    heads = heads.to(device=p.device, dtype=p.dtype)
    set_draft_vocab(heads, vocab)
    return heads, meta


def _slug(model_spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(model_spec)).strip("_")[-80:] or "model"


def default_heads_path(model_spec: str, num_depths: int, loss: str) -> Path:
    """$MTP_ROLLOUT_CACHE/heads/<model>-D<n>-<loss>.safetensors (a draft vocabulary, if any, is inside)."""
    return cache_dir() / "heads" / f"{_slug(model_spec)}-D{num_depths}-{loss}.safetensors"
