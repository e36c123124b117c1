"""The distillation core: one batch layout, one mask rule, one draft-vocabulary map, one objective registry.

Head pre-training (mtp_heads.pretrain) and the co-trainer (mtp_heads.cotrainer) both train through
`distill_loss`, so a refresh optimises exactly what pre-training and drafting use:

* layout   `DistillBatch`: right-padded tokens [B, T], the policy's final-norm states [B, T, d]
           (hidden[:, t] predicts tokens[:, t+1]) and loss_mask [B, T] (True where tokens[:, t+1]
           is text the heads should draft: completions / assistant turns). Built from stored
           sequences (`batch_from_sequences`) or from replayed rollouts with a policy forward
           (`batch_from_replay`).
* steps    `unroll` (mtp_heads.ttt) gives the head's state of draft step s at every chain start t;
           step s at t is trained iff loss_mask[t+s] (its teacher, the policy state at t+s, exists
           and predicts a trained token).
* vocab    `DraftVocabMap`: with a draft vocabulary S (the heads' `draft_vocab` buffer) both the
           student q and the teacher p are softmaxes over the LM-head rows of S only, i.e. p is
           renormalised on S; the optimum of TV(p_S, q) is also the best q supported on S for the
           true TV(p, q). Drafting computes exactly these |S| rows (MTPHeads.draft_logits).
* losses   `OBJECTIVES`: one entry per kind of mtp_heads.losses.draft_loss; "tv" and "tv_e2e" go
           through the fused kernels (no [N, V] tensors); "tv_top64" is "tv" restricted to the union of
           p's and q's 64 most likely tokens (Bebop's top-K TV, an ablation row). Every objective is the
           mean over steps of the mean over that step's rows; "tv_e2e" is (k - E[accepted of k]) / k, in [0, 1].
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mtp_heads.eagle3 import policy_states
from mtp_heads.fused_tv import fused_linear_tv_e2e_loss, fused_linear_tv_loss
from mtp_heads.heads import MTPHeads
from mtp_heads.losses import IGNORE_INDEX, draft_loss
from mtp_heads.ttt import unroll
from rollout.models.decoder import CausalLM

DEFAULT_UNROLL_STEPS = 3   # k drafted per round by default: the recurrent head is trained for 3 steps


def default_unroll_steps(num_depths: int) -> int:
    """Steps to unroll when none are given: every depth, and at least the default k."""
    return max(num_depths, DEFAULT_UNROLL_STEPS)


# ----------------------------------------------------------------------------------- batch layout


@dataclass
class DistillBatch:
    """Right-padded sequences with the policy's states and which next tokens to train on."""

    tokens: torch.Tensor      # [B, T] int64, 0 after each sequence's end
    hidden: torch.Tensor      # [B, T, d] policy final-norm states (no grad); hidden[:, t] predicts tokens[:, t+1]
    loss_mask: torch.Tensor   # [B, T] bool, True where tokens[:, t+1] is a trained token (False past the end)
    aux: torch.Tensor | None = None   # [B, T, n_aux * d] the policy's aux-layer states (EAGLE-3 drafters read
                                      # them; None = recomputed from the tokens when needed)

    def step_mask(self, s: int, width: int) -> torch.Tensor:
        """[B, width] bool: step s at chain start t = 0..width-1 is trained iff loss_mask[t+s]."""
        m = self.loss_mask[:, s:s + width]
        if m.shape[1] < width:
            m = F.pad(m, (0, width - m.shape[1]), value=False)
        return m

    def labels(self, s: int, width: int) -> torch.Tensor:
        """[B, width] int64: the token step s at chain t drafts, x_{t+s+1} (0 past the end)."""
        lab = torch.zeros(self.tokens.shape[0], width, dtype=torch.long, device=self.tokens.device)
        n = max(0, min(width, self.tokens.shape[1] - s - 1))
        lab[:, :n] = self.tokens[:, s + 1:s + 1 + n]
        return lab

    @property
    def num_trained_positions(self) -> int:
        return int(self.loss_mask.sum())


