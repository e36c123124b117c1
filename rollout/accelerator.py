"""RolloutAccelerator: the one object an RL pipeline talks to.

It starts N rollout workers and one head co-trainer as Ray actors (resources from the
config, so the same code runs on a laptop's local Ray and on a GPU cluster), keeps the
acceptance monitor in the driver, and offers four calls: sync_policy, generate, end_step,
shutdown. Nothing in the head path blocks rollouts: the co-trainer is only ever sent
fire-and-forget calls and polled without waiting; if it dies, rollouts go on with the last
heads and it is restarted from its checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from mtp_heads.heads import MTPHeads, init_heads
from rollout.models.decoder import CausalLM, build_model
from rollout.monitor import AcceptanceMonitor, MonitorConfig
from rollout.types import Completion, RolloutBatch, SamplingParams
from rollout.weights import FlatWeights, pack, torch_dtype
from rollout.workers import ENGINES, RolloutWorker
from trainers.cotrainer import HeadCoTrainer, RefreshResult
from trainers.refresh import REFRESH_POLICIES, StepObservation

logger = logging.getLogger(__name__)

MAX_PENDING_OBSERVATIONS = 4   # co-trainer decisions in flight before end_step skips sending more


@dataclass(frozen=True)
class WorkerConfig:
    num_workers: int = 1
    num_cpus_per_worker: float = 1
    num_gpus_per_worker: float = 0
    engine: str = "torch"               # a key of rollout.workers.ENGINES
    max_retries: int = 2                # per prompt chunk, after its worker died


@dataclass(frozen=True)
class CoTrainerConfig:
    enabled: bool = True
    loss: str = "tv"                    # a key of trainers.cotrainer.HEAD_LOSSES
    lr: float = 1e-3
    steps_per_refresh: int = 20
    batch_tokens: int = 2048            # tokens per training batch (prompt + completion)
    replay_capacity: int = 64           # completions kept
    refresh: tuple[str, ...] = ("entropy_rise",)   # any of trainers.refresh.REFRESH_POLICIES
    every_n_steps: int = 10
    entropy_delta: float = 0.1          # nats
    acceptance_epsilon: float = 0.05
    num_cpus: float = 1
    num_gpus: float = 0
    checkpoint_dir: str | None = None   # None: no checkpoints, a restart starts from the initial heads
    temperature: float = 1.0            # of the TV target p and student q (match the rollouts' sampling)
    max_restarts: int = 1               # automatic restarts after the co-trainer died


@dataclass(frozen=True)
class AcceleratorConfig:
    workers: WorkerConfig
    cotrainer: CoTrainerConfig
    monitor: MonitorConfig
    model: str = "smollm2-135m"         # rollout.models.loaders.load_model spec
    heads_path: str | None = None       # mtp_heads.checkpoint file (also <checkpoint_dir>/heads_latest.safetensors)
    num_depths: int = 1
    dtype: str = "float32"              # rollout workers' weights
    ray_address: str | None = None      # None: start (or join) a local Ray
    seed: int = 0


def validate(cfg: AcceleratorConfig) -> None:
    w, c = cfg.workers, cfg.cotrainer
    if w.num_workers < 1:
        raise ValueError(f"workers.num_workers must be >= 1, got {w.num_workers}")
    if w.num_cpus_per_worker < 0 or w.num_gpus_per_worker < 0 or c.num_cpus < 0 or c.num_gpus < 0:
        raise ValueError("num_cpus / num_gpus must be >= 0")
    if w.max_retries < 0 or c.max_restarts < 0:
        raise ValueError("workers.max_retries and cotrainer.max_restarts must be >= 0")
    if w.engine not in ENGINES:
        raise ValueError(f"workers.engine {w.engine!r} unknown; choose from {sorted(ENGINES)}")
    refresh = (c.refresh,) if isinstance(c.refresh, str) else tuple(c.refresh)
    bad = [r for r in refresh if r not in REFRESH_POLICIES]
    if bad:
        raise ValueError(f"cotrainer.refresh has unknown policies {bad}; choose from {sorted(REFRESH_POLICIES)}")
    torch_dtype(cfg.dtype)


def _check_resources(cfg: AcceleratorConfig) -> None:
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


def _threads(num_cpus: float) -> int:
    return max(1, int(math.floor(num_cpus)))


def load_heads_for(path: str, policy: CausalLM, num_depths: int) -> MTPHeads:
    """Heads written by mtp_heads.checkpoint.save_heads (pre-training or a co-trainer checkpoint)."""
    from mtp_heads.checkpoint import load_heads

    heads, meta = load_heads(path, policy)
    if meta.num_depths != num_depths:
        raise ValueError(f"{path} holds {meta.num_depths} MTP depths but num_depths={num_depths}; "
                         f"set num_depths={meta.num_depths}")
    return heads


def _split(n: int, parts: int) -> list[range]:
    """Contiguous, balanced, non-empty index ranges."""
    parts = max(1, min(parts, n))
    bounds = np.linspace(0, n, parts + 1).round().astype(int)
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _chunk_sampling(sp: SamplingParams, chunk: int) -> SamplingParams:
    """Distinct seeds per chunk (a GRPO group split across workers must not repeat itself);
    chunk 0 keeps the caller's seed, and a retried chunk reuses its own."""
    return sp if sp.seed is None or chunk == 0 else dataclasses.replace(sp, seed=sp.seed + 1_000_003 * chunk)


