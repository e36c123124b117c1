"""Head pre-training on a tiny random policy: frozen policy, objectives, schedule, resume, vocabulary, eval."""
import numpy as np
import pytest
import torch

from experiments.heads_data import GenerateConfig, generate_token_data
from mtp_heads.checkpoint import draft_vocab_of, load_heads, read_meta
from mtp_heads.distill import OBJECTIVES, DraftVocabMap, batch_from_sequences, distill_loss
from mtp_heads.evaluate import EvalSet, teacher_forced_acceptance
from mtp_heads.heads import init_heads
from mtp_heads.pretrain import HEAD_INITS, Phase, TrainConfig, batch_for_step, lr_at, train_heads
from mtp_heads.token_data import TokenData, draft_vocab_from_counts, trained_token_counts
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.conftest import sharpened_tiny_policy

GEN = GenerateConfig(max_new_tokens=20, gen_batch_size=16)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _cfg(**kw):
    base = dict(num_depths=1, unroll_steps=2, phases=[Phase("tv", 4, 3e-3)], batch_tokens=160, warmup_steps=1,
                draft_vocab_size=0, max_seq_len=64)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def policy():
    return sharpened_tiny_policy()


@pytest.fixture(scope="module")
def data(policy):
    return generate_token_data(policy, _prompts(16, 0), GEN, seed=0, progress=False)


@pytest.fixture(scope="module")
def held_out(policy):
    return generate_token_data(policy, _prompts(8, 1), GEN, seed=1, progress=False)


def test_generated_states_equal_teacher_forcing(policy, data, tmp_path):
    assert len(data) == 16 and data.num_completion_tokens() > 24
    for i in (0, 5, 15):
        s = data[i]
        ref = policy.hidden_states(torch.tensor(s.tokens[None], dtype=torch.long))[0]
        torch.testing.assert_close(torch.from_numpy(s.hidden[:-1]), ref[:-1], atol=1e-4, rtol=1e-4)
        P = int(data.prompt_lens[i])
        assert s.loss_mask.tolist() == [P - 1 <= t < len(s.tokens) - 1 for t in range(len(s.tokens))]
    data.save(tmp_path / "d.npz")
    again = TokenData.load(tmp_path / "d.npz")
    assert np.array_equal(again.tokens, data.tokens) and np.array_equal(again.hidden, data.hidden)


def test_only_heads_get_gradients_and_policy_is_unchanged(policy, data):
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    res = train_heads(policy, data, _cfg(), progress=False)
    assert all(p.grad is None and not p.requires_grad for p in policy.parameters())
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    init = init_heads(policy, 1, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(init.parameters(), res.heads.parameters()))


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_each_objective_lowers_its_own_held_out_divergence(policy, data, held_out, objective):
    """Trained with objective X, the heads' held-out value of X falls well below its start: the
    objective is wired to the right teacher and student, with the sign that minimises it."""
    held_batch = batch_from_sequences([(s.tokens, s.hidden, s.loss_mask) for s in
                                       (held_out[i] for i in range(len(held_out)))], "cpu")
    vocab = DraftVocabMap.build(policy, None)

    def divergence(heads):
        with torch.no_grad():
            return float(distill_loss(heads, policy, held_batch, objective, vocab, steps=2).loss)

    start = divergence(init_heads(policy, 1, seed=0))
    res = train_heads(policy, data, _cfg(phases=[Phase(objective, 40, 3e-3)], warmup_steps=3), progress=False)
    end = divergence(res.heads)
    assert end < 0.9 * start, (objective, start, end)


def test_phases_continue_weights_and_optimizer(policy, data):
    cfg = _cfg(phases=[Phase("fkl", 3, 1e-3), Phase("tv", 3, 2e-3)], warmup_steps=1)
    assert [cfg.phase_at(s).objective for s in range(6)] == ["fkl"] * 3 + ["tv"] * 3
    assert lr_at(3, cfg) == pytest.approx(2 * lr_at(3, _cfg(phases=[Phase("fkl", 3, 1e-3), Phase("tv", 3, 1e-3)])))
    two = train_heads(policy, data, cfg, progress=False)
    first = train_heads(policy, data, cfg, progress=False, stop_after=3)
    assert two.losses[:3] == first.losses       # phase 2 continues from phase 1's state
    with pytest.raises(ValueError, match="unknown objective"):
        Phase("mse", 3)
    # a phase may train fewer draft steps (a cheap warm-up before training-time test)
    from mtp_heads.pretrain import step_loss
    cheap = _cfg(unroll_steps=3, phases=[Phase("tv", 1, unroll_steps=1), Phase("tv", 1)])
    batch = batch_for_step(data, cheap, 0, "cpu")
    heads, vocab = init_heads(policy, 1, seed=0), DraftVocabMap.build(policy, None)
    assert step_loss(heads, policy, batch, cheap, 0, vocab).rows < step_loss(heads, policy, batch, cheap, 1, vocab).rows


