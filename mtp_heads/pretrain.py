"""Head pre-training: the heads learn to draft the policy's own distribution, the policy stays frozen.

Data is any sequence source (mtp_heads.token_data): teacher-forced conversations from the token
store, or self-generated rollouts. Each optimiser step takes a batch (`batch_for_step`, a
function of (seed, step) only, so a resumed run sees the same data), unrolls the heads' draft
steps exactly as the engine drafts them (training-time test, mtp_heads.ttt) and applies the
objective of the current phase (mtp_heads.distill, the same core the co-trainer uses).

The objective schedule is a list of phases (objective, steps, lr), each continuing from the
previous phase's weights and AdamW state; the learning rate is phase.lr times one warm-up +
cosine shape over all steps. Checkpoints (heads + optimizer state) are written atomically every
`checkpoint_every` steps; resuming continues exactly (same batches, same optimizer state).

The same loop trains an EAGLE-3 drafter (train.drafter=eagle3): a `DrafterKind` says how a kind of
drafter starts, what its loss is and how it is checkpointed (HEADS here, EAGLE3 in
mtp_heads.eagle3_train).
"""
from __future__ import annotations

import io
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mtp_heads.checkpoint import HeadMeta, draft_vocab_of, load_heads, save_heads, set_draft_vocab
from mtp_heads.distill import DistillBatch, DrafterKind, DraftVocabMap, batch_from_sequences, check_objective, \
    distill_loss
from mtp_heads.eagle3_train import EAGLE3
from mtp_heads.heads import MTPHeads, grow_layers, init_heads, zero_residual_branches
from rollout.fileio import atomic_write, file_sha256
from rollout.models.decoder import CausalLM


@dataclass(frozen=True)
class Phase:
    """One stretch of the objective schedule."""

    objective: str = "tv"     # a key of mtp_heads.distill.OBJECTIVES
    steps: int = 100          # optimiser steps in this phase
    lr: float = 2e-3          # peak learning rate of this phase (times the warm-up/cosine shape)
    unroll_steps: int = 0     # draft steps trained in this phase (0 = train.unroll_steps): a cheap 1-step
                              # phase before the training-time-test phase costs a third per token
    feature_weight: float = 0.0   # + this x SmoothL1(head state, policy state at the drafted position)
                                  # (EAGLE's feature regression; mtp_heads.distill.feature_regression)

    def __post_init__(self) -> None:
        check_objective(self.objective)
        if self.steps < 0 or not self.lr > 0 or self.unroll_steps < 0 or not self.feature_weight >= 0:
            raise ValueError(f"a phase needs steps >= 0, lr > 0, unroll_steps >= 0 and feature_weight >= 0, got "
                             f"steps={self.steps}, lr={self.lr}, unroll_steps={self.unroll_steps}, "
                             f"feature_weight={self.feature_weight}")


SHIPPED_INIT = "shipped"   # train.init: the shipped heads of the model (resolved by experiments.pretrain_heads)
DRAFTERS = ("heads", "eagle3")                 # train.drafter: MTPHeads, or an EAGLE-3 drafter (mtp_heads.eagle3_train)
EAGLE3_INIT_NAMES = ("last_layer", "random")   # mtp_heads.eagle3_train.EAGLE3_INITS; else an EAGLE-3 directory


def _default_phases() -> list[Phase]:
    return [Phase("fkl", 60), Phase("tv", 60)]


