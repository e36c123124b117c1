"""Per-row draft lengths and sources (heads, rollout history) in the torch engine: never a change in
what is generated, on both attention kernels (padded verification over SDPA, packed over the paged
kernel)."""
from dataclasses import replace

import numpy as np
import pytest
import torch

import rollout.engine.round as round_module
from rollout.engine.chooser import DraftChooser
from rollout.engine.config import EngineConfig
from rollout.engine.history import RolloutHistory
from rollout.engine.predictor import HISTORY
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.conftest import random_heads
from tests.lossless import MIXED_PROMPTS, chi2_pvalue, first_tokens, lossy_rejection_sample
from tests.test_torch_engine import ATTENTION, attention_config


def eager_chooser(monkeypatch):
    """The real chooser with a threshold near 0 and no round budget, so that every row drafts whatever it
    has (the head steps still chosen on the round's measured costs), and odd rows that have a history
    draft take it: the widest mix of sources and lengths in one batch, which is what losslessness must
    survive (the choice depends on the row and its history, as the real one may). Rows are valued alike
    (row_values): in these fixed-length calls the row holding the call back would otherwise be the only
    one worth drafting for."""
    monkeypatch.setattr(DraftChooser, "threshold", lambda self, bucket, active, rows=None: 1e-3)
    monkeypatch.setattr(DraftChooser, "row_values", lambda self, bucket, view, active, rows: None)
    best_budget = DraftChooser._best_budget

    def keep_all(self, bucket, rows, active, head_steps, wanted, value):
        return int(np.ceil(wanted.sum())), best_budget(self, bucket, rows, active, head_steps, wanted, value)[1]
    monkeypatch.setattr(DraftChooser, "_best_budget", keep_all)
    assign = DraftChooser.assign

    def mixed(self, bucket, view, head_steps, head_feature):
        plan = assign(self, bucket, view, head_steps, head_feature)
        for b in range(1, len(plan.source), 2):
            if view.active[b] and view.history_tokens and view.history_tokens[b]:
                n = len(view.history_tokens[b])
                plan.source[b], plan.num_drafts[b] = HISTORY, n
                plan.predicted[b], plan.features[b] = np.full(n, 0.5), view.history_cond[b][:n]
        return plan
    monkeypatch.setattr(DraftChooser, "assign", mixed)


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("mode", ["greedy", "rejection"])
def test_temperature_zero_per_row_drafts_equal_plain_decoding(attention, mode, monkeypatch):
    """Heads and history drafts of different lengths per row, rows finishing at different times (stop tokens
    and max_new_tokens), a second call drafting from the first call's rollouts: tokens equal plain decoding."""
    eager_chooser(monkeypatch)
    policy = random_model(attention_config(attention, vocab_size=32), seed=1)
    heads = random_heads(policy, 2, seed=2)
    prompts = MIXED_PROMPTS + MIXED_PROMPTS[:2]              # repeated prompts: a group with siblings
    unstopped = TorchEngine(policy).generate(prompts, SamplingParams(max_new_tokens=40, temperature=0,
                                                                     ignore_eos=True))
    stop = unstopped.completions[0].tokens[12]                # a token some rows emit: they stop there
    base = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop,))
    plain = TorchEngine(policy).generate(prompts, base)
    engine = TorchEngine(policy, heads)
    sp = replace(base, num_draft_tokens=4, draft_mode=mode)
    first, second = engine.generate(prompts, sp), engine.generate(prompts, sp)
    for out in (first, second):
        assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    assert len({len(c.tokens) for c in plain.completions}) > 1          # rows finished at different times
    sources = {s for c in first.completions + second.completions for s in c.round_sources}
    assert sources == {"heads", "history"}
    lengths = {n for c in first.completions + second.completions for n in c.round_draft_tokens}
    assert len(lengths) > 1
    history_accepted = sum(n for c in second.completions for n, s in zip(c.round_accepted, c.round_sources)
                           if s == "history")
    assert history_accepted > 0


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("sources, prompt", [(("heads", "history"), [4, 2, 4, 2, 4]),
                                             (("history",), [0, 1, 2, 3, 4])])