def _mean_entropy(comps: list[Completion]) -> float:
    ent = [h for c in comps for h in c.entropies]
    return float(np.mean(ent)) if ent else float("nan")


class RolloutAccelerator:
    """Facade over the Ray actors; see module docstring. Build with from_config()."""

    def __init__(self, cfg: AcceleratorConfig, policy: CausalLM, heads: MTPHeads, *, owns_ray: bool):
        self.cfg = cfg
        self._owns_ray = owns_ray
        # generate() may run in a prefetch thread while the driver syncs weights or ends a step:
        # the lock keeps worker replacement, weight refs and the step's completions consistent.
        self._lock = threading.RLock()
        self._policy_config = policy.config
        self._num_depths = heads.num_depths
        # the full current policy (a sync may send only the trained tensors): what respawned actors load
        self._policy_state = {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}
        self._policy_index = {k: tuple(v.shape) for k, v in self._policy_state.items()}
        self._full_ref = ray.put(pack(self._policy_state))
        self.policy_version = 0
        self.head_version = 0
        self._heads_ref = ray.put(pack(heads.state_dict()))
        self._worker_cls = ray.remote(RolloutWorker)
        self._cotrainer_cls = ray.remote(HeadCoTrainer)
        self.workers = [self._spawn_worker(i) for i in range(cfg.workers.num_workers)]
        self.monitor = AcceptanceMonitor(cfg.monitor)
        self.cotrainer = None
        self._cotrainer_restarts = 0
        self._pending: deque[ray.ObjectRef] = deque()  # the co-trainer's in-flight observe() calls, in order
        if cfg.cotrainer.enabled:
            self.cotrainer = self._spawn_cotrainer()
        self._step_completions: list[Completion] = []
        self._step_wall_s = 0.0
        self._step = 0

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: AcceleratorConfig, *, policy: CausalLM | None = None,
                    heads: MTPHeads | None = None) -> "RolloutAccelerator":
        """Start (or join) Ray, load the policy and heads unless given, start the actors."""
        validate(cfg)
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(address=cfg.ray_address, include_dashboard=False)
        if cfg.ray_address is None:
            _check_resources(cfg)
        if policy is None:
            from rollout.models.loaders import load_model
            loaded = load_model(cfg.model)
            policy = build_model(loaded.config, loaded.state_dict, torch_dtype(cfg.dtype))
        if heads is None:
            heads = (load_heads_for(cfg.heads_path, policy, cfg.num_depths) if cfg.heads_path
                     else init_heads(policy, cfg.num_depths, seed=cfg.seed))
        heads.check_compatible(policy)
        return cls(cfg, policy, heads, owns_ray=owns_ray)

    def _full_policy_ref(self):
        if self._full_ref is None:
            self._full_ref = ray.put(pack(self._policy_state))
        return self._full_ref

    def _spawn_worker(self, i: int):
        """A fresh worker holding the latest policy and heads (also after a crash)."""
        w = self.cfg.workers
        return self._worker_cls.options(num_cpus=w.num_cpus_per_worker, num_gpus=w.num_gpus_per_worker,
                                        max_restarts=0).remote(
            i, w, self._policy_config, self._full_policy_ref(), self.policy_version, self._heads_ref, self._num_depths,
            self.head_version, dtype=self.cfg.dtype, num_threads=_threads(w.num_cpus_per_worker))

    def _spawn_cotrainer(self):
        """A co-trainer with the latest policy; it resumes its heads from checkpoint_dir if one is there."""
        c = self.cfg.cotrainer
        return self._cotrainer_cls.options(num_cpus=c.num_cpus, num_gpus=c.num_gpus, max_restarts=0).remote(
            c, self._policy_config, self._full_policy_ref(), self.policy_version, self._heads_ref, self._num_depths,
            self.head_version, seed=self.cfg.seed, num_threads=_threads(c.num_cpus),
            device="cuda" if c.num_gpus > 0 else "cpu")

    # -- the four calls ----------------------------------------------------------------------------

    def sync_policy(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """New policy weights to every worker and the co-trainer: one object-store put, no waiting.
        Workers apply them after the generate call they may be running."""
        tied = self._policy_config.tie_word_embeddings
        unknown = [k for k in named_tensors if k not in self._policy_index and not (tied and k == "lm_head.weight")]
        bad = [k for k, t in named_tensors.items() if k in self._policy_index
               and tuple(t.shape) != self._policy_index[k]]
        if unknown or bad:
            raise ValueError(f"sync_policy: names not in the policy {unknown[:5]}, wrong shapes {bad[:5]}; "
                             "send the policy's own state_dict names (HF naming)")
        flat = pack(named_tensors)
        with self._lock:
            with torch.no_grad():
                for k, t in named_tensors.items():        # keep the full current policy for respawns
                    if k in self._policy_state:
                        self._policy_state[k].copy_(t)
            self._full_ref = None                         # re-packed only if an actor must be respawned
            ref = ray.put(flat)
            self.policy_version = version
            for w in self.workers:
                w.update_policy.remote(ref, version)
            if self.cotrainer is not None:
                self.cotrainer.update_policy.remote(ref, version)

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
        chunks = _split(len(prompts), len(self.workers))
        results: dict[int, RolloutBatch] = {}
        inflight = {}    # ref -> (chunk, worker slot, the worker's handle, attempt)
        for c, idx in enumerate(chunks):
            slot = c % len(self.workers)
            inflight[self._submit(slot, prompts, idx, sampling, c)] = (c, slot, self.workers[slot], 0)
        while inflight:
            done, _ = ray.wait(list(inflight), num_returns=1)
            c, slot, handle, attempt = inflight.pop(done[0])
            try:
                results[c] = ray.get(done[0])
            except RayActorError as e:
                if attempt >= self.cfg.workers.max_retries:
                    raise RuntimeError(f"prompt chunk {c} failed on {attempt + 1} workers; last error: {e}") from e
                if self.workers[slot] is handle:      # not yet replaced for another chunk
                    self._replace_worker(slot, e)
                nxt = (slot + 1) % len(self.workers)
                inflight[self._submit(nxt, prompts, chunks[c], sampling, c)] = (c, nxt, self.workers[nxt],
                                                                                attempt + 1)
        comps = [comp for c in range(len(chunks)) for comp in results[c].completions]
        if domains is not None:
            for comp, dom in zip(comps, domains):
                comp.domain = dom
        batch = RolloutBatch(comps, wall_time_s=time.perf_counter() - t0)
        with self._lock:
            self._step_completions.extend(comps)
            self._step_wall_s += batch.wall_time_s
            if self.cotrainer is not None:   # fire and forget: never waits on the co-trainer
                self.cotrainer.add_rollouts.remote([(c.prompt, c.tokens) for c in comps])
        return batch

    def end_step(self, step: int, extra_metrics: dict | None = None) -> dict:
        """Monitor record of this step's generate() calls; applies a finished head refresh,
        notices a dead co-trainer, and asks the co-trainer about this step (without waiting)."""
        self._step = step
        self._poll_cotrainer(step)
        with self._lock:
            comps, wall = self._step_completions, self._step_wall_s
            self._step_completions, self._step_wall_s = [], 0.0
        if not comps:
            logger.warning("end_step(%d): no generate() since the last end_step; nothing recorded", step)
            return {"step": step, "num_completions": 0}
        rec = self.monitor.record_step(step, RolloutBatch(comps, wall_time_s=wall), extra=extra_metrics)
        batch_stats = RolloutBatch(comps).spec_stats()
        obs = StepObservation(step, _mean_entropy(comps), batch_stats.acceptance_rate,
                              max(c.head_version for c in comps))
        if self.cotrainer is not None:
            if len(self._pending) < MAX_PENDING_OBSERVATIONS:
                self._pending.append(self.cotrainer.observe.remote(obs))
            else:   # it is still training: a late decision on old data is worth less than no backlog
                logger.warning("end_step(%d): co-trainer is %d decisions behind; skipping this step's",
                               step, len(self._pending))
        return rec

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let a refresh in progress finish (up to `timeout` s; its heads are checkpointed and
        logged), close the monitor's files, stop the actors (and Ray, if this facade started it)."""
        if self.cotrainer is not None and timeout > 0:
            self.flush(timeout)
        self.monitor.close()
        for actor in [*self.workers, self.cotrainer]:
            if actor is not None:
                ray.kill(actor)
        self.workers, self.cotrainer = [], None
        self._pending.clear()
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "RolloutAccelerator":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- heads -------------------------------------------------------------------------------------

    def publish_heads(self, named_tensors: dict[str, torch.Tensor], version: int, *, step: int | None = None,
                      reason: str = "published") -> None:
        """Heads trained elsewhere to every worker (one put); applied between generate calls."""
        self._publish(pack(named_tensors), version, self._step if step is None else step, {"reason": reason})

    def _publish(self, flat: FlatWeights, version: int, step: int, detail: dict) -> None:
        with self._lock:
            self._heads_ref = ray.put(flat)
            self.head_version = version
            for w in self.workers:
                w.update_heads.remote(self._heads_ref, version)
            self.monitor.record_event(step, "head_refresh", {"head_version": version, **detail})

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (up to timeout s in all) for the co-trainer's pending decisions; True if none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            left = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._poll_cotrainer(self._step, wait=left) and left == 0.0:
                break
        return not self._pending

    def restart_cotrainer(self) -> None:
        """Start a new co-trainer; it resumes from the last checkpoint in cotrainer.checkpoint_dir."""
        with self._lock:
            if self.cotrainer is not None:
                ray.kill(self.cotrainer)
            self._pending.clear()
            self.cotrainer = self._spawn_cotrainer()
            self.monitor.record_event(self._step, "cotrainer_restarted", {"head_version": self.head_version})

    def _poll_cotrainer(self, step: int, wait: float = 0.0) -> bool:
        """Apply the co-trainer's finished decisions in order, waiting up to `wait` s (inf: no limit)
        for the first of them. False if one is still running."""
        first = True
        while self._pending:
            t = wait if first else 0.0
            done, _ = ray.wait([self._pending[0]], timeout=None if math.isinf(t) else t)
            first = False
            if not done:
                return False
            self._apply(self._pending.popleft(), step)
        return True

    def _apply(self, ref, step: int) -> None:
        try:
            result: RefreshResult = ray.get(ref)
        except RayActorError as e:
            self._cotrainer_failed(step, e)
            return
        except ray.exceptions.RayTaskError as e:     # a bug or bad batch in observe(): log, keep rolling out
            logger.error("head co-trainer raised at step %d: %s", step, e)
            self.monitor.record_event(step, "cotrainer_error", {"error": str(e)[:500]})
            return
        if result.refreshed:
            self._publish(result.weights, result.head_version, step, {
                "reason": result.reason, "refresh_step": result.step, "loss_first": result.losses[0],
                "loss_last": result.losses[-1], "train_time_s": result.train_time_s})

    def _cotrainer_failed(self, step: int, error: Exception) -> None:
        logger.error("head co-trainer died at step %d (%s); rollouts continue with head version %d",
                     step, type(error).__name__, self.head_version)
        self.monitor.record_event(step, "cotrainer_failed", {"head_version": self.head_version,
                                                             "error": str(error)[:500]})
        self.cotrainer = None
        self._pending.clear()                      # the dead actor's other calls fail the same way
        if self._cotrainer_restarts < self.cfg.cotrainer.max_restarts:
            self._cotrainer_restarts += 1
            self.restart_cotrainer()

    # -- workers -------------------------------------------------------------------------------------

    def _submit(self, slot: int, prompts, idx: range, sampling: SamplingParams, chunk: int):
        return self.workers[slot].generate.remote([prompts[i] for i in idx], _chunk_sampling(sampling, chunk))

    def _replace_worker(self, slot: int, error: Exception) -> None:
        logger.warning("rollout worker %d died (%s); starting a replacement", slot, type(error).__name__)
        with self._lock:
            ray.kill(self.workers[slot])
            self.workers[slot] = self._spawn_worker(slot)
            self.monitor.record_event(self._step, "worker_restarted", {"worker": slot, "error": str(error)[:500]})
