"""In-memory training sequences and the draft vocabulary drawn from their token counts.

Training reads any *sequence source*: `len(src)` and `src[i]` with `.tokens` [T] int, `.hidden`
[T, d] (float32 or bfloat16; hidden[t] predicts tokens[t+1]) and `.loss_mask` [T] bool (True where
tokens[t+1] is trained text). The sharded token store (mtp_heads.data.token_store, its split views)
is one; `TokenData` below is the small in-memory one that self-generated rollouts
(experiments/heads_data.py) and the tests use.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtp_heads.distill import completion_mask
from rollout.fileio import atomic_write


@dataclass
class Seq:
    tokens: np.ndarray      # [T] int
    hidden: np.ndarray      # [T, d] float32
    loss_mask: np.ndarray   # [T] bool


@dataclass
class TokenData:
    """Prompt + completion sequences with the policy's hidden state at every position.

    hidden[t] of a sequence is the final-norm state after reading tokens[..t] (it predicts
    tokens[t+1]); the last position's state is never needed and stored as zeros. The loss mask
    is the completion: tokens[t+1] with t+1 >= prompt length.
    """

    tokens: np.ndarray        # [total] int32, sequences back to back
    hidden: np.ndarray        # [total, d] float32
    offsets: np.ndarray       # [n+1] int64
    prompt_lens: np.ndarray   # [n] int32

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, i: int) -> Seq:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return Seq(self.tokens[lo:hi], self.hidden[lo:hi], completion_mask(hi - lo, int(self.prompt_lens[i])))

    def completion_tokens(self) -> np.ndarray:
        return np.concatenate([self[i].tokens[self.prompt_lens[i]:] for i in range(len(self))] or
                              [np.zeros(0, np.int32)])

    def num_completion_tokens(self) -> int:
        return int((self.lengths() - self.prompt_lens).sum())

    def subset(self, idx: Sequence[int]) -> "TokenData":
        parts = []
        for i in idx:
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            parts.append(TokenData(self.tokens[lo:hi], self.hidden[lo:hi], np.array([0, hi - lo], np.int64),
                                   self.prompt_lens[i:i + 1]))
        return TokenData.concat(parts)

    def save(self, path: Path) -> None:
        buf = io.BytesIO()
        np.savez(buf, tokens=self.tokens, hidden=self.hidden, offsets=self.offsets, prompt_lens=self.prompt_lens)
        atomic_write(Path(path), buf.getvalue())

    @classmethod
    def load(cls, path: Path) -> "TokenData":
        with np.load(path) as z:
            return cls(z["tokens"], z["hidden"], z["offsets"], z["prompt_lens"])

    @classmethod
    def concat(cls, parts: Sequence["TokenData"]) -> "TokenData":
        sizes = [p.offsets[-1] for p in parts]
        starts = np.cumsum([0] + sizes[:-1])
        return cls(np.concatenate([p.tokens for p in parts]), np.concatenate([p.hidden for p in parts]),
                   np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, starts)]).astype(np.int64),
                   np.concatenate([p.prompt_lens for p in parts]))


def trained_token_counts(source, vocab_size: int, max_sequences: int | None = None) -> np.ndarray:
    """[vocab_size] counts of the trained next tokens (tokens[t+1] where loss_mask[t]) of a source."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    n = len(source) if max_sequences is None else min(len(source), max_sequences)
    for i in range(n):
        s = source[i]
        tok = np.asarray(s.tokens, dtype=np.int64)
        mask = np.asarray(s.loss_mask, dtype=bool)[:-1]
        counts += np.bincount(tok[1:][mask], minlength=vocab_size)
    return counts


def draft_vocab_from_counts(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent tokens (plus `always`, e.g. EOS): sorted unique ids [<= size + len(always)]."""
    vocab_size = len(counts)
    if size <= 0 or size >= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}), got {size}")
    top = np.argsort(-counts, kind="stable")[:size]
    return torch.unique(torch.tensor(np.concatenate([top, np.asarray(always, dtype=np.int64)]), dtype=torch.long))
