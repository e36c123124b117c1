"""Weights as one flat byte buffer plus a small index, for shipping through Ray's object store.

Why: Ray pickles torch tensors one by one (slow: tens of ms per 10 MB) but moves
a numpy array out of band, zero-copy. Packing every tensor of a state dict into a single
uint8 array means one `ray.put` per sync, whatever the number of tensors, and any dtype
(bfloat16 included, which numpy lacks) travels as raw bytes.
"""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from rollout.models.config import ModelConfig
from rollout.models.decoder import CausalLM, build_model
from rollout.models.dtypes import parse_dtype

_ALIGN = 64  # bytes; every tensor starts on a boundary so that a dtype view is always legal


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str          # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    offset: int         # bytes
    nbytes: int


@dataclass(frozen=True)
class FlatWeights:
    """A state dict as one contiguous uint8 buffer and a name/shape/dtype index."""

    buffer: np.ndarray              # [total_bytes] uint8
    index: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def names(self) -> list[str]:
        return [e.name for e in self.index]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a FlatWeights index; was it packed by another torch version?")
    return dt


def pack(named_tensors: dict[str, torch.Tensor]) -> FlatWeights:
    """Copy every tensor (on any device) into one aligned uint8 buffer."""
    if not named_tensors:
        raise ValueError("pack() got no tensors: pass a non-empty {name: tensor} dict")
    entries, offset = [], 0
    for name, t in named_tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    buffer = torch.zeros(offset, dtype=torch.uint8)
    for e, t in zip(entries, named_tensors.values()):
        if e.nbytes:
            src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buffer[e.offset:e.offset + e.nbytes] = src
    return FlatWeights(buffer.numpy(), tuple(entries))


def unpack(flat: FlatWeights, *, copy: bool = False) -> dict[str, torch.Tensor]:
    """Tensors that view the buffer (copy=False: no copy; treat them as read-only, since an
    object-store buffer is) or own their memory (copy=True)."""
    buf = flat.buffer
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise ValueError(f"FlatWeights.buffer must be 1-D uint8, got {buf.dtype} with shape {buf.shape}")
    with warnings.catch_warnings():
        # Ray hands out read-only arrays; torch warns on wrapping them. We only ever read them.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        whole = torch.from_numpy(buf)
    out = {}
    for e in flat.index:
        raw = whole[e.offset:e.offset + e.nbytes]
        t = raw.view(_dtype(e.dtype)).reshape(e.shape)
        out[e.name] = t.clone() if copy else t
    return out


# -- shipped weights -> a policy module (workers and the co-trainer build theirs the same way) ------

def weights_digest(module: torch.nn.Module) -> str:
    """A cheap fingerprint of a module's weights (every 997th value of every tensor, in float32):
    tells two policies of one architecture apart, e.g. to key data made with them."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().flatten()[::997].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def policy_from_flat(config: ModelConfig, flat: FlatWeights, dtype: str = "float32",
                     device: str = "cpu") -> CausalLM:
    """A frozen CausalLM (rollout.models.decoder) holding the shipped weights."""
    return build_model(config, unpack(flat), parse_dtype(dtype), device)


def own_storage(obj):
    """Tensors unpacked from one flat weight buffer are views of one byte storage with different dtypes,
    which torch.save refuses: give each its own storage (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: own_storage(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(own_storage(v) for v in obj)
    return obj