@dataclass(frozen=True)
class TrainConfig:
    """How heads are trained (the `train` section of configs/train_heads.yaml)."""

    drafter: str = "heads"             # what is trained: `heads` (MTPHeads) or `eagle3` (an EAGLE-3 drafter in vLLM's
                                       # layout, reading the aux layers below)
    aux_layer_ids: list[int] = field(default_factory=list)   # eagle3: policy layers whose residual stream fc fuses
                                                             # (0 = embeddings .. L); [] = vLLM's (2, L // 2, L - 3)
    num_depths: int = 1                # distinct head depths; 1 = the recurrent (EAGLE-style) drafter
    num_layers: int = 1                # decoder layers per depth; a 1-layer init checkpoint is grown
                                       # to this with identity-started layers (heads.grow_layers)
    unroll_steps: int = 3              # draft steps trained per chain (training-time test); >= num_depths
    phases: list[Phase] = field(default_factory=_default_phases)   # the objective schedule
    batch_tokens: int = 2048           # sequence tokens per optimiser step (after cropping)
    max_seq_len: int = 512             # longer sequences are cropped to a window fixed by (seed, step)
    warmup_steps: int = 10             # linear warm-up of the learning rate
    min_lr_ratio: float = 0.1          # cosine decay over all phases down to lr * min_lr_ratio
    weight_decay: float = 0.0          # AdamW weight decay
    grad_clip: float = 1.0             # max gradient norm (0 = no clipping)
    temperature: float = 1.0           # of teacher p and student q in the loss
    draft_vocab_size: int = 8192       # most frequent trained tokens (+ EOS) the heads draft from; 0 = all
    init: str = "last_layer"           # a key of HEAD_INITS, a head checkpoint to fine-tune from, or
                                       # "shipped": the heads shipped for the model (its draft vocabulary kept
                                       # when draft_vocab_size is 0)
    checkpoint_every: int = 50         # steps between checkpoints (0 = only at the end)
    eval_every: int = 0                # steps between held-out evaluations (0 = only at the end)
    seed: int = 0                      # initialisation and batch order

    def __post_init__(self) -> None:
        if self.num_depths < 1 or self.num_layers < 1 or self.unroll_steps < self.num_depths:
            raise ValueError(f"need num_depths >= 1, num_layers >= 1 and unroll_steps >= num_depths, got "
                             f"{self.num_depths}, {self.num_layers}, {self.unroll_steps}")
        if not self.phases:
            raise ValueError("phases must list at least one (objective, steps, lr)")
        if self.batch_tokens < 1 or self.max_seq_len < self.unroll_steps + 2:
            raise ValueError(f"need batch_tokens >= 1 and max_seq_len >= unroll_steps + 2, got "
                             f"{self.batch_tokens}, {self.max_seq_len}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"train.drafter={self.drafter!r} is not a drafter kind; choose one of {list(DRAFTERS)}")
        if self.drafter == "heads":
            if self.init not in HEAD_INITS and self.init != SHIPPED_INIT and not self.init.endswith(".safetensors"):
                raise ValueError(f"unknown head init {self.init!r}; choose one of {sorted(HEAD_INITS)}, "
                                 f"{SHIPPED_INIT!r} or a .safetensors head checkpoint")
            if self.aux_layer_ids:
                raise ValueError(f"train.aux_layer_ids={list(self.aux_layer_ids)} is for train.drafter=eagle3; "
                                 "heads read the final hidden state")
        else:
            self._check_eagle3()
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = full vocabulary), got {self.draft_vocab_size}")

    def _check_eagle3(self) -> None:
        """What an EAGLE-3 drafter cannot be: checked before the policy loads (the aux ids' upper bound,
        which needs the policy's depth, is checked by mtp_heads.eagle3_train.aux_layer_ids_for)."""
        if self.num_depths != 1 or self.num_layers != 1:
            raise ValueError(f"train.drafter=eagle3 is one recurrent layer: train.num_depths and train.num_layers "
                             f"must be 1, got {self.num_depths} and {self.num_layers}")
        if self.init == SHIPPED_INIT or self.init.endswith(".safetensors"):
            raise ValueError(f"train.init={self.init!r} is a head checkpoint; an EAGLE-3 drafter starts from one of "
                             f"{list(EAGLE3_INIT_NAMES)} or an EAGLE-3 directory (config.json + model.safetensors)")
        ids = list(self.aux_layer_ids)
        if ids and (len(set(ids)) != len(ids) or ids != sorted(ids) or ids[0] < 0):
            raise ValueError(f"train.aux_layer_ids={ids}: must be distinct, ascending and >= 0 "
                             "(0 = embeddings .. L = the last layer)")
        for i, p in enumerate(self.phases):
            if p.feature_weight:
                raise ValueError(f"train.phases[{i}].feature_weight={p.feature_weight}: EAGLE-3 drafters have no "
                                 "feature target (their state is not the policy's); use 0")

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def phase_at(self, step: int) -> Phase:
        for p in self.phases:
            if step < p.steps:
                return p
            step -= p.steps
        return self.phases[-1]


