"""Training EAGLE-3 drafters: the unroll equals the drafting recurrence, objectives, held-out acceptance,
resume, recorded aux states, the train-heads job and the co-trainer, on a tiny random policy."""
import json

import numpy as np
import pytest
import torch

from experiments.heads_data import GenerateConfig, generate_token_data
from mtp_heads.distill import OBJECTIVES, batch_from_replay, batch_from_sequences
from mtp_heads.eagle3 import aux_hidden_states, init_eagle3
from mtp_heads.eagle3_checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_eagle3
from mtp_heads.eagle3_train import EAGLE3_OBJECTIVES, drafter_vocab, eagle3_loss, last_layer_eagle3, unroll_eagle3
from mtp_heads.evaluate import EvalSet, teacher_forced_acceptance
from mtp_heads.pretrain import Phase, TrainConfig, batch_for_step, train_heads, train_state_path
from tests.conftest import sharpened_tiny_policy

GEN = GenerateConfig(max_new_tokens=20, gen_batch_size=16)
AUX = (1, 2, 4)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _cfg(**kw):
    base = dict(drafter="eagle3", aux_layer_ids=list(AUX), unroll_steps=2, phases=[Phase("tv", 4, 3e-3)],
                batch_tokens=400, warmup_steps=1, draft_vocab_size=0, max_seq_len=64)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def policy():
    """Four layers: aux states from distinct low / middle / high layers."""
    return sharpened_tiny_policy(num_hidden_layers=4)


@pytest.fixture(scope="module")
def data(policy):
    """128 sequences: an EAGLE-3 drafter (its own LM head included) overfits 16 within 30 steps."""
    return generate_token_data(policy, _prompts(128, 0), GEN, seed=0, progress=False)


@pytest.fixture(scope="module")
def held_out(policy):
    return generate_token_data(policy, _prompts(16, 1), GEN, seed=1, progress=False)


# ------------------------------------------------------------------------------ the unroll


@torch.no_grad()
def test_unroll_equals_the_drafting_recurrence_at_every_step(policy):
    """Step s at chain start t is what the drafter computes when drafting after position t with its KV
    cache (teacher-forced positions <= t, then its own pre-norm outputs), fed the data's tokens."""
    drafter = init_eagle3(policy, AUX, draft_vocab=torch.arange(0, 64, 2), seed=3)
    T, k = 11, 4
    seq = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(5))
    aux = aux_hidden_states(policy, seq, AUX)
    outs = unroll_eagle3(drafter, policy, aux, seq, k)
    assert [o.shape[1] for o in outs] == [T - s for s in range(1, k + 1)]
    for t in range(T - 1):
        cache = drafter.new_cache(1, T + k)
        post, pre = drafter.step(policy, seq[:, 1:t + 2], drafter.fc(aux[:, :t + 1]), torch.arange(t + 1)[None], cache)
        post, pre = post[:, -1:], pre[:, -1:]
        for s in range(1, k + 1):
            if t + s >= T:
                break
            if s > 1:
                post, pre = drafter.step(policy, seq[:, t + s:t + s + 1], pre, torch.tensor([[t + s - 1]]), cache)
            torch.testing.assert_close(outs[s - 1][:, t], post[:, 0], atol=1e-5, rtol=1e-5)


def test_the_objectives_are_the_heads_objectives():
    assert set(EAGLE3_OBJECTIVES) == set(OBJECTIVES)


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_each_objective_lowers_its_own_held_out_divergence(policy, data, held_out, objective):
    held = [held_out[i] for i in range(len(held_out))]
    batch = batch_from_sequences([(s.tokens, s.hidden, s.loss_mask) for s in held], "cpu")

    def divergence(drafter):
        with torch.no_grad():
            return float(eagle3_loss(drafter, policy, batch, objective, drafter_vocab(policy, drafter), steps=2).loss)

    start = divergence(last_layer_eagle3(policy, AUX, None, 0))
    res = train_heads(policy, data, _cfg(phases=[Phase(objective, 30, 3e-3)], warmup_steps=3), progress=False)
    assert divergence(res.heads) < 0.9 * start, (objective, start, divergence(res.heads))


