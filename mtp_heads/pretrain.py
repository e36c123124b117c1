"""Head pre-training by self-distillation: the policy writes the data, the heads learn to draft it.

SmolLM2 ships no MTP heads, so they are trained against the policy itself:

1. data    sample completions from the policy (TorchEngine, k = 0, temperature T) for chat
           prompts and RL-task prompts; keep each sequence's tokens and the policy's final-norm
           hidden state at every position. Generation dominates the cost on a CPU, so the result
           is cached as an .npz keyed by model, prompts and settings.
2. train   depth j at position i reads h^{j-1}_i and x_{i+j} (MTPHeads.teacher_forced) and is
           pulled toward the policy's own distribution at position i+j, p_j = softmax(W h_{i+j} / T),
           with one of the draft losses; AdamW on head parameters only, the policy stays frozen.
3. eval    on held-out sequences: per-depth E[1 - TV(p_j, q_j)] (rejection-mode acceptance) and
           E[p_j(argmax q_j)] (greedy mode), teacher-forced; and the engine's measured acceptance
           at k drafts per round.

Hidden states come from the decoding itself (SamplingParams.return_hidden_states) plus one
teacher-forced forward per distinct prompt: they equal policy.hidden_states(sequence) up to
float rounding (tests/test_pretrain.py checks it) and cost nothing extra.

An optional reduced draft vocabulary S (the N most frequent completion tokens) restricts q to
S: the heads then train against p renormalised on S, whose optimum is also optimal for the true
TV(p, q) with q supported on S, and drafting costs |S| instead of V LM-head rows.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mtp_heads.checkpoint import (HeadMeta, _atomic_write, default_heads_path, draft_vocab_of, load_heads,
                                  read_meta, save_heads, set_draft_vocab)
from mtp_heads.fused_tv import fused_linear_tv_e2e_loss, fused_linear_tv_loss
from mtp_heads.heads import MTPHeads, init_heads
from mtp_heads.losses import draft_loss
from rollout.models.decoder import CausalLM
from rollout.models.default_model import cache_dir
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams

DATA_FORMAT = 1

# Varied user turns (explanations, lists, code, maths, stories): the chat traffic heads must draft.
BUILTIN_PROMPTS: tuple[str, ...] = (
    "Explain why the sky is blue.",
    "Write a short poem about the ocean.",
    "What are three tips for staying healthy?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "How do I reverse a list in Python?",
    "What is the capital of France, and what is it famous for?",
    "Give me a recipe for pancakes.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a virus and a bacterium?",
    "List five animals that live in the desert.",
    "How does a rainbow form?",
    "Write a Python function that checks whether a number is prime.",
    "What causes the seasons on Earth?",
    "Describe your ideal weekend.",
    "Tell me a short story about a brave little mouse.",
    "What is machine learning?",
    "How many minutes are there in a day? Show your work.",
    "Give me three ideas for a birthday party.",
    "Why do cats purr?",
    "Explain what a black hole is.",
    "Write an email asking my manager for a day off.",
    "What are the benefits of reading books?",
    "How do airplanes stay in the air?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is 17 times 23?",
    "Name the planets of the solar system in order.",
    "Write a limerick about a cat who loves coffee.",
    "How can I improve my sleep?",
    "What is the water cycle?",
    "Explain the rules of chess briefly.",
    "Write a SQL query that counts the rows in a table called users.",
    "What is the Pythagorean theorem?",
    "Suggest a name for a coffee shop and explain why.",
    "What are the main causes of climate change?",
    "Describe how to make a paper airplane.",
    "Why is exercise important?",
    "What is the difference between weather and climate?",
    "Give me a motivational quote and explain it.",
    "How do vaccines work?",
)


@dataclass(frozen=True)
class DataConfig:
    """Which rollouts to generate for pre-training (and for the held-out evaluation)."""

    num_sequences: int = 128            # training sequences
    num_eval_sequences: int = 16        # held-out sequences (other prompts, other seeds)
    max_new_tokens: int = 96
    gen_batch_size: int = 32
    temperature: float = 1.0
    task_fraction: float = 0.25         # share of prompts drawn from trainers.tasks (when present)
    seed: int = 0


@dataclass(frozen=True)
class TrainConfig:
    """How the heads are trained on the generated data."""

    num_depths: int = 3
    loss: str = "tv"                    # a key of OBJECTIVES
    steps: int = 120
    seqs_per_step: int = 6
    lr: float = 2e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1           # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0            # of the teacher and the student
    draft_vocab_size: int = 4096        # 0 = full vocabulary (~12x the LM-head cost per step and per draft)
    init: str = "last_layer"            # a key of HEAD_INITS
    checkpoint_every: int = 40          # 0 = only at the end
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss not in OBJECTIVES:
            raise ValueError(f"unknown head loss {self.loss!r}; choose one of {sorted(OBJECTIVES)}")
        if not 1 <= self.num_depths:
            raise ValueError(f"num_depths must be >= 1, got {self.num_depths}")
        if self.steps < 0 or self.seqs_per_step < 1:
            raise ValueError(f"need steps >= 0 and seqs_per_step >= 1, got {self.steps}, {self.seqs_per_step}")
        if self.init not in HEAD_INITS:
            raise ValueError(f"unknown head init {self.init!r}; choose one of {sorted(HEAD_INITS)}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = full vocabulary), got {self.draft_vocab_size}")


# ----------------------------------------------------------------------------------- head initialisation


def _last_layer_init(policy: CausalLM, num_depths: int, seed: int, data: "TokenData") -> MTPHeads:
    return init_heads(policy, num_depths, seed=seed)


def _identity_init(policy: CausalLM, num_depths: int, seed: int, data: "TokenData") -> MTPHeads:
    """Each depth starts as (almost) the identity on h, so q_j starts at the policy's own p_i
    instead of a confidently wrong distribution: block residual branches zeroed (o_proj,
    down_proj), eh_proj = [0 | I], and the output norm rescaled to the hidden states' median RMS."""
    heads = init_heads(policy, num_depths, seed=seed)
    rms = float(np.median(np.sqrt((data.hidden[data.hidden.any(1)] ** 2).mean(1)))) if len(data) else 1.0
    d = policy.config.hidden_size
    with torch.no_grad():
        for depth in heads.depths:
            depth.block.self_attn.o_proj.weight.zero_()
            depth.block.mlp.down_proj.weight.zero_()
            depth.eh_proj.weight.copy_(torch.cat([torch.zeros(d, d), torch.eye(d)], dim=1))
            depth.hnorm.weight.fill_(1.0)
            depth.norm.weight.fill_(rms)
    return heads