# ----------------------------------------------------------------------------------- initialisation


def _last_layer_init(policy: CausalLM, num_depths: int, num_layers: int, seed: int, data) -> MTPHeads:
    return init_heads(policy, num_depths, seed=seed, num_layers=num_layers)


def _identity_init(policy: CausalLM, num_depths: int, num_layers: int, seed: int, data) -> MTPHeads:
    """Each depth starts as (almost) the identity on h, so q starts at the policy's own p_i: block
    residual branches zeroed, eh_proj = [0 | I], output norm at the hidden states' median RMS.
    (It trains to lower acceptance than last_layer.)"""
    heads = init_heads(policy, num_depths, seed=seed, num_layers=num_layers)
    h = torch.cat([torch.as_tensor(data[i].hidden).float() for i in range(min(len(data), 8))]) if len(data) else None
    rms = float(h.pow(2).mean(1).sqrt().median()) if h is not None else 1.0
    d = policy.config.hidden_size
    with torch.no_grad():
        for depth in heads.depths:
            for block in depth.blocks:
                zero_residual_branches(block)
            depth.eh_proj.weight.copy_(torch.cat([torch.zeros(d, d), torch.eye(d)], dim=1))
            depth.hnorm.weight.fill_(1.0)
            depth.norm.weight.fill_(rms)
    return heads


HEAD_INITS: dict[str, Callable[[CausalLM, int, int, int, object], MTPHeads]] = {
    "last_layer": _last_layer_init,      # heads.init_heads: a copy of the policy's last layer
    "identity": _identity_init,
}


def initial_heads(policy: CausalLM, cfg: TrainConfig, data, draft_vocab: torch.Tensor | None) -> MTPHeads:
    """Fresh heads (HEAD_INITS) or a checkpoint to fine-tune; `draft_vocab` overrides the checkpoint's."""
    if cfg.init in HEAD_INITS:
        heads = HEAD_INITS[cfg.init](policy, cfg.num_depths, cfg.num_layers, cfg.seed, data)
        return set_draft_vocab(heads, draft_vocab)
    heads, meta = load_heads(cfg.init, policy)
    if meta.num_depths != cfg.num_depths:
        raise ValueError(f"init={cfg.init} has {meta.num_depths} depths, train.num_depths is {cfg.num_depths}")
    if meta.num_layers > cfg.num_layers:
        raise ValueError(f"init={cfg.init} has {meta.num_layers} layers per depth, train.num_layers is "
                         f"{cfg.num_layers}; heads can grow, not shrink")
    heads = grow_layers(heads, policy, cfg.num_layers)
    if draft_vocab is not None:
        set_draft_vocab(heads, draft_vocab)
    return heads


# ----------------------------------------------------------------------------------- batches and schedule


