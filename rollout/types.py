"""Plain data passed between engines, workers, the co-trainer and the monitor."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DRAFT_MODES = ("greedy", "rejection")
# k drafts and the bonus token are verified in one pass; 15 + 1 fills the torch engine's widest
# verification width (EngineConfig.verify_widths), beyond which rounds only get slower.
MAX_DRAFT_TOKENS = 15


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch. temperature 0 means greedy; k = 0 means plain decoding."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0                      # 0 = off
    top_p: float = 1.0                  # 1 = off
    num_draft_tokens: int = 0           # k drafts per round; 0 = plain autoregressive decoding
    draft_mode: str = "rejection"       # greedy: draft argmax q (q one-hot); rejection: draft ~ q
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False
    seed: int | None = None
    return_hidden_states: bool = False  # target hidden state (after final norm) of every emitted token

    def validate(self) -> None:
        """Types and ranges of every field, with errors naming the parameter and the value:
        ints must be ints (not floats or bools), numbers must be finite."""
        for name in ("max_new_tokens", "top_k", "num_draft_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("temperature", "top_p"):
            _check_real(name, getattr(self, name))
        if self.seed is not None:
            _check_int("seed", self.seed)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens (k) must be >= 0, got {self.num_draft_tokens}")
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens (k) must be <= {MAX_DRAFT_TOKENS} (MAX_DRAFT_TOKENS, the widest "
                             f"verification), got {self.num_draft_tokens}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def check_token_ids(prompt, where: str, vocab_size: int | None = None) -> list[int]:
    """One prompt as a list of ints: a list/tuple of ints or a 1-D integer tensor/array. Floats
    (no silent truncation), bools, strings, None and tensors of another rank are refused by name."""
    if isinstance(prompt, (str, bytes)) or prompt is None:
        raise ValueError(f"{where} must be a sequence of token ids, got {type(prompt).__name__} {prompt!r:.60}; "
                         "tokenize text first")
    dims = getattr(prompt, "ndim", None)
    if dims is not None:                       # torch tensor or numpy array
        if dims != 1:
            raise ValueError(f"{where} must be 1-D (one sequence of token ids), got a {dims}-D "
                             f"{type(prompt).__name__} of shape {tuple(prompt.shape)}")
        dtype = str(prompt.dtype)
        if "int" not in dtype or "bool" in dtype:
            raise ValueError(f"{where} must hold integer token ids, got dtype {dtype}")
        ids = [int(t) for t in prompt.tolist()]
    elif isinstance(prompt, (list, tuple)):
        for j, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{where}, position {j}: token ids must be integers, got {t!r} "
                                 f"({type(t).__name__})")
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"{where} must be a list of token ids or a 1-D integer tensor, "
                         f"got {type(prompt).__name__}")
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def validate_request(prompts: list[list[int]], sp: SamplingParams, *, vocab_size: int, context_length: int,
                     has_heads: bool) -> None:   # has_heads: a drafter is there (heads or history)
    """The checks every engine runs before any work, with errors that name the problem."""
    sp.validate()
    if isinstance(prompts, (str, bytes)) or getattr(prompts, "ndim", None) is not None \
            or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of prompts (each a list of token ids), got "
                         f"{type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    for i, prompt in enumerate(prompts):
        ids = check_token_ids(prompt, f"prompt {i}", vocab_size)
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if len(ids) + sp.max_new_tokens > context_length:
            raise ValueError(f"prompt {i} ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
                             f"exceeds the context length {context_length}")
    if sp.num_draft_tokens > 0 and not has_heads:
        raise ValueError("num_draft_tokens > 0 needs a drafter: MTP heads (heads= to the engine), or rollout history "
                         "(EngineConfig.draft_sources with 'history' and draft_lengths='chosen')")


@dataclass
class Completion:
    """One generated continuation and everything RL and the monitor need about it."""

    prompt: list[int]
    tokens: list[int]                   # emitted tokens (stop token included when hit)
    logprobs: list[float]               # log p_policy(token) from raw logits (temperature 1, no top-k/p)
    entropies: list[float]              # entropy (nats) of the processed target dist. each token came from
    max_probs: list[float] = field(default_factory=list)  # max_v p(v) of that dist. (1 at temperature 0)
    # speculative rounds: round r proposed k drafts, accepted round_accepted[r] of them;
    # draft_entropies[r][j] is H(p) at draft position j of round r (reached iff j <= accepted).
    round_accepted: list[int] = field(default_factory=list)
    draft_entropies: list[list[float]] = field(default_factory=list)
    round_draft_tokens: list[int] = field(default_factory=list)  # drafts verified in round r; [] = all k
    round_sources: list[str] = field(default_factory=list)      # where round r's drafts came from: heads | history
    round_predicted: list[list[float]] = field(default_factory=list)   # predicted acceptance of each (torch engine)
    nonfinite_draft_rounds: int = 0     # rounds whose q had NaN/inf: no drafts, one plain token
    num_draft_tokens: int = 0
    finish_reason: str = "length"       # "stop" | "length"
    policy_version: int = 0
    head_version: int = 0
    hidden_states: np.ndarray | None = None  # [len(tokens), d] float32, on request
    domain: str | None = None           # task domain label, set by the caller

    def spec_stats(self) -> "SpecDecodingStats":
        stats = SpecDecodingStats.from_rounds(self.round_accepted, self.num_draft_tokens,
                                              self.round_draft_tokens or None)
        stats.num_nonfinite_rounds = self.nonfinite_draft_rounds
        return stats


@dataclass
class SpecDecodingStats:
    """Counters in vLLM's terms: acceptance rate = accepted / proposed draft tokens."""

    num_drafts: int = 0                 # verification rounds that proposed drafts
    num_draft_tokens: int = 0           # proposed draft tokens
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0         # accepted + one recovered/bonus token per round
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position j
    reached_per_pos: list[int] = field(default_factory=list)   # rounds that reached position j
    num_nonfinite_rounds: int = 0       # row-rounds whose draft q had NaN/inf (fell back to a plain token)

    @classmethod
    def from_rounds(cls, round_accepted: list[int], k: int, round_k: list[int] | None = None) -> "SpecDecodingStats":
        """round_k[r]: drafts proposed in round r (adaptive k); None = k every round."""
        s = cls(accepted_per_pos=[0] * k, reached_per_pos=[0] * k)
        for r, n in enumerate(round_accepted):
            k_r = k if round_k is None else round_k[r]
            s.num_drafts += 1
            s.num_draft_tokens += k_r
            s.num_accepted_tokens += n
            s.num_emitted_tokens += n + 1
            for j in range(k_r):
                s.reached_per_pos[j] += int(n >= j)
                s.accepted_per_pos[j] += int(n > j)
        return s

    def merge(self, other: "SpecDecodingStats") -> "SpecDecodingStats":
        k = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda xs: list(xs) + [0] * (k - len(xs))  # noqa: E731
        return SpecDecodingStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            self.num_emitted_tokens + other.num_emitted_tokens,
            [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
            [a + b for a, b in zip(pad(self.reached_per_pos), pad(other.reached_per_pos))],
            self.num_nonfinite_rounds + other.num_nonfinite_rounds,
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verification round, bonus token included (tau)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def conditional_acceptance(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted_per_pos, self.reached_per_pos)]


