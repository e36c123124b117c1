"""The compiled path (torch.compile over the static cache) generates what the eager path does.

Kept small for CI: one tiny model (float32, and once in bfloat16), one batch bucket and k = 1 with a
one-depth head, so each dtype compiles three graphs (a decoder layer at widths 1 and 2, the head
block at 2)."""
import pytest
import torch

import rollout.engine.round as round_module
from rollout.engine.config import EngineConfig
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.conftest import random_heads, tiny_config
from tests.lossless import chi2_pvalue, continuation_counts, lossy_rejection_sample

N = 2000           # rows of the distribution tests = the one batch bucket
PROMPTS = [[4, 2], [1, 3, 0, 2, 2, 4], [3], [0, 1, 2]]


@pytest.fixture(scope="module")
def model():
    policy = random_model(tiny_config(vocab_size=5), seed=3)
    return policy, random_heads(policy, 1, seed=5)


@pytest.fixture(scope="module")
def compiled(model):
    return TorchEngine(*model, config=EngineConfig(compile=True, batch_buckets=(N,), draft_lengths="fixed"))


@pytest.fixture(scope="module")
def eager(model):
    return TorchEngine(*model, config=EngineConfig(compile=False, batch_buckets=(N,), draft_lengths="fixed"))


@pytest.mark.parametrize("k, mode", [(0, "rejection"), (1, "rejection"), (1, "greedy")])
def test_compiled_equals_eager_at_temperature_zero(compiled, eager, k, mode):
    sp = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, num_draft_tokens=k, draft_mode=mode)
    a, b = eager.generate(PROMPTS, sp), compiled.generate(PROMPTS, sp)
    assert [c.tokens for c in a.completions] == [c.tokens for c in b.completions]
    assert [c.round_accepted for c in a.completions] == [c.round_accepted for c in b.completions]
    for ca, cb in zip(a.completions, b.completions):
        assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)
    assert compiled.forwards.compiled and not eager.forwards.compiled


def test_compiled_two_layer_heads_equal_eager(model):
    """Heads with two decoder layers per depth: one compiled graph over both blocks and their caches."""
    from mtp_heads.heads import init_heads
    policy, _ = model
    heads = init_heads(policy, 1, seed=6, num_layers=2)
    sp = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, num_draft_tokens=1)
    runs = [TorchEngine(policy, heads, config=EngineConfig(compile=c, batch_buckets=(N,), draft_lengths="fixed")).generate(PROMPTS, sp)
            for c in (False, True)]
    assert [c.tokens for c in runs[0].completions] == [c.tokens for c in runs[1].completions]
    assert [c.round_accepted for c in runs[0].completions] == [c.round_accepted for c in runs[1].completions]
    assert runs[1].spec_stats().num_accepted_tokens > 0


def test_compiled_speculative_equals_compiled_plain_at_temperature_zero(compiled):
    plain = compiled.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    spec = compiled.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True,
                                                     num_draft_tokens=1))
    assert [c.tokens for c in plain.completions] == [c.tokens for c in spec.completions]
    assert spec.spec_stats().num_draft_tokens > 0          # drafts were proposed and verified


def test_compiled_sequence_distribution_unchanged_and_lossy_control_fails(compiled, monkeypatch):
    plain = continuation_counts(compiled, SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True,
                                                          seed=1), N)
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=2, num_draft_tokens=1)
    assert chi2_pvalue(plain, continuation_counts(compiled, sp, N)) > 1e-3
    monkeypatch.setattr(round_module, "rejection_sample", lossy_rejection_sample)
    assert chi2_pvalue(plain, continuation_counts(compiled, sp, N)) < 1e-6


def test_compiled_bfloat16_sequence_distribution_unchanged_and_lossy_control_fails(monkeypatch):
    """The same distribution test on the compiled path in bfloat16 (the CPU's default dtype here)."""
    policy = random_model(tiny_config(vocab_size=5), seed=3, dtype=torch.bfloat16)
    engine = TorchEngine(policy, random_heads(policy, 1, seed=5),
                         config=EngineConfig(compile=True, batch_buckets=(N,), draft_lengths="fixed"))
    plain = continuation_counts(engine, SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True,
                                                        seed=1), N)
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=2, num_draft_tokens=1)
    assert chi2_pvalue(plain, continuation_counts(engine, sp, N)) > 1e-3
    assert engine.forwards.compiled and policy.lm_head_weight.dtype == torch.bfloat16
    monkeypatch.setattr(round_module, "rejection_sample", lossy_rejection_sample)
    assert chi2_pvalue(plain, continuation_counts(engine, sp, N)) < 1e-6


def test_compile_time_is_reported_apart_and_shapes_are_reused(compiled):
    sp = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, num_draft_tokens=1)
    compiled.generate(PROMPTS, sp)
    graphs = dict(compiled.forwards.compile_times)
    again = compiled.generate(PROMPTS, sp)
    assert again.compile_time_s == 0.0 and compiled.forwards.compile_times == graphs
    assert {name for name, _, _ in graphs} == {"layer", "depth"} and len(graphs) <= 3
    assert torch._dynamo.config.recompile_limit >= 64 if hasattr(torch._dynamo.config, "recompile_limit") else True