HEAD_INITS: dict[str, Callable[[CausalLM, int, int, "TokenData"], MTPHeads]] = {
    "last_layer": _last_layer_init,      # heads.init_heads: a copy of the policy's last layer
    "identity": _identity_init,
}


# ----------------------------------------------------------------------------------- data


@dataclass
class TokenData:
    """Sequences (prompt + completion) with the policy's hidden state at every position.

    hidden[t] of a sequence is the final-norm state after reading tokens[..t] (it predicts
    tokens[t+1]); the last position's state is never needed and stored as zeros.
    """

    tokens: np.ndarray        # [total] int32, sequences back to back
    hidden: np.ndarray        # [total, d] float32
    offsets: np.ndarray       # [n+1] int64
    prompt_lens: np.ndarray   # [n] int32

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[lo:hi], self.hidden[lo:hi], int(self.prompt_lens[i])

    def completion_tokens(self) -> np.ndarray:
        return np.concatenate([self.sequence(i)[0][self.prompt_lens[i]:] for i in range(len(self))] or
                              [np.zeros(0, np.int32)])

    def num_completion_tokens(self) -> int:
        return int((self.lengths() - self.prompt_lens).sum())

    def save(self, path: Path) -> None:
        def write(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, tokens=self.tokens, hidden=self.hidden, offsets=self.offsets,
                         prompt_lens=self.prompt_lens)
        _atomic_write(Path(path), write)

    @classmethod
    def load(cls, path: Path) -> "TokenData":
        with np.load(path) as z:
            return cls(z["tokens"], z["hidden"], z["offsets"], z["prompt_lens"])

    @classmethod
    def concat(cls, parts: Sequence["TokenData"]) -> "TokenData":
        sizes = [p.offsets[-1] for p in parts]
        starts = np.cumsum([0] + sizes[:-1])
        return cls(np.concatenate([p.tokens for p in parts]), np.concatenate([p.hidden for p in parts]),
                   np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, starts)]).astype(np.int64),
                   np.concatenate([p.prompt_lens for p in parts]))


