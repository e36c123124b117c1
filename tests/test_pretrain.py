"""Head pre-training on a tiny random policy: data, frozen policy, resume, improvement, draft vocabulary."""
import numpy as np
import pytest
import torch

from mtp_heads.checkpoint import draft_vocab_of, load_heads, read_meta, set_draft_vocab
from mtp_heads.heads import init_heads
from mtp_heads.pretrain import (OBJECTIVES, DataConfig, TokenData, TrainConfig,
                                draft_vocab_from_counts, engine_acceptance, generate_token_data,
                                teacher_forced_acceptance, train_heads)
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams

DATA = DataConfig(max_new_tokens=20, gen_batch_size=16)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def policy():
    from rollout.models.decoder import random_model
    from tests.conftest import tiny_config
    return random_model(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def data(policy):
    return generate_token_data(policy, _prompts(16, 0), DATA, seed=0, progress=False)


@pytest.fixture(scope="module")
def held_out(policy):
    return generate_token_data(policy, _prompts(8, 1), DATA, seed=1, progress=False)


def test_generated_states_equal_teacher_forcing(policy, data, tmp_path):
    assert len(data) == 16 and data.num_completion_tokens() > 24
    for i in (0, 5, 15):
        tokens, hidden, P = data.sequence(i)
        ref = policy.hidden_states(torch.tensor(tokens[None], dtype=torch.long))[0]
        torch.testing.assert_close(torch.from_numpy(hidden[:-1]), ref[:-1], atol=1e-4, rtol=1e-4)
        assert 3 <= P < len(tokens)
    data.save(tmp_path / "d.npz")
    again = TokenData.load(tmp_path / "d.npz")
    assert np.array_equal(again.tokens, data.tokens) and np.array_equal(again.hidden, data.hidden)


def test_only_heads_get_gradients_and_policy_is_unchanged(policy, data):
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    res = train_heads(policy, data, TrainConfig(num_depths=2, steps=2, seqs_per_step=4, warmup_steps=1),
                      progress=False)
    assert all(p.grad is None and not p.requires_grad for p in policy.parameters())
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    init = init_heads(policy, 2, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(init.parameters(), res.heads.parameters()))


@pytest.mark.parametrize("loss", sorted(OBJECTIVES))
def test_every_objective_trains(policy, data, loss):
    res = train_heads(policy, data, TrainConfig(num_depths=2, loss=loss, steps=2, seqs_per_step=4, warmup_steps=1),
                      progress=False)
    assert len(res.losses) == 2 and all(np.isfinite(res.losses))


def test_resume_equals_uninterrupted(policy, data, tmp_path):
    cfg = TrainConfig(num_depths=2, steps=6, seqs_per_step=4, warmup_steps=2, checkpoint_every=3)
    full = train_heads(policy, data, cfg, checkpoint=tmp_path / "a.safetensors", progress=False)
    cut = train_heads(policy, data, cfg, checkpoint=tmp_path / "b.safetensors", progress=False, stop_after=3)
    assert cut.steps == 3 and read_meta(tmp_path / "b.safetensors").steps == 3
    resumed = train_heads(policy, data, cfg, checkpoint=tmp_path / "b.safetensors", resume=True, progress=False)
    assert resumed.losses == full.losses[3:]
    a, b = full.heads.state_dict(), resumed.heads.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    heads, meta = load_heads(tmp_path / "b.safetensors", policy)
    assert meta.steps == 6 and meta.loss == "tv"
    with pytest.raises(ValueError, match="config differs"):
        train_heads(policy, data, TrainConfig(num_depths=2, steps=9, seqs_per_step=4), progress=False,
                    checkpoint=tmp_path / "b.safetensors", resume=True)


def test_short_pretraining_raises_teacher_forced_acceptance(policy, data, held_out):
    init = init_heads(policy, 2, seed=0)
    before = teacher_forced_acceptance(policy, init, held_out)
    res = train_heads(policy, data, TrainConfig(num_depths=2, steps=25, seqs_per_step=8, lr=3e-3, warmup_steps=2),
                      progress=False)
    after = teacher_forced_acceptance(policy, res.heads, held_out)
    for b, a in zip(before, after):
        assert a["rows"] == b["rows"] > 0
        assert a["rejection"] > b["rejection"] + 0.02, (before, after)
        assert 0.0 <= a["greedy"] <= 1.0


def test_draft_vocab_is_frequency_based_and_drafts_stay_inside(policy, data):
    vocab = draft_vocab_from_counts(data, 16, 64, always=(1,))
    counts = np.bincount(data.completion_tokens(), minlength=64)
    assert 1 in vocab.tolist() and len(vocab) <= 17
    top_outside = max((counts[t] for t in range(64) if t not in set(vocab.tolist())), default=0)
    assert all(counts[t] >= top_outside for t in vocab.tolist() if t != 1)
    res = train_heads(policy, data, TrainConfig(num_depths=2, steps=3, seqs_per_step=4, warmup_steps=1),
                      draft_vocab=vocab, progress=False)
    assert draft_vocab_of(res.heads).tolist() == vocab.tolist()
    tf = teacher_forced_acceptance(policy, res.heads, data)
    assert all(0 < d["rejection"] < 1 for d in tf)
    out = TorchEngine(policy, res.heads).generate([[3, 4, 5]], SamplingParams(max_new_tokens=12, num_draft_tokens=2,
                                                                             seed=0))
    assert len(out.completions[0].tokens) == 12


def test_engine_acceptance_reports_both_modes(policy):
    heads = init_heads(policy, 2, seed=0)
    res = engine_acceptance(policy, heads, _prompts(4, 2), k=3, max_new_tokens=16, batch_size=4)
    assert set(res) == {"greedy", "rejection"}
    for r in res.values():
        assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["acceptance_length"] <= 4
        assert len(r["conditional_acceptance"]) == 3


def test_draft_cost_reports_positive_times(policy):
    heads = init_heads(policy, 1, seed=0)
    set_draft_vocab(heads, torch.arange(16))
    from mtp_heads.pretrain import draft_cost
    c = draft_cost(policy, heads, context=8, k=2, repeats=2)
    assert c["draft_vocab_size"] == 16
    assert all(c[key] > 0 for key in ("target_1", "target_k1", "head_block", "lm_head_full", "lm_head_draft"))


def test_load_or_train_default_heads_trains_once_then_loads(policy, tmp_path, monkeypatch):
    import mtp_heads.pretrain as pt
    from mtp_heads.checkpoint import HeadMeta, save_heads
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path))
    calls = []

    def fake_pretrain(policy, loaded, plan, out, **kw):
        calls.append(out)
        heads = init_heads(policy, plan.train.num_depths, seed=3)
        save_heads(out, heads, HeadMeta.for_heads(heads, loss=plan.train.loss, steps=plan.train.steps))
        return heads, None, None, None, None
    monkeypatch.setattr(pt, "pretrain", fake_pretrain)
    plan = pt.PretrainPlan(model="tiny", train=TrainConfig(num_depths=2, steps=5))
    heads, meta = pt.load_or_train_default_heads(policy, None, model_spec="tiny", plan=plan)
    again, meta2 = pt.load_or_train_default_heads(policy, None, model_spec="tiny", plan=plan)
    assert len(calls) == 1 and calls[0] == tmp_path / "heads" / "tiny-D2-tv.safetensors"
    assert meta2 == meta and meta.steps == 5
    assert all(torch.equal(a, b) for a, b in zip(heads.parameters(), again.parameters()))


