"""RolloutWorker: one engine behind a Ray actor.

The actor is sequential (one call at a time), so a weight update queued while a generate
call runs is applied after it, never in the middle of a decode round, and calls from the
facade run in the order they were sent. Weights arrive as rollout.models.flat_weights.FlatWeights (one
object-store buffer per sync); every completion carries the versions it ran with.
"""
from __future__ import annotations

import importlib
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from mtp_heads.drafters import DrafterSpec, drafter_from_flat
from mtp_heads.eagle3_drafter import Eagle3Heads
from rollout.models.config import ModelConfig
from rollout.models.flat_weights import FlatWeights, policy_from_flat, unpack
from rollout.types import RolloutBatch, SamplingParams

if TYPE_CHECKING:
    from mtp_heads.heads import MTPHeads
    from rollout.models.decoder import CausalLM


class Engine(Protocol):
    policy_version: int
    head_version: int

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch: ...
    def update_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...
    def update_heads(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...


def _torch_engine(policy: "CausalLM", heads: "MTPHeads | Eagle3Heads | None", policy_version: int, head_version: int,
                  config: "WorkerConfig") -> Engine:
    from rollout.engine.config import EngineConfig
    from rollout.torch_engine import TorchEngine

    return TorchEngine(policy, heads, policy_version=policy_version, head_version=head_version,
                       config=EngineConfig(draft_lengths=config.draft_lengths,
                                           draft_sources=tuple(config.draft_sources),
                                           plain_when_slower=config.plain_when_slower))


def _vllm_engine(policy: "CausalLM", heads: "MTPHeads | Eagle3Heads | None", policy_version: int,
                 head_version: int, config: "WorkerConfig") -> Engine:
    # lazy: vllm is an optional extra and slow to import
    module = importlib.import_module("rollout.vllm")
    if isinstance(heads, Eagle3Heads):
        if config.vllm_draft_method != "heads":
            raise ValueError(EAGLE3_VLLM_METHOD.format(method=config.vllm_draft_method))
        return VLLMEagle3Engine(module, policy, heads, policy_version, head_version)
    return module.VLLMEngine(policy, heads, policy_version=policy_version, head_version=head_version,
                             config=module.VLLMEngineConfig(draft_method=config.vllm_draft_method))


class VLLMEagle3Engine:
    """vLLM's built-in eagle3 method drafting with the worker's EAGLE-3 drafter. vLLM reads that drafter
    from a directory and refreshes it through update_drafter, so it is written out once at the start and
    head updates go there; everything else is the vLLM engine's."""

    def __init__(self, module, policy: "CausalLM", heads: Eagle3Heads, policy_version: int, head_version: int):
        from mtp_heads.eagle3_checkpoint import save_eagle3

        with tempfile.TemporaryDirectory(prefix="mtp-rollout-eagle3-") as tmp:   # read by the engine's constructor
            path = save_eagle3(os.path.join(tmp, "eagle3"), heads.drafter)
            self.engine = module.VLLMEngine(policy, None, policy_version=policy_version, head_version=head_version,
                                            config=module.VLLMEngineConfig(draft_method="eagle3",
                                                                           drafter_path=str(path)))

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def head_version(self) -> int:
        return self.engine.head_version

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        return self.engine.generate(prompts, sampling)

    def update_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_policy(state_dict, version)

    def update_heads(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_drafter(state_dict, version)


EAGLE3_VLLM_METHOD = ("workers.vllm_draft_method={method} drafts from history and leaves the EAGLE-3 drafter unused; "
                      "set workers.vllm_draft_method=heads (vLLM's eagle3 method) or pass MTP heads")


# engine name -> factory(policy, heads, policy_version, head_version, worker config)
ENGINES: dict[str, Callable[..., Engine]] = {"torch": _torch_engine, "vllm": _vllm_engine}


@dataclass(frozen=True)
class WorkerConfig:
    """The rollout workers: how many, their Ray resources, their engine, their retries."""

    num_workers: int = 1                # rollout worker actors; prompts are split across them
    num_cpus_per_worker: float = 1      # Ray CPUs per worker (also its torch threads); fractions allowed
    num_gpus_per_worker: float = 0      # Ray GPUs per worker; > 0 puts the engine on CUDA
    engine: str = "torch"               # `torch` (reference) or `vllm` (a key of ENGINES)
    max_retries: int = 2                # retries of a prompt chunk whose worker died
    draft_lengths: str = "chosen"       # torch engine, k > 0: chosen = each row, each round, drafts 0..k tokens from
                                        # the source predicted to pay most; fixed = k head tokens for every row (studies)
    draft_sources: tuple[str, ...] = ("heads", "history")   # what `chosen` drafts from
    plain_when_slower: bool = True      # `chosen`: calls of a batch size whose speculating calls recently cost more
                                        # than plain decoding run plain, re-checked now and then (EngineConfig);
                                        # false for studies that need every call to draft
    vllm_draft_method: str = "heads"    # vLLM engine: heads (the run's drafter: MTP heads, or an EAGLE-3 drafter by
                                        # vLLM's eagle3 method), ngram or suffix (one method per engine, docs/vllm.md)

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"workers.num_workers must be >= 1, got {self.num_workers}")
        if self.num_cpus_per_worker < 0 or self.num_gpus_per_worker < 0:
            raise ValueError("workers.num_cpus_per_worker / num_gpus_per_worker must be >= 0, got "
                             f"{self.num_cpus_per_worker} / {self.num_gpus_per_worker}")
        if self.max_retries < 0:
            raise ValueError(f"workers.max_retries must be >= 0, got {self.max_retries}")
        if self.engine not in ENGINES:
            raise ValueError(f"workers.engine {self.engine!r} unknown; choose from {sorted(ENGINES)}")
        if self.draft_lengths not in ("chosen", "fixed"):
            raise ValueError(f"workers.draft_lengths must be chosen or fixed, got {self.draft_lengths!r}")
        if self.vllm_draft_method not in ("heads", "ngram", "suffix"):
            raise ValueError(f"workers.vllm_draft_method must be heads, ngram or suffix, got {self.vllm_draft_method!r}")
        if not self.draft_sources or set(self.draft_sources) - {"heads", "history"}:
            raise ValueError(f"workers.draft_sources must be a non-empty subset of [heads, history], got "
                             f"{list(self.draft_sources)}")

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus_per_worker > 0 else "cpu"


class WorkerPaused(RuntimeError):
    """generate() on a paused worker."""


class RolloutWorker:
    """generate / update_policy / update_heads / stats / pause / resume around one engine.

    Plain class; rollout.worker_pool wraps it with ray.remote and the config's resources.
    """

    def __init__(self, worker_id: int, config: WorkerConfig, policy_config: ModelConfig,
                 policy_weights: FlatWeights, policy_version: int, head_weights: FlatWeights | None,
                 drafter: DrafterSpec, head_version: int, *, dtype: str = "float32", num_threads: int | None = None):
        if num_threads is not None:
            torch.set_num_threads(num_threads)   # threads = the actor's CPU share (oversubscribed is slower)
        device = config.device
        self.worker_id = worker_id
        policy = policy_from_flat(policy_config, policy_weights, dtype, device)
        heads = None if head_weights is None else drafter_from_flat(policy_config, drafter, head_weights, dtype, device)
        self.engine = ENGINES[config.engine](policy, heads, policy_version, head_version, config)
        self.engine_name = config.engine
        self.paused = False
        self.num_generate = 0
        self.num_tokens = 0
        self.busy_s = 0.0

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        if self.paused:
            raise WorkerPaused(f"rollout worker {self.worker_id} is paused; call resume() before generate()")
        t0 = time.perf_counter()
        batch = self.engine.generate(prompts, sampling)
        self.busy_s += time.perf_counter() - t0
        self.num_generate += 1
        self.num_tokens += batch.num_tokens
        return batch

    def remember(self, rollouts: list[tuple[list[int], list[int], int]]) -> int:
        """Earlier rollouts (prompt, tokens, policy version) into the engine's history (a replacement
        worker's start); engines without one ignore them. -> how many were taken."""
        remember = getattr(self.engine, "remember", None)
        if remember is None:
            return 0
        remember(rollouts)
        return len(rollouts)

    def update_policy(self, weights: FlatWeights, version: int) -> int:
        self.engine.update_policy(unpack(weights), version)
        return version

    def update_heads(self, weights: FlatWeights, version: int) -> int:
        self.engine.update_heads(unpack(weights), version)
        return version

    def pause(self) -> None:
        """Refuse generate() until resume() (e.g. while a colocated trainer uses the device)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def stats(self) -> dict:
        return {"worker_id": self.worker_id, "pid": os.getpid(), "engine": self.engine_name,
                "policy_version": self.engine.policy_version, "head_version": self.engine.head_version,
                "paused": self.paused, "num_generate": self.num_generate, "num_tokens": self.num_tokens,
                "busy_s": self.busy_s, "num_threads": torch.get_num_threads()}