def test_tv_training_raises_held_out_acceptance_at_every_position(policy, data, held_out):
    evalset = EvalSet.build(policy, held_out, (0.7, 1.0), aux_layer_ids=AUX)
    vocab = torch.arange(0, 64, 2)
    before = teacher_forced_acceptance(policy, last_layer_eagle3(policy, AUX, vocab, 0), evalset, steps=3)
    res = train_heads(policy, data, _cfg(unroll_steps=3, phases=[Phase("tv", 80, 3e-3)], warmup_steps=5),
                      draft_vocab=vocab, progress=False)
    after = teacher_forced_acceptance(policy, res.heads, evalset, steps=3)
    for T in (0.7, 1.0):
        for j in range(3):
            assert after[T]["rejection"]["per_position"][j] > before[T]["rejection"]["per_position"][j] + 0.05, \
                (T, before[T], after[T])
        assert after[T]["rejection"]["tau"] > before[T]["rejection"]["tau"] + 0.1
    assert set(res.heads.target_ids(torch.arange(32)).tolist()) == set(vocab.tolist())


def test_teacher_forced_acceptance_matches_a_direct_computation(policy, held_out):
    drafter = init_eagle3(policy, AUX, draft_vocab=torch.arange(1, 64, 3), seed=2)
    res = teacher_forced_acceptance(policy, drafter, EvalSet.build(policy, held_out, (0.7,)), steps=2)[0.7]
    W = policy.lm_head_weight
    rej, greedy, n = [0.0, 0.0], [0.0, 0.0], [0, 0]
    for i in range(len(held_out)):
        s = held_out[i]
        tok, hid = torch.tensor(s.tokens[None], dtype=torch.long), torch.from_numpy(s.hidden[None])
        with torch.no_grad():
            outs = unroll_eagle3(drafter, policy, aux_hidden_states(policy, tok, AUX), tok, 2)
        for j, out in enumerate(outs, start=1):
            for t in range(out.shape[1]):
                if not s.loss_mask[t + j]:
                    continue
                p = torch.softmax(hid[0, t + j] @ W.t() / 0.7, -1)
                with torch.no_grad():
                    q = torch.softmax(drafter.draft_logits(out[0, t]) / 0.7, -1)     # full vocabulary, 0 outside S
                rej[j - 1] += float(torch.minimum(p, q).sum())
                greedy[j - 1] += float(p[q.argmax()])
                n[j - 1] += 1
    assert res["rejection"]["rows"] == n
    for j in range(2):
        assert res["rejection"]["per_position"][j] == pytest.approx(rej[j] / n[j], rel=1e-4)
        assert res["greedy"]["per_position"][j] == pytest.approx(greedy[j] / n[j], rel=1e-4)


# ------------------------------------------------------------------------------ checkpoints and data


def test_resume_equals_uninterrupted_and_a_foreign_state_is_refused(policy, data, tmp_path):
    cfg = _cfg(phases=[Phase("fkl", 3, 3e-3), Phase("tv", 3, 3e-3)], checkpoint_every=2)
    vocab = torch.arange(0, 64, 2)
    full = train_heads(policy, data, cfg, draft_vocab=vocab, checkpoint=tmp_path / "a", progress=False)
    cut = train_heads(policy, data, cfg, draft_vocab=vocab, checkpoint=tmp_path / "b", progress=False, stop_after=4)
    assert cut.steps == 4 and (tmp_path / "b" / CONFIG_FILE).is_file() and train_state_path(tmp_path / "b").is_file()
    state = torch.load(train_state_path(tmp_path / "b"), weights_only=True)     # plain data only
    assert state["step"] == 4
    resumed = train_heads(policy, data, cfg, checkpoint=tmp_path / "b", resume=True, progress=False)
    assert resumed.losses == full.losses[4:]
    a, b = full.heads.state_dict(), resumed.heads.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    loaded = load_eagle3(tmp_path / "b", policy)
    assert loaded.aux_layer_ids == AUX and int(loaded.t2d.sum()) == 32
    assert all(torch.equal(loaded.state_dict()[k], b[k]) for k in b)
    # another run's optimizer state (same config and step, other weights: another draft vocabulary) is refused
    train_heads(policy, data, cfg, draft_vocab=torch.arange(1, 64, 2), checkpoint=tmp_path / "c", progress=False)
    train_state_path(tmp_path / "c").replace(train_state_path(tmp_path / "b"))
    with pytest.raises(ValueError, match="does not belong"):
        train_heads(policy, data, cfg, checkpoint=tmp_path / "b", resume=True, progress=False)


