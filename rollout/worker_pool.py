"""N rollout workers as Ray actors: split prompts over them, retry a chunk whose worker died.

A worker that dies mid-generate is replaced by a fresh actor loading the newest published
weights, and its prompt chunk is re-run on the next worker; a chunk keeps its own sampling
seed across retries, so the completions do not depend on which worker produced them.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from rollout.published_weights import PublishedWeights
from rollout.types import RolloutBatch, SamplingParams, sum_history_sizes
from rollout.workers import RolloutWorker, WorkerConfig

logger = logging.getLogger(__name__)
RECENT_PER_WORKER = 512   # rollouts kept per worker slot to seed a replacement's history


def actor_threads(num_cpus: float) -> int:
    """Torch threads of an actor = its whole CPUs (more threads than CPUs run several times slower)."""
    return max(1, int(math.floor(num_cpus)))


class PromptRouter:
    """Prompt -> worker slot, sticky across calls (bounded: the least recently routed prompts are
    forgotten first), new prompts to the least loaded slot of the call."""

    def __init__(self, num_slots: int, max_prompts: int = 65_536):
        self.num_slots, self.max_prompts = num_slots, max_prompts
        self._slot: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def route(self, prompts: list[list[int]]) -> list[list[int]]:
        """Row indices per slot (in prompt order within each slot; a slot may get none)."""
        rows: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        for i, p in enumerate(prompts):
            rows.setdefault(tuple(p), []).append(i)
        load, out = [0] * self.num_slots, [[] for _ in range(self.num_slots)]
        known = [(key, idx) for key, idx in rows.items() if key in self._slot]
        new = [(key, idx) for key, idx in rows.items() if key not in self._slot]
        for key, idx in known:
            load[self._slot[key]] += len(idx)
        for key, idx in new:
            self._slot[key] = min(range(self.num_slots), key=lambda s: load[s])
            load[self._slot[key]] += len(idx)
        for key, idx in rows.items():
            self._slot.move_to_end(key)
            out[self._slot[key]].extend(idx)
        while len(self._slot) > self.max_prompts:
            self._slot.popitem(last=False)
        return [sorted(x) for x in out]


def chunk_sampling(sp: SamplingParams, chunk: int) -> SamplingParams:
    """Distinct seeds per chunk (a GRPO group split across workers must not repeat itself);
    chunk 0 keeps the caller's seed, and a retried chunk reuses its own."""
    return sp if sp.seed is None or chunk == 0 else dataclasses.replace(sp, seed=sp.seed + 1_000_003 * chunk)


class WorkerPool:
    """The worker actors and their handles; the facade's lock guards replacement and broadcasts."""

    def __init__(self, cfg: WorkerConfig, weights: PublishedWeights, *, dtype: str, lock: threading.RLock,
                 on_event: Callable[[str, dict], None]):
        self.cfg = cfg
        self.dtype = dtype
        self._weights = weights
        self._lock = lock
        self._on_event = on_event              # (kind, detail) -> recorded by the monitor
        self._actor_cls = ray.remote(RolloutWorker)
        self.workers = [self._spawn(i) for i in range(cfg.num_workers)]
        self.router = PromptRouter(cfg.num_workers)
        # per slot, the last rollouts of the prompts routed there (prompt, tokens, policy version)
        self._recent: list[deque] = [deque(maxlen=RECENT_PER_WORKER) for _ in range(cfg.num_workers)]

    def _spawn(self, i: int):
        """A fresh worker holding the latest policy and heads (also after a crash)."""
        w, pw = self.cfg, self._weights
        return self._actor_cls.options(num_cpus=w.num_cpus_per_worker, num_gpus=w.num_gpus_per_worker,
                                       max_restarts=0).remote(
            i, w, pw.policy_config, pw.full_policy_ref(), pw.policy_version, pw.heads_ref, pw.drafter,
            pw.head_version, dtype=self.dtype, num_threads=actor_threads(w.num_cpus_per_worker))

    def broadcast_policy(self, ref: ray.ObjectRef, version: int) -> None:
        """Fire and forget; each worker applies it after the generate call it may be running."""
        for w in self.workers:
            w.update_policy.remote(ref, version)

    def broadcast_heads(self, ref: ray.ObjectRef, version: int) -> None:
        for w in self.workers:
            w.update_heads.remote(ref, version)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """The completions in prompt order; each worker decodes the prompts routed to it, and a chunk whose
        worker died is retried on a live or respawned worker (cfg.max_retries times)."""
        routed = self.router.route(prompts)
        slots = [s for s, idx in enumerate(routed) if idx]
        chunks = [routed[s] for s in slots]
        results: dict[int, RolloutBatch] = {}
        inflight = {}    # ref -> (chunk, worker slot, the worker's handle, attempt)
        for c, (idx, slot) in enumerate(zip(chunks, slots)):
            inflight[self._submit(slot, prompts, idx, sampling, c)] = (c, slot, self.workers[slot], 0)
        while inflight:
            done, _ = ray.wait(list(inflight), num_returns=1)
            c, slot, handle, attempt = inflight.pop(done[0])
            try:
                results[c] = ray.get(done[0])
            except RayActorError as e:
                if attempt >= self.cfg.max_retries:
                    raise RuntimeError(f"prompt chunk {c} failed on {attempt + 1} workers; last error: {e}") from e
                if self.workers[slot] is handle:      # not yet replaced for another chunk
                    self.replace(slot, e)
                nxt = (slot + 1) % len(self.workers)   # a live worker: the replacement may wait for resources
                inflight[self._submit(nxt, prompts, chunks[c], sampling, c)] = (c, nxt, self.workers[nxt],
                                                                                attempt + 1)
        completions = [None] * len(prompts)
        for c, idx in enumerate(chunks):
            for i, comp in zip(idx, results[c].completions):
                completions[i] = comp
            for i in idx:   # what a replacement of this slot re-learns its history from
                comp = completions[i]
                self._recent[slots[c]].append((comp.prompt, comp.tokens, comp.policy_version))
        return RolloutBatch(completions, wall_time_s=max(r.wall_time_s for r in results.values()),
                            compile_time_s=max(r.compile_time_s for r in results.values()),
                            plain_estimate_s=max_or_nan([r.plain_estimate_s for r in results.values()]),
                            history_sizes=sum_history_sizes([r.history_sizes for r in results.values()]),
                            speculation_paused=any(r.speculation_paused for r in results.values()),
                            speculation_tail_only=any(r.speculation_tail_only for r in results.values()))

    def _submit(self, slot: int, prompts: list[list[int]], idx: list[int], sampling: SamplingParams, chunk: int):
        return self.workers[slot].generate.remote([prompts[i] for i in idx], chunk_sampling(sampling, chunk))

    def replace(self, slot: int, error: Exception) -> None:
        logger.warning("rollout worker %d died (%s); starting a replacement", slot, type(error).__name__)
        with self._lock:
            ray.kill(self.workers[slot])
            self.workers[slot] = self._spawn(slot)
            if self._recent[slot]:      # its prompts' recent rollouts: drafts from history resume at once
                self.workers[slot].remember.remote(list(self._recent[slot]))
            self._on_event("worker_restarted", {"worker": slot, "error": str(error)[:500]})

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def max_or_nan(values: list[float]) -> float:
    """The slowest worker's figure, or nan if any worker could not tell."""
    return max(values) if all(math.isfinite(v) for v in values) else float("nan")
