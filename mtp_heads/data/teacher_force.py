"""The policy's final-norm hidden states for whole token sequences, batched by similar length.

Sequences are sorted by length and cut into batches of at most `max_batch_tokens` padded
tokens; rows are padded on the right, which the causal mask keeps from touching the real
positions. The states are returned as bf16 bits (uint16), the store's format.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rollout.models.decoder import CausalLM


def length_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that len(batch) * longest <= max_batch_tokens (>= 1 row each)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > max_batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def to_bf16_bits(x: torch.Tensor) -> np.ndarray:
    # x [..., d] any float dtype -> same shape uint16 holding bfloat16 bits
    return x.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


@torch.inference_mode()
def teacher_force(policy: CausalLM, seqs: Sequence[np.ndarray], max_batch_tokens: int = 8192,
                  pad_id: int = 0) -> list[np.ndarray]:
    """Hidden states [T_i, d] uint16 (bf16 bits) for each token sequence seqs[i] [T_i] int."""
    device = policy.lm_head_weight.device
    out: list[np.ndarray | None] = [None] * len(seqs)
    for batch in length_batches([len(s) for s in seqs], max_batch_tokens):
        T = len(seqs[batch[0]])
        ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, :len(seqs[i])] = torch.from_numpy(np.asarray(seqs[i], dtype=np.int64))
        hidden = to_bf16_bits(policy.hidden_states(ids.to(device)))       # [B, T, d]
        for r, i in enumerate(batch):
            out[i] = hidden[r, :len(seqs[i])].copy()
    return out