def test_sequence_distribution_unchanged_by_mixed_sources_in_one_batch(attention, sources, prompt, monkeypatch):
    """3-token continuations at T = 1 with heads and history drafts mixed in every batch, and with
    history drafts alone (no heads; a prompt without repeats, so that the drafts are the siblings'
    continuations, often right, rather than the prompt's pattern, nearly always wrong, against which
    a lossy verifier is hardly visible): the same distribution as plain sampling (chi-square); the
    lossy verifier fails the same test."""
    eager_chooser(monkeypatch)
    cfg = attention_config(attention, vocab_size=5)
    policy = random_model(cfg, seed=3)
    heads = random_heads(policy, 1, seed=5) if "heads" in sources else None
    engine = TorchEngine(policy, heads, config=EngineConfig(draft_sources=sources))
    n = 4000
    prompt = [prompt]
    plain = first_tokens(TorchEngine(policy).generate(
        prompt * n, SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=1)))
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=2, num_draft_tokens=2)
    engine.generate(prompt * 64, sp)                     # history of this prompt to copy from
    spec_batch = engine.generate(prompt * n, sp)
    spec = first_tokens(spec_batch)
    drafted = [s for c in spec_batch.completions for s in c.round_sources]
    assert all(drafted.count(s) > n // 10 for s in sources) and set(drafted) == set(sources)
    assert chi2_pvalue(plain, spec) > 1e-3
    monkeypatch.setattr(round_module, "rejection_sample", lossy_rejection_sample)
    lossy = first_tokens(engine.generate(prompt * n, sp))
    assert chi2_pvalue(plain, lossy) < 1e-6


def budgeted_chooser(monkeypatch, share):
    """The real chooser running every head step (k_max), every row wanting every draft (threshold near 0),
    and a round budget of `share` of the drafts the rows wanted before drafting: every round cuts drafts
    position by position, as a round stopping short of a step in verification cost does. Rows are valued
    alike (row_values), as every row wanting every draft has them."""
    monkeypatch.setattr(DraftChooser, "threshold", lambda self, bucket, active, rows=None: 1e-3)
    monkeypatch.setattr(DraftChooser, "row_values", lambda self, bucket, view, active, rows: None)
    monkeypatch.setattr(DraftChooser, "head_steps", lambda self, bucket, view: self.k_max)
    monkeypatch.setattr(DraftChooser, "_best_budget",
                        lambda self, bucket, rows, active, h, wanted, value: (int(share * wanted.sum()), 0.0))


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("mode", ["greedy", "rejection"])
def test_temperature_zero_drafts_cut_to_a_round_budget_equal_plain_decoding(attention, mode, monkeypatch):
    budgeted_chooser(monkeypatch, 0.6)
    policy = random_model(attention_config(attention, vocab_size=32), seed=1)
    prompts = MIXED_PROMPTS + MIXED_PROMPTS[:2]
    base = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    plain = TorchEngine(policy).generate(prompts, base)
    # no probe rounds: they verify every head draft uncut where history drafts have kept the heads unverified
    engine = TorchEngine(policy, random_heads(policy, 3, seed=2), config=EngineConfig(probe_every=10**6))
    sp = replace(base, num_draft_tokens=3, draft_mode=mode)
    for _ in range(2):     # the second call also has history drafts, cut with the heads'
        out = engine.generate(prompts, sp)
        assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    lengths = {n for c in out.completions for n in c.round_draft_tokens}
    assert {1, 2} <= lengths and 3 not in lengths     # 60% of three drafts a row: none keeps all three


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_temperature_zero_drafts_for_the_row_holding_the_call_back_equal_plain_decoding(attention, monkeypatch):
    """Rows that cannot stop early (ignore_eos) are valued by whether each alone holds the call back
    (chooser.call_lead), and a round's budget keeps the most valuable rows' drafts first. With a threshold
    near 0 and a budget of 60% of the drafts wanted, rows draft, finish apart and some rounds have one
    row valued above the rest: the tokens are plain decoding's."""
    monkeypatch.setattr(DraftChooser, "threshold", lambda self, bucket, active, rows=None: 1e-3)
    monkeypatch.setattr(DraftChooser, "_best_budget",
                        lambda self, bucket, rows, active, h, wanted, value: (int(0.6 * wanted.sum()), 0.0))
    values = []
    assign = DraftChooser.assign

    def recorded(self, bucket, view, head_steps, head_feature):
        plan = assign(self, bucket, view, head_steps, head_feature)
        values.append((plan.value, plan.num_drafts.copy()))
        return plan
    monkeypatch.setattr(DraftChooser, "assign", recorded)
    policy = random_model(attention_config(attention, vocab_size=32), seed=1)
    base = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    plain = TorchEngine(policy).generate(MIXED_PROMPTS, base)
    engine = TorchEngine(policy, random_heads(policy, 3, seed=2))
    for _ in range(2):     # the second call also has history drafts
        out = engine.generate(MIXED_PROMPTS, replace(base, num_draft_tokens=3))
        assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    # rounds of two or more rows where one of them is valued above the rest (finished rows are valued 0)
    one_behind = [n for v, n in values if v is not None and len(v) > 1 and 0 < np.sort(v[:, 0])[-2] < v[:, 0].max()]
    assert one_behind and sum(int(n.sum()) for n in one_behind) > 0
    values.clear()                          # rows that can stop on a stop token: valued alike, as in RL calls
    engine.generate(MIXED_PROMPTS, replace(base, num_draft_tokens=3, ignore_eos=False, stop_token_ids=[5]))
    assert values and all(v is None for v, _ in values)


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_sequence_distribution_unchanged_by_drafts_cut_to_a_round_budget(attention, monkeypatch):
    """3-token continuations at T = 1, two head drafts wanted per row and 60% of them kept per round
    (the first rows in each round keep both): the distribution of plain sampling; a lossy verifier fails."""
    budgeted_chooser(monkeypatch, 0.6)
    policy = random_model(attention_config(attention, vocab_size=5), seed=3)
    engine = TorchEngine(policy, random_heads(policy, 2, seed=5), config=EngineConfig(draft_sources=("heads",)))
    n, prompt = 4000, [[4, 2, 4, 2, 4]]
    plain = first_tokens(TorchEngine(policy).generate(
        prompt * n, SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=1)))
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=2, num_draft_tokens=2)
    batch = engine.generate(prompt * n, sp)
    assert {1, 2} <= {d for c in batch.completions for d in c.round_draft_tokens}
    assert chi2_pvalue(plain, first_tokens(batch)) > 1e-3
    monkeypatch.setattr(round_module, "rejection_sample", lossy_rejection_sample)
    lossy = first_tokens(engine.generate(prompt * n, sp))
    assert chi2_pvalue(plain, lossy) < 1e-6


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_history_only_drafting_needs_no_heads_and_is_lossless(attention):
    policy = random_model(attention_config(attention, vocab_size=32), seed=4)
    engine = TorchEngine(policy, config=EngineConfig(draft_sources=("history",)))
    plain = TorchEngine(policy).generate(MIXED_PROMPTS, SamplingParams(max_new_tokens=30, temperature=0,
                                                                       ignore_eos=True))
    sp = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, num_draft_tokens=3)
    for _ in range(2):
        out = engine.generate(MIXED_PROMPTS, sp)
        assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    assert {s for c in out.completions for s in c.round_sources} == {"history"}
    assert engine.history.stats()["responses"] >= len(MIXED_PROMPTS)


