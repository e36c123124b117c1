"""The vLLM engine against the torch engine on one tiny float32 model and D = 1 (recurrent) heads.

vLLM applies one drafter layer recurrently at every draft position, which is the torch engine with
one depth, so with D = 1 both engines compute the same drafts: at temperature 0 outputs AND
per-round accepted counts must be identical; at temperature 1 the conditional acceptance at every
draft position must agree within sampling error. Entropies (and hidden states) come from inside
vLLM and must equal a teacher-forced pass of the torch policy.
One vLLM instance serves the greedy-draft-mode tests (starts cost ~10-60 s); the rejection-mode
test runs last in a second instance, with heads that have a reduced draft vocabulary.
"""
import copy
import math
import sys

import numpy as np
import pytest
import torch

from mtp_heads.heads import MTPHeads, init_heads
from rollout.models.decoder import random_model
from rollout.engine.config import EngineConfig
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams, SpecDecodingStats
from rollout.verify import process_logits
from tests.helpers import entropy
from tests.conftest import random_heads, tiny_config

pytestmark = pytest.mark.vllm

# head_dim 32: the vLLM CPU attention kernels want a multiple of 16
CFG = tiny_config(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_ids=(1,))
K = 3


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, CFG.vocab_size, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 13, (n,), generator=g)]