def test_recorded_aux_states_equal_the_policys_and_are_reused(policy, data, tmp_path):
    from mtp_heads.data.aux_states import record_aux_states
    said = []

    def log(msg):
        said.extend([msg] if "recorded in" in msg else [])

    src = record_aux_states(policy, data, AUX, tmp_path / "aux.npy", max_batch_tokens=64, log=log)
    assert len(src) == len(data) and len(said) == 1
    for i in (0, 7, 15):
        want = aux_hidden_states(policy, torch.tensor(data[i].tokens[None], dtype=torch.long), AUX)[0]
        torch.testing.assert_close(src[i].aux.float(), want, atol=0.02, rtol=0.01)    # bf16, as the store
    again = record_aux_states(policy, data, AUX, tmp_path / "aux.npy", log=log)
    assert len(said) == 1 and np.array_equal(np.asarray(again.aux), np.asarray(src.aux))    # read back, not redone
    record_aux_states(policy, data, (1, 3), tmp_path / "aux.npy", log=log)            # other layers: redone
    assert len(said) == 2
    cfg = _cfg()
    recorded = batch_for_step(record_aux_states(policy, data, AUX, tmp_path / "aux.npy", log=log), cfg, 0, "cpu")
    plain = batch_for_step(data, cfg, 0, "cpu")
    assert plain.aux is None and recorded.tokens.equal(plain.tokens)
    drafter = last_layer_eagle3(policy, AUX, None, 0)
    vocab = drafter_vocab(policy, drafter)
    with torch.no_grad():
        a = float(eagle3_loss(drafter, policy, recorded, "tv", vocab, steps=2).loss)
        b = float(eagle3_loss(drafter, policy, plain, "tv", vocab, steps=2).loss)     # recomputed from the tokens
    assert a == pytest.approx(b, rel=0.02)


# ------------------------------------------------------------------------------ the train-heads job


def _mock_job(monkeypatch, tmp_path, policy, data, held_out):
    import experiments.pretrain_heads as job
    import rollout.models.loaders as loaders
    from rollout.models.loaders import LoadedModel
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loaders, "load_model", lambda spec: LoadedModel(policy.config, policy.state_dict(), None, None, spec))
    monkeypatch.setattr(job, "open_data", lambda cfg, policy, loaded, progress: (data, held_out, {"tiny": True}))


ARGS = ["train-heads", "model=tiny", "progress=false", "train.drafter=eagle3", "train.batch_tokens=160",
        "train.max_seq_len=64", "train.draft_vocab_size=16", "train.unroll_steps=2",
        "train.phases=[{objective: tv, steps: 3}]", "eval.heldout_sequences=4", "eval.train_sequences=2", "eval.steps=2"]


def test_train_heads_trains_an_eagle3_drafter_and_compares_it_with_heads(policy, data, held_out, tmp_path, monkeypatch,
                                                                         capsys):
    from experiments import cli
    from mtp_heads.checkpoint import HeadMeta, save_heads
    from mtp_heads.heads import init_heads
    _mock_job(monkeypatch, tmp_path, policy, data, held_out)
    heads = init_heads(policy, 1, seed=0)
    save_heads(tmp_path / "heads.safetensors", heads, HeadMeta.for_heads(heads))
    out = tmp_path / "run"
    assert cli.main([*ARGS, f"out_dir={out}", f"eval.compare=[{tmp_path / 'heads.safetensors'}]"]) == 0
    cfg = json.loads((out / "eagle3" / CONFIG_FILE).read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] in (16, 17)   # 16 (+ EOS)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]      # the default for 4 layers
    assert (out / "eagle3" / WEIGHTS_FILE).is_file() and (out / "eagle3.train.pt").is_file()
    report = json.loads((out / "eagle3.run.json").read_text())
    assert report["steps"] == 3 and report["meta"]["draft_vocab_size"] == cfg["draft_vocab_size"]
    ours, theirs = report["final"]["heldout"], report["compare"][str(tmp_path / "heads.safetensors")]["heldout"]
    assert ours.keys() == theirs.keys() == {"0.7", "1.0"}
    assert ours["1.0"]["rejection"]["rows"] == theirs["1.0"]["rejection"]["rows"]      # the same held-out positions
    printed = capsys.readouterr().out
    assert "heads.safetensors (same sequences)" in printed
    # resume on the finished run: nothing more to train, same drafter
    before = (out / "eagle3" / WEIGHTS_FILE).read_bytes()
    assert cli.main([*ARGS, f"out_dir={out}", "resume=true"]) == 0
    assert (out / "eagle3" / WEIGHTS_FILE).read_bytes() == before