def test_fixed_lengths_draft_k_head_tokens_for_every_row(tiny_policy, tiny_heads):
    """k head drafts per row every round, the last ones included (vLLM's drafter does the same)."""
    engine = TorchEngine(tiny_policy, tiny_heads, config=EngineConfig(draft_lengths="fixed"))
    out = engine.generate(MIXED_PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True,
                                                        num_draft_tokens=3, seed=0))
    for c in out.completions:
        assert set(c.round_draft_tokens) == {3} and set(c.round_sources) == {"heads"}
    assert engine.history is None


def test_chosen_drafts_stop_at_what_a_row_can_still_emit(tiny_policy, tiny_heads, monkeypatch):
    """The chooser, wanting every draft it has (heads and the first call's history), verifies no draft a
    row could not emit before its max_new_tokens; the tokens stay plain decoding's at T = 0."""
    eager_chooser(monkeypatch)
    base = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    plain = TorchEngine(tiny_policy).generate(MIXED_PROMPTS, base)
    engine = TorchEngine(tiny_policy, tiny_heads)
    sp = replace(base, num_draft_tokens=4)
    capped = 0
    for out in (engine.generate(MIXED_PROMPTS, sp), engine.generate(MIXED_PROMPTS, sp)):
        assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
        for c in out.completions:
            emitted = 1
            for drafts, accepted in zip(c.round_draft_tokens, c.round_accepted):
                left = 10 - emitted
                assert 1 <= drafts <= left - 1
                capped += drafts < 4 and left - 1 < 4
                emitted += min(accepted + 1, left)
    assert capped > 0