def batch_for_step(data, cfg: TrainConfig, step: int, device) -> DistillBatch:
    """Random sequences (a random window of each long one) up to cfg.batch_tokens; depends only on
    (cfg.seed, step), so a resumed run sees exactly the batches an uninterrupted one would. A source
    whose sequences carry `.aux` (mtp_heads.data.aux_states) fills DistillBatch.aux."""
    g = np.random.default_rng([cfg.seed, step])
    order = g.permutation(len(data))
    seqs, total = [], 0
    for i in order:
        s = data[int(i)]
        n = len(s.tokens)
        lo = int(g.integers(0, n - cfg.max_seq_len + 1)) if n > cfg.max_seq_len else 0
        hi = min(n, lo + cfg.max_seq_len)
        if not np.asarray(s.loss_mask[lo:hi]).any():
            continue
        aux = getattr(s, "aux", None)               # recorded aux states (EAGLE-3), when the source has them
        seqs.append((s.tokens[lo:hi], s.hidden[lo:hi], s.loss_mask[lo:hi], None if aux is None else aux[lo:hi]))
        total += hi - lo
        if total >= cfg.batch_tokens:
            break
    if not seqs:
        raise ValueError("no training sequence has a trained position (loss_mask is all False)")
    return batch_from_sequences(seqs, device)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """phase.lr x (linear warm-up, then cosine decay to min_lr_ratio over all phases)."""
    total = cfg.total_steps
    if step < cfg.warmup_steps:
        shape = (step + 1) / cfg.warmup_steps
    else:
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        shape = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.phase_at(step).lr * shape


def step_loss(heads: MTPHeads, policy: CausalLM, batch: DistillBatch, cfg: TrainConfig, step: int,
              vocab: DraftVocabMap):
    """The loss of one pre-training step: the current phase's objective through the distillation core."""
    phase = cfg.phase_at(step)
    return distill_loss(heads, policy, batch, phase.objective, vocab, temperature=cfg.temperature,
                        steps=max(phase.unroll_steps or cfg.unroll_steps, cfg.num_depths),
                        feature_weight=phase.feature_weight)


# ----------------------------------------------------------------------------------- drafter kinds


def _save_heads(path, heads: MTPHeads, step: int, cfg: TrainConfig, meta_defaults: dict) -> None:
    loss = "+".join(f"{p.objective}:{p.steps}" + (f"@k{p.unroll_steps}" if p.unroll_steps else "") for p in cfg.phases)
    save_heads(path, heads, HeadMeta.for_heads(heads, loss=loss, steps=step, **meta_defaults))


def _load_heads(path, policy: CausalLM) -> tuple[MTPHeads, int]:
    heads, meta = load_heads(path, policy)
    return heads, meta.steps


HEADS = DrafterKind(
    name="heads", initial=initial_heads, loss=step_loss,
    vocab=lambda policy, heads: DraftVocabMap.build(policy, draft_vocab_of(heads)),
    save=_save_heads, load=_load_heads, weights_file=Path, exists=lambda path: Path(path).is_file())


DRAFTER_KINDS: dict[str, DrafterKind] = {"heads": HEADS, "eagle3": EAGLE3}


def drafter_kind(name: str) -> DrafterKind:
    if name not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {name!r}; choose one of {list(DRAFTERS)}")
    return DRAFTER_KINDS[name]


# ----------------------------------------------------------------------------------- checkpoints


def train_state_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".train.pt")



def save_training_checkpoint(path, heads, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                             meta_defaults: dict, history: list[dict]) -> None:
    """The drafter (heads: safetensors + JSON; eagle3: config.json + model.safetensors), then the
    optimizer state, each written atomically; the state names its step and the digest of the weights
    file, so a crash between the two is detected on resume."""
    kind = drafter_kind(cfg.drafter)
    kind.save(path, heads, step, cfg, meta_defaults)
    state = {"step": step, "optimizer": opt.state_dict(), "config": asdict(cfg), "history": history,
             "weights_sha256": file_sha256(kind.weights_file(Path(path)))}
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write(train_state_path(path), buf.getvalue())


