"""The distillation core: training-time test equals the engine's drafting; one loss for pre-training
and the co-trainer; each objective minimises its own divergence."""
import numpy as np
import pytest
import torch

from mtp_heads.distill import (OBJECTIVES, DistillBatch, DraftVocabMap, batch_from_sequences,
                               completion_mask, distill_loss)
from mtp_heads.heads import MTPHeads, init_heads
from mtp_heads.ttt import unroll
from rollout.engine.config import EngineConfig
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def policy():
    return random_model(tiny_config(), seed=0)


def _randomised(heads: MTPHeads, seed: int) -> MTPHeads:
    """Heads with every weight perturbed, so that no path through them is an identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g) * (p.std() if p.numel() > 1 else 1.0))
    return heads


def _greedy_sequence(policy, prompt, n):
    out = TorchEngine(policy).generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                ignore_eos=True, seed=0))
    return list(prompt) + out.completions[0].tokens


def _force_drafts(monkeypatch, sequence):
    """Make the engine's drafts the sequence's tokens (rollout.engine.round.draft / draft_token);
    returns the list that collects (position drafted, head state [d], q [V]) per draft."""
    import rollout.engine.round as rnd
    seq, seen, where = torch.tensor(sequence), [], {}
    real_draft, real_token = rnd.draft, rnd.draft_token

    def draft(ctx, st, k):
        where["c"], where["step"] = int(st.committed[0]), 0
        return real_draft(ctx, st, k)

    def draft_token(ctx, head_hidden):
        token, q, vocab, bad = real_token(ctx, head_hidden)
        pos = where["c"] + where["step"]                    # draft j of a round fills position c-1+j
        where["step"] += 1
        q_full = q[0].clone() if vocab is None else q.new_zeros(ctx.policy.config.vocab_size).index_copy_(0, vocab, q[0])
        seen.append((pos, head_hidden[0].clone(), q_full))
        return seq[pos].view(1), q, vocab, bad

    monkeypatch.setattr(rnd, "draft", draft)
    monkeypatch.setattr(rnd, "draft_token", draft_token)
    return seen


@pytest.mark.parametrize("num_depths,k,num_layers", [(1, 3, 1), (1, 4, 1), (2, 4, 1), (3, 3, 1), (1, 3, 2), (2, 4, 2)])
def test_training_time_test_unroll_equals_engine_drafting(policy, num_depths, k, num_layers, monkeypatch):
    heads = _randomised(init_heads(policy, num_depths, seed=0, num_layers=num_layers), seed=num_depths)
    seq = _greedy_sequence(policy, [5, 9, 2, 7], 24)
    seen = _force_drafts(monkeypatch, seq)
    out = TorchEngine(policy, heads, config=EngineConfig(draft_lengths="fixed")).generate([seq[:4]], SamplingParams(
        max_new_tokens=20, temperature=0.0, num_draft_tokens=k, ignore_eos=True, seed=0))
    assert out.completions[0].tokens == seq[4:24]          # forced drafts = the greedy text: all accepted
    assert len(seen) >= 3 * k
    tokens = torch.tensor([seq])
    with torch.no_grad():
        outs = unroll(heads, policy, policy.hidden_states(tokens), tokens, k)
    for i, (pos, head_state, q) in enumerate(seen):
        s = i % k + 1                                       # draft step within its round
        t = pos - s - 1                                     # chain start: step s at t drafts x_{t+s+1}
        torch.testing.assert_close(outs[s - 1][0, t], head_state, rtol=1e-5, atol=1e-5)
        mine = torch.softmax(heads.draft_logits(policy, outs[s - 1][0, t:t + 1]), -1)[0]
        assert int(mine.argmax()) == int(q.argmax())


@pytest.mark.parametrize("num_layers", [1, 2])
def test_unroll_within_depths_is_teacher_forcing(policy, num_layers):
    heads = _randomised(init_heads(policy, 3, seed=0, num_layers=num_layers), seed=7)
    tokens = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    hidden = policy.hidden_states(tokens)
    for a, b in zip(unroll(heads, policy, hidden, tokens, 3), heads.teacher_forced(policy, hidden, tokens)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_completion_mask_and_step_masks():
    assert completion_mask(6, 2).tolist() == [False, True, True, True, True, False]
    tok = np.arange(6)
    batch = batch_from_sequences([(tok, np.zeros((6, 4), np.float32), completion_mask(6, 2))], "cpu")
    # step 2 at chain t is trained iff tokens[t+3] exists and is a completion token: t + 3 in [2, 5]
    assert batch.step_mask(2, 4)[0].tolist() == [True, True, True, False]
    assert batch.labels(2, 4)[0].tolist() == [3, 4, 5, 0]


def _cotrainer(policy, heads, **kw):
    from rollout.models.flat_weights import pack
    from mtp_heads.cotrainer import CoTrainerConfig, HeadCoTrainer
    from mtp_heads.drafters import drafter_spec
    cfg = CoTrainerConfig(**{"batch_tokens": 100_000, "lr": 3e-3, "policy_dtype": "float32", **kw})
    return HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()),
                         drafter_spec(heads), 0, seed=0)


def _rollouts(policy, n, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 64, (4,), generator=g).tolist() for _ in range(n)]
    out = TorchEngine(policy).generate(prompts, SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed,
                                                               ignore_eos=True))
    return [(c.prompt, c.tokens) for c in out.completions]


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_pretraining_and_cotrainer_compute_the_same_loss_and_gradient(policy, objective):
    """One batch through both paths: pre-training's own data path (a TokenData sequence source and
    batch_for_step, as train_heads reads it) and replayed rollouts with a fresh policy forward
    (co-trainer), same heads and draft vocabulary -> same loss and gradient."""
    from mtp_heads.pretrain import Phase, TrainConfig, batch_for_step, step_loss
    from mtp_heads.token_data import TokenData
    heads = _randomised(init_heads(policy, 1, seed=0), seed=3)
    heads.set_draft_vocab(torch.arange(0, 64, 3))
    rollouts = _rollouts(policy, 1, seed=5)
    seq = np.asarray(rollouts[0][0] + rollouts[0][1], dtype=np.int64)
    with torch.no_grad():
        hidden = policy.hidden_states(torch.tensor(seq[None]))[0].numpy()
    data = TokenData(seq.astype(np.int32), hidden, np.array([0, len(seq)], np.int64),
                     np.array([len(rollouts[0][0])], np.int32))
    cfg = TrainConfig(num_depths=1, unroll_steps=3, phases=[Phase(objective, 1)], temperature=0.8,
                      batch_tokens=len(seq), max_seq_len=len(seq))
    batch = batch_for_step(data, cfg, 0, "cpu")
    assert batch.loss_mask[0].tolist() == completion_mask(len(seq), len(rollouts[0][0])).tolist()[:-1] + [False]
    mine = _randomised(init_heads(policy, 1, seed=0), seed=3)
    mine.set_draft_vocab(torch.arange(0, 64, 3))
    loss_a = step_loss(mine, policy, batch, cfg, 0, DraftVocabMap.for_heads(policy, mine)).loss
    loss_a.backward()

    ct = _cotrainer(policy, heads, loss=objective, temperature=0.8)
    ct.add_rollouts(rollouts)
    loss_b = ct.batch_loss(ct._sample_batch())
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(mine.named_parameters(), ct.heads.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cotrainer_honours_the_draft_vocabulary_and_raises_held_out_acceptance(policy):
    from mtp_heads.evaluate import EvalSet, teacher_forced_acceptance
    from mtp_heads.token_data import TokenData
    heads = init_heads(policy, 1, seed=0)
    vocab = torch.arange(0, 64, 2)
    heads.set_draft_vocab(vocab)
    held = _rollouts(policy, 8, seed=11)
    seqs = [np.asarray(p + c, dtype=np.int64) for p, c in held]
    with torch.no_grad():
        hid = [policy.hidden_states(torch.tensor(s[None]))[0].numpy() for s in seqs]
    data = TokenData(np.concatenate(seqs), np.concatenate(hid), np.cumsum([0] + [len(s) for s in seqs]),
                     np.asarray([len(p) for p, _ in held], dtype=np.int32))
    evalset = EvalSet.build(policy, data, (1.0,))
    before = teacher_forced_acceptance(policy, heads, evalset, steps=3)[1.0]["rejection"]

    ct = _cotrainer(policy, heads, loss="tv", batch_tokens=200)
    assert torch.equal(ct.heads.draft_vocab, vocab)
    ct.add_rollouts(_rollouts(policy, 16, seed=1))
    losses = ct.train(30)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    after_heads = ct.heads
    assert torch.equal(after_heads.draft_vocab, vocab)
    after = teacher_forced_acceptance(policy, after_heads, evalset, steps=3)[1.0]["rejection"]
    assert after["per_position"][0] > before["per_position"][0] + 0.02, (before, after)
    assert after["tau"] > before["tau"]
    # drafting from the refreshed heads only ever proposes draft-vocabulary tokens
    logits = after_heads.draft_logits(policy, torch.randn(4, policy.config.hidden_size))
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()


def test_top_k_tv_objective_equals_a_direct_computation():
    """tv_top64 (Bebop's top-K TV row of the ablation) = 0.5 * sum |p - q| over the union of p's and q's
    64 most likely draft-vocabulary tokens, recomputed here in plain torch; it never exceeds full TV and
    its gradient flows to the student."""
    from mtp_heads.distill import OBJECTIVES, TOP_K_TV, StepRows

    g = torch.Generator().manual_seed(0)
    W = torch.randn(300, 16, generator=g)                          # |S| = 300 draft rows, d = 16
    vm = DraftVocabMap(W, None)
    student = torch.randn(40, 16, generator=g, requires_grad=True)
    target = torch.randn(40, 16, generator=g)
    rows = [StepRows(student, target, torch.zeros(40, dtype=torch.long))]
    loss = OBJECTIVES[f"tv_top{TOP_K_TV}"].fn(rows, vm, 0.8)
    p, q = torch.softmax(target @ W.T / 0.8, -1), torch.softmax(student.detach() @ W.T / 0.8, -1)
    union = torch.zeros_like(p, dtype=torch.bool)
    union.scatter_(1, p.topk(TOP_K_TV, -1).indices, True)
    union.scatter_(1, q.topk(TOP_K_TV, -1).indices, True)
    expected = (0.5 * ((p - q).abs() * union).sum(-1)).mean()
    assert torch.allclose(loss, expected, atol=1e-6)
    assert float(loss) < float(0.5 * (p - q).abs().sum(-1).mean())   # the tail outside the union is left out
    loss.backward()
    assert student.grad is not None and float(student.grad.abs().sum()) > 0


def test_feature_regression_adds_smooth_l1_to_the_next_policy_state(policy):
    """feature_weight w adds w x mean over steps of SmoothL1(head state at (t, s), policy state at t+s) on the
    trained rows, recomputed here from ttt.unroll; w = 0 is the objective alone; a negative w is refused."""
    import torch.nn.functional as F

    heads = _randomised(init_heads(policy, 1), seed=3)
    g = torch.Generator().manual_seed(5)
    T = 14
    tokens = torch.randint(0, policy.config.vocab_size, (2, T), generator=g)
    hidden = policy.hidden_states(tokens).float()
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[:, -1] = False
    mask[1, :4] = False
    batch = DistillBatch(tokens, hidden, mask)
    vm = DraftVocabMap.build(policy, None)
    plain = distill_loss(heads, policy, batch, "tv", vm, steps=3).loss
    mixed = distill_loss(heads, policy, batch, "tv", vm, steps=3, feature_weight=0.5).loss
    outs = unroll(heads, policy, hidden, tokens, 3)
    reg = []
    for s, out in enumerate(outs, start=1):
        m = batch.step_mask(s, out.shape[1])
        reg.append(F.smooth_l1_loss(out[m], hidden[:, s:s + out.shape[1]][m]))
    assert torch.allclose(mixed - plain, 0.5 * torch.stack(reg).mean(), atol=1e-6)
    assert float(torch.stack(reg).mean()) > 0
    with pytest.raises(ValueError, match="feature_weight"):
        distill_loss(heads, policy, batch, "tv", vm, feature_weight=-1.0)



def test_float32_heads_teacher_force_on_a_bfloat16_policy_without_mixed_dtypes(tiny_policy):
    """A co-trainer keeps float32 heads over a bf16 policy copy: the depth reads bf16 states and embeddings
    in its own dtype (no mixed-dtype fallback inside the norms), as if they had been given in float32."""
    import warnings
    policy = tiny_policy.to(torch.bfloat16)
    heads = init_heads(policy, num_depths=1).float()
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        hidden = policy.model.norm(policy.model.embed_tokens(tokens))                   # [2, 10, d] bf16
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (out,) = heads.teacher_forced(policy, hidden, tokens)                         # [2, 9, d]
        ref = heads.depths[0](hidden[:, :9].float(), policy.model.embed_tokens(tokens[:, 1:]).float(), positions,
                              policy.model.rotary(positions), None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)