def test_the_chooser_learns_and_the_history_persists_across_calls(tiny_policy, tiny_heads):
    engine = TorchEngine(tiny_policy, tiny_heads)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, num_draft_tokens=2, seed=0)
    engine.generate(MIXED_PROMPTS, sp)
    chooser, history = engine.chooser, engine.history
    assert chooser.costs.known(4)
    engine.generate(MIXED_PROMPTS, sp)
    assert engine.chooser is chooser and engine.history is history
    assert history.stats()["responses"] == 2 * len(MIXED_PROMPTS)


def test_packed_verification_writes_each_rows_cache_like_a_fresh_prefill(monkeypatch):
    """After per-row drafts were verified packed (paged kernel), every row's cache and hidden states over its
    committed tokens equal a fresh prefill of those tokens."""
    eager_chooser(monkeypatch)
    policy = random_model(attention_config("paged", vocab_size=32), seed=6)
    engine = TorchEngine(policy, random_heads(policy, 2, seed=1))
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True, num_draft_tokens=3, seed=3,
                        return_hidden_states=True)
    out = engine.generate(MIXED_PROMPTS, sp)
    assert len({n for c in out.completions for n in c.round_draft_tokens}) > 1
    for c in out.completions:
        full = torch.tensor([c.prompt + c.tokens])
        hidden = policy.hidden_states(full)[0, len(c.prompt) - 1:len(c.prompt) - 1 + len(c.tokens)]
        assert np.allclose(c.hidden_states, hidden.numpy(), atol=1e-4)


def test_an_engine_whose_drafts_never_pay_pauses_its_choosing_and_decodes_as_plain(tiny_policy, tiny_heads,
                                                                                    monkeypatch):
    """Nothing worth drafting (an infinite threshold): the rounds soon run plain without history lookups
    or choices, the rollout history still learns every token, and the tokens are plain decoding's."""
    monkeypatch.setattr(DraftChooser, "threshold", lambda self, bucket, active, rows=None: float("inf"))
    lookups = []
    propose = RolloutHistory.propose
    monkeypatch.setattr(RolloutHistory, "propose", lambda self, row, k: lookups.append(row) or propose(self, row, k))
    sp = SamplingParams(max_new_tokens=150, temperature=0, ignore_eos=True)
    plain = TorchEngine(tiny_policy).generate(MIXED_PROMPTS, sp)
    engine = TorchEngine(tiny_policy, tiny_heads)
    out = engine.generate(MIXED_PROMPTS, replace(sp, num_draft_tokens=3))
    assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    rounds = 150 - 1
    assert len(lookups) < 0.6 * rounds * len(MIXED_PROMPTS)          # most rounds did not look
    assert engine.history.stats()["responses"] == len(MIXED_PROMPTS)
    assert out.history_sizes["tokens"] >= 150 * len(MIXED_PROMPTS)   # every token reached the history