def chat_prompts(loaded, n: int, *, held_out: bool, task_fraction: float = 0.25, seed: int = 0) -> list[list[int]]:
    """n prompt token lists through the model's chat template; held_out picks disjoint prompts.

    Built-in prompts are split 4:1 into train/held-out; RL-task prompts (trainers.tasks, when
    importable) come from step 0 (train) or step 1 (held out) of the task sampler.
    """
    texts = [t for i, t in enumerate(BUILTIN_PROMPTS) if (i % 5 == 0) == held_out]
    n_tasks = int(round(n * task_fraction))
    task_texts: list[str] = []
    if n_tasks:
        try:
            from trainers.tasks import TaskConfig, TaskSampler
            task_texts = [t.prompt for t in TaskSampler(TaskConfig(seed=seed)).sample(n_tasks, int(held_out))]
        except ImportError:
            task_texts = []
    chosen = task_texts + [texts[i % len(texts)] for i in range(n - len(task_texts))]
    from rollout.models.loaders import apply_chat_template
    return [apply_chat_template(loaded, [{"role": "user", "content": t}]) for t in chosen]


def weights_digest(policy: CausalLM) -> str:
    """Cheap fingerprint of the weights (every 997th value of every tensor): keys the data cache."""
    h = hashlib.sha256()
    for name, t in sorted(policy.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().flatten()[::997].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def data_cache_path(policy: CausalLM, prompts: list[list[int]], cfg: DataConfig, split: str) -> Path:
    """$MTP_ROLLOUT_CACHE/pretrain_data/<key>.npz, key = hash(weights, prompts, settings, split)."""
    blob = json.dumps({"format": DATA_FORMAT, "arch": policy.config.fingerprint(), "weights": weights_digest(policy),
                       "prompts": prompts, "cfg": asdict(cfg), "split": split}, sort_keys=True)
    return cache_dir() / "pretrain_data" / f"{split}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}.npz"


def generate_token_data(policy: CausalLM, prompts: list[list[int]], cfg: DataConfig, *, seed: int,
                        progress: bool = True) -> TokenData:
    """Sample one completion per prompt (k = 0, temperature cfg.temperature) with the states."""
    engine = TorchEngine(policy)
    d = policy.config.hidden_size
    prompt_hidden: dict[tuple[int, ...], np.ndarray] = {}
    tokens, hidden, lengths, prompt_lens = [], [], [], []
    bar = tqdm(total=len(prompts), desc="generate", unit="seq", disable=not progress)
    started, made = time.perf_counter(), 0
    for b0 in range(0, len(prompts), cfg.gen_batch_size):
        chunk = prompts[b0:b0 + cfg.gen_batch_size]
        sp = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            seed=seed * 1_000_003 + b0, return_hidden_states=True)
        batch = engine.generate(chunk, sp)
        for prompt, comp in zip(chunk, batch.completions):
            key = tuple(prompt)
            if key not in prompt_hidden:
                with torch.inference_mode():
                    ids = torch.tensor([prompt], dtype=torch.long, device=policy.lm_head_weight.device)
                    prompt_hidden[key] = policy.hidden_states(ids)[0].float().cpu().numpy()
            P = len(prompt)
            tokens.append(np.asarray(list(prompt) + comp.tokens, dtype=np.int32))
            hidden.append(np.concatenate([prompt_hidden[key][:P - 1], comp.hidden_states,
                                          np.zeros((1, d), np.float32)]))
            lengths.append(P + len(comp.tokens))
            prompt_lens.append(P)
            made += len(comp.tokens)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{made / (time.perf_counter() - started):.0f}")
    bar.close()
    return TokenData(np.concatenate(tokens), np.concatenate(hidden).astype(np.float32),
                     np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                     np.asarray(prompt_lens, dtype=np.int32))


