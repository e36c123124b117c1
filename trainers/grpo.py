"""Compact GRPO with an entropy control, trained one step off-policy.

Per RL step: G completions per prompt, rewards from the task checkers, advantages
normalised inside each group (A = (r - mean_g) / (std_g + eps)), and a token-level
clipped-ratio loss against the rollout's own log-probabilities:

    ratio_t = exp(log pi_theta(y_t) - log pi_rollout(y_t))           (both from raw logits)
    loss    = sum_t [ -min(ratio_t A, clip(ratio_t, 1-eps_low, 1+eps_high) A) - c_H H_t ] / #tokens

H_t is the policy's entropy at the token (temperature 1). The entropy coefficient c_H and
the sampling temperature follow schedules (`ScheduleConfig`), so that the policy's entropy
rises over a run the way Bebop describes RL doing, which is what the MTP heads must survive.
Rollouts for step t+1 run in a background thread (`Prefetcher`) while step t trains; the
ratio corrects for that one step of staleness.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rollout.models.decoder import CausalLM
from rollout.types import RolloutBatch
from trainers.rl_policy import trainable_copy

# ------------------------------------------------------------------------------ schedules

SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda frac: 0.0,
    "linear": lambda frac: frac,
    "cosine": lambda frac: 0.5 - 0.5 * math.cos(math.pi * frac),
}


@dataclass(frozen=True)
class ScheduleConfig:
    """A value that moves from `start` (step 0) to `end` (last step) along `shape`."""

    start: float = 0.0        # value at step 0
    end: float = 0.0          # value at the last step
    shape: str = "linear"     # `constant` (stays at start), `linear`, `cosine`

    def __post_init__(self) -> None:
        if self.shape not in SCHEDULES:
            raise ValueError(f"schedule shape {self.shape!r} is unknown; choose one of {sorted(SCHEDULES)}")

    def at(self, step: int, total_steps: int) -> float:
        frac = min(max(step / max(total_steps - 1, 1), 0.0), 1.0)
        return self.start + (self.end - self.start) * SCHEDULES[self.shape](frac)


# ------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class GRPOConfig:
    """The policy update. Defaults suit a 135M model on 2 CPU cores."""

    prompts_per_step: int = 4            # prompts P per RL step
    group_size: int = 4                  # completions G per prompt (advantages are normalised within a group)
    lr: float = 1e-5                     # AdamW learning rate of the policy
    weight_decay: float = 0.0            # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)   # AdamW betas
    clip_low: float = 0.2                # ratio clipped below at 1 - clip_low
    clip_high: float = 0.28              # ratio clipped above at 1 + clip_high (DAPO's clip-higher: room for
                                         # low-probability tokens to grow)
    max_grad_norm: float = 1.0           # gradient norm clip
    adv_eps: float = 1e-6                # added to the group's reward std
    entropy_coef: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(0.0, 0.01))  # entropy bonus coefficient
    micro_batch: int = 8                 # completions per forward/backward (memory bound)
    train_last_layers: int = 2           # train the last N decoder layers (-1: all); the rest is frozen
    train_final_norm: bool = True        # train the final RMSNorm
    train_embeddings: bool = False       # train the (tied) embedding / LM head, which the MTP heads share

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1 or self.group_size < 2:
            raise ValueError(f"grpo needs prompts_per_step >= 1 and group_size >= 2 (advantages are relative "
                             f"within a group), got {self.prompts_per_step} and {self.group_size}")
        if self.lr <= 0 or self.micro_batch < 1:
            raise ValueError(f"grpo.lr must be > 0 and grpo.micro_batch >= 1, got {self.lr}, {self.micro_batch}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"grpo.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, "
                             f"{self.clip_high}")


# ------------------------------------------------------------------------------ the loss


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P*G] (groups contiguous) -> advantages [P*G]; a group with equal rewards gets 0."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)                                      # [P, G]
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)).view(-1)


def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, entropy: torch.Tensor,
                    *, clip_low: float, clip_high: float, entropy_coef: float,
                    num_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped policy-gradient loss with an entropy bonus, summed then / num_tokens.

    logp, old_logp, adv, entropy: [M] one entry per completion token (adv repeated per token);
    num_tokens: tokens of the whole step, so that micro-batches add up to the step's mean.
    """
    ratio = torch.exp(logp - old_logp)                                             # [M]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)                                # [M]
    loss = (pg - entropy_coef * entropy).sum() / num_tokens
    with torch.no_grad():
        stats = {"pg_loss": pg.sum() / num_tokens, "entropy": entropy.sum() / num_tokens,
                 "clip_frac": ((ratio - clipped).abs() > 0).float().sum() / num_tokens,
                 "approx_kl": (old_logp - logp).sum() / num_tokens}
    return loss, stats


