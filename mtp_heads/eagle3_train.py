"""Training EAGLE-3 drafters (mtp_heads.eagle3) with our objectives and training-time test.

The drafter reads, at position i, the policy's aux states (the residual stream after the layers of
`drafter.aux_layer_ids`, from mtp_heads.eagle3.aux_hidden_states) and drafts recurrently as vLLM's
`eagle3` proposer does:

* step 1 at chain start t reads fc(aux_t) and token x_{t+1} at position t; over a whole sequence
  this is plain teacher forcing (every t at once, causal attention over step-1 keys);
* step s > 1 reads the drafter's own pre-norm output of step s-1 and token x_{t+s} at position
  t+s-1, attending to the step-1 keys at positions <= t plus its own chain's keys of steps 2..s
  (the mask of mtp_heads.ttt.chain_attention: what the drafter's KV cache holds while drafting).

`unroll_eagle3` returns the post-norm state of every step for every chain start, so a loss at every
step trains the drafter for the inputs it sees when drafting. As for the heads, the step inputs are
the data's tokens (the policy's distribution after another token is not in the data).

The objectives are the heads' (mtp_heads.distill.OBJECTIVES, same names and the same mask rule:
step s at t is trained iff loss_mask[t+s]); the teacher p is the policy's distribution at t+s
renormalised on the draft vocabulary. The drafter has its own trainable LM head over the draft
vocabulary, so the logits are explicit ([N, |S|], small with a reduced vocabulary) instead of the
fused kernel, which needs a frozen LM head.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mtp_heads.distill import DistillBatch, DistillOutput, DrafterKind, DraftVocabMap, StepRows, check_objective, \
    step_rows
from mtp_heads.eagle3 import Eagle3Drafter, aux_hidden_states, check_aux_layer_ids, default_aux_layer_ids, \
    init_eagle3
from mtp_heads.eagle3_checkpoint import WEIGHTS_FILE, load_eagle3, save_eagle3
from mtp_heads.losses import draft_loss
from mtp_heads.ttt import causal_attention, chain_attention
from rollout.models.decoder import CausalLM

# ----------------------------------------------------------------------------------- unroll


def _qkv(drafter: Eagle3Drafter, policy: CausalLM, hidden: torch.Tensor, tokens: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # hidden [B, n, d] the step's input state; tokens [B, n]; positions [B, n] -> q, k, v [B, H, n, hd]
    # (K/V repeated over query groups, as mtp_heads.ttt does for the chain attention)
    layer = drafter.midlayer
    x = torch.cat([layer.input_layernorm(drafter.embed(policy, tokens)), layer.hidden_norm(hidden)], dim=-1)
    attn = layer.self_attn
    q, k, v = attn.project_qkv(x, drafter.rotary(positions))
    groups = attn.n_heads // attn.n_kv
    return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _finish(drafter: Eagle3Drafter, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    # hidden [B, n, d] the step's input state; attn_out [B, H, n, hd] -> pre-norm output [B, n, d]
    layer = drafter.midlayer
    B, H, n, hd = attn_out.shape
    r = hidden + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(B, n, H * hd))
    return r + layer.mlp(layer.post_attention_layernorm(r))


def unroll_eagle3(drafter: Eagle3Drafter, policy: CausalLM,
                  aux: torch.Tensor,      # [B, T, n_aux * d] aux states; aux[:, t] is read with tokens[:, t+1]
                  tokens: torch.Tensor,   # [B, T] int64
                  steps: int) -> list[torch.Tensor]:
    """Post-norm drafter states of draft steps s = 1..steps for every chain start t (see module docstring).

    Step s is [B, T-s, d] (fewer steps when the sequence is too short): row t has read x_{t+1..t+s},
    drafts x_{t+s+1}, and its teacher is the policy's distribution at position t+s."""
    B, T, _ = aux.shape
    dev = aux.device
    outs: list[torch.Tensor] = []
    n = T - 1
    if n <= 0 or steps < 1:
        return outs
    first = drafter.fc(aux.to(drafter.fc.weight.dtype))[:, :n]                            # [B, n, d]
    q, k, v = _qkv(drafter, policy, first, tokens[:, 1:1 + n], torch.arange(n, device=dev).expand(B, n))
    pre = _finish(drafter, first, causal_attention(q, k, v))
    base, chain = (k, v), []
    outs.append(drafter.norm(pre))
    for s in range(2, steps + 1):
        n = T - s
        if n <= 0:
            break
        hidden = pre[:, :n]
        positions = (torch.arange(n, device=dev) + (s - 1)).expand(B, n)
        q, k, v = _qkv(drafter, policy, hidden, tokens[:, s:s + n], positions)
        chain.append((k, v))
        pre = _finish(drafter, hidden, chain_attention(q, base, chain))
        outs.append(drafter.norm(pre))
    return outs