def test_resume_equals_uninterrupted(policy, data, tmp_path):
    cfg = _cfg(phases=[Phase("fkl", 3, 3e-3), Phase("tv", 3, 3e-3)], checkpoint_every=2)
    full = train_heads(policy, data, cfg, checkpoint=tmp_path / "a.safetensors", progress=False)
    cut = train_heads(policy, data, cfg, checkpoint=tmp_path / "b.safetensors", progress=False, stop_after=4)
    assert cut.steps == 4 and read_meta(tmp_path / "b.safetensors").steps == 4
    resumed = train_heads(policy, data, cfg, checkpoint=tmp_path / "b.safetensors", resume=True, progress=False)
    assert resumed.losses == full.losses[4:]
    a, b = full.heads.state_dict(), resumed.heads.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    heads, meta = load_heads(tmp_path / "b.safetensors", policy)
    assert meta.steps == 6 and meta.loss == "fkl:3+tv:3"
    with pytest.raises(ValueError, match="config differs"):
        train_heads(policy, data, _cfg(phases=[Phase("tv", 9)]), progress=False,
                    checkpoint=tmp_path / "b.safetensors", resume=True)


def test_fine_tuning_starts_from_given_heads(policy, data, tmp_path):
    base = train_heads(policy, data, _cfg(), checkpoint=tmp_path / "base.safetensors", progress=False)
    tuned = train_heads(policy, data, _cfg(init=str(tmp_path / "base.safetensors"), phases=[Phase("tv", 1, 1e-9)]),
                        progress=False)
    for a, b in zip(base.heads.parameters(), tuned.heads.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_batches_depend_only_on_seed_and_step(data):
    cfg = _cfg(batch_tokens=60, max_seq_len=12)
    a, b = batch_for_step(data, cfg, 5, "cpu"), batch_for_step(data, cfg, 5, "cpu")
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
    assert a.tokens.shape[1] <= 12 and not torch.equal(a.tokens, batch_for_step(data, cfg, 6, "cpu").tokens)


def test_short_pretraining_raises_teacher_forced_acceptance(policy, data, held_out):
    evalset = EvalSet.build(policy, held_out, (1.0,))
    before = teacher_forced_acceptance(policy, init_heads(policy, 1, seed=0), evalset, steps=3)[1.0]
    res = train_heads(policy, data, _cfg(unroll_steps=3, phases=[Phase("tv", 25, 3e-3)], warmup_steps=2),
                      progress=False)
    after = teacher_forced_acceptance(policy, res.heads, evalset, steps=3)[1.0]
    for j in range(3):
        assert after["rejection"]["per_position"][j] > before["rejection"]["per_position"][j] + 0.02, (before, after)
    assert after["rejection"]["tau"] > before["rejection"]["tau"]


def test_teacher_forced_acceptance_matches_a_direct_computation(policy, held_out):
    """The cached log-normaliser gives the same numbers as the full distributions, per head."""
    heads = init_heads(policy, 1, seed=0)
    heads.set_draft_vocab(torch.arange(0, 64, 2))
    res = teacher_forced_acceptance(policy, heads, EvalSet.build(policy, held_out, (0.7,)), steps=2)[0.7]
    W = policy.lm_head_weight
    rej, greedy, n = [0.0, 0.0], [0.0, 0.0], [0, 0]
    from mtp_heads.ttt import unroll
    for i in range(len(held_out)):
        s = held_out[i]
        tok, hid = torch.tensor(s.tokens[None], dtype=torch.long), torch.from_numpy(s.hidden[None])
        with torch.no_grad():
            outs = unroll(heads, policy, hid, tok, 2)
        for j, out in enumerate(outs, start=1):
            for t in range(out.shape[1]):
                if not s.loss_mask[t + j]:
                    continue
                p = torch.softmax(hid[0, t + j] @ W.t() / 0.7, -1)
                with torch.no_grad():
                    q = torch.softmax(heads.draft_logits(policy, out[0, t:t + 1])[0] / 0.7, -1)
                rej[j - 1] += float(torch.minimum(p, q).sum())
                greedy[j - 1] += float(p[q.argmax()])
                n[j - 1] += 1
    assert res["rejection"]["rows"] == n
    for j in range(2):
        assert res["rejection"]["per_position"][j] == pytest.approx(rej[j] / n[j], rel=1e-4)
        assert res["greedy"]["per_position"][j] == pytest.approx(greedy[j] / n[j], rel=1e-4)


def test_draft_vocab_is_frequency_based_and_drafts_stay_inside(policy, data):
    counts = trained_token_counts(data, 64)
    assert counts.sum() == data.num_completion_tokens()
    vocab = draft_vocab_from_counts(counts, 16, always=(1,))
    assert 1 in vocab.tolist() and len(vocab) <= 17
    top_outside = max((counts[t] for t in range(64) if t not in set(vocab.tolist())), default=0)
    assert all(counts[t] >= top_outside for t in vocab.tolist() if t != 1)
    res = train_heads(policy, data, _cfg(), draft_vocab=vocab, progress=False)
    assert draft_vocab_of(res.heads).tolist() == vocab.tolist()
    out = TorchEngine(policy, res.heads).generate([[3, 4, 5]], SamplingParams(max_new_tokens=12, num_draft_tokens=2,
                                                                             seed=0))
    assert len(out.completions[0].tokens) == 12


def test_identity_init_drafts_the_policys_own_next_token_distribution(policy, data):
    heads = HEAD_INITS["identity"](policy, 1, 1, 0, data)
    s = data[0]
    tok, hid = torch.tensor(s.tokens[None], dtype=torch.long), torch.from_numpy(s.hidden[None])
    out = heads.teacher_forced(policy, hid, tok)[0]
    h = hid[:, :out.shape[1]]
    scale = heads.depths[0].norm.weight[0]
    expected = scale * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + policy.config.rms_norm_eps)
    torch.testing.assert_close(out[:, :-1], expected[:, :-1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown head init"):
        _cfg(init="zeros")


def _tiny_run_cfg(tmp_path, **train):
    from experiments.pretrain_heads import EvalConfig, TrainHeadsConfig
    return TrainHeadsConfig(model="tiny", out_dir=str(tmp_path / "h"), progress=False,
                            train=_cfg(draft_vocab_size=16, eval_every=2, **train),
                            eval=EvalConfig(temperatures=[0.7, 1.0], steps=2, heldout_sequences=4, train_sequences=4))


def test_train_heads_job_writes_heads_report_and_curve(policy, data, held_out, tmp_path, monkeypatch):
    import json
    import experiments.pretrain_heads as job
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(job, "open_data", lambda cfg, policy, loaded, progress: (data, held_out, {"tiny": True}))
    report = job.run(_tiny_run_cfg(tmp_path), "resolved: yaml\n", policy, None)
    assert [h["step"] for h in report["history"]] == [2, 4]
    assert set(report["final"]["heldout"]) == {0.7, 1.0} and set(report["final"]["train"]) == {0.7, 1.0}
    saved = json.loads((tmp_path / "h" / "heads.run.json").read_text())
    assert saved["steps"] == 4 and len(saved["history"]) == 2
    heads, meta = load_heads(tmp_path / "h" / "heads.safetensors", policy)
    assert meta.steps == 4 and meta.draft_vocab_size == len(draft_vocab_of(heads)) <= 17
    from experiments.ship_heads import model_card
    card = model_card(saved, meta, "tiny", "mtp-rollout train-heads x", 12.0, "abc123")
    assert "| 1 | rejection |" in card and "abc123" in card and "| 4 |" in card


def test_heldout_sources_are_scored_apart_and_at_step_0(policy, tmp_path, monkeypatch):
    """eval.heldout_sources scores each source's held-out split on its own; eval.at_start adds step 0
    (the start of a fine-tuning curve) with the initial heads."""
    import experiments.pretrain_heads as job
    from mtp_heads.data.builder import Example, build_shards
    from mtp_heads.data.token_store import StoreWriter
    from experiments.pretrain_heads import EvalConfig, TrainHeadsConfig, DataConfig
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    root = tmp_path / "store"
    for source, split, seed in (("sharegpt", "train", 0), ("sharegpt", "heldout", 1), ("onpolicy", "heldout", 2)):
        items = []
        for i in range(6):
            T = int(rng.integers(12, 30))
            mask = np.zeros(T, bool)
            mask[3:] = True
            items.append((f"{source}{seed}-{i}", rng.integers(2, 64, T).astype(np.int32), mask))
        build_shards(StoreWriter(root, {"model": "tiny", "hidden_size": 32, "dtype": "bfloat16"}), policy,
                     source=source, split=split, items=items, items_per_shard=3, target_tokens=10**9,
                     max_batch_tokens=64, log=lambda *a: None,
                     make_examples=lambda chunk, _: [Example(k, t, a) for k, t, a in chunk])
    cfg = TrainHeadsConfig(model="tiny", out_dir=str(tmp_path / "h"), progress=False,
                           data=DataConfig(store=str(root), sources=["sharegpt"]),
                           train=_cfg(draft_vocab_size=0, eval_every=2),
                           eval=EvalConfig(temperatures=[1.0], steps=2, heldout_sequences=4, train_sequences=0,
                                           heldout_sources=["sharegpt", "onpolicy"], at_start=True))
    report = job.run(cfg, "", policy, None)
    assert [h["step"] for h in report["history"]] == [0, 2, 4]
    for h in report["history"]:
        assert h["heldout_sharegpt"] == h["heldout"]                  # the same split, scored twice
        assert h["heldout_onpolicy"] != h["heldout"]
    start, end = (report["history"][i]["heldout"][1.0]["rejection"]["per_position"][0] for i in (0, -1))
    assert start != end
    from experiments.ship_heads import model_card
    card = model_card(report, read_meta(tmp_path / "h" / "heads.safetensors"), "tiny", "cmd", None, "abc")
    assert "Held-out split of the `onpolicy` source alone" in card and "onpolicy pos 1/2/3" in card
    assert report["machine"] in card


def test_train_heads_cli_exits_0_after_a_real_run(policy, data, held_out, tmp_path, monkeypatch, capsys):
    """`mtp-rollout train-heads ...` through the CLI with the real job (model and data swapped for the
    tiny ones): trains, writes the heads and the report, and exits 0 (it once returned the report
    dict as its exit status)."""
    import experiments.pretrain_heads as job
    import rollout.models.loaders as loaders
    from experiments import cli
    from rollout.models.loaders import LoadedModel
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loaders, "load_model",
                        lambda spec: LoadedModel(policy.config, policy.state_dict(), None, None, spec))
    monkeypatch.setattr(job, "open_data", lambda cfg, policy, loaded, progress: (data, held_out, {"tiny": True}))
    out = tmp_path / "h" / "heads.safetensors"     # out_dir holds the heads under a fixed name
    status = cli.main(["train-heads", "model=tiny", f"out_dir={out.parent}", "progress=false", "train.batch_tokens=160",
                       "train.max_seq_len=64", "train.draft_vocab_size=16", "train.unroll_steps=2",
                       "train.phases=[{objective: tv, steps: 3}]", "eval.heldout_sequences=4", "eval.train_sequences=0",
                       "eval.steps=2"])
    assert status == 0
    assert read_meta(out).steps == 3 and out.with_suffix(".run.json").is_file()
    assert "held-out:" in capsys.readouterr().out


def test_train_heads_refuses_eval_steps_0_before_training(policy, data, held_out, tmp_path, monkeypatch, capsys):
    """eval.steps=0 used to train, write the heads and then exit 1 with an IndexError."""
    import experiments.pretrain_heads as job
    import rollout.models.loaders as loaders
    from experiments import cli
    from rollout.models.loaders import LoadedModel
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loaders, "load_model",
                        lambda spec: LoadedModel(policy.config, policy.state_dict(), None, None, spec))
    monkeypatch.setattr(job, "open_data", lambda cfg, policy, loaded, progress: (data, held_out, {"tiny": True}))
    out = tmp_path / "h"
    assert cli.main(["train-heads", "model=tiny", f"out_dir={out}", "progress=false", "train.batch_tokens=160",
                     "train.max_seq_len=64", "train.draft_vocab_size=16", "train.unroll_steps=2",
                     "train.phases=[{objective: tv, steps: 2}]", "eval.heldout_sequences=4", "eval.train_sequences=0",
                     "eval.steps=0"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mtp-rollout")]
    assert len(err) == 1 and "eval.steps" in err[0] and "got 0" in err[0], err
    assert not out.exists()                      # nothing trained, nothing written


def test_train_heads_names_data_generate_num_sequences_0(tmp_path, monkeypatch, capsys):
    from experiments import cli
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path / "cache"))
    assert cli.main(["train-heads", "model=tiny-random", f"out_dir={tmp_path / 'h'}", "progress=false",
                     "data.generate.num_sequences=0"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mtp-rollout")]
    assert len(err) == 1 and "data.generate.num_sequences must be >= 1, got 0" in err[0], err


def test_shipped_heads_load_without_training(policy, tmp_path, monkeypatch):
    import mtp_heads.shipped as shipped
    from mtp_heads.checkpoint import HeadMeta, save_heads
    heads = init_heads(policy, 1, seed=4).to(torch.bfloat16)
    save_heads(tmp_path / "tiny.safetensors", heads, HeadMeta.for_heads(heads, loss="fkl:1+tv:1", steps=2))
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path)
    monkeypatch.setattr(shipped, "SHIPPED", {"tiny": "tiny.safetensors"})
    got, desc = shipped.resolve_heads(policy, "shipped", model="tiny")
    assert "2 steps" in desc and got.depths[0].eh_proj.weight.dtype == torch.float32
    torch.testing.assert_close(got.depths[0].eh_proj.weight, heads.depths[0].eh_proj.weight.float())
    with pytest.raises(ValueError, match="holds 1 MTP depths but 2"):
        shipped.resolve_heads(policy, "shipped", model="tiny", num_depths=2)


def test_other_policies_use_the_heads_train_heads_cached_or_say_how_to_get_them(policy, tmp_path, monkeypatch):
    from mtp_heads.checkpoint import HeadMeta, save_heads
    from mtp_heads.shipped import resolve_heads, trained_heads_path
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="train-heads model=other-model"):
        resolve_heads(policy, "shipped", model="other-model")
    heads = init_heads(policy, 1, seed=3)
    save_heads(trained_heads_path("other-model"), heads, HeadMeta.for_heads(heads, steps=7))
    got, desc = resolve_heads(policy, "shipped", model="other-model")
    assert "7 steps" in desc
    torch.testing.assert_close(got.depths[0].eh_proj.weight, heads.depths[0].eh_proj.weight)
    path_heads, _ = resolve_heads(policy, str(trained_heads_path("other-model")), model="other-model")
    torch.testing.assert_close(path_heads.depths[0].eh_proj.weight, heads.depths[0].eh_proj.weight)
    with pytest.raises(ValueError, match="no such heads file"):
        resolve_heads(policy, str(tmp_path / "missing.safetensors"), model="other-model")