@pytest.mark.parametrize("arg, key", [
    ("train.aux_layer_ids=[1, 2, 9]", "train.aux_layer_ids=[1, 2, 9]"),
    ("train.aux_layer_ids=[3, 1]", "train.aux_layer_ids=[3, 1]"),
    ("train.init=shipped", "train.init='shipped'"),
    ("train.num_layers=2", "train.num_layers must be 1"),
    ("data.aux_states=keep", "data.aux_states='keep'"),
    ("eval.engine_prompts=4", "eval.engine_prompts=4"),
])
def test_bad_eagle3_input_is_refused_before_training_in_one_line(policy, data, held_out, tmp_path, monkeypatch, capsys,
                                                                  arg, key):
    from experiments import cli
    _mock_job(monkeypatch, tmp_path, policy, data, held_out)
    out = tmp_path / "run"
    assert cli.main([*ARGS, f"out_dir={out}", arg]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mtp-rollout")]
    assert len(err) == 1 and key in err[0], err
    assert not (out / "eagle3").exists()


# ------------------------------------------------------------------------------ the co-trainer


def test_cotrainer_trains_an_eagle3_drafter_with_the_pretraining_loss_and_resumes(policy, data, tmp_path):
    from mtp_heads.cotrainer import CoTrainerConfig, HeadCoTrainer
    from mtp_heads.drafters import drafter_spec
    from mtp_heads.refresh import StepObservation
    from rollout.models.flat_weights import pack
    drafter = last_layer_eagle3(policy, AUX, torch.arange(0, 64, 2), 0)
    cfg = CoTrainerConfig(loss="tv", lr=3e-3, steps_per_refresh=25, batch_tokens=200, refresh=("every_n_steps",),
                          every_n_steps=1, checkpoint_dir=str(tmp_path / "ct"), unroll_steps=2)
    ct = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(drafter.state_dict()),
                       drafter_spec(drafter), 0)
    assert ct.is_eagle3
    rollouts = [(data[i].tokens[:int(data.prompt_lens[i])].tolist(), data[i].tokens[int(data.prompt_lens[i]):].tolist())
                for i in range(len(data))]
    ct.add_rollouts(rollouts)
    seqs = [(np.asarray(p + c), len(p)) for p, c in rollouts[:4]]
    batch = batch_from_replay(ct.policy, seqs, "cpu", AUX)
    want = eagle3_loss(drafter.float(), policy, batch, "tv", drafter_vocab(policy, drafter), steps=2).loss
    assert float(ct.batch_loss(batch)) == pytest.approx(float(want), rel=1e-5)
    assert not ct.observe(StepObservation(step=0, mean_entropy=1.0, acceptance_rate=0.5, head_version=0)).refreshed
    res = ct.observe(StepObservation(step=1, mean_entropy=1.0, acceptance_rate=0.5, head_version=0))
    assert res.refreshed and res.head_version == 1 and np.mean(res.losses[-5:]) < np.mean(res.losses[:5])
    assert (tmp_path / "ct" / "eagle3_latest" / WEIGHTS_FILE).is_file()
    again = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(drafter.state_dict()),
                          drafter_spec(drafter), 0)
    assert again.head_version == 1 and again.train_steps == ct.train_steps
    assert all(torch.equal(again.heads.state_dict()[k], v) for k, v in ct.heads.state_dict().items())