@dataclass
class RolloutBatch:
    """The completions of one generate() call, in prompt order."""

    completions: list[Completion]
    wall_time_s: float = 0.0
    compile_time_s: float = 0.0         # part of wall_time_s spent compiling (torch engine)
    # what the same call would have taken decoding plainly, from the engine's round-cost model
    # (torch engine with per-row drafting; plain calls: wall_time_s; nan where it cannot tell)
    plain_estimate_s: float = float("nan")
    # what the engine's rollout history holds after the call (RolloutHistory.stats: prompts, responses,
    # tokens, memory_bytes, ...; summed over workers); None where no history is kept
    history_sizes: dict[str, int] | None = None
    # the engine ran the call plain although it asked for drafts: speculating calls of its batch size had
    # recently cost more than plain decoding (torch engine, rollout.engine.call_gate); across workers: any
    speculation_paused: bool = False
    # the engine decoded the call's full batch plain and speculated only once enough rows had finished for
    # the rest to move into a smaller batch (the gate's TAIL mode: its full batch had lost); across workers: any
    speculation_tail_only: bool = False

    @property
    def nonfinite_draft_rounds(self) -> int:
        return sum(c.nonfinite_draft_rounds for c in self.completions)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_time_s if self.wall_time_s > 0 else float("nan")

    def spec_stats(self) -> SpecDecodingStats:
        total = SpecDecodingStats()
        for c in self.completions:
            total = total.merge(c.spec_stats())
        return total


def sum_history_sizes(sizes: Sequence[dict[str, int] | None]) -> dict[str, int] | None:
    """Several engines' history sizes as one (each key summed); None where none keeps a history."""
    kept = [s for s in sizes if s]
    if not kept:
        return None
    return {key: sum(s.get(key, 0) for s in kept) for key in kept[0]}


def check_draft_modes(draft_modes: Sequence[str]) -> list[str]:
    """The draft modes a study compares; ValueError naming `draft_modes` for an empty list or an unknown mode."""
    modes = list(draft_modes)
    if not modes:
        raise ValueError(f"draft_modes is empty: give one or more of {list(DRAFT_MODES)}")
    bad = [m for m in modes if m not in DRAFT_MODES]
    if bad:
        raise ValueError(f"draft_modes: unknown draft mode {bad[0]!r}; known: {list(DRAFT_MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"draft_modes lists a mode twice: {modes}")
    return modes