def cached_token_data(policy: CausalLM, prompts: list[list[int]], cfg: DataConfig, split: str, *,
                      seed: int, progress: bool = True) -> TokenData:
    """generate_token_data, reusing the .npz from an earlier run with the same key."""
    path = data_cache_path(policy, prompts, cfg, split)
    if path.is_file():
        return TokenData.load(path)
    data = generate_token_data(policy, prompts, cfg, seed=seed, progress=progress)
    data.save(path)
    return data


def draft_vocab_from_counts(data: TokenData, size: int, vocab_size: int,
                            always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent completion tokens (plus `always`, e.g. EOS): sorted ids [<= size + len(always)]."""
    if size <= 0 or size >= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}), got {size}")
    counts = np.bincount(data.completion_tokens(), minlength=vocab_size)
    top = np.argsort(-counts, kind="stable")[:size]
    return torch.unique(torch.tensor(np.concatenate([top, np.asarray(always, dtype=np.int64)]), dtype=torch.long))


# ----------------------------------------------------------------------------------- training


@dataclass
class Batch:
    tokens: torch.Tensor       # [B, T] int64 (0 after the end)
    hidden: torch.Tensor       # [B, T, d] policy final-norm states
    lengths: torch.Tensor      # [B]
    prompt_lens: torch.Tensor  # [B]


def make_batch(data: TokenData, idx: Sequence[int], device, dtype=torch.float32) -> Batch:
    seqs = [data.sequence(int(i)) for i in idx]
    T = max(len(s[0]) for s in seqs)
    d = data.hidden.shape[1]
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    hidden = torch.zeros(len(seqs), T, d, dtype=torch.float32)
    for b, (tok, hid, _) in enumerate(seqs):
        tokens[b, :len(tok)] = torch.from_numpy(tok.astype(np.int64))
        hidden[b, :len(tok)] = torch.from_numpy(hid)
    return Batch(tokens.to(device), hidden.to(device=device, dtype=dtype),
                 torch.tensor([len(s[0]) for s in seqs], device=device),
                 torch.tensor([s[2] for s in seqs], device=device))


def depth_mask(batch: Batch, j: int, width: int) -> torch.Tensor:
    """[B, width] True where depth j at position i has a completion label: P <= i+j+1 <= L-1."""
    label_pos = torch.arange(width, device=batch.tokens.device)[None] + j + 1
    return (label_pos >= batch.prompt_lens[:, None]) & (label_pos <= batch.lengths[:, None] - 1)


@dataclass
class DepthRows:
    """Training rows of one depth: student states, teacher states, sampled next tokens."""

    student: torch.Tensor   # [N, d] (requires grad)
    target: torch.Tensor    # [N, d] policy state at i+j
    labels: torch.Tensor    # [N] x_{i+j+1}


def depth_rows(batch: Batch, outs: list[torch.Tensor]) -> list[DepthRows]:
    rows = []
    for j, out in enumerate(outs, start=1):
        width = out.shape[1]
        mask = depth_mask(batch, j, width)
        rows.append(DepthRows(out[mask], batch.hidden[:, j:j + width][mask], _labels(batch, j, width)[mask]))
    return rows


def _labels(batch: Batch, j: int, width: int) -> torch.Tensor:
    # [B, width] x_{i+j+1}, 0 past the end (masked anyway)
    lab = torch.zeros(batch.tokens.shape[0], width, dtype=torch.long, device=batch.tokens.device)
    n = min(width, batch.tokens.shape[1] - j - 1)
    lab[:, :n] = batch.tokens[:, j + 1:j + 1 + n]
    return lab


@dataclass(frozen=True)
class DraftVocabMap:
    """Maps the full vocabulary onto the draft vocabulary S for training."""

    weight: torch.Tensor    # [|S|, d] LM-head rows of S (the full W when S is everything)
    index: torch.Tensor | None  # [V] position in S, -100 outside; None = full vocabulary

    @classmethod
    def build(cls, policy: CausalLM, draft_vocab: torch.Tensor | None) -> "DraftVocabMap":
        W = policy.lm_head_weight.detach()
        if draft_vocab is None:
            return cls(W, None)
        index = torch.full((W.shape[0],), -100, dtype=torch.long, device=W.device)
        index[draft_vocab.to(W.device)] = torch.arange(len(draft_vocab), device=W.device)
        return cls(W.index_select(0, draft_vocab.to(W.device)).contiguous(), index)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        return labels if self.index is None else self.index[labels]


# objective(rows per depth, vocabulary map, temperature) -> scalar loss
Objective = Callable[[list[DepthRows], DraftVocabMap, float], torch.Tensor]


def _logit_objective(kind: str) -> Objective:
    def fn(rows: list[DepthRows], vm: DraftVocabMap, T: float) -> torch.Tensor:
        losses = []
        for r in rows:
            student = F.linear(r.student, vm.weight)                                   # [N, |S|]
            if kind == "ce":
                losses.append(draft_loss("ce", student, labels=vm.labels(r.labels), temperature=T))
            else:
                with torch.no_grad():
                    target = F.linear(r.target, vm.weight)
                losses.append(draft_loss(kind, student, target_logits=target, temperature=T))
        return torch.stack(losses).mean()
    return fn


def _tv_objective(rows: list[DepthRows], vm: DraftVocabMap, T: float) -> torch.Tensor:
    return torch.stack([fused_linear_tv_loss(r.student, r.target, vm.weight, T) for r in rows]).mean()


def _tv_e2e_objective(rows: list[DepthRows], vm: DraftVocabMap, T: float) -> torch.Tensor:
    # rows of all depths at the same positions i: see common_rows
    student = torch.stack([r.student for r in rows], 1)                              # [N, D, d]
    target = torch.stack([r.target for r in rows], 1)
    return fused_linear_tv_e2e_loss(student, target, vm.weight, T) / len(rows)


@dataclass(frozen=True)
class ObjectiveSpec:
    fn: Objective
    same_positions: bool   # all depths at the same positions i (expected accepted length)


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "ce": ObjectiveSpec(_logit_objective("ce"), False),
    "fkl": ObjectiveSpec(_logit_objective("fkl"), False),
    "rkl": ObjectiveSpec(_logit_objective("rkl"), False),
    "tv": ObjectiveSpec(_tv_objective, False),
    "tv_e2e": ObjectiveSpec(_tv_e2e_objective, True),
}


def common_rows(batch: Batch, outs: list[torch.Tensor]) -> list[DepthRows]:
    """Rows at positions i where every depth has a completion label (for tv_e2e)."""
    D = len(outs)
    width = outs[-1].shape[1]
    mask = torch.ones_like(depth_mask(batch, 1, width))
    for j in range(1, D + 1):
        mask &= depth_mask(batch, j, width)
    return [DepthRows(out[:, :width][mask], batch.hidden[:, j:j + width][mask], _labels(batch, j, width)[mask])
            for j, out in enumerate(outs, start=1)]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def batch_indices(n: int, k: int, seed: int, step: int) -> list[int]:
    """The sequences of one step: depends only on (seed, step), so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randperm(n, generator=g)[:min(k, n)].tolist()


def train_state_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".train.pt")


