"""The head co-trainer: keeps the MTP heads close to a policy that RL keeps changing.

It runs beside the rollout workers (a Ray actor, created by rollout.accelerator) and never
sits on the rollout path: rollouts are fed to it fire-and-forget, it decides per RL step
whether to refresh (mtp_heads.refresh), trains the heads against its own copy of the current
policy by teacher forcing the recent rollouts, checkpoints atomically and hands the new
heads back to the facade, which publishes them to the workers.

The drafter may also be an EAGLE-3 drafter (mtp_heads.eagle3): its flat weights come with a
DrafterSpec (mtp_heads.drafters rebuilds either kind from the two), the aux states it reads are
recomputed from the replayed tokens in the same policy forward that gives the teacher's states
(mtp_heads.distill.batch_from_replay), its loss is mtp_heads.eagle3_train's and its checkpoint is an
EAGLE-3 directory (EAGLE3_NAME).
"""
from __future__ import annotations

import copy
import logging
import os
import random
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mtp_heads.checkpoint import HeadMeta, load_heads, save_heads
from mtp_heads.distill import OBJECTIVES, DistillBatch, DraftVocabMap, batch_from_replay, default_unroll_steps, \
    distill_loss
from mtp_heads.drafters import DrafterSpec, drafter_from_flat, trained_module
from mtp_heads.eagle3 import Eagle3Drafter
from mtp_heads.eagle3_checkpoint import WEIGHTS_FILE, load_eagle3, save_eagle3
from mtp_heads.eagle3_train import drafter_vocab, eagle3_loss
from mtp_heads.refresh import REFRESH_POLICIES, StepObservation, build_refresh_policy
from rollout.models.config import ModelConfig
from rollout.models.dtypes import parse_dtype
from rollout.models.flat_weights import FlatWeights, pack, policy_from_flat, unpack

logger = logging.getLogger(__name__)

HEADS_NAME = "heads_latest.safetensors"   # mtp_heads.checkpoint format: usable as heads_path
STATE_NAME = "cotrainer_state.pt"          # optimizer, refresh-policy state, history
EAGLE3_NAME = "eagle3_latest"              # an EAGLE-3 drafter's checkpoint directory (vLLM's layout)


def remove_checkpoint(checkpoint_dir: str | os.PathLike) -> None:
    """Delete a co-trainer's checkpoint (either drafter kind), so that a run rewound to an earlier step
    does not resume it from a later one."""
    d = Path(checkpoint_dir)
    for name in (HEADS_NAME, str(Path(HEADS_NAME).with_suffix(".json")), STATE_NAME):
        (d / name).unlink(missing_ok=True)
    shutil.rmtree(d / EAGLE3_NAME, ignore_errors=True)


