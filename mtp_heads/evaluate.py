"""Cheap teacher-forced evaluation: expected acceptance per draft position, without an engine.

For draft step s of the chain started at t (mtp_heads.ttt.unroll), with p the policy's
distribution at position t+s at temperature T (full vocabulary) and q the head's (zero outside
its draft vocabulary S):

    rejection mode   E[1 - TV(p, q)] = sum_{v in S} min(p_v, q_v)
    greedy mode      p(argmax q)

Both only need p on S, and p_v = exp(W_v h / T - logsumexp(W h / T)): the full-vocabulary
log-normaliser is the only [V]-sized work, so `EvalSet` computes it once per evaluation set and
temperature and every head evaluated on the set reuses it (the old per-head evaluation recomputed
the full distribution: ~70 s per head on 109k rows). Reported per step: the conditional
acceptance (the mean over trained chains), and over chains trained at every step the expected
acceptance length tau = 1 + sum_j prod_{i<=j} a_i (bonus token included).

EAGLE-3 drafters (mtp_heads.eagle3) are scored the same way on the same batches: their steps come
from mtp_heads.eagle3_train.unroll_eagle3 (aux states built into the set with `aux_layer_ids`, or
recomputed per batch), q from their own LM head over their draft vocabulary, p the policy's on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_heads.checkpoint import draft_vocab_of
from mtp_heads.distill import DistillBatch, batch_from_sequences
from mtp_heads.eagle3 import Eagle3Drafter, aux_hidden_states
from mtp_heads.eagle3_train import batch_aux, drafter_vocab, unroll_eagle3
from mtp_heads.heads import MTPHeads
from mtp_heads.ttt import unroll
from rollout.models.decoder import CausalLM

MODES = ("rejection", "greedy")


@dataclass
class EvalSet:
    """Evaluation batches and, per temperature, the policy's full-vocabulary log-normaliser."""

    batches: list[DistillBatch]
    lse: dict[float, list[torch.Tensor]]   # T -> per batch [B, L] logsumexp_v(W_v h / T)

    @classmethod
    @torch.no_grad()
    def build(cls, policy: CausalLM, data, temperatures=(0.7, 1.0), *, max_sequences: int | None = None,
              max_seq_len: int = 512, batch_tokens: int = 4096, chunk: int = 1024,
              aux_layer_ids: tuple[int, ...] | None = None) -> "EvalSet":
        """The first `max_sequences` sequences of a source (each cut to max_seq_len tokens); with
        aux_layer_ids each batch also holds the policy's aux states (for EAGLE-3 drafters)."""
        n = len(data) if max_sequences is None else min(len(data), max_sequences)
        W = policy.lm_head_weight.detach().float()
        batches, lse = [], {float(T): [] for T in temperatures}
        group, total = [], 0
        for i in range(n):
            s = data[i]
            hi = min(len(s.tokens), max_seq_len)
            group.append((s.tokens[:hi], s.hidden[:hi], s.loss_mask[:hi]))
            total += hi
            if total >= batch_tokens or i == n - 1:
                b = batch_from_sequences(group, W.device)
                if aux_layer_ids:
                    b.aux = aux_hidden_states(policy, b.tokens, tuple(aux_layer_ids)).float()
                batches.append(b)
                flat = b.hidden.reshape(-1, b.hidden.shape[-1])
                for T in lse:
                    parts = [torch.logsumexp(flat[c:c + chunk] @ W.t() / T, -1) for c in range(0, len(flat), chunk)]
                    lse[T].append(torch.cat(parts).view(b.tokens.shape))
                group, total = [], 0
        return cls(batches, lse)

    def to_state(self) -> dict:
        """Tensors in plain lists and dicts only, so that torch.load(weights_only=True) reads it back."""
        return {"batches": [{"tokens": b.tokens, "hidden": b.hidden, "loss_mask": b.loss_mask,
                             **({} if b.aux is None else {"aux": b.aux})} for b in self.batches],
                "lse": {float(T): list(v) for T, v in self.lse.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "EvalSet":
        return cls([DistillBatch(b["tokens"], b["hidden"], b["loss_mask"], b.get("aux")) for b in state["batches"]],
                   {float(T): list(v) for T, v in state["lse"].items()})

    @property
    def temperatures(self) -> list[float]:
        return sorted(self.lse)

    @property
    def num_positions(self) -> int:
        return sum(b.num_trained_positions for b in self.batches)


def _draft_steps(policy: CausalLM, drafter: MTPHeads | Eagle3Drafter, batch: DistillBatch,
                 steps: int) -> list[torch.Tensor]:
    """The drafter's state per draft step for every chain start (mtp_heads.ttt / eagle3_train)."""
    if isinstance(drafter, Eagle3Drafter):
        return unroll_eagle3(drafter, policy, batch_aux(policy, drafter, batch).float(), batch.tokens, steps)
    return unroll(drafter, policy, batch.hidden.float(), batch.tokens, steps)


def _vocab_rows(policy: CausalLM, drafter: MTPHeads | Eagle3Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """(the policy's LM-head rows of the draft vocabulary [|S|, d], the drafter's rows for q [|S|, d]),
    both float32 and in the same token order."""
    if isinstance(drafter, Eagle3Drafter):
        return drafter_vocab(policy, drafter).weight, drafter.lm_head.weight.detach().float()
    W = policy.lm_head_weight.detach().float()
    vocab = draft_vocab_of(drafter)
    W_s = W if vocab is None else W.index_select(0, vocab.to(W.device))
    return W_s, W_s


@torch.no_grad()
def teacher_forced_acceptance(policy: CausalLM, heads: MTPHeads | Eagle3Drafter, evalset: EvalSet,
                              steps: int = 3) -> dict:
    """{T: {mode: {"per_position": [a_1..a_k], "tau": float, "rows": [n_1..n_k], "chains": n}}}
    for MTP heads or an EAGLE-3 drafter."""
    W_s, W_q = _vocab_rows(policy, heads)
    was_training = heads.training
    heads.eval()
    sums = {T: {m: torch.zeros(steps, dtype=torch.float64) for m in MODES} for T in evalset.temperatures}
    chain_sums = {T: {m: 0.0 for m in MODES} for T in evalset.temperatures}
    rows = torch.zeros(steps, dtype=torch.long)
    chains = 0
    for bi, batch in enumerate(evalset.batches):
        hidden = batch.hidden.float()
        outs = _draft_steps(policy, heads, batch, steps)
        k = len(outs)
        width = outs[-1].shape[1] if outs else 0
        every = torch.ones(batch.tokens.shape[0], width, dtype=torch.bool, device=hidden.device)
        for s in range(1, k + 1):
            every &= batch.step_mask(s, width)
        chains += int(every.sum())
        for T in evalset.temperatures:
            acc = {m: [] for m in MODES}           # per step: [B, width] acceptance at chains < width
            for s, out in enumerate(outs, start=1):
                w = out.shape[1]
                mask = batch.step_mask(s, w)
                lse = evalset.lse[T][bi][:, s:s + w]                                     # [B, w]
                target = hidden[:, s:s + w]
                logp = target @ W_s.t() / T - lse[..., None]                              # [B, w, |S|]
                q = torch.softmax(out.float() @ W_q.t() / T, -1)
                p = logp.exp()
                rej = torch.minimum(p, q).sum(-1)                                         # [B, w]
                greedy = p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1)
                for m, a in (("rejection", rej), ("greedy", greedy)):
                    sums[T][m][s - 1] += float(a[mask].sum())
                    acc[m].append(a[:, :width])
                if T == evalset.temperatures[0]:
                    rows[s - 1] += int(mask.sum())
            for m in MODES:
                if k:
                    a = torch.stack(acc[m], -1)[every]                                    # [chains, k]
                    chain_sums[T][m] += float((1 + torch.cumprod(a, -1).sum(-1)).sum())
    heads.train(was_training)
    out = {}
    for T in evalset.temperatures:
        out[T] = {m: {"per_position": [float(sums[T][m][j] / max(int(rows[j]), 1)) for j in range(steps)],
                      "tau": chain_sums[T][m] / max(chains, 1),
                      "rows": rows.tolist(), "chains": chains} for m in MODES}
    return out


def format_acceptance(result: dict) -> str:
    """One line per (temperature, mode): per-position acceptance and tau."""
    lines = []
    for T, modes in sorted(result.items()):
        for m, r in modes.items():
            per = " / ".join(f"{a:.3f}" for a in r["per_position"])
            lines.append(f"T={T:g} {m:9s}: {per}  tau={r['tau']:.2f}  ({r['rows'][0]} rows)")
    return "\n".join(lines)