@dataclass
class TrainResult:
    heads: MTPHeads
    steps: int
    losses: list[float]          # per step of this call
    rows_per_s: float            # trained (position, depth) rows per second


def train_heads(policy: CausalLM, data: TokenData, cfg: TrainConfig, *, draft_vocab: torch.Tensor | None = None,
                checkpoint: str | os.PathLike | None = None, resume: bool = False,
                meta_defaults: dict | None = None, progress: bool = True,
                stop_after: int | None = None) -> TrainResult:
    """Train cfg.num_depths heads on `data` (see module docstring); policy weights are never touched.

    checkpoint: where heads (+ `.train.pt` optimizer state) are written every
    cfg.checkpoint_every steps and at the end; resume=True continues from it. stop_after ends
    the call after that many total steps (simulates an interruption in tests).
    """
    if len(data) == 0:
        raise ValueError("no training sequences: generate data first")
    spec = OBJECTIVES[cfg.loss]
    p = policy.lm_head_weight
    start = 0
    if resume:
        if checkpoint is None or not Path(checkpoint).is_file():
            raise ValueError(f"--resume needs an existing checkpoint, {checkpoint} does not exist")
        heads, meta = load_heads(checkpoint, policy)
        state = torch.load(train_state_path(checkpoint), weights_only=False)
        if state["step"] != meta.steps or state["config"] != asdict(cfg):
            raise ValueError(f"{train_state_path(checkpoint)} (step {state['step']}) does not belong to "
                             f"{checkpoint} (step {meta.steps}) or the config differs; restart without --resume")
        start = meta.steps
        draft_vocab = draft_vocab_of(heads)
    else:
        heads = HEAD_INITS[cfg.init](policy, cfg.num_depths, cfg.seed, data)
        set_draft_vocab(heads, draft_vocab)
    heads = heads.to(device=p.device, dtype=torch.float32).train()
    for prm in heads.parameters():
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if resume:
        opt.load_state_dict(state["optimizer"])
    vm = DraftVocabMap.build(policy, draft_vocab)
    if vm.weight.dtype != torch.float32:
        vm = DraftVocabMap(vm.weight.float(), vm.index)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    losses, rows_done, t0 = [], 0, time.perf_counter()
    bar = tqdm(range(start, end), desc=f"train {cfg.loss}", unit="step", disable=not progress, initial=0)
    for step in bar:
        batch = make_batch(data, batch_indices(len(data), cfg.seqs_per_step, cfg.seed, step), p.device)
        outs = heads.teacher_forced(policy, batch.hidden, batch.tokens)
        rows = common_rows(batch, outs) if spec.same_positions else depth_rows(batch, outs)
        rows = [r for r in rows if r.student.shape[0] > 0]
        if not rows:
            raise ValueError("a training batch has no completion positions deep enough for the heads; "
                             "generate longer completions or use fewer depths")
        loss = spec.fn(rows, vm, cfg.temperature)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(heads.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        rows_done += sum(r.student.shape[0] for r in rows)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{rows_done / (time.perf_counter() - t0):.0f}")
        done = step + 1
        if checkpoint is not None and ((cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == end):
            save_training_checkpoint(checkpoint, heads, opt, done, cfg, meta_defaults or {})
    bar.close()
    heads.eval()
    for prm in heads.parameters():
        prm.requires_grad_(False)
    return TrainResult(heads, end, losses, rows_done / max(time.perf_counter() - t0, 1e-9))


def save_training_checkpoint(path, heads: MTPHeads, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                             meta_defaults: dict) -> None:
    """Heads (safetensors + JSON) and the optimizer state, both written atomically."""
    meta = HeadMeta.for_heads(heads, loss=cfg.loss, steps=step, **meta_defaults)
    save_heads(path, heads, meta)
    state = {"step": step, "optimizer": opt.state_dict(), "config": asdict(cfg)}
    _atomic_write(train_state_path(path), lambda tmp: torch.save(state, tmp))


# ----------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def teacher_forced_acceptance(policy: CausalLM, heads: MTPHeads, data: TokenData, temperature: float = 1.0,
                              seqs_per_batch: int = 8, chunk: int = 512) -> list[dict]:
    """Per depth on `data`: E[1 - TV(p_j, q_j)] (rejection), E[p_j(argmax q_j)] (greedy), rows.

    p is the policy's full-vocabulary distribution at temperature T; q is the head's, zero
    outside the heads' draft vocabulary when they have one.
    """
    W = policy.lm_head_weight.detach().float()
    vocab = draft_vocab_of(heads)
    W_draft = W if vocab is None else W.index_select(0, vocab.to(W.device))
    sums = [[0.0, 0.0, 0] for _ in range(heads.num_depths)]
    was_training = heads.training
    heads.eval()
    for b0 in range(0, len(data), seqs_per_batch):
        batch = make_batch(data, range(b0, min(b0 + seqs_per_batch, len(data))), W.device)
        outs = heads.teacher_forced(policy, batch.hidden.to(W.dtype), batch.tokens)
        for j, r in enumerate(depth_rows(batch, outs)):
            for c0 in range(0, r.student.shape[0], chunk):
                p = torch.softmax(r.target[c0:c0 + chunk].float() @ W.t() / temperature, -1)        # [n, V]
                q_small = torch.softmax(r.student[c0:c0 + chunk].float() @ W_draft.t() / temperature, -1)
                q = q_small if vocab is None else torch.zeros_like(p).index_copy_(1, vocab.to(W.device), q_small)
                sums[j][0] += float(torch.minimum(p, q).sum(-1).sum())
                sums[j][1] += float(p.gather(1, q.argmax(-1, keepdim=True)).sum())
                sums[j][2] += q.shape[0]
    heads.train(was_training)
    return [{"depth": j + 1, "rejection": s[0] / max(s[2], 1), "greedy": s[1] / max(s[2], 1), "rows": s[2]}
            for j, s in enumerate(sums)]


def engine_acceptance(policy: CausalLM, heads: MTPHeads, prompts: list[list[int]], *, k: int = 3,
                      temperature: float = 1.0, max_new_tokens: int = 128, batch_size: int = 8,
                      modes: Sequence[str] = ("greedy", "rejection"), seed: int = 0) -> dict[str, dict]:
    """The engine's measured acceptance at k drafts per round, per draft mode."""
    engine = TorchEngine(policy, heads)
    out = {}
    for mode in modes:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, num_draft_tokens=k,
                            draft_mode=mode, seed=seed)
        stats, wall, ntok = None, 0.0, 0
        for b0 in range(0, len(prompts), batch_size):
            batch = engine.generate(prompts[b0:b0 + batch_size], sp)
            s = batch.spec_stats()
            stats = s if stats is None else stats.merge(s)
            wall += batch.wall_time_s
            ntok += batch.num_tokens
        out[mode] = {"acceptance_rate": stats.acceptance_rate, "acceptance_length": stats.acceptance_length,
                     "conditional_acceptance": stats.conditional_acceptance, "rounds": stats.num_drafts,
                     "tokens_per_s": ntok / wall if wall else float("nan")}
    return out