def _sp(temperature: float, mode: str = "greedy", max_new_tokens: int = 20, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, num_draft_tokens=K,
                          draft_mode=mode, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def policy():
    return random_model(CFG, seed=0)


@pytest.fixture(scope="module")
def good_heads(policy):
    return init_heads(policy, 1, seed=0)


@pytest.fixture(scope="module")
def engine(policy, good_heads, tmp_path_factory):
    from rollout.vllm import VLLMEngine, VLLMEngineConfig

    # own copies: refreshes change the engine's policy / heads in place
    eng = VLLMEngine(copy.deepcopy(policy), copy.deepcopy(good_heads),
                     config=VLLMEngineConfig(work_dir=str(tmp_path_factory.mktemp("vllm")), max_model_len=512))
    yield eng
    eng.close()


def _torch(policy, heads) -> TorchEngine:
    """The torch engine drafting k head tokens every round, as vLLM's drafter does (its default chooser
    drafts 0..k per row from heads or history)."""
    return TorchEngine(policy, heads, config=EngineConfig(draft_lengths="fixed"))


def _per_round(batch) -> np.ndarray:
    return np.array([n for c in batch.completions for n in c.round_accepted], dtype=float)


def _assert_same_acceptance(a: np.ndarray, b: np.ndarray, k: int) -> None:
    """Mean accepted drafts per round agree within 4 standard errors (rounds ~ independent)."""
    se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    assert abs(a.mean() - b.mean()) < 4 * se + 1e-9, (a.mean() / k, b.mean() / k, se / k)


def _assert_same_per_position(a: SpecDecodingStats, b: SpecDecodingStats) -> None:
    """Conditional acceptance accepted_j / reached_j agrees at every draft position j within 4 standard
    errors of the difference of two proportions (pooled)."""
    for j, (na, ra, nb, rb) in enumerate(zip(a.accepted_per_pos, a.reached_per_pos,
                                             b.accepted_per_pos, b.reached_per_pos)):
        assert ra >= 10 and rb >= 10, f"too few rounds reach position {j}: {ra}, {rb}"
        pooled = (na + nb) / (ra + rb)
        se = math.sqrt(max(pooled * (1 - pooled), 1e-4) * (1 / ra + 1 / rb))
        assert abs(na / ra - nb / rb) < 4 * se, (j, na / ra, nb / rb, se)


@torch.inference_mode()
def _teacher_forced(policy, prompt: list[int], tokens: list[int], sp: SamplingParams):
    """Our torch policy over prompt + completion in one forward: per-token entropy [T] and largest
    probability [T] of the processed target distribution, and the final-norm hidden state that
    predicted each token [T, d]."""
    h = policy.hidden_states(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:]
    probs = process_logits(policy.compute_logits(h), sp.temperature, sp.top_k, sp.top_p)
    return entropy(probs).numpy(), probs.amax(-1).numpy(), h.numpy()


# ------------------------------------------------------------------------------ greedy draft mode
def test_temperature_0_identical_outputs_and_acceptance(engine, policy, good_heads):
    prompts = _prompts()
    ours = _torch(policy, good_heads).generate(prompts, _sp(0.0))
    theirs = engine.generate(prompts, _sp(0.0))
    for c_t, c_v in zip(ours.completions, theirs.completions):
        assert c_v.tokens == c_t.tokens
        assert c_v.round_accepted == c_t.round_accepted      # same drafter function, same KV history
        np.testing.assert_allclose(c_v.logprobs, c_t.logprobs, atol=1e-4)
        np.testing.assert_allclose(c_v.entropies, c_t.entropies, atol=1e-4)
        assert c_v.max_probs == c_t.max_probs == [1.0] * len(c_v.tokens)    # one-hot p at temperature 0
        assert len(c_v.draft_entropies) == len(c_v.round_accepted)
        assert (c_v.policy_version, c_v.head_version, c_v.finish_reason) == (0, 0, "length")
    # vLLM's own counters agree with the per-request ones
    stats, per_request = engine.last_stats, theirs.spec_stats()
    assert stats.num_drafts == per_request.num_drafts
    assert stats.num_accepted_tokens == per_request.num_accepted_tokens
    assert stats.accepted_per_pos == per_request.accepted_per_pos
    assert stats.reached_per_pos == per_request.reached_per_pos


def test_temperature_1_acceptance_matches_torch_greedy_mode(engine, policy, good_heads):
    prompts = _prompts(8, seed=1)
    ours = _torch(policy, good_heads).generate(prompts, _sp(1.0, "greedy", 40, seed=1))
    theirs = engine.generate(prompts, _sp(1.0, "greedy", 40, seed=1))
    assert [len(c.tokens) for c in theirs.completions] == [40] * 8
    _assert_same_acceptance(_per_round(theirs), _per_round(ours), K)


def test_entropies_and_hidden_states_come_from_vllm_without_a_second_pass(engine, policy, monkeypatch):
    """Entropy of the processed target distribution (temperature, top-k, top-p) of every emitted token
    and at every draft position, and its max-probability at every emitted token, computed inside vLLM:
    equal to the torch policy's teacher-forced values, and the engine's torch copy of the policy is
    never run."""
    prompts = _prompts(4, seed=3)
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.9, num_draft_tokens=K,
                        draft_mode="greedy", ignore_eos=True, seed=3, return_hidden_states=True)

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the vLLM engine ran its torch policy")
    monkeypatch.setattr(engine.policy, "hidden_states", no_second_pass)
    batch = engine.generate(prompts, sp)
    monkeypatch.undo()
    reached = 0
    for c in batch.completions:
        ent, max_prob, hidden = _teacher_forced(policy, c.prompt, c.tokens, sp)
        assert len(c.entropies) == len(c.max_probs) == len(c.tokens) == 24
        np.testing.assert_allclose(c.entropies, ent, atol=1e-3)
        assert max(c.entropies) > 0.5                       # a real distribution, not a one-hot
        np.testing.assert_allclose(c.max_probs, max_prob, atol=1e-3)
        assert min(c.max_probs) < 0.9
        np.testing.assert_allclose(c.hidden_states, hidden, atol=1e-4)
        # round r verified positions t_r .. t_r + k: reached draft positions emitted tokens t_r + j
        assert len(c.draft_entropies) == len(c.round_accepted)
        t = 1                                                # token 0 came from the prefill step
        for n, h in zip(c.round_accepted, c.draft_entropies):
            assert len(h) == K and all(np.isfinite(h))     # unreached positions too (as the torch engine)
            for j in range(min(n + 1, K, len(c.tokens) - t)):
                assert abs(h[j] - c.entropies[t + j]) < 1e-5
                reached += 1
            t += n + 1
    assert reached > 20