def test_train_heads_cli_help_lists_every_key(capsys):
    from experiments.pretrain_heads import TrainHeadsConfig, load_train_heads_config, main
    from rollout.config_loader import config_keys
    main(["--help"])
    text = capsys.readouterr().out
    for k in config_keys(TrainHeadsConfig):
        assert k.key in text and k.help, k
    cfg, _ = load_train_heads_config(["heads_smollm2", "train.phases=[{objective: tv, steps: 7}]", "train.seed=3"])
    assert cfg.train.phases == [Phase("tv", 7)] and cfg.train.seed == 3 and cfg.train.num_depths == 1
    with pytest.raises(ValueError, match="objectiv"):
        load_train_heads_config(["train_heads", "train.phases=[{objectiv: tv}]"])


def test_the_shipped_smollm2_heads_are_in_the_package():
    """The file the main job, generate and the benchmarks load: one recurrent depth, bf16, <= 32 MB,
    a draft vocabulary and a model card beside it."""
    from safetensors import safe_open
    from mtp_heads.shipped import shipped_heads_path
    path = shipped_heads_path("smollm2-135m")
    assert path is not None and path.stat().st_size <= 32 * 2**20
    meta = read_meta(path)
    assert (meta.num_depths, meta.hidden_size, meta.vocab_size) == (1, 576, 49152) and meta.draft_vocab_size > 0
    with safe_open(str(path), framework="pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys() if k != "draft_vocab"}
    assert dtypes == {torch.bfloat16}
    assert path.with_suffix(".md").is_file()