def load_train_state(path: Path) -> dict:
    """The optimizer state, step, config and history that save_training_checkpoint wrote. Read with
    weights_only: the file may come from someone else, and a full unpickle would run any code in it."""
    if not path.is_file():
        raise ValueError(f"{path} is missing: it holds the optimizer state that resume needs; restart without resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's errors do not name the file
        raise ValueError(f"{path} is not a readable train-heads state ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}); restart without resume") from None
    if not isinstance(state, dict) or not {"step", "optimizer", "config"} <= state.keys():
        raise ValueError(f"{path} is not a train-heads state (no step, optimizer and config); restart without resume")
    return state


# ----------------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    heads: MTPHeads
    steps: int
    losses: list[float]          # per step of this call
    rows_per_s: float            # trained (chain, step) rows per second
    tokens_per_s: float          # batch sequence tokens per second
    history: list[dict]          # what `on_eval` returned, with the step, over the whole run (resumes included)


def train_heads(policy: CausalLM, data, cfg: TrainConfig, *, draft_vocab: torch.Tensor | None = None,
                checkpoint: str | os.PathLike | None = None, resume: bool = False,
                meta_defaults: dict | None = None, progress: bool = True, stop_after: int | None = None,
                on_eval: Callable[[int, MTPHeads], dict] | None = None, eval_at_start: bool = False) -> TrainResult:
    """Train heads on the sequence source `data` (see module docstring); the policy is never touched.

    checkpoint: where heads (+ `.train.pt`) are written every cfg.checkpoint_every steps and at
    the end; resume=True continues from it. on_eval(step, heads) runs every cfg.eval_every steps
    and at the end (and at step 0 with eval_at_start); its dicts are kept in the training state
    (the scaling curve). stop_after
    ends the call after that many total steps (an interruption, in tests).
    """
    if len(data) == 0:
        raise ValueError("no training sequences")
    device = policy.lm_head_weight.device
    kind = drafter_kind(cfg.drafter)
    start, history, state = 0, [], None
    if resume:
        if checkpoint is None or not kind.exists(Path(checkpoint)):
            raise ValueError(f"resume needs an existing checkpoint; {checkpoint} does not exist")
        heads, recorded = kind.load(checkpoint, policy)
        state = load_train_state(train_state_path(checkpoint))
        digest = state.get("weights_sha256")
        if (recorded is not None and state["step"] != recorded) or state["config"] != asdict(cfg) or \
                (digest is not None and digest != file_sha256(kind.weights_file(Path(checkpoint)))):
            raise ValueError(f"{train_state_path(checkpoint)} (step {state['step']}) does not belong to "
                             f"{checkpoint} (step {recorded if recorded is not None else 'unrecorded'}: other "
                             "weights) or the config differs; restart without resume")
        start, history = state["step"], list(state.get("history", []))
    else:
        heads = kind.initial(policy, cfg, data, draft_vocab)
    heads = heads.to(device=device, dtype=torch.float32).train()
    for prm in heads.parameters():
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.phases[0].lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    vocab = kind.vocab(policy, heads)
    total = cfg.total_steps
    end = total if stop_after is None else min(total, stop_after)
    losses, rows_done, toks_done, t0 = [], 0, 0, time.perf_counter()
    if on_eval is not None and eval_at_start and start == 0:
        heads.eval()
        history.append({"step": 0, **on_eval(0, heads)})
        heads.train()
    bar = tqdm(range(start, end), desc="train heads", unit="step", disable=not progress)
    for step in bar:
        phase = cfg.phase_at(step)
        batch = batch_for_step(data, cfg, step, device)
        out = kind.loss(heads, policy, batch, cfg, step, vocab)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(heads.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(out.loss.detach()))
        rows_done += out.rows
        toks_done += int(batch.tokens.numel())
        bar.set_postfix(obj=phase.objective, loss=f"{losses[-1]:.4f}",
                        tok_s=f"{toks_done / (time.perf_counter() - t0):.0f}")
        done = step + 1
        if on_eval is not None and ((cfg.eval_every and done % cfg.eval_every == 0) or done == total):
            heads.eval()
            history.append({"step": done, **on_eval(done, heads)})
            heads.train()
        if checkpoint is not None and ((cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == end):
            save_training_checkpoint(checkpoint, heads, opt, done, cfg, meta_defaults or {}, history)
    bar.close()
    heads.eval()
    for prm in heads.parameters():
        prm.requires_grad_(False)
    dt = max(time.perf_counter() - t0, 1e-9)
    return TrainResult(heads, end, losses, rows_done / dt, toks_done / dt, history)
