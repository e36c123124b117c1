"""The facade's side of the head co-trainer actor: send without waiting, poll, apply, restart.

Nothing in the head path may block rollouts (docs/design.md). Rollouts and step observations go
to the actor fire-and-forget; its decisions come back as object refs that are only polled.
A finished refresh is handed to `publish`; a dead actor is logged, restarted from its
checkpoint (up to max_restarts), and meanwhile rollouts go on with the last heads.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from mtp_heads.cotrainer import CoTrainerConfig, HeadCoTrainer, RefreshResult
from mtp_heads.refresh import StepObservation
from rollout.models.flat_weights import FlatWeights
from rollout.published_weights import PublishedWeights
from rollout.worker_pool import actor_threads

logger = logging.getLogger(__name__)

MAX_PENDING_OBSERVATIONS = 4   # co-trainer decisions in flight before observe() skips sending more
COTRAINER_NICENESS = 10        # added to the co-trainer's niceness: below rollouts and the RL trainer


class BackgroundCoTrainer(HeadCoTrainer):
    """The co-trainer in its own actor process, at a lower CPU priority than the processes on the
    rollout path (the workers and the RL trainer). Where it shares cores with them (every CPU run, a
    GPU node's host threads) it takes mostly the cycles they leave, instead of slowing the rollouts
    while it trains. It still gets a share under full load, so refreshes slow down rather than stop."""

    def __init__(self, *args, **kwargs):
        os.nice(COTRAINER_NICENESS)         # relative to the worker's own (0 on a local Ray we start)
        super().__init__(*args, **kwargs)


class CoTrainerClient:
    """Owns the co-trainer actor handle and its in-flight observe() calls, in order."""

    def __init__(self, cfg: CoTrainerConfig, weights: PublishedWeights, *, seed: int, lock: threading.RLock,
                 on_event: Callable[[str, dict], None],
                 publish: Callable[[FlatWeights, int, dict], None]):
        self.cfg = cfg
        self.seed = seed
        self._weights = weights
        self._lock = lock
        self._on_event = on_event                 # (kind, detail) -> recorded by the monitor
        self._publish = publish                   # (weights, head_version, detail) -> to the workers
        self._actor_cls = ray.remote(BackgroundCoTrainer)
        self._pending: deque[ray.ObjectRef] = deque()
        self.restarts = 0
        self.actor = self._spawn()

    def _spawn(self):
        """A co-trainer with the latest policy; it resumes its heads from checkpoint_dir if one is there."""
        c, pw = self.cfg, self._weights
        return self._actor_cls.options(num_cpus=c.num_cpus, num_gpus=c.num_gpus, max_restarts=0).remote(
            c, pw.policy_config, pw.full_policy_ref(), pw.policy_version, pw.heads_ref, pw.drafter,
            pw.head_version, seed=self.seed, num_threads=actor_threads(c.num_cpus),
            device="cuda" if c.num_gpus > 0 else "cpu")

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- fire and forget ------------------------------------------------------------------------

    def update_policy(self, ref: ray.ObjectRef, version: int) -> None:
        if self.actor is not None:
            self.actor.update_policy.remote(ref, version)

    def add_rollouts(self, sequences: list[tuple[list[int], list[int]]]) -> None:
        if self.actor is not None:
            self.actor.add_rollouts.remote(sequences)

    def observe(self, obs: StepObservation) -> bool:
        """Ask for this step's refresh decision; False (skipped) while MAX_PENDING are unanswered:
        a late decision on old data is worth less than a backlog."""
        if self.actor is None:
            return False
        if len(self._pending) >= MAX_PENDING_OBSERVATIONS:
            logger.warning("step %d: co-trainer is %d decisions behind; skipping this step's",
                           obs.step, len(self._pending))
            return False
        self._pending.append(self.actor.observe.remote(obs))
        return True

    # -- results ---------------------------------------------------------------------------------

    def poll(self, step: int, wait: float = 0.0) -> bool:
        """Apply finished decisions in order, waiting up to `wait` s (inf: no limit) for the first
        of them. False if one is still running."""
        first = True
        while self._pending:
            t = wait if first else 0.0
            done, _ = ray.wait([self._pending[0]], timeout=None if math.isinf(t) else t)
            first = False
            if not done:
                return False
            self._apply(self._pending.popleft(), step)
        return True

    def flush(self, step: int, timeout: float | None = None) -> bool:
        """Wait (up to timeout s in all) for the pending decisions; True if none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            left = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.poll(step, wait=left) and left == 0.0:
                break
        return not self._pending

    def _apply(self, ref: ray.ObjectRef, step: int) -> None:
        try:
            result: RefreshResult = ray.get(ref)
        except RayActorError as e:
            self._failed(step, e)
            return
        except ray.exceptions.RayTaskError as e:     # a bug or bad batch in observe(): log, keep rolling out
            logger.error("head co-trainer raised at step %d: %s", step, e)
            self._on_event("cotrainer_error", {"error": str(e)[:500]})
            return
        if not result.refreshed and result.reason.startswith("rejected"):
            self._on_event("head_refresh_rejected", {"reason": result.reason, "refresh_step": result.step,
                                                     "train_time_s": result.train_time_s})
        if result.refreshed:
            self._publish(result.weights, result.head_version, {
                "reason": result.reason, "refresh_step": result.step, "loss_first": result.losses[0],
                "loss_last": result.losses[-1], "train_time_s": result.train_time_s})

    def _failed(self, step: int, error: Exception) -> None:
        logger.error("head co-trainer died at step %d (%s); rollouts continue with head version %d",
                     step, type(error).__name__, self._weights.head_version)
        self._on_event("cotrainer_failed", {"head_version": self._weights.head_version, "error": str(error)[:500]})
        self.actor = None
        self._pending.clear()                      # the dead actor's other calls fail the same way
        if self.restarts < self.cfg.max_restarts:
            self.restarts += 1
            self.restart()

    def restart(self) -> None:
        """A new actor; it resumes from the last checkpoint in cfg.checkpoint_dir."""
        with self._lock:
            if self.actor is not None:
                ray.kill(self.actor)
            self._pending.clear()
            self.actor = self._spawn()
            self._on_event("cotrainer_restarted", {"head_version": self._weights.head_version})

    def shutdown(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
        self.actor = None
        self._pending.clear()
