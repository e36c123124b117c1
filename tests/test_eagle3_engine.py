"""The torch engine drafting with an EAGLE-3 drafter (mtp_heads.eagle3_drafter.Eagle3Heads, the engine's
heads source): what is generated never changes, on both attention kernels (padded SDPA, packed paged), with
the per-row chooser and with a fixed k; every draft equals the reference drafting function's
(mtp_heads.eagle3.draft_greedy, which tests/test_vllm_eagle3.py holds vLLM's drafts to); heads=<EAGLE-3
directory> through `mtp-rollout generate`, and a drafter of another policy refused naming its file."""
import json
from dataclasses import replace

import pytest
import torch

import rollout.engine.round as round_module
from experiments import cli
from mtp_heads.eagle3 import draft_greedy, init_eagle3
from mtp_heads.eagle3_checkpoint import CONFIG_FILE, save_eagle3
from mtp_heads.eagle3_drafter import Eagle3Heads
from mtp_heads.shipped import resolve_heads
from rollout.engine.chooser import DraftChooser
from rollout.engine.config import EngineConfig
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.conftest import export_tiny_chat_model, tiny_chat_llama_config
from tests.lossless import chi2_pvalue, continuation_counts, lossy_rejection_sample
from tests.test_per_row_drafting import eager_chooser
from tests.test_torch_engine import ATTENTION, attention_config
from tests.test_vllm_eagle3 import DRAFT_VOCAB, _prompts, _trained_drafter

K = 3


@pytest.fixture(scope="module", params=sorted(ATTENTION))
def eagle(request):
    """A 4-layer float32 policy (vocabulary 256) on one attention kernel, a drafter trained briefly on its
    greedy text (aux layers 1, 2, 4; a reduced draft vocabulary, so d2t maps ids), and its engine adapter."""
    policy = random_model(attention_config(request.param, vocab_size=256, num_hidden_layers=4), seed=0)
    drafter = _trained_drafter(policy, seed=1)
    return policy, drafter, Eagle3Heads(drafter)


def policy_forwards(monkeypatch, policy) -> list[tuple[int, ...]]:
    """The shapes of the policy's own forwards from here on: the prompts' aux states must come from the
    prefill's forward, one per generate call, not from running the policy over the prompts again."""
    calls, real = [], policy.hidden_states

    def counted(tokens, *args, **kwargs):
        calls.append(tuple(tokens.shape))
        return real(tokens, *args, **kwargs)
    monkeypatch.setattr(policy, "hidden_states", counted)
    return calls


def _stopping_requests(policy, prompts):
    """Greedy sampling params whose stop token some rows emit early (rows finish at different times), and
    plain decoding's output under them."""
    unstopped = TorchEngine(policy).generate(prompts, SamplingParams(max_new_tokens=40, temperature=0,
                                                                     ignore_eos=True))
    base = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                          stop_token_ids=(unstopped.completions[0].tokens[12],))
    return base, TorchEngine(policy).generate(prompts, base)


@pytest.mark.parametrize("lengths", ["chosen", "fixed"])
@pytest.mark.parametrize("mode", ["greedy", "rejection"])
def test_temperature_zero_output_equals_plain_decoding(eagle, lengths, mode, monkeypatch):
    policy, _, heads = eagle
    if lengths == "chosen":
        eager_chooser(monkeypatch)            # the real chooser drafting whatever it has; odd rows take history
    prompts = _prompts() + _prompts()[:2]    # repeated prompts: siblings to copy from (and a deduplicated prefill)
    base, plain = _stopping_requests(policy, prompts)
    forwards = policy_forwards(monkeypatch, policy)
    assert len({len(c.tokens) for c in plain.completions}) > 1
    engine = TorchEngine(policy, heads, config=EngineConfig(draft_lengths=lengths))
    sp = replace(base, num_draft_tokens=K, draft_mode=mode)
    outs = [engine.generate(prompts, sp) for _ in range(2)]
    assert len(forwards) == 2, forwards                  # the prefills, nothing more
    for out in outs:
        assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    comps = [c for out in outs for c in out.completions]
    by_heads = [(a, n) for c in comps for a, n, s in zip(c.round_accepted, c.round_draft_tokens, c.round_sources)
                if s == "heads"]
    assert sum(a for a, _ in by_heads) >= 10, by_heads            # EAGLE-3 drafts were accepted ...
    assert any(a < n for a, n in by_heads)                        # ... and rejected
    per_row = [sum(c.round_accepted) for c in outs[0].completions]
    assert len(set(per_row)) > 1                                  # rows advanced by different amounts
    if lengths == "chosen":
        assert {s for c in comps for s in c.round_sources} == {"heads", "history"}