def decode_speedup(policy: CausalLM, heads: MTPHeads, prompts: list[list[int]], *, k: int = 3,
                   temperature: float = 1.0, max_new_tokens: int = 128, draft_mode: str = "rejection",
                   repeats: int = 1, seed: int = 0) -> dict:
    """Batch-1 tokens/s of plain decoding (k = 0) vs speculative (k), prompt by prompt, interleaved
    so that load from other processes hits both alike."""
    engine = TorchEngine(policy, heads)
    times = {0: [0.0, 0], k: [0.0, 0]}
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            for kk in (0, k):
                sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, num_draft_tokens=kk,
                                    draft_mode=draft_mode, seed=seed + 1000 * r + i, ignore_eos=True)
                batch = engine.generate([prompt], sp)
                times[kk][0] += batch.wall_time_s
                times[kk][1] += batch.num_tokens
    base, spec = times[0][1] / times[0][0], times[k][1] / times[k][0]
    return {"k": k, "plain_tokens_per_s": base, "spec_tokens_per_s": spec, "speedup": spec / base,
            "draft_mode": draft_mode, "max_new_tokens": max_new_tokens, "prompts": len(prompts) * repeats}


@torch.inference_mode()
def draft_cost(policy: CausalLM, heads: MTPHeads, *, context: int = 96, k: int = 3, repeats: int = 15) -> dict:
    """Batch-1 wall times (ms, medians) of the pieces of one speculative round.

    target_1 / target_k1: policy forward over 1 / k+1 new tokens after `context` cached ones;
    head_block: one depth's block on 1 token; lm_head_full / lm_head_draft: logits over V / the
    draft vocabulary. Speedup ~ tau * target_1 / (target_k1 + k * (head_block + lm_head)).
    """
    dev = policy.lm_head_weight.device
    d = policy.config.hidden_size
    ids = torch.randint(3, policy.config.vocab_size, (1, context + k + 1), device=dev)
    cache = policy.new_cache(1, context + k + 2)
    policy.hidden_states(ids[:, :context], cache)
    hcache = heads.new_caches(1, context + k + 2, policy.lm_head_weight.dtype, dev)[0]
    pos = torch.tensor([[context]], device=dev)
    h = torch.randn(1, 1, d, device=dev, dtype=policy.lm_head_weight.dtype)
    heads.depth_forward(0, policy, torch.randn(1, context, d, device=dev), ids[:, 1:context + 1],
                        torch.arange(context, device=dev)[None], hcache)
    vocab = draft_vocab_of(heads)
    W_draft = policy.lm_head_weight if vocab is None else policy.lm_head_weight.index_select(0, vocab)
    start = torch.tensor([context], device=dev)

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return 1000 * float(np.median(ts))

    out = {
        "target_1": timed(lambda: policy.hidden_states(ids[:, context:context + 1], cache, start)),
        "target_k1": timed(lambda: policy.hidden_states(ids[:, context:context + k + 1], cache, start)),
        "head_block": timed(lambda: heads.depth_forward(0, policy, h, ids[:, context:context + 1], pos, hcache)),
        "lm_head_full": timed(lambda: torch.softmax(policy.compute_logits(h[:, 0]), -1)),
        "lm_head_draft": timed(lambda: torch.softmax(F.linear(h[:, 0], W_draft).float(), -1)),
        "draft_vocab_size": int(W_draft.shape[0]), "k": k, "context": context,
    }
    return out