# ----------------------------------------------------------------------------------- aux states


def batch_aux(policy: CausalLM, drafter: Eagle3Drafter, batch: DistillBatch) -> torch.Tensor:
    """The batch's aux states [B, T, n_aux * d]: recorded ones, or recomputed from its tokens with the
    frozen policy (one forward up to the last aux layer's output, at most the whole policy)."""
    if batch.aux is not None:
        want = len(drafter.aux_layer_ids) * policy.config.hidden_size
        if batch.aux.shape[-1] != want:
            raise ValueError(f"the batch's aux states have width {batch.aux.shape[-1]}, the drafter reads "
                             f"{want} (aux layers {list(drafter.aux_layer_ids)})")
        return batch.aux
    return aux_hidden_states(policy, batch.tokens, drafter.aux_layer_ids)


# ----------------------------------------------------------------------------------- vocabulary and objectives


def drafter_vocab(policy: CausalLM, drafter: Eagle3Drafter) -> DraftVocabMap:
    """The policy's LM-head rows in the drafter's draft-id order (draft id j <-> target_ids(j))."""
    if drafter.d2t is None:
        return DraftVocabMap.build(policy, None)
    ids = drafter.target_ids(torch.arange(drafter.draft_vocab_size, device=drafter.d2t.device))
    return DraftVocabMap.build(policy, ids)


def _student_logits(drafter: Eagle3Drafter, post: torch.Tensor) -> torch.Tensor:
    # post [N, d] -> [N, |S|] float32, through the drafter's own (trained) LM head
    return F.linear(post.float(), drafter.lm_head.weight.float())


# objective(rows per step, drafter, vocabulary map, temperature) -> scalar
Eagle3ObjectiveFn = Callable[[list[StepRows], Eagle3Drafter, DraftVocabMap, float], torch.Tensor]


def _per_step(kind: str, top_k: int | None = None) -> Eagle3ObjectiveFn:
    def objective(rows, drafter, vm, temperature):
        losses = []
        for r in rows:
            if r.student.shape[0] == 0:
                continue
            student = _student_logits(drafter, r.student)
            if kind == "ce":
                losses.append(draft_loss("ce", student, labels=vm.labels(r.labels), temperature=temperature))
                continue
            with torch.no_grad():
                target = vm.logits(r.target)
            losses.append(draft_loss(kind, student, target_logits=target, temperature=temperature, top_k=top_k))
        return torch.stack(losses).mean()
    return objective


def _tv_e2e(rows, drafter, vm, temperature):
    student = torch.stack([_student_logits(drafter, r.student) for r in rows], 1)          # [N, k, |S|]
    with torch.no_grad():
        target = torch.stack([vm.logits(r.target) for r in rows], 1)
    return draft_loss("tv_e2e", student, target_logits=target, temperature=temperature) / len(rows)


# name -> (function, all steps on the same chains); the names are mtp_heads.distill.OBJECTIVES'
EAGLE3_OBJECTIVES: dict[str, tuple[Eagle3ObjectiveFn, bool]] = {
    "ce": (_per_step("ce"), False),
    "fkl": (_per_step("fkl"), False),
    "rkl": (_per_step("rkl"), False),
    "tv": (_per_step("tv"), False),
    "tv_e2e": (_tv_e2e, True),
    "tv_top64": (_per_step("tv", top_k=64), False),
}


def eagle3_loss(drafter: Eagle3Drafter, policy: CausalLM, batch: DistillBatch, objective: str,
                vocab: DraftVocabMap, *, temperature: float = 1.0, steps: int = 3) -> DistillOutput:
    """The drafter's loss on one batch: unroll `steps` draft steps and apply the objective."""
    check_objective(objective)
    fn, same_positions = EAGLE3_OBJECTIVES[objective]
    outs = unroll_eagle3(drafter, policy, batch_aux(policy, drafter, batch), batch.tokens, steps)
    rows = step_rows(batch, outs, same_positions) if outs else []
    n = sum(r.student.shape[0] for r in rows)
    if n == 0:
        raise ValueError("a training batch has no trained positions deep enough for the draft steps; "
                         "use longer sequences or fewer steps")
    return DistillOutput(fn(rows, drafter, vocab, temperature), n)