def _record_weight_updates(monkeypatch, engine) -> list[str]:
    """The weight-transfer API sessions the engine opens on its vLLM instance (the greedy-mode one), in order."""
    llm, calls = engine._ensure_llm(K, "greedy"), []
    for name in ("start_weight_update", "start_draft_weight_update"):
        def start(original=getattr(llm, name), name=name):
            calls.append(name)
            original()
        monkeypatch.setattr(llm, name, start)
    return calls


def test_live_head_refresh_through_the_weight_transfer_api_changes_drafts_not_outputs(engine, policy, good_heads,
                                                                                      monkeypatch):
    """At T = 0 the per-round accepted counts are a function of the drafts: equal to the torch engine's
    with the new heads after each refresh, through start_draft_weight_update, without a restart."""
    calls = _record_weight_updates(monkeypatch, engine)
    prompts, starts = _prompts(), engine.num_starts
    bad = random_heads(policy, 1, seed=3)
    ref_bad = _torch(policy, bad).generate(prompts, _sp(0.0))
    ref_good = _torch(policy, good_heads).generate(prompts, _sp(0.0))
    engine.update_heads(bad.state_dict(), version=1)
    out_bad = engine.generate(prompts, _sp(0.0))
    engine.update_heads(good_heads.state_dict(), version=2)
    out_good = engine.generate(prompts, _sp(0.0))
    assert engine.num_starts == starts                                      # no restart
    assert calls == ["start_draft_weight_update"] * 2
    for b, g, rb, rg in zip(out_bad.completions, out_good.completions, ref_bad.completions, ref_good.completions):
        assert b.tokens == g.tokens == rg.tokens                            # lossless: outputs unchanged
        assert b.round_accepted == rb.round_accepted                        # the drafter is the new heads
        assert g.round_accepted == rg.round_accepted
        assert (b.head_version, g.head_version) == (1, 2)
    assert out_good.spec_stats().acceptance_rate > out_bad.spec_stats().acceptance_rate + 0.05