def completion_mask(length: int, prompt_len: int) -> np.ndarray:
    """[length] bool loss mask of one prompt+completion sequence: True at t = prompt_len-1 .. length-2."""
    m = np.zeros(length, dtype=bool)
    m[max(prompt_len - 1, 0):max(length - 1, 0)] = True
    return m


def _states(x, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def batch_from_sequences(seqs: Sequence[tuple], device, dtype: torch.dtype = torch.float32) -> DistillBatch:
    """seqs: (tokens [T_i] int, hidden [T_i, d] float/bf16, loss_mask [T_i] bool[, aux [T_i, n_aux * d]])
    per sequence; aux (all sequences or none) goes into DistillBatch.aux."""
    T = max(len(s[0]) for s in seqs)
    d = seqs[0][1].shape[1]
    with_aux = len(seqs[0]) > 3 and seqs[0][3] is not None
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    hidden = torch.zeros(len(seqs), T, d, dtype=dtype)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    aux = torch.zeros(len(seqs), T, seqs[0][3].shape[1], dtype=dtype) if with_aux else None
    for b, (tok, hid, m, *rest) in enumerate(seqs):
        n = len(tok)
        tokens[b, :n] = torch.as_tensor(np.asarray(tok, dtype=np.int64))
        hidden[b, :n] = _states(hid, dtype)
        mask[b, :n] = torch.as_tensor(np.asarray(m, dtype=bool))
        mask[b, n - 1:] = False                      # the last state predicts nothing in the data
        if with_aux:
            aux[b, :n] = _states(rest[0], dtype)
    return DistillBatch(tokens.to(device), hidden.to(device), mask.to(device),
                        None if aux is None else aux.to(device))


@torch.no_grad()
def batch_from_replay(policy: CausalLM, seqs: Sequence[tuple[np.ndarray, int]], device,
                      aux_layer_ids: tuple[int, ...] | None = None) -> DistillBatch:
    """Replayed rollouts (tokens [T_i] int64 = prompt + completion, prompt length): the policy's
    states come from one teacher-forced forward of the current policy (right padding is harmless:
    attention is causal); with aux_layer_ids the same forward also gives the aux states an EAGLE-3
    drafter reads."""
    T = max(len(s) for s, _ in seqs)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (seq, prompt_len) in enumerate(seqs):
        tokens[b, :len(seq)] = torch.as_tensor(np.asarray(seq, dtype=np.int64))
        mask[b, :len(seq)] = torch.from_numpy(completion_mask(len(seq), prompt_len))
    tokens = tokens.to(device)
    if aux_layer_ids:
        hidden, aux = policy_states(policy, tokens, tuple(aux_layer_ids))
        return DistillBatch(tokens, hidden.float(), mask.to(device), aux.float())
    hidden = policy.hidden_states(tokens).float()
    return DistillBatch(tokens, hidden, mask.to(device))


# ----------------------------------------------------------------------------------- draft vocabulary


@dataclass(frozen=True)
class DraftVocabMap:
    """The LM-head rows the heads draft from, and where each full-vocabulary id sits among them."""

    weight: torch.Tensor          # [|S|, d] float32, frozen (the full W when S is everything)
    index: torch.Tensor | None    # [V] position in S, IGNORE_INDEX outside; None = full vocabulary

    @classmethod
    def build(cls, policy: CausalLM, draft_vocab: torch.Tensor | None) -> "DraftVocabMap":
        W = policy.lm_head_weight.detach().float()
        if draft_vocab is None:
            return cls(W, None)
        ids = draft_vocab.to(W.device)
        index = torch.full((W.shape[0],), IGNORE_INDEX, dtype=torch.long, device=W.device)
        index[ids] = torch.arange(len(ids), device=W.device)
        return cls(W.index_select(0, ids).contiguous(), index)

    @classmethod
    def for_heads(cls, policy: CausalLM, heads: MTPHeads) -> "DraftVocabMap":
        return cls.build(policy, getattr(heads, "draft_vocab", None))

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ids -> positions in S (IGNORE_INDEX for ids outside S)."""
        return labels if self.index is None else self.index[labels]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, d] -> [N, |S|] float32
        return F.linear(hidden.float(), self.weight)


# ----------------------------------------------------------------------------------- objectives


@dataclass
class StepRows:
    """The trained rows of one draft step: head states, teacher states, the data's next tokens."""

    student: torch.Tensor   # [N, d] (requires grad)
    target: torch.Tensor    # [N, d] policy state at t+s
    labels: torch.Tensor    # [N] x_{t+s+1}


def step_rows(batch: DistillBatch, outs: list[torch.Tensor], same_positions: bool) -> list[StepRows]:
    """Per step s, the rows where it is trained; same_positions keeps only chains t trained at
    every step (what an expected accepted length over the chain needs)."""
    if same_positions:
        width = outs[-1].shape[1]
        mask = batch.step_mask(1, width)
        for s in range(2, len(outs) + 1):
            mask = mask & batch.step_mask(s, width)
        masks = [mask] * len(outs)
        outs = [o[:, :width] for o in outs]
    else:
        masks = [batch.step_mask(s, o.shape[1]) for s, o in enumerate(outs, start=1)]
    rows = []
    for s, (out, mask) in enumerate(zip(outs, masks), start=1):
        w = out.shape[1]
        rows.append(StepRows(out[mask], batch.hidden[:, s:s + w][mask], batch.labels(s, w)[mask]))
    return rows


# objective(rows per step, vocabulary map, temperature) -> scalar
ObjectiveFn = Callable[[list[StepRows], DraftVocabMap, float], torch.Tensor]


def _per_step_mean(fn: Callable[[StepRows, DraftVocabMap, float], torch.Tensor]) -> ObjectiveFn:
    def objective(rows: list[StepRows], vm: DraftVocabMap, temperature: float) -> torch.Tensor:
        return torch.stack([fn(r, vm, temperature) for r in rows if r.student.shape[0] > 0]).mean()
    return objective


def _logit_kind(kind: str) -> ObjectiveFn:
    def one(r: StepRows, vm: DraftVocabMap, temperature: float) -> torch.Tensor:
        student = vm.logits(r.student)                                                     # [N, |S|]
        if kind == "ce":
            return draft_loss("ce", student, labels=vm.labels(r.labels), temperature=temperature)
        with torch.no_grad():
            target = vm.logits(r.target)
        return draft_loss(kind, student, target_logits=target, temperature=temperature)
    return _per_step_mean(one)


def _tv(r: StepRows, vm: DraftVocabMap, temperature: float) -> torch.Tensor:
    return fused_linear_tv_loss(r.student.float(), r.target.float(), vm.weight, temperature)


TOP_K_TV = 64   # Bebop's top-K TV: the loss sees only the union of p's and q's 64 most likely tokens


def _tv_top_k(r: StepRows, vm: DraftVocabMap, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        target = vm.logits(r.target)                                                       # [N, |S|]
    return draft_loss("tv", vm.logits(r.student), target_logits=target, temperature=temperature, top_k=TOP_K_TV)


def _tv_e2e(rows: list[StepRows], vm: DraftVocabMap, temperature: float) -> torch.Tensor:
    student = torch.stack([r.student for r in rows], 1).float()                            # [N, k, d]
    target = torch.stack([r.target for r in rows], 1).float()
    return fused_linear_tv_e2e_loss(student, target, vm.weight, temperature) / len(rows)


@dataclass(frozen=True)
class Objective:
    fn: ObjectiveFn
    same_positions: bool   # all steps on the same chains (expected accepted length)
    doc: str


OBJECTIVES: dict[str, Objective] = {
    "ce": Objective(_logit_kind("ce"), False, "-log q(x_{t+s+1}): the data's next token (outside S: ignored)"),
    "fkl": Objective(_logit_kind("fkl"), False, "KL(p || q): mass-covering, smooth near the optimum"),
    "rkl": Objective(_logit_kind("rkl"), False, "KL(q || p): mode-seeking"),
    "tv": Objective(_per_step_mean(_tv), False, "TV(p, q) = 1 - rejection-mode acceptance, per step"),
    "tv_e2e": Objective(_tv_e2e, True, "(k - E[accepted drafts of k]) / k over whole chains"),
    f"tv_top{TOP_K_TV}": Objective(_per_step_mean(_tv_top_k), False,
                                   f"TV on the union of p's and q's top-{TOP_K_TV} tokens only (Bebop's top-K TV)"),
}


def check_objective(name: str) -> None:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}")


@dataclass
class DistillOutput:
    loss: torch.Tensor       # scalar
    rows: int                # trained (chain, step) rows


def feature_regression(rows: list[StepRows]) -> torch.Tensor:
    """EAGLE's feature loss: SmoothL1 from the head's state at (t, s) to the policy's state at t+s (the
    state whose distribution the step drafts), mean over steps. Both are final-norm states, so the head's
    output feeds its next step (and the LM head) in the policy's own coordinates."""
    return torch.stack([F.smooth_l1_loss(r.student.float(), r.target.float()) for r in rows
                        if r.student.shape[0] > 0]).mean()


def distill_loss(heads: MTPHeads, policy: CausalLM, batch: DistillBatch, objective: str, vocab: DraftVocabMap,
                 *, temperature: float = 1.0, steps: int | None = None,
                 feature_weight: float = 0.0) -> DistillOutput:
    """The heads' loss on one batch: unroll `steps` draft steps (mtp_heads.ttt), apply the objective and
    add `feature_weight` x the feature regression (0 = the objective alone)."""
    check_objective(objective)
    if not feature_weight >= 0:
        raise ValueError(f"feature_weight must be >= 0, got {feature_weight}")
    spec = OBJECTIVES[objective]
    steps = default_unroll_steps(heads.num_depths) if steps is None else steps
    outs = unroll(heads, policy, batch.hidden, batch.tokens, steps)
    rows = step_rows(batch, outs, spec.same_positions) if outs else []
    n = sum(r.student.shape[0] for r in rows)
    if n == 0:
        raise ValueError("a training batch has no trained positions deep enough for the draft steps; "
                         "use longer sequences or fewer steps")
    loss = spec.fn(rows, vocab, temperature)
    if feature_weight > 0:
        loss = loss + feature_weight * feature_regression(rows)
    return DistillOutput(loss, n)


# ----------------------------------------------------------------------------------- drafter kinds


@dataclass(frozen=True)
class DrafterKind:
    """What pre-training (mtp_heads.pretrain) needs from one kind of drafter (train.drafter): a start, a
    loss, the draft-vocabulary rows, and a checkpoint whose weights file the optimizer state is tied to.
    HEADS is in mtp_heads.pretrain, EAGLE3 in mtp_heads.eagle3_train."""

    name: str
    initial: Callable[..., torch.nn.Module]   # (policy, TrainConfig, data, draft vocab or None) -> drafter
    loss: Callable[..., object]      # (drafter, policy, batch, cfg, step, vocab) -> DistillOutput
    vocab: Callable[[CausalLM, torch.nn.Module], DraftVocabMap]
    save: Callable[..., None]        # (path, drafter, step, cfg, meta_defaults)
    load: Callable[..., tuple]       # (path, policy) -> (drafter, the step it records or None)
    weights_file: Callable[[Path], Path]
    exists: Callable[[Path], bool]