# ----------------------------------------------------------------------------------- initialisation


def aux_layer_ids_for(policy: CausalLM, requested) -> tuple[int, ...]:
    """train.aux_layer_ids checked against the policy ([] = vLLM's default for its depth)."""
    L = policy.config.num_hidden_layers
    return check_aux_layer_ids(tuple(requested) or default_aux_layer_ids(L), L)


def last_layer_eagle3(policy: CausalLM, aux_layer_ids: tuple[int, ...], draft_vocab: torch.Tensor | None,
                      seed: int = 0) -> Eagle3Drafter:
    """A drafter that starts from the policy's own pieces: its decoder layer a copy of the policy's last
    layer (reading the hidden half of [emb ; hidden]; the embedding half small and random), fc passing the
    highest aux layer through, the final norm and the LM-head rows of the draft vocabulary the policy's.
    The scales match the policy's from the first step (a random layer trains to the same place slower)."""
    drafter = init_eagle3(policy, aux_layer_ids, draft_vocab, seed)
    last, layer = policy.model.layers[-1], drafter.midlayer
    d = policy.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)

    def small(rows: int, cols: int) -> torch.Tensor:
        return 0.1 * torch.randn(rows, cols, generator=gen) / cols ** 0.5

    with torch.no_grad():
        layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(last.self_attn, name).weight                                      # [out, d]
            getattr(layer.self_attn, name).weight.copy_(torch.cat([small(w.shape[0], d).to(w), w], dim=1))
        layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        layer.mlp.load_state_dict(last.mlp.state_dict())
        n_aux = len(aux_layer_ids)
        fc = small(d, n_aux * d)
        fc[:, (n_aux - 1) * d:] = torch.eye(d)
        drafter.fc.weight.copy_(fc.to(drafter.fc.weight))
        drafter.norm.weight.copy_(policy.model.norm.weight)
        ids = drafter.target_ids(torch.arange(drafter.draft_vocab_size, device=policy.lm_head_weight.device))
        drafter.lm_head.weight.copy_(policy.lm_head_weight.index_select(0, ids))
    return drafter


EAGLE3_INITS: dict[str, Callable[[CausalLM, tuple[int, ...], torch.Tensor | None, int], Eagle3Drafter]] = {
    "last_layer": last_layer_eagle3,
    "random": init_eagle3,
}


def initial_eagle3(policy: CausalLM, cfg, data, draft_vocab: torch.Tensor | None) -> Eagle3Drafter:
    """A fresh drafter (EAGLE3_INITS) or an EAGLE-3 directory to fine-tune (its aux layers and draft
    vocabulary kept; a different train.aux_layer_ids is refused)."""
    if cfg.init in EAGLE3_INITS:
        return EAGLE3_INITS[cfg.init](policy, aux_layer_ids_for(policy, cfg.aux_layer_ids), draft_vocab, cfg.seed)
    drafter = load_eagle3(cfg.init, policy)
    if cfg.aux_layer_ids and tuple(cfg.aux_layer_ids) != drafter.aux_layer_ids:
        raise ValueError(f"train.aux_layer_ids={list(cfg.aux_layer_ids)} but train.init={cfg.init} reads aux "
                         f"layers {list(drafter.aux_layer_ids)}; leave train.aux_layer_ids empty to keep them")
    return drafter


# ----------------------------------------------------------------------------------- the training loop's view
# `cfg` below is mtp_heads.pretrain.TrainConfig (which imports this module, so it is not imported here)


def _loss(drafter: Eagle3Drafter, policy: CausalLM, batch: DistillBatch, cfg, step: int,
          vocab: DraftVocabMap) -> DistillOutput:
    phase = cfg.phase_at(step)
    return eagle3_loss(drafter, policy, batch, phase.objective, vocab, temperature=cfg.temperature,
                       steps=phase.unroll_steps or cfg.unroll_steps)


def _save(path, drafter: Eagle3Drafter, step: int, cfg, meta_defaults: dict) -> None:
    save_eagle3(path, drafter, torch.float32)      # float32: a resumed run continues exactly


def _load(path, policy: CausalLM) -> tuple[Eagle3Drafter, int | None]:
    return load_eagle3(path, policy), None          # the step is checked through the weights' digest


EAGLE3 = DrafterKind(
    name="eagle3", initial=initial_eagle3, loss=_loss, vocab=drafter_vocab, save=_save, load=_load,
    weights_file=lambda path: Path(path) / WEIGHTS_FILE,
    exists=lambda path: (Path(path) / WEIGHTS_FILE).is_file())
