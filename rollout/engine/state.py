"""Per-call decoding state: tokens, lengths, hidden states and caches of the rows still running.

Rows live in a batch bucket (rollout.engine.config); `row_ids` maps each slot to its prompt
(-1 for padding). When the unfinished rows fit a smaller bucket, `compact` gathers them there
and hands the finished ones to `Results`; until then packed verification leaves finished rows out
of its forwards (rollout.engine.round), so that they cost nothing either way.

Invariants per row b, with c[b] = committed tokens (prompt + emitted):
  * seq[b, :c]   holds them; seq[b, c-1] (the pending token) is not yet in the target cache;
  * the target cache holds positions 0 .. c-2 and hidden[b, i] is the policy's state there;
  * head depth j's cache holds valid entries for positions < head_len[j][b];
  * depth 1 reads, at position i, drafter_input[b, i]: the policy's state hidden[b, i], or for a drafter
    that reads the policy's intermediate layers (EAGLE-3) draft_states[b, i], stored beside it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from rollout.models.decoder import Cache


@dataclass
class DecodeState:
    seq: torch.Tensor            # [B, L] int64 tokens (beyond c: drafts or scratch)
    committed: torch.Tensor      # [B] c
    prompt_len: torch.Tensor     # [B]
    hidden: torch.Tensor         # [B, L, d] policy final-norm states
    logprob: torch.Tensor        # [B, L] log p(raw) of each emitted token at its position
    token_entropy: torch.Tensor  # [B, L] H(processed p) each emitted token came from
    token_max_prob: torch.Tensor  # [B, L] max_v of that processed p (1 at temperature 0)
    finished: torch.Tensor       # [B] bool (padding rows start finished)
    stopped: torch.Tensor        # [B] bool, finished on a stop token
    row_ids: torch.Tensor        # [B] int64 prompt index of each slot, -1 = padding
    target: Cache
    heads: list[Cache] = field(default_factory=list)             # one per head depth
    head_len: list[torch.Tensor] = field(default_factory=list)     # [B] per depth
    head_hidden: list[torch.Tensor] = field(default_factory=list)  # [B, L, d] per depth
    # host-side bound on how many positions each depth's cache lags behind (see round.update_heads)
    head_lag: list[int] = field(default_factory=list)
    # host-side bound on max(c): the caches' read window follows it (round.set_read_window)
    longest: int = 0
    # [B, L, d] what the drafter reads at each position when that is not the policy's final state (EAGLE-3:
    # fc over the aux layers' states); None = it reads `hidden`
    draft_states: torch.Tensor | None = None

    @property
    def drafter_input(self) -> torch.Tensor:
        """[B, L, d] what head depth 1 reads at each position."""
        return self.hidden if self.draft_states is None else self.draft_states

    @property
    def batch(self) -> int:
        return self.seq.shape[0]

    @property
    def max_len(self) -> int:
        return self.seq.shape[1]


_ROW_TENSORS = ("seq", "committed", "prompt_len", "hidden", "logprob", "token_entropy", "token_max_prob", "finished",
                "stopped", "row_ids")


def gather_rows(state: DecodeState, idx: torch.Tensor, target: Cache, heads: list[Cache]) -> DecodeState:
    """A state of len(idx) rows: state's rows idx, caches copied into `target` / `heads` (no new
    allocation when those are the engine's preallocated caches of the smaller bucket)."""
    for new, old in zip([target, *heads], [state.target, *state.heads]):
        new.copy_rows_from(old, idx)
    rows = {f.name: getattr(state, f.name)[idx] for f in fields(state) if f.name in _ROW_TENSORS}
    return DecodeState(**rows, target=target, heads=heads, head_len=[h[idx] for h in state.head_len],
                       head_hidden=[h[idx] for h in state.head_hidden], head_lag=list(state.head_lag),
                       longest=state.longest,
                       draft_states=None if state.draft_states is None else state.draft_states[idx])


class Results:
    """The rows' final tensors in prompt order, filled as rows leave the batch."""

    def __init__(self, num_rows: int, max_len: int, hidden_size: int, keep_hidden: bool,
                 dtype: torch.dtype, device: torch.device):
        z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.seq = z(num_rows, max_len, dt=torch.long)
        self.committed = z(num_rows, dt=torch.long)
        self.prompt_len = z(num_rows, dt=torch.long)
        self.logprob = z(num_rows, max_len)
        self.token_entropy = z(num_rows, max_len)
        self.token_max_prob = z(num_rows, max_len)
        self.stopped = z(num_rows, dt=torch.bool)
        self.hidden = z(num_rows, max_len, hidden_size, dt=dtype) if keep_hidden else None

    def save(self, state: DecodeState, slots: torch.Tensor | None = None) -> None:
        """Copy slots (default: all real rows) of `state` to their prompt's row."""
        if slots is None:
            slots = (state.row_ids >= 0).nonzero().squeeze(1)
        rows = state.row_ids[slots]
        for name in ("seq", "committed", "prompt_len", "logprob", "token_entropy", "token_max_prob", "stopped"):
            getattr(self, name)[rows] = getattr(state, name)[slots]
        if self.hidden is not None:
            self.hidden[rows] = state.hidden[slots]