@pytest.mark.parametrize("lengths", ["fixed", "chosen"])
def test_every_engine_draft_equals_the_reference_drafting_function(eagle, lengths, monkeypatch):
    """At T = 0 every row's k drafts of every round equal draft_greedy on the prefix committed then: the
    teacher-forced drafter cache over committed positions (fc of the aux states from prefill and
    verification) and the recurrence on the pre-norm state."""
    policy, drafter, heads = eagle
    if lengths == "chosen":       # per-row lengths and sources, every round with head steps: many drafts to check
        eager_chooser(monkeypatch)
        monkeypatch.setattr(DraftChooser, "head_steps", lambda self, bucket, view: self.k_max)
    records = []
    real_draft = round_module.draft

    def recording_draft(ctx, st, k):
        out = real_draft(ctx, st, k)
        committed, finished = st.committed.tolist(), st.finished.tolist()
        for b in range(st.batch):
            if not finished[b]:
                records.append((st.seq[b, :committed[b]].tolist(), out[0][b].tolist()))
        return out

    monkeypatch.setattr(round_module, "draft", recording_draft)
    prompts = _prompts()                     # distinct prompts of different lengths: one prefill forward
    base, plain = _stopping_requests(policy, prompts)
    forwards = policy_forwards(monkeypatch, policy)
    engine = TorchEngine(policy, heads, config=EngineConfig(draft_lengths=lengths))
    out = engine.generate(prompts, replace(base, num_draft_tokens=K, draft_mode="greedy"))
    assert len(forwards) == 1, forwards                  # the prefill, nothing more
    assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    assert len(records) >= 2 * len(prompts)
    assert lengths == "chosen" or {len(d) for _, d in records} == {K}   # the chooser picks the head steps
    assert len({len(prefix) for prefix, _ in records}) > 10       # many positions, rows at different lengths
    for prefix, drafts in records:
        assert drafts == draft_greedy(policy, drafter, prefix, len(drafts)), prefix
    assert all(t in set(DRAFT_VOCAB.tolist()) for _, d in records for t in d)


def test_a_drafter_update_changes_the_drafts_to_the_new_weights(eagle, monkeypatch):
    """update_heads with an EAGLE-3 state dict (vLLM's names): the engine then drafts what the new drafter
    drafts."""
    policy, drafter, _ = eagle
    engine = TorchEngine(policy, Eagle3Heads(init_eagle3(policy, drafter.aux_layer_ids, DRAFT_VOCAB, seed=7)),
                         config=EngineConfig(draft_lengths="fixed"))
    engine.update_heads(drafter.state_dict(), version=3)
    records = []
    real_draft = round_module.draft

    def recording_draft(ctx, st, k):
        out = real_draft(ctx, st, k)
        records.append((st.seq[0, :int(st.committed[0])].tolist(), out[0][0].tolist()))
        return out

    monkeypatch.setattr(round_module, "draft", recording_draft)
    out = engine.generate(_prompts(1), SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                                      num_draft_tokens=K, draft_mode="greedy"))
    assert out.completions[0].head_version == 3 and records
    for prefix, drafts in records:
        assert drafts == draft_greedy(policy, drafter, prefix, K)


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("mode", ["rejection", "greedy"])
def test_sequence_distribution_at_temperature_one_is_plain_sampling(attention, mode, monkeypatch):
    """3-token continuations at T = 1 with two EAGLE-3 drafts per round (reduced draft vocabulary: q = 0
    outside it) vs plain sampling: one distribution (chi-square); the lossy verifier fails the same test."""
    policy = random_model(attention_config(attention, vocab_size=5), seed=3)
    drafter = init_eagle3(policy, draft_vocab=torch.tensor([0, 2, 3, 4]), seed=5)
    engine = TorchEngine(policy, Eagle3Heads(drafter), config=EngineConfig(draft_lengths="fixed"))
    n = 4000
    plain = continuation_counts(engine, SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=1), n)
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=2, num_draft_tokens=2,
                        draft_mode=mode)
    batch = engine.generate([[4, 2]] * n, sp)
    stats = batch.spec_stats()
    assert 0.05 < stats.acceptance_rate < 0.95, stats           # drafts are both accepted and rejected
    assert chi2_pvalue(plain, [tuple(c.tokens) for c in batch.completions]) > 1e-3
    monkeypatch.setattr(round_module, "rejection_sample", lossy_rejection_sample)
    assert chi2_pvalue(plain, continuation_counts(engine, sp, n)) < 1e-6