@dataclass(frozen=True)
class CoTrainerConfig:
    """The head co-trainer: its objective, when it refreshes, its resources and checkpoints."""

    enabled: bool = True                # run the head co-trainer (false: heads stay as loaded)
    loss: str = "tv"                    # head loss: `tv` (default), `tv_e2e`, `tv_top64`, `fkl`, `rkl`, `ce`
    feature_weight: float = 0.0         # + this x the feature regression (SmoothL1 to the policy state), as in pre-training
    lr: float = 1e-3                    # co-trainer AdamW learning rate
    steps_per_refresh: int = 20         # head training steps per refresh (at most: see refresh_budget_s)
    refresh_budget_s: float = 0.0       # wall-clock budget of one refresh (>= 1 step); 0 = no limit. Keeps the
                                        # actor's queue (decisions, policy syncs, checkpoint state) moving
    batch_tokens: int = 2048            # tokens per head training batch (prompt + completion)
    replay_capacity: int = 64           # recent completions kept for head training
    refresh: tuple[str, ...] = ("entropy_rise",)   # when to refresh, any of: `every_n_steps`, `entropy_rise`,
                                                   # `acceptance_drop`, `never`
    every_n_steps: int = 10             # period of `every_n_steps`
    entropy_delta: float = 0.1          # nats of entropy rise that trigger `entropy_rise`
    acceptance_epsilon: float = 0.05    # acceptance drop that triggers `acceptance_drop`
    num_cpus: float = 1                 # Ray CPUs of the co-trainer (also its torch threads)
    num_gpus: float = 0                 # Ray GPUs of the co-trainer; > 0 trains on CUDA
    checkpoint_dir: str | None = None   # where the co-trainer checkpoints (a restart resumes from it); null: none
    temperature: float = 1.0            # temperature of the TV target p and student q (match the rollouts')
    max_restarts: int = 1               # automatic restarts of a dead co-trainer
    unroll_steps: int = 0               # draft steps trained per chain (training-time test); 0 = max(depths, 3)
    policy_dtype: str = "float32"       # the policy copy that teacher-forces replayed rollouts (heads always train
                                        # in float32); auto = bfloat16 where the hardware has it (3.5x faster there)

    def __post_init__(self) -> None:
        """Every value is checked here, when the config is built: the actor that would otherwise
        find it bad starts only after Ray, and its death would only cost the run its heads."""
        parse_dtype(self.policy_dtype)
        if self.loss not in OBJECTIVES:
            raise ValueError(f"cotrainer.loss={self.loss!r} is not a head loss; choose one of {sorted(OBJECTIVES)}")
        refresh = (self.refresh,) if isinstance(self.refresh, str) else tuple(self.refresh)
        bad = [r for r in refresh if r not in REFRESH_POLICIES]
        if bad:
            raise ValueError(f"cotrainer.refresh has unknown policies {bad}; choose from {sorted(REFRESH_POLICIES)}")
        if not refresh:
            raise ValueError(f"cotrainer.refresh is empty: name at least one of {sorted(REFRESH_POLICIES)}")
        for make in REFRESH_POLICIES.values():      # each policy checks its own parameter, used or not
            try:
                make(self)
            except ValueError as e:
                raise ValueError(f"cotrainer.{e}") from None
        for key in ("steps_per_refresh", "batch_tokens", "replay_capacity"):
            if getattr(self, key) < 1:
                raise ValueError(f"cotrainer.{key} must be >= 1, got {getattr(self, key)}")
        if not self.lr > 0:
            raise ValueError(f"cotrainer.lr must be > 0, got {self.lr}")
        if not self.temperature > 0:
            raise ValueError(f"cotrainer.temperature must be > 0, got {self.temperature}")
        if self.unroll_steps < 0:
            raise ValueError(f"cotrainer.unroll_steps must be >= 0 (0 = max(depths, 3)), got {self.unroll_steps}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"cotrainer.num_cpus / num_gpus must be >= 0, got {self.num_cpus} / {self.num_gpus}")
        if self.max_restarts < 0:
            raise ValueError(f"cotrainer.max_restarts must be >= 0, got {self.max_restarts}")
        if not self.refresh_budget_s >= 0:
            raise ValueError(f"cotrainer.refresh_budget_s must be >= 0 (0 = no limit), got {self.refresh_budget_s}")
        if not self.feature_weight >= 0:
            raise ValueError(f"cotrainer.feature_weight must be >= 0, got {self.feature_weight}")


@dataclass
class RefreshResult:
    """What one observe() call did; `weights` is set only when the heads changed."""

    refreshed: bool
    reason: str
    head_version: int
    step: int
    losses: list[float] = field(default_factory=list)
    train_time_s: float = 0.0
    weights: FlatWeights | None = None


class HeadCoTrainer:
    """Replay buffer + policy copy + heads + refresh policy + atomic checkpoints.

    Plain class: rollout.accelerator wraps it with ray.remote; tests may use it directly.
    """

    def __init__(self, config: CoTrainerConfig, policy_config: ModelConfig, policy_weights: FlatWeights,
                 policy_version: int, head_weights: FlatWeights, drafter: DrafterSpec, head_version: int = 0, *,
                 seed: int = 0, num_threads: int | None = None, device: str = "cpu"):
        if num_threads is not None:
            torch.set_num_threads(num_threads)   # match the actor's CPU share (oversubscribed is slower)
        self.config = config
        self.device = device
        self.policy = policy_from_flat(policy_config, policy_weights, config.policy_dtype, device)
        self.policy_version = policy_version
        self.heads = trained_module(drafter_from_flat(policy_config, drafter, head_weights, "float32", device)).train()
        self.is_eagle3 = isinstance(self.heads, Eagle3Drafter)
        if self.is_eagle3 and config.feature_weight:
            raise ValueError(f"cotrainer.feature_weight={config.feature_weight}: an EAGLE-3 drafter has no feature "
                             "target; use 0")
        # the same draft steps (training-time test) and draft vocabulary as pre-training: mtp_heads.distill
        self.unroll_steps = config.unroll_steps or default_unroll_steps(drafter.num_depths)
        self.head_version = head_version
        self.optimizer = torch.optim.AdamW(self.heads.parameters(), lr=config.lr, weight_decay=0.0)
        self.refresh_policy = build_refresh_policy(config)
        self.replay: deque[tuple[np.ndarray, int]] = deque(maxlen=config.replay_capacity)
        self.rng = random.Random(seed)
        self.history: list[dict] = []            # one entry per refresh: step, reason, version, loss
        self.train_steps = 0
        self.resumed_from: str | None = None
        self._load_checkpoint()

    # -- inputs ------------------------------------------------------------------------------

    def add_rollouts(self, sequences: list[tuple[list[int], list[int]]]) -> int:
        """(prompt, completion tokens) pairs; the oldest fall out of the bounded buffer."""
        for prompt, tokens in sequences:
            if tokens:
                self.replay.append((np.asarray(list(prompt) + list(tokens), dtype=np.int64), len(prompt)))
        return len(self.replay)

    def update_policy(self, weights: FlatWeights, version: int) -> None:
        sd = unpack(weights)
        if self.policy.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        self.policy.load_state_dict(sd, strict=False)
        self.policy_version = version

    # -- decisions -----------------------------------------------------------------------------

    def observe(self, obs: StepObservation) -> RefreshResult:
        """Decide on a refresh for this step; if so train, checkpoint and return the new heads."""
        fire, reason = self.refresh_policy.decide(obs)
        if not fire:
            return RefreshResult(False, "", self.head_version, obs.step)
        if not self.replay:
            logger.warning("co-trainer step %d: refresh wanted (%s) but the replay buffer is empty", obs.step, reason)
            return RefreshResult(False, f"skipped, empty replay buffer: {reason}", self.head_version, obs.step)
        t0 = time.perf_counter()
        held = self._held_out()
        held_batch = self._batch(held) if held else None     # one teacher-forcing forward, scored twice
        before = self._held_out_loss(held_batch)
        kept = {k: v.detach().clone() for k, v in self.heads.state_dict().items()}
        losses = self.train(self.config.steps_per_refresh, budget_s=self.config.refresh_budget_s,
                            exclude=len(held))
        after = self._held_out_loss(held_batch)
        if after is not None and not after < before:
            # worse (or no better) on the newest rollouts, which it did not train on: the workers keep
            # the heads they have; the optimizer keeps its moments, so the next refresh starts warmer
            self.heads.load_state_dict(kept)
            self.refresh_policy.on_refresh(obs, self.head_version)
            why = f"rejected ({reason}): held-out loss {before:.4f} -> {after:.4f}"
            self.history.append({"step": obs.step, "reason": why, "head_version": self.head_version,
                                 "policy_version": self.policy_version, "loss_first": losses[0],
                                 "loss_last": losses[-1], "train_steps": len(losses),
                                 "train_time_s": time.perf_counter() - t0, "rejected": True})
            logger.info("co-trainer refresh at step %d %s", obs.step, why)
            return RefreshResult(False, why, self.head_version, obs.step, losses, time.perf_counter() - t0)
        self.head_version += 1
        self.refresh_policy.on_refresh(obs, self.head_version)
        entry = {"step": obs.step, "reason": reason, "head_version": self.head_version,
                 "policy_version": self.policy_version, "loss_first": losses[0], "loss_last": losses[-1],
                 "heldout_before": before, "heldout_after": after,
                 "train_steps": len(losses), "train_time_s": time.perf_counter() - t0}
        self.history.append(entry)
        logger.info("co-trainer refresh -> head version %d at step %d: %s (loss %.4f -> %.4f)",
                    self.head_version, obs.step, reason, losses[0], losses[-1])
        self._save_checkpoint()
        return RefreshResult(True, reason, self.head_version, obs.step, losses, time.perf_counter() - t0,
                             self.head_weights())

    # -- training ------------------------------------------------------------------------------

    def _held_out(self) -> list[tuple[np.ndarray, int]]:
        """The newest rollouts a refresh validates on (a quarter of the replay, up to batch_tokens;
        none while the replay holds fewer than 4): the policy's latest behaviour, which the heads
        will draft for next."""
        held, total = [], 0
        for seq in reversed(list(self.replay)[-(len(self.replay) // 4):] if len(self.replay) >= 4 else []):
            held.append(seq)
            total += len(seq[0])
            if total >= self.config.batch_tokens:
                break
        return held

    @torch.no_grad()
    def _held_out_loss(self, batch: DistillBatch | None) -> float | None:
        return None if batch is None else float(self.batch_loss(batch))

    def _batch(self, seqs: list[tuple[np.ndarray, int]]) -> DistillBatch:
        """Replayed sequences with the current policy's states (and an EAGLE-3 drafter's aux states)."""
        return batch_from_replay(self.policy, seqs, self.device, self.heads.aux_layer_ids if self.is_eagle3 else None)

    def train(self, num_steps: int, budget_s: float = 0.0, exclude: int = 0) -> list[float]:
        """Up to num_steps optimiser steps on batches drawn from the replay buffer but its newest
        `exclude` sequences, stopping early once budget_s seconds are spent (0 = no limit; one step
        always runs); losses per step."""
        if not self.replay:
            raise ValueError("the replay buffer is empty: add_rollouts() before train()")
        losses = []
        deadline = time.perf_counter() + budget_s if budget_s > 0 else float("inf")
        for _ in range(num_steps):
            if losses and time.perf_counter() >= deadline:
                break
            loss = self.batch_loss(self._sample_batch(exclude))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.train_steps += 1
            losses.append(loss.item())
        return losses

    def batch_loss(self, batch: DistillBatch) -> torch.Tensor:
        """The co-trainer's loss on a batch: the distillation core with the heads' own draft vocabulary
        (the rows drafting computes) and the same draft steps as pre-training."""
        if self.is_eagle3:
            return eagle3_loss(self.heads, self.policy, batch, self.config.loss, drafter_vocab(self.policy, self.heads),
                               temperature=self.config.temperature, steps=self.unroll_steps).loss
        vocab = DraftVocabMap.for_heads(self.policy, self.heads)
        return distill_loss(self.heads, self.policy, batch, self.config.loss, vocab,
                            temperature=self.config.temperature, steps=self.unroll_steps,
                            feature_weight=self.config.feature_weight).loss

    def _sample_batch(self, exclude: int = 0) -> DistillBatch:
        """Random replay sequences until batch_tokens is reached (at least one), with the current
        policy's states (mtp_heads.distill.batch_from_replay; an EAGLE-3 drafter's aux states too)."""
        picked, total = [], 0
        order = list(range(max(1, len(self.replay) - exclude)))
        self.rng.shuffle(order)
        for i in order:
            picked.append(self.replay[i])
            total += len(picked[-1][0])
            if total >= self.config.batch_tokens:
                break
        return self._batch(picked)

    # -- outputs ----------------------------------------------------------------------------

    def head_weights(self) -> FlatWeights:
        return pack(self.heads.state_dict())

    def stats(self) -> dict:
        return {"head_version": self.head_version, "policy_version": self.policy_version,
                "replay_size": len(self.replay), "train_steps": self.train_steps,
                "refreshes": list(self.history), "resumed_from": self.resumed_from, "pid": os.getpid()}

    # -- a run's checkpoint (resume=true) -------------------------------------------------------

    def state(self) -> dict:
        """Everything a resumed run needs to continue as if never stopped (plain tensors and lists)."""
        return {"heads": {k: v.detach().cpu().clone() for k, v in self.heads.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "head_version": self.head_version,
                "refresh_state": self.refresh_policy.state(), "history": list(self.history),
                "train_steps": self.train_steps, "rng": list(self.rng.getstate()[1]),
                "replay": [(torch.from_numpy(seq.copy()), int(plen)) for seq, plen in self.replay]}

    def load_state(self, state: dict) -> None:
        """Undo state(); rewrites checkpoint_dir so that a later restart resumes from this state."""
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.head_version = int(state["head_version"])
        self.refresh_policy.load_state(state["refresh_state"])
        self.history = list(state["history"])
        self.train_steps = int(state["train_steps"])
        self.rng.setstate((3, tuple(state["rng"]), None))
        self.replay.clear()
        self.replay.extend((seq.numpy().astype(np.int64), plen) for seq, plen in state["replay"])
        self._save_checkpoint()

    # -- checkpoints ---------------------------------------------------------------------------

    def _save_checkpoint(self) -> None:
        """Heads via mtp_heads.checkpoint (atomic, with a header), then the trainer state, each
        written to a temporary file and os.replace'd; a crash leaves a consistent older pair."""
        d = self.config.checkpoint_dir
        if not d:
            return
        path = Path(d) / STATE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"optimizer": self.optimizer.state_dict(), "head_version": self.head_version,
                    "refresh_state": self.refresh_policy.state(), "history": self.history,
                    "train_steps": self.train_steps}, tmp)
        if self.is_eagle3:      # its version lives in the state only (the layout has no header of ours)
            save_eagle3(Path(d) / EAGLE3_NAME, self.heads)
        else:
            save_heads(Path(d) / HEADS_NAME, self.heads, HeadMeta.for_heads(
                self.heads, loss=self.config.loss, steps=self.train_steps, head_version=self.head_version,
                notes="head co-trainer refresh"))
        os.replace(tmp, path)

    def _load_checkpoint(self) -> None:
        d = self.config.checkpoint_dir
        if self.is_eagle3:
            self._load_eagle3_checkpoint()
            return
        if not d or not (Path(d) / HEADS_NAME).exists():
            return
        heads_path, state_path = Path(d) / HEADS_NAME, Path(d) / STATE_NAME
        heads, meta = load_heads(heads_path, self.policy)
        if meta.num_depths != self.heads.num_depths:
            raise ValueError(f"{heads_path} has {meta.num_depths} depths, this run uses {self.heads.num_depths}; "
                             "set num_depths to match or point checkpoint_dir elsewhere")
        self.heads.load_state_dict(heads.state_dict())
        self.head_version = meta.head_version
        state = torch.load(state_path, map_location=self.device, weights_only=True) if state_path.exists() else None
        if state is not None and state["head_version"] == meta.head_version:
            self._restore(state)
        else:
            logger.warning("%s missing or from another head version: resuming the heads only", state_path)
        self.resumed_from = str(heads_path)
        logger.info("co-trainer resumed from %s at head version %d", heads_path, self.head_version)

    def _restore(self, state: dict) -> None:
        """Optimizer, refresh-policy state, history and step count from a STATE_NAME checkpoint."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.refresh_policy.load_state(state["refresh_state"])
        self.history = list(state["history"])
        self.train_steps = int(state["train_steps"])

    def _load_eagle3_checkpoint(self) -> None:
        """The drafter and, when its state is there, the optimizer and refresh state; the version is the
        state's (a drafter without a state resumes its weights at this run's head version)."""
        d = self.config.checkpoint_dir
        if not d or not (Path(d) / EAGLE3_NAME / WEIGHTS_FILE).exists():
            return
        drafter = load_eagle3(Path(d) / EAGLE3_NAME, self.policy)
        if drafter.aux_layer_ids != self.heads.aux_layer_ids:
            raise ValueError(f"{Path(d) / EAGLE3_NAME} reads aux layers {list(drafter.aux_layer_ids)}, this run's "
                             f"drafter {list(self.heads.aux_layer_ids)}; point checkpoint_dir elsewhere")
        self.heads.load_state_dict(drafter.state_dict())
        state_path = Path(d) / STATE_NAME
        if state_path.exists():
            state = torch.load(state_path, map_location=self.device, weights_only=True)
            self._restore(state)
            self.head_version = int(state["head_version"])
        self.resumed_from = str(Path(d) / EAGLE3_NAME)
        logger.info("co-trainer resumed the EAGLE-3 drafter from %s at head version %d", self.resumed_from,
                    self.head_version)