@dataclass
class PackedTokens:
    """Completions of one micro-batch as padded rows, and their completion tokens flattened."""

    seq: torch.Tensor        # [N, L] int64 prompt + completion, right-padded with 0
    target: torch.Tensor     # [N, L-1] bool: seq[:, t+1] is a completion token (predicted at t)
    old_logp: torch.Tensor   # [M] rollout log p of each completion token, row-major
    adv: torch.Tensor        # [M] its completion's advantage


def pack_completions(prompts: list[list[int]], completions: list[list[int]], old_logprobs: list[list[float]],
                     advantages: list[float]) -> PackedTokens:
    """Lay prompt+completion rows side by side; completions without tokens contribute none."""
    L = max(len(p) + len(c) for p, c in zip(prompts, completions))
    seq = torch.zeros(len(prompts), L, dtype=torch.long)
    target = torch.zeros(len(prompts), L - 1, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        target[i, len(p) - 1:len(p) - 1 + len(c)] = True
    old = torch.tensor([x for lp in old_logprobs for x in lp], dtype=torch.float32)
    adv = torch.tensor([a for a, c in zip(advantages, completions) for _ in c], dtype=torch.float32)
    return PackedTokens(seq, target, old, adv)


def token_logprobs(model: CausalLM, packed: PackedTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t) and entropy H_t (nats, temperature 1) of every completion token: [M], [M]."""
    hidden = model.hidden_states(packed.seq[:, :-1])                               # [N, L-1, d]
    logits = model.compute_logits(hidden[packed.target])                          # [M, V] float32
    logprobs = F.log_softmax(logits, -1)
    tokens = packed.seq[:, 1:][packed.target]                                      # [M]
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, tokens[:, None]).squeeze(-1), entropy


# ------------------------------------------------------------------------------ the trainer


class GRPOTrainer:
    """Owns a trainable copy of the policy and its AdamW; one `step` per RL step."""

    def __init__(self, policy: CausalLM, cfg: GRPOConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.model, self.trainable_names = trainable_copy(
            policy, cfg.train_last_layers, cfg.train_final_norm, cfg.train_embeddings)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)

    def step(self, batch: RolloutBatch, rewards: list[float], step: int) -> dict[str, float]:
        """One clipped-ratio update on a batch of P groups of G completions (groups contiguous)."""
        cfg, comps = self.cfg, batch.completions
        if len(comps) != len(rewards):
            raise ValueError(f"{len(comps)} completions but {len(rewards)} rewards")
        adv = group_advantages(torch.tensor(rewards), cfg.group_size, cfg.adv_eps).tolist()
        num_tokens = sum(len(c.tokens) for c in comps)
        coef = cfg.entropy_coef.at(step, self.total_steps)
        totals: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for lo in range(0, len(comps), cfg.micro_batch):
            part = comps[lo:lo + cfg.micro_batch]
            if not any(c.tokens for c in part):
                continue
            packed = pack_completions([c.prompt for c in part], [c.tokens for c in part],
                                      [c.logprobs for c in part], adv[lo:lo + cfg.micro_batch])
            logp, ent = token_logprobs(self.model, packed)
            loss, stats = grpo_token_loss(logp, packed.old_logp, packed.adv, ent, clip_low=cfg.clip_low,
                                          clip_high=cfg.clip_high, entropy_coef=coef, num_tokens=num_tokens)
            loss.backward()
            for k, v in {"loss": loss.detach(), **stats}.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm) if totals else torch.tensor(0.)
        if totals:
            self.optimizer.step()
        return {**totals, "grad_norm": float(grad_norm), "entropy_coef": coef, "num_tokens": num_tokens,
                "reward": float(np.mean(rewards)), "adv_abs": float(np.mean(np.abs(adv)))}

    def trained_weights(self) -> dict[str, torch.Tensor]:
        """The trained parameters only (HF names), detached: what the rollout side must receive."""
        named = dict(self.model.named_parameters())
        return {n: named[n].detach().clone() for n in self.trainable_names}


# ------------------------------------------------------------------------------ one step ahead


class Prefetcher:
    """Runs `generate` for the next step in a background thread while the current step trains.

    Only one generation is in flight at a time, so weights are synced strictly between two
    generate calls: batch t+1 is produced by the policy of step t (one step off-policy).
    """

    def __init__(self, generate: Callable[[int], Any]):
        self._generate = generate
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._pending: Future | None = None
        self._lock = threading.Lock()

    def submit(self, step: int) -> None:
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("a generation is already in flight: call result() before the next submit()")
            self._pending = self._pool.submit(self._generate, step)

    def result(self) -> Any:
        with self._lock:
            if self._pending is None:
                raise RuntimeError("nothing was submitted")
            pending, self._pending = self._pending, None
        return pending.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