# ----------------------------------------------------------------------------------- the default heads


@dataclass(frozen=True)
class PretrainPlan:
    """Everything one pre-training run needs; the defaults are the cached default heads."""

    model: str = "smollm2-135m"
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()


def prepare_data(policy: CausalLM, loaded, data_cfg: DataConfig, progress: bool = True) -> tuple[TokenData, TokenData]:
    """(train, held-out) token data for a loaded model, from the cache when present."""
    train_prompts = chat_prompts(loaded, data_cfg.num_sequences, held_out=False,
                                 task_fraction=data_cfg.task_fraction, seed=data_cfg.seed)
    eval_prompts = chat_prompts(loaded, data_cfg.num_eval_sequences, held_out=True,
                                task_fraction=data_cfg.task_fraction, seed=data_cfg.seed)
    train = cached_token_data(policy, train_prompts, data_cfg, "train", seed=data_cfg.seed, progress=progress)
    held = cached_token_data(policy, eval_prompts, data_cfg, "eval", seed=data_cfg.seed + 1, progress=progress)
    return train, held


def pretrain(policy: CausalLM, loaded, plan: PretrainPlan, out: str | os.PathLike, *, resume: bool = False,
             progress: bool = True) -> tuple[MTPHeads, HeadMeta, TokenData, TokenData, TrainResult]:
    """Data (cached) -> draft vocabulary -> training with checkpoints at `out`."""
    train, held = prepare_data(policy, loaded, plan.data, progress)
    vocab = None
    if 0 < plan.train.draft_vocab_size < policy.config.vocab_size:      # else: the full vocabulary
        vocab = draft_vocab_from_counts(train, plan.train.draft_vocab_size, policy.config.vocab_size,
                                        always=policy.config.eos_token_ids)
    notes = json.dumps({"data": asdict(plan.data), "train_tokens": train.num_completion_tokens()}, sort_keys=True)
    result = train_heads(policy, train, plan.train, draft_vocab=vocab, checkpoint=out, resume=resume,
                         meta_defaults={"model_spec": plan.model, "notes": notes}, progress=progress)
    return result.heads, read_meta(out), train, held, result


def load_or_train_default_heads(policy: CausalLM, loaded, *, model_spec: str = "smollm2-135m",
                                plan: PretrainPlan | None = None, progress: bool = True) -> tuple[MTPHeads, HeadMeta]:
    """The cached heads for this policy; trains (and caches) them first when there are none.

    Heads cached for another architecture are retrained and replaced (the file name is per
    model spec, so this happens only when the model behind a spec changed).
    """
    plan = plan or PretrainPlan(model=model_spec)
    path = default_heads_path(model_spec, plan.train.num_depths, plan.train.loss)
    if path.is_file():
        try:
            return load_heads(path, policy)
        except ValueError:
            pass
    pretrain(policy, loaded, plan, path, progress=progress)
    return load_heads(path, policy)