# ------------------------------------------------------------------ loading: heads=<EAGLE-3 directory>
def test_resolve_heads_loads_an_eagle3_directory_as_the_engines_drafter(tmp_path):
    policy = random_model(attention_config("sdpa", vocab_size=96, num_hidden_layers=4), seed=0)
    drafter = init_eagle3(policy, (1, 2, 4), draft_vocab=torch.arange(0, 96, 2), seed=1)
    path = save_eagle3(tmp_path / "eagle3", drafter)
    for spec in (path, path / CONFIG_FILE):
        heads, desc = resolve_heads(policy, str(spec), model="tiny")
        assert isinstance(heads, Eagle3Heads) and "EAGLE-3, aux layers [1, 2, 4], draft vocabulary 48" in desc
        assert all(heads.state_dict()[k].equal(v) for k, v in drafter.state_dict().items())
    with pytest.raises(ValueError, match="EAGLE-3 drafter .*num_depths=2"):
        resolve_heads(policy, str(path), model="tiny", num_depths=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither drafter layout; accepted: mtp-rollout heads.*EAGLE-3"):
        resolve_heads(policy, str(tmp_path / "empty"), model="tiny")


def _answer(stdout: str) -> tuple[str, str]:
    """generate's printed answer to its one prompt, and its stats line."""
    text = stdout.split(">>> hi\n", 1)[1]
    body, _, stats = text.rpartition("\n[")
    return body, stats


def test_generate_cli_drafts_with_an_eagle3_directory_and_refuses_one_of_another_policy(tmp_path, capsys,
                                                                                       monkeypatch):
    policy = random_model(tiny_chat_llama_config(), seed=0)
    model = export_tiny_chat_model(policy, tmp_path / "model")
    path = save_eagle3(tmp_path / "eagle3", init_eagle3(policy, seed=1))
    eager_chooser(monkeypatch)               # the heads source drafts every round: acceptance is measured
    common = [f"model={model}", f"heads={path}", "--prompt", "hi", "--max-new-tokens", "16", "--dtype", "float32",
              "--temperature", "0"]
    assert cli.main(["generate", *common, "--k", "0"]) == 0
    plain, plain_stats = _answer(capsys.readouterr().out)
    assert cli.main(["generate", *common, "--k", "3"]) == 0
    out = capsys.readouterr().out
    assert f"heads: {path} (EAGLE-3, aux layers [0, 1, 2])" in out
    spec, stats = _answer(out)
    assert spec == plain and stats.split(" tokens")[0] == plain_stats.split(" tokens")[0]
    assert "acceptance " in stats and "acceptance nan" not in stats
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps({**config, "hidden_size": 64}))
    assert cli.main(["generate", *common, "--k", "3"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mtp-rollout ")]
    assert len(err) == 1 and str(path / CONFIG_FILE) in err[0] and "hidden_size 64 != the policy's 32" in err[0], err
