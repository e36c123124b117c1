"""RolloutAccelerator: the one object an RL pipeline talks to.

It starts N rollout workers (rollout.worker_pool) and one head co-trainer (rollout.
cotrainer_client) as Ray actors, with resources from the config, so the same code runs on a
laptop's local Ray and on a GPU cluster; it keeps the acceptance monitor in the driver and
offers four calls: sync_policy, generate, end_step, shutdown. Nothing in the head path blocks
rollouts: the co-trainer is only sent fire-and-forget calls and polled without waiting; if it
dies, rollouts go on with the last heads and it is restarted from its checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch

from mtp_heads.drafters import DrafterSpec, drafter_spec
from mtp_heads.eagle3_drafter import Eagle3Heads
from mtp_heads.heads import MTPHeads
from rollout.cotrainer_client import CoTrainerClient
from rollout.models.decoder import CausalLM
from rollout.models.dtypes import parse_dtype
from rollout.monitor import AcceptanceMonitor, MonitorConfig
from rollout.published_weights import PublishedWeights
from rollout.ray_guard import GuardedRay, init_ray
from rollout.types import Completion, RolloutBatch, SamplingParams
from rollout.models.flat_weights import FlatWeights, pack, unpack
from rollout.worker_pool import WorkerPool
from rollout.workers import EAGLE3_VLLM_METHOD, WorkerConfig
from mtp_heads.cotrainer import CoTrainerConfig
from mtp_heads.refresh import StepObservation

__all__ = ["AcceleratorConfig", "CoTrainerConfig", "MonitorConfig", "RolloutAccelerator", "WorkerConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcceleratorConfig:
    """The rollout runtime: workers, co-trainer, monitor, and the model and heads they start from."""

    workers: WorkerConfig = dataclasses.field(default_factory=WorkerConfig)
    cotrainer: CoTrainerConfig = dataclasses.field(default_factory=CoTrainerConfig)
    monitor: MonitorConfig = dataclasses.field(default_factory=lambda: MonitorConfig(out_dir="runs/monitor"))
    model: str = "smollm2-135m"         # `smollm2-135m`, `tiny-random` (byte-level test model), a `.gguf` file
                                        # or an HF directory
    heads: str = "shipped"              # draft heads: `shipped` (the package's, or train-heads' cached ones),
                                        # `init` (untrained), a heads checkpoint path or an EAGLE-3 drafter directory
    num_depths: int = 1                 # MTP depths D of the heads (1 for an EAGLE-3 drafter)
    dtype: str = "float32"              # rollout weights: `float32`, `bfloat16`, `float16`, `auto` (the hardware's best)
    ray_address: str | None = None      # Ray cluster address; null starts (or joins) a local Ray
    seed: int = 0                       # seed of freshly initialised heads in the accelerator

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        from mtp_heads.shipped import check_heads_spec
        check_heads_spec("heads", self.heads)   # a run sets it as `heads`
        w = self.workers
        if w.engine == "vllm" and w.vllm_draft_method != "heads" and is_eagle3_dir(self.heads, self.model):
            raise ValueError(f"heads={self.heads} is an EAGLE-3 drafter: "
                             + EAGLE3_VLLM_METHOD.format(method=w.vllm_draft_method))
        if self.num_depths < 1:
            raise ValueError(f"accelerator.num_depths must be >= 1, got {self.num_depths}")


def is_eagle3_dir(heads: str, model: str) -> bool:
    """Whether a `heads` setting names an EAGLE-3 drafter directory, the shipped one (`shipped-eagle3`) included
    (a path in neither layout is not: the heads loader names it)."""
    from mtp_heads.shipped import drafter_location
    heads = drafter_location(heads, model)
    if heads in ("shipped", "init") or not Path(heads).expanduser().exists():
        return False
    from mtp_heads.eagle3_checkpoint import drafter_layout
    try:
        return drafter_layout(Path(heads).expanduser()) == "eagle3"
    except ValueError:
        return False


def check_resources(cfg: AcceleratorConfig) -> None:
    """Actors that do not fit wait forever; say so at once instead (local clusters only:
    an autoscaling cluster may grow to fit)."""
    w, c = cfg.workers, cfg.cotrainer
    need_cpu = w.num_workers * w.num_cpus_per_worker + (c.num_cpus if c.enabled else 0)
    need_gpu = w.num_workers * w.num_gpus_per_worker + (c.num_gpus if c.enabled else 0)
    have = ray.cluster_resources()
    if need_cpu > have.get("CPU", 0) + 1e-9 or need_gpu > have.get("GPU", 0) + 1e-9:
        raise ValueError(
            f"the actors need {need_cpu:g} CPUs and {need_gpu:g} GPUs but this Ray cluster has "
            f"{have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs; lower workers.num_workers, "
            "workers.num_cpus_per_worker (fractions are allowed) or cotrainer.num_cpus, or set "
            "cotrainer.enabled=false")


def mean_entropy(comps: list[Completion]) -> float:
    ent = [h for c in comps for h in c.entropies]
    return float(np.mean(ent)) if ent else float("nan")


class RolloutAccelerator:
    """Facade over the Ray actors; see module docstring. Build with from_config()."""

    def __init__(self, cfg: AcceleratorConfig, policy: CausalLM, heads: MTPHeads | Eagle3Heads, *,
                 owns_ray: GuardedRay | None = None, policy_version: int = 0, head_version: int = 0):
        self.cfg = cfg
        self._owns_ray = owns_ray          # the Ray this facade started (stopped by shutdown), or None
        # generate() may run in a prefetch thread while the driver syncs weights or ends a step:
        # the lock keeps worker replacement, weight refs and the step's completions consistent.
        self._lock = threading.RLock()
        self._weights = PublishedWeights(policy.config, policy.state_dict(), heads.state_dict(), drafter_spec(heads),
                                         policy_version=policy_version, head_version=head_version)
        self.monitor = AcceptanceMonitor(cfg.monitor)
        self._step = 0
        self._pool = WorkerPool(cfg.workers, self._weights, dtype=cfg.dtype, lock=self._lock,
                                on_event=self._record_event)
        self._cotrainer = self._new_cotrainer_client() if cfg.cotrainer.enabled else None
        self._step_completions: list[Completion] = []
        self._step_wall_s = 0.0
        self._step_plain_s = 0.0           # the same calls decoded plainly, as the engines estimate it
        self._step_history: dict[str, int] | None = None   # the engines' rollout history after the latest call
        self._step_paused = False          # a call of the step ran plain where speculating had cost more
        self._step_tail_only = False       # a call of the step speculated only once rows had finished

    def _new_cotrainer_client(self) -> CoTrainerClient:
        return CoTrainerClient(self.cfg.cotrainer, self._weights, seed=self.cfg.seed, lock=self._lock,
                               on_event=self._record_event, publish=self._publish)

    def _record_event(self, kind: str, detail: dict) -> None:
        self.monitor.record_event(self._step, kind, detail)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: AcceleratorConfig, *, policy: CausalLM | None = None,
                    heads: MTPHeads | Eagle3Heads | None = None, policy_version: int = 0,
                    head_version: int = 0) -> "RolloutAccelerator":
        """Start (or join) Ray, load the policy and heads unless given, start the actors. A local Ray
        started here is guarded (stopped with this process, even after SIGKILL) and listens on
        loopback only (rollout.ray_guard)."""
        owns_ray = init_ray(cfg.ray_address)       # None: Ray was already initialised by the caller
        try:
            if cfg.ray_address is None:
                check_resources(cfg)
            if policy is None:
                from rollout.models.loaders import load_policy
                policy, _ = load_policy(cfg.model, cfg.dtype)
            if heads is None:     # a file holding other than cfg.num_depths depths is refused, naming it
                from mtp_heads.shipped import resolve_heads
                heads, desc = resolve_heads(policy, cfg.heads, model=cfg.model, num_depths=cfg.num_depths,
                                            seed=cfg.seed)
                logger.info("heads: %s", desc)
            heads.check_compatible(policy)
            return cls(cfg, policy, heads, owns_ray=owns_ray, policy_version=policy_version,
                       head_version=head_version)
        except BaseException:
            if owns_ray is not None:
                owns_ray.shutdown()
            raise

    # -- state other code reads ---------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._weights.policy_version

    @property
    def head_version(self) -> int:
        return self._weights.head_version

    @property
    def workers(self) -> list:
        """The worker actor handles (a dead one is replaced in place)."""
        return self._pool.workers

    @property
    def cotrainer(self):
        """The co-trainer actor handle; None when disabled or dead beyond its restarts."""
        return None if self._cotrainer is None else self._cotrainer.actor

    # -- the four calls ----------------------------------------------------------------------------

    def sync_policy(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """New policy weights to every worker and the co-trainer: one object-store put, no waiting.
        Workers apply them after the generate call they may be running."""
        with self._lock:
            ref = self._weights.set_policy(named_tensors, version)
            self._pool.broadcast_policy(ref, version)
            if self._cotrainer is not None:
                self._cotrainer.update_policy(ref, version)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 domains: list[str] | None = None) -> RolloutBatch:
        """Completions in prompt order, spread over the workers; a chunk whose worker died is
        retried on a live or respawned worker (workers.max_retries times)."""
        sampling.validate()
        if domains is not None and len(domains) != len(prompts):
            raise ValueError(f"domains has {len(domains)} labels for {len(prompts)} prompts")
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
        t0 = time.perf_counter()
        pooled = self._pool.generate(prompts, sampling)
        comps = pooled.completions
        if domains is not None:
            for comp, dom in zip(comps, domains):
                comp.domain = dom
        wall = time.perf_counter() - t0
        batch = RolloutBatch(comps, wall_time_s=wall,   # the engines' plain estimate + what Ray added around them
                             plain_estimate_s=wall - pooled.wall_time_s + pooled.plain_estimate_s,
                             history_sizes=pooled.history_sizes, speculation_paused=pooled.speculation_paused,
                             speculation_tail_only=pooled.speculation_tail_only)
        with self._lock:
            self._step_completions.extend(comps)
            self._step_wall_s += batch.wall_time_s
            self._step_plain_s += batch.plain_estimate_s
            self._step_history = batch.history_sizes or self._step_history
            self._step_paused = self._step_paused or batch.speculation_paused
            self._step_tail_only = self._step_tail_only or batch.speculation_tail_only
            if self._cotrainer is not None:   # fire and forget: never waits on the co-trainer
                self._cotrainer.add_rollouts([(c.prompt, c.tokens) for c in comps])
        return batch

    def end_step(self, step: int, extra_metrics: dict | None = None) -> dict:
        """Monitor record of this step's generate() calls; applies a finished head refresh,
        notices a dead co-trainer, and asks the co-trainer about this step (without waiting)."""
        self._step = step
        if self._cotrainer is not None:
            self._cotrainer.poll(step)
        with self._lock:
            comps, wall, plain = self._step_completions, self._step_wall_s, self._step_plain_s
            history, paused, tail_only = self._step_history, self._step_paused, self._step_tail_only
            self._step_completions, self._step_wall_s, self._step_plain_s = [], 0.0, 0.0
            self._step_paused = self._step_tail_only = False
        if not comps:
            logger.warning("end_step(%d): no generate() since the last end_step; nothing recorded", step)
            return {"step": step, "num_completions": 0}
        rec = self.monitor.record_step(step, RolloutBatch(comps, wall_time_s=wall, plain_estimate_s=plain,
                                                          history_sizes=history, speculation_paused=paused,
                                                          speculation_tail_only=tail_only),
                                       extra=extra_metrics)
        if self._cotrainer is not None:
            self._cotrainer.observe(StepObservation(step, mean_entropy(comps), RolloutBatch(comps).spec_stats()
                                                    .acceptance_rate, max(c.head_version for c in comps)))
        return rec

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let a refresh in progress finish (up to `timeout` s; its heads are checkpointed and
        logged), close the monitor's files, stop the actors (and Ray, if this facade started it)."""
        if self._cotrainer is not None and timeout > 0:
            self.flush(timeout)
        self.monitor.close()
        self._pool.shutdown()
        if self._cotrainer is not None:
            self._cotrainer.shutdown()
        if self._owns_ray is not None:
            self._owns_ray.shutdown()
            self._owns_ray = None

    def __enter__(self) -> "RolloutAccelerator":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- heads -------------------------------------------------------------------------------------

    def publish_heads(self, named_tensors: dict[str, torch.Tensor], version: int, *, step: int | None = None,
                      reason: str = "published") -> None:
        """Heads trained elsewhere to every worker (one put); applied between generate calls."""
        self._publish(pack(named_tensors), version, {"reason": reason}, step=step)

    def _publish(self, flat: FlatWeights, version: int, detail: dict, step: int | None = None) -> None:
        with self._lock:
            ref = self._weights.set_heads(flat, version)
            self._pool.broadcast_heads(ref, version)
            self.monitor.record_event(self._step if step is None else step, "head_refresh",
                                      {"head_version": version, **detail})

    def current_heads(self) -> tuple[dict[str, torch.Tensor], int]:
        """The heads the workers run now and their version (what a run checkpoint saves)."""
        with self._lock:
            return unpack(ray.get(self._weights.heads_ref)), self.head_version

    @property
    def drafter_spec(self) -> DrafterSpec:
        """What rebuilds the heads from current_heads()'s tensors: MTP heads' depths or an EAGLE-3
        drafter's config (mtp_heads.drafters.drafter_from_flat)."""
        return self._weights.drafter

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (up to timeout s in all) for the co-trainer's pending decisions; True if none is left."""
        return True if self._cotrainer is None else self._cotrainer.flush(self._step, timeout)

    def restart_cotrainer(self) -> None:
        """Start a new co-trainer; it resumes from the last checkpoint in cotrainer.checkpoint_dir."""
        with self._lock:
            if self._cotrainer is None:
                self._cotrainer = self._new_cotrainer_client()
                self._record_event("cotrainer_restarted", {"head_version": self.head_version})
            else:
                self._cotrainer.restart()