def test_nonfinite_heads_slow_but_never_change_or_crash_vllm(engine, policy, good_heads):
    """Heads with NaN/inf (a diverged refresh) reach vLLM's drafter zeroed: greedy outputs equal the
    torch engine's plain decoding, sampling at T = 1 does not crash, and every round is counted."""
    prompts = _prompts()
    nan_heads = copy.deepcopy(good_heads)
    with torch.no_grad():
        nan_heads.depths[0].eh_proj.weight[0, 0] = float("nan")
        nan_heads.depths[0].blocks[0].mlp.up_proj.weight[1, :3] = float("inf")
    plain = TorchEngine(policy).generate(prompts, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    engine.update_heads(nan_heads.state_dict(), version=5)
    try:
        assert sorted(engine.nonfinite_heads) == ["depths.0.blocks.0.mlp.up_proj.weight", "depths.0.eh_proj.weight"]
        greedy = engine.generate(prompts, _sp(0.0))
        sampled = engine.generate(prompts, _sp(1.0, "rejection"))
    finally:
        engine.update_heads(good_heads.state_dict(), version=6)
    assert [c.tokens for c in greedy.completions] == [c.tokens for c in plain.completions]
    for batch in (greedy, sampled):
        assert all(len(c.tokens) == 20 for c in batch.completions)
        assert batch.nonfinite_draft_rounds == sum(len(c.round_accepted) for c in batch.completions) > 0
    assert engine.nonfinite_heads == []


def test_policy_refresh_logprobs_match_torch(engine, good_heads, monkeypatch):
    new_policy = random_model(CFG, seed=1)
    calls = _record_weight_updates(monkeypatch, engine)
    engine.update_policy(new_policy.state_dict(), version=5)
    assert calls == ["start_weight_update"] and engine._llm.get_weight_version() == "5"
    prompts = _prompts()
    ours = _torch(new_policy, good_heads).generate(prompts, _sp(0.0))
    theirs = engine.generate(prompts, _sp(0.0))
    for c_t, c_v in zip(ours.completions, theirs.completions):
        assert c_v.tokens == c_t.tokens
        np.testing.assert_allclose(c_v.logprobs, c_t.logprobs, atol=1e-4)
        assert c_v.round_accepted == c_t.round_accepted   # drafter sees the new shared embedding / LM head
        assert c_v.policy_version == 5


# ------------------------------------------------------------------------------ rejection draft mode
def test_rejection_mode_with_draft_vocab_matches_torch(engine, policy, good_heads, tmp_path):
    """A second vLLM instance: rejection mode, two-layer heads (both vLLM blocks must be the torch
    heads' blocks) with a reduced draft vocabulary (q = 0 outside)."""
    from mtp_heads.checkpoint import set_draft_vocab
    from rollout.vllm import VLLMEngine, VLLMEngineConfig

    engine.close()                                # one vLLM instance at a time on the test machine
    two_layers = init_heads(policy, 1, seed=1, num_layers=2)
    heads = set_draft_vocab(copy.deepcopy(two_layers), torch.arange(0, CFG.vocab_size, 2))
    ref = _torch(policy, heads)
    engine = VLLMEngine(copy.deepcopy(policy), copy.deepcopy(heads),
                        config=VLLMEngineConfig(work_dir=str(tmp_path), max_model_len=512))
    prompts = _prompts(8, seed=2)
    greedy_t, greedy_v = ref.generate(prompts, _sp(0.0, "rejection")), engine.generate(prompts, _sp(0.0, "rejection"))
    assert [c.tokens for c in greedy_v.completions] == [c.tokens for c in greedy_t.completions]
    assert [c.round_accepted for c in greedy_v.completions] == [c.round_accepted for c in greedy_t.completions]
    # a stop token ends the completion as in the torch engine (stop token included, finish_reason "stop")
    stop = greedy_t.completions[0].tokens[len(greedy_t.completions[0].tokens) // 2]
    stop_sp = SamplingParams(max_new_tokens=20, temperature=0.0, num_draft_tokens=K, draft_mode="rejection",
                             stop_token_ids=(stop,))
    stopped_t, stopped_v = ref.generate(prompts, stop_sp), engine.generate(prompts, stop_sp)
    assert [(c.tokens, c.finish_reason) for c in stopped_v.completions] == \
        [(c.tokens, c.finish_reason) for c in stopped_t.completions]
    assert stopped_v.completions[0].finish_reason == "stop" and stopped_v.completions[0].tokens[-1] == stop
    ours = ref.generate(prompts, _sp(1.0, "rejection", 40, seed=2))
    theirs = engine.generate(prompts, _sp(1.0, "rejection", 40, seed=2))
    _assert_same_acceptance(_per_round(theirs), _per_round(ours), K)
    assert engine.last_stats.num_drafts == len(_per_round(theirs))
    drafted = [t for c in theirs.completions for t in c.tokens]
    assert any(t % 2 for t in drafted)            # outputs are not limited to the draft vocabulary
    # a refresh carries the draft vocabulary (part of MTPHeads' state dict): clearing it must reach vLLM
    with pytest.raises(ValueError, match="1 depths, 2 layers per depth"):
        engine.update_heads(good_heads.state_dict(), version=7)          # a one-layer drafter does not fit
    engine.update_heads(two_layers.state_dict(), version=7)
    cleared_t = _torch(policy, two_layers).generate(prompts, _sp(0.0, "rejection"))
    cleared_v = engine.generate(prompts, _sp(0.0, "rejection"))
    assert [c.round_accepted for c in cleared_v.completions] == [c.round_accepted for c in cleared_t.completions]
    # the recurrent two-layer drafter at temperature 1: conditional acceptance at every draft position (k = 3)
    ours = _torch(policy, two_layers).generate(prompts, _sp(1.0, "rejection", 48, seed=4))
    theirs = engine.generate(prompts, _sp(1.0, "rejection", 48, seed=4))
    _assert_same_per_position(theirs.spec_stats(), ours.spec_stats())
    assert engine.num_starts == 1
    engine.close()


# ------------------------------------------------------------------------------ bad input
def test_heads_for_another_policy_are_rejected(policy):
    from rollout.vllm import VLLMEngine

    other = MTPHeads(tiny_config(vocab_size=256, hidden_size=64, intermediate_size=128), 1)
    with pytest.raises(ValueError, match="train or load heads for this policy"):
        VLLMEngine(policy, other)
    same_shape_other_arch = MTPHeads(tiny_config(vocab_size=256, hidden_size=128, intermediate_size=256,
                                                 num_hidden_layers=3, num_attention_heads=4), 1)
    with pytest.raises(ValueError, match="another policy"):
        VLLMEngine(policy, same_shape_other_arch)


def test_bad_prompts_and_weights_rejected_before_vllm(policy, good_heads):
    from rollout.vllm import VLLMEngine

    eng = VLLMEngine(copy.deepcopy(policy), copy.deepcopy(good_heads))
    with pytest.raises(ValueError, match="empty"):
        eng.generate([], _sp(0.0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([[5, 999]], _sp(0.0))
    with pytest.raises(ValueError, match="exceeds the context length"):
        eng.generate([[5] * 500], _sp(0.0, max_new_tokens=64))
    with pytest.raises(ValueError, match="needs a drafter"):
        VLLMEngine(policy).generate([[5, 6]], _sp(0.0))
    with pytest.raises(ValueError, match="do not fit this policy"):
        eng.update_heads({"depths.0.eh_proj.weight": torch.zeros(64, 128)}, 1)
    with pytest.raises(ValueError, match="unknown"):
        eng.update_policy({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}, 1)
    assert eng.num_starts == 0


def test_missing_vllm_names_the_fix(monkeypatch, policy):
    from rollout.vllm import install

    monkeypatch.setitem(sys.modules, "vllm", None)   # import vllm -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'mtp-rollout\[vllm\]'"):
        install.require_vllm()


def test_vllm_without_draft_sampling_option_names_the_fix(monkeypatch):
    from dataclasses import dataclass

    from rollout.vllm import install

    @dataclass
    class OldSpeculativeConfig:
        num_speculative_tokens: int = 0

    monkeypatch.setattr(install, "_speculative_config_class", lambda: OldSpeculativeConfig)
    with pytest.raises(RuntimeError, match=r"draft_sample_method.*pip install 'mtp-rollout\[vllm\]'"):
        install.require_vllm()


def test_plugin_entry_point_names_the_drafter_registration():
    """vLLM loads `vllm.general_plugins` in every engine process: the entry point must resolve."""
    import importlib
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["vllm.general_plugins"]["mtp_rollout_drafter"]
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_against_vllm_bench_config_names_bad_engines():
    """`bench-decode --against vllm` refuses an engine list it cannot run, before starting anything."""
    from experiments.bench_vllm import AgainstVLLMConfig
    from rollout.config_loader import load_config

    cfg, _ = load_config(AgainstVLLMConfig, ["engines=[vllm-plain,vllm-spec]", "dtypes=[float32]"])
    assert cfg.engines == ["vllm-plain", "vllm-spec"] and cfg.num_draft_tokens == 3
    with pytest.raises(ValueError, match="engines must be"):
        load_config(AgainstVLLMConfig, ["engines=[vllm-fast]"])
    assert load_config(AgainstVLLMConfig, ["vllm_draft_method=suffix"])[0].vllm_draft_method == "suffix"
    with pytest.raises(ValueError, match="vllm_draft_method must be one of"):
        load_config(AgainstVLLMConfig, ["vllm_draft_method=medusa"])


def test_against_vllm_bench_drafts_an_eagle3_heads_directory_with_vllms_eagle3(tmp_path):
    """Our drafter plugin computes MTP heads only: `heads=<EAGLE-3 dir>` makes vllm-spec use vLLM's eagle3
    method on that directory (no vLLM start here; tests/test_vllm_eagle3.py runs that method)."""
    from experiments.bench_vllm import AgainstVLLMConfig, vllm_drafter
    from mtp_heads.eagle3 import init_eagle3
    from mtp_heads.eagle3_checkpoint import save_eagle3

    policy = random_model(tiny_config(num_hidden_layers=4), seed=0)
    path = str(save_eagle3(tmp_path / "eagle3", init_eagle3(policy, (1, 2, 4))))
    m = "smollm2-135m"
    assert vllm_drafter(path, "heads", m) == vllm_drafter(f"{path}/config.json", "eagle3", m) == ("eagle3", path)
    assert vllm_drafter(path, "suffix", m) == ("suffix", None)
    assert vllm_drafter("shipped", "heads", m) == vllm_drafter("my-heads.safetensors", "heads", m) == ("heads", None)
    from mtp_heads.shipped import shipped_eagle3_path
    assert vllm_drafter("shipped-eagle3", "heads", m) == ("eagle3", str(shipped_eagle3_path(m)))
    assert AgainstVLLMConfig(heads=path, vllm_draft_method="eagle3").heads == path
    with pytest.raises(ValueError, match="vllm_draft_method=eagle3 needs heads=<an EAGLE-3 directory>"):
        AgainstVLLMConfig(vllm_draft_method="eagle3")


def test_against_vllm_bench_gives_each_engine_its_own_cores(monkeypatch):
    """vLLM's pinned OpenMP threads take cores 0..t-1 and our engine the next t where the machine has them,
    so one engine never computes beside the other's idle threads; with too few cores they share."""
    from experiments.bench_vllm import engine_cores

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert engine_cores("vllm-plain", 2) == engine_cores("vllm-spec", 2) == [0, 1]
    assert engine_cores("torch", 2) == [2, 3] and engine_cores("torch", 1) == [1]
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert engine_cores("torch", 2) == [0, 1]


# ------------------------------------------------------------------------------ history drafts (vLLM's ngram / suffix)
def _history_prompts() -> list[list[int]]:
    """Two prompts that repeat themselves (prompt lookup finds matches) and four random ones."""
    return [[5, 6, 7, 8, 9] * 4, [20, 30, 40] * 5] + _prompts(4, seed=5)


def _history_engine(policy, method: str, work_dir):
    from rollout.vllm import VLLMEngine, VLLMEngineConfig

    return VLLMEngine(copy.deepcopy(policy), config=VLLMEngineConfig(work_dir=str(work_dir), max_model_len=512,
                                                                     draft_method=method))


@pytest.fixture(scope="module")
def plain_vllm_tokens(policy, tmp_path_factory):
    """vLLM without drafts at temperature 0: the reference the history methods must reproduce."""
    eng = _history_engine(policy, "heads", tmp_path_factory.mktemp("vllm_plain"))
    try:
        sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        return [c.tokens for c in eng.generate(_history_prompts(), sp).completions]
    finally:
        eng.close()


def _assert_history_batch(engine, batch, plain_tokens=None) -> None:
    """plain_tokens: greedy outputs must equal them and drafts must have been proposed and accepted."""
    stats, per_request = engine.last_stats, batch.spec_stats()
    if plain_tokens is not None:
        assert [c.tokens for c in batch.completions] == plain_tokens          # lossless
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_pos) == \
        (per_request.num_drafts, per_request.num_draft_tokens, per_request.num_accepted_tokens,
         per_request.accepted_per_pos)                                       # vLLM's counters agree per request
    for c in batch.completions:
        assert len(c.entropies) == len(c.tokens) == 40
        assert len(c.round_draft_tokens) == len(c.round_accepted) == len(c.draft_entropies)
        assert all(1 <= d <= K for d in c.round_draft_tokens)
        assert all(a <= d for a, d in zip(c.round_accepted, c.round_draft_tokens))
        assert set(c.round_sources) <= {"history"}


def test_ngram_drafts_without_heads_are_lossless(policy, plain_vllm_tokens, tmp_path):
    """vLLM's prompt lookup as the drafter (no heads): greedy outputs equal plain vLLM's, drafts are proposed
    and accepted; sampling at temperature 1 runs (this random model rarely repeats itself there)."""
    engine = _history_engine(policy, "ngram", tmp_path)
    try:
        _assert_history_batch(engine, engine.generate(_history_prompts(), _sp(0.0, max_new_tokens=40)),
                              plain_vllm_tokens)
        _assert_history_batch(engine, engine.generate(_history_prompts(), _sp(1.0, "rejection", 40, seed=7)))
        assert engine.num_starts == 1             # draft_mode does not apply to history drafts: no restart
    finally:
        engine.close()


def test_suffix_drafts_are_lossless_and_learn_from_earlier_responses(policy, plain_vllm_tokens, tmp_path):
    """vLLM's SuffixDecoding keeps earlier responses in the instance: a second call on the same prompts
    drafts from the first call's responses and accepts more, with outputs still equal to plain vLLM's."""
    pytest.importorskip("arctic_inference.suffix_decoding", reason="draft_method='suffix' needs arctic-inference")
    engine = _history_engine(policy, "suffix", tmp_path)
    try:
        first = engine.generate(_history_prompts(), _sp(0.0, max_new_tokens=40))
        _assert_history_batch(engine, first, plain_vllm_tokens)
        second = engine.generate(_history_prompts(), _sp(0.0, max_new_tokens=40))
        _assert_history_batch(engine, second, plain_vllm_tokens)
        a, b = first.spec_stats(), second.spec_stats()
        assert b.num_accepted_tokens > a.num_accepted_tokens and b.acceptance_length > a.acceptance_length, (a, b)
        assert sum(len(c.round_accepted) for c in second.completions) < \
            sum(len(c.round_accepted) for c in first.completions)             # fewer verification steps
    finally:
        engine.close()


def test_draft_method_builds_vllm_speculative_config():
    """Each draft_method maps onto vLLM's own SpeculativeConfig keys; bad settings name the key."""
    from rollout.vllm import VLLMEngineConfig
    from rollout.vllm.install import _speculative_config_class

    fields = set(_speculative_config_class().__dataclass_fields__)
    heads = VLLMEngineConfig().speculative_config(3, "rejection", "/d")
    assert heads == {"method": "eagle", "model": "/d", "num_speculative_tokens": 3,
                     "draft_sample_method": "probabilistic"}
    ngram = VLLMEngineConfig(draft_method="ngram", ngram_min=1, ngram_max=4).speculative_config(3, "rejection", None)
    assert ngram == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    suffix = VLLMEngineConfig(draft_method="suffix", suffix_max_cached_requests=0).speculative_config(5, "greedy", None)
    assert suffix["method"] == "suffix" and suffix["suffix_decoding_max_cached_requests"] == 0
    for spec in (heads, ngram, suffix):
        assert set(spec) <= fields, set(spec) - fields
    with pytest.raises(ValueError, match="draft_method must be one of"):
        VLLMEngineConfig(draft_method="medusa")
    with pytest.raises(ValueError, match="ngram_min / ngram_max"):
        VLLMEngineConfig(draft_method="ngram", ngram_min=4, ngram_max=2)


def test_suffix_without_arctic_inference_names_the_fix(monkeypatch, policy):
    from rollout.vllm import VLLMEngine, VLLMEngineConfig

    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)   # import -> ImportError
    with pytest.raises(ImportError, match="arctic-inference.*pip install"):
        VLLMEngine(policy, config=VLLMEngineConfig(draft_method="suffix"))


def test_kernel_registry_scan_survives_unscannable_modules(monkeypatch):
    """vLLM's kernel registry scans every loaded module; llvmlite's `ffi.lib` (numba, loaded by the ngram
    drafter) made that scan raise, so every later vLLM start in the process failed. The guard leaves such
    modules out of the scan and puts them back."""
    import types

    from rollout.vllm.cpu_kernels import guard_kernel_registry
    from vllm.triton_utils import dispatcher

    class Unscannable:                         # like llvmlite's _lib_wrapper: __slots__ and a __getattr__
        __slots__ = ()

        def __getattr__(self, name):
            return object()

    module = types.ModuleType("fake_llvmlite_ffi")
    module.lib = Unscannable()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    if not getattr(dispatcher.register_kernels, "_skips_unscannable_modules", False):   # no engine started yet
        with pytest.raises(AttributeError):
            dispatcher.register_kernels({})
    guard_kernel_registry()
    guarded = dispatcher.register_kernels
    guard_kernel_registry()
    assert dispatcher.register_kernels is guarded                    # wrapped once
    dispatcher.register_kernels({})
    assert sys.modules[module.__name__] is module
