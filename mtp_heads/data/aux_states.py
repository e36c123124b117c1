"""The policy's aux-layer states for the sequences a run trains on, recorded once (what EAGLE-3 reads).

The token store keeps each token's final-norm state (it gives the teacher p); an EAGLE-3 drafter
also reads the residual stream after its aux layers (mtp_heads.eagle3.aux_hidden_states), 3 x d
values per token for three layers. Recomputing them costs a policy forward per training step;
recording them costs one forward per token once, whatever the number of epochs, and 3 x 2 x d
bytes per token on disk (the measurement behind the choice: docs/heads.md).

`record_aux_states` writes them, bf16, into one memory-mapped .npy beside a JSON key (layers, policy,
sequence lengths), atomically; a second run on the same sequences reuses the file. `WithAux` serves
the source's sequences with `.aux` added, which mtp_heads.pretrain.batch_for_step puts into the batch.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtp_heads.data.teacher_force import length_batches, to_bf16_bits
from mtp_heads.eagle3 import aux_hidden_states
from rollout.fileio import atomic_write
from rollout.models.decoder import CausalLM


@dataclass
class AuxSequence:
    """A source sequence with its aux states."""

    tokens: torch.Tensor      # [T] int64
    hidden: torch.Tensor      # [T, d] final-norm states; hidden[t] predicts tokens[t+1]
    loss_mask: torch.Tensor   # [T] bool
    aux: torch.Tensor         # [T, n_aux * d] bfloat16: the residual stream after each aux layer at t


class WithAux:
    """`source` (len, [i] with tokens / hidden / loss_mask) with recorded aux states per sequence."""

    def __init__(self, source, aux: np.ndarray, offsets: np.ndarray):
        self.source, self.aux, self.offsets = source, aux, offsets   # aux [N, n_aux * d] uint16; offsets [n+1]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> AuxSequence:
        s = self.source[i]
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        aux = torch.from_numpy(np.array(self.aux[lo:hi])).view(torch.bfloat16)
        return AuxSequence(torch.as_tensor(s.tokens), torch.as_tensor(s.hidden), torch.as_tensor(s.loss_mask), aux)


def _key(policy: CausalLM, layer_ids: tuple[int, ...], lengths: list[int]) -> dict:
    return {"format": 1, "layer_ids": list(layer_ids), "policy": policy.config.fingerprint(),
            "hidden_size": policy.config.hidden_size, "sequences": len(lengths), "tokens": int(sum(lengths)),
            "lengths_sha256": hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()}


@torch.no_grad()
def record_aux_states(policy: CausalLM, source, layer_ids: tuple[int, ...], path: str | os.PathLike, *,
                      max_batch_tokens: int = 4096, log: Callable[[str], None] = print) -> WithAux:
    """`source` with aux states, computed by teacher forcing (batched by length) into `path` (.npy) or
    read back from it when its key (`path`.json) matches these layers, this policy and these sequences.
    Another key is rebuilt; the file and its key are each replaced atomically, the key last."""
    path = Path(path)
    layer_ids = tuple(sorted(layer_ids))
    lengths = [len(source[i].tokens) for i in range(len(source))]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    key = _key(policy, layer_ids, lengths)
    key_path = path.with_suffix(".json")
    if path.is_file() and key_path.is_file():
        try:
            stored = json.loads(key_path.read_text())
        except ValueError:
            stored = None
        if stored == key:
            aux = np.load(path, mmap_mode="r")
            if aux.shape == (int(offsets[-1]), len(layer_ids) * policy.config.hidden_size):
                return WithAux(source, aux, offsets)
        log(f"aux states {path} were recorded for other sequences or layers: recording them again")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    width = len(layer_ids) * policy.config.hidden_size
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16, shape=(int(offsets[-1]), width))
    device = policy.lm_head_weight.device
    t0, done = time.perf_counter(), 0
    try:
        for batch in length_batches(lengths, max_batch_tokens):
            T = lengths[batch[0]]
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, :lengths[i]] = torch.as_tensor(np.asarray(source[i].tokens, dtype=np.int64))
            bits = to_bf16_bits(aux_hidden_states(policy, ids.to(device), layer_ids))     # [B, T, width]
            for r, i in enumerate(batch):
                out[offsets[i]:offsets[i + 1]] = bits[r, :lengths[i]]
            done += sum(lengths[i] for i in batch)
        out.flush()
        del out
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dt = time.perf_counter() - t0
    atomic_write(key_path, json.dumps(key, indent=1) + "\n")
    log(f"aux states of {len(lengths)} sequences ({done} tokens, layers {list(layer_ids)}) recorded in {dt:.0f} s "
        f"= {done / max(dt, 1e-9):.0f} tok/s, {path.stat().st_size / 1e6:.0f} MB: {path}")
    return WithAux(source, np.load(path, mmap_mode="r"), offsets)