def test_cli_flags_map_onto_the_plan():
    from experiments.pretrain_heads import parse_args, plan_from_args
    plan = plan_from_args(parse_args(["--loss", "ce", "--depths", "2", "--steps", "7", "--draft-vocab", "0",
                                      "--num-sequences", "9", "--max-new-tokens", "33", "--seed", "4"]))
    assert (plan.train.loss, plan.train.num_depths, plan.train.steps, plan.train.draft_vocab_size) == ("ce", 2, 7, 0)
    assert (plan.data.num_sequences, plan.data.max_new_tokens, plan.data.seed, plan.train.seed) == (9, 33, 4, 4)
    with pytest.raises(SystemExit):
        parse_args(["--loss", "mse"])


def test_identity_init_drafts_the_policys_own_next_token_distribution(policy, data):
    from mtp_heads.pretrain import HEAD_INITS, make_batch
    heads = HEAD_INITS["identity"](policy, 2, 0, data)
    batch = make_batch(data, [0, 1], "cpu")
    outs = heads.teacher_forced(policy, batch.hidden, batch.tokens)
    h = batch.hidden[:, :outs[0].shape[1]]
    scale = heads.depths[0].norm.weight[0]
    expected = scale * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + policy.config.rms_norm_eps)
    n = int(batch.lengths.min()) - 2
    torch.testing.assert_close(outs[0][:, :n], expected[:, :n], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown head init"):
        TrainConfig(init="zeros")


def test_cli_summary_lists_every_measurement():
    from experiments.pretrain_heads import summary
    eng = {"acceptance_rate": 0.5, "acceptance_length": 2.0, "conditional_acceptance": [0.6, 0.5, 0.4]}
    report = {"plan": {"train": {"loss": "tv"}}, "train": {"steps": 3, "train_tokens": 10, "draft_vocab_size": 0},
              "teacher_forced": [{"depth": 1, "rejection": 0.7, "greedy": 0.6, "rows": 5}],
              "teacher_forced_train": [{"depth": 1, "rejection": 0.8, "greedy": 0.7, "rows": 5}],
              "engine": {"greedy": eng, "rejection": eng},
              "speedup": {"plain_tokens_per_s": 1.0, "spec_tokens_per_s": 1.5, "speedup": 1.5, "k": 3,
                          "draft_mode": "rejection"},
              "draft_cost_ms": {"target_1": 1.0, "target_k1": 1.2, "head_block": 0.1, "lm_head_full": 0.3,
                                "lm_head_draft": 0.05, "draft_vocab_size": 49152}}
    text = summary(report)
    assert "draft_vocab=full" in text and "rejection=0.700" in text and "on training sequences rejection=0.800" in text
    assert "length 2.00" in text and "(1.50x, k=3, rejection)" in text and "draft vocab (49152) 0.1" in text
