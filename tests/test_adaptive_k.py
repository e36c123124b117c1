"""Adaptive k: weak heads fall back to plain decoding, good ones draft, and outputs stay lossless."""
from dataclasses import replace

import pytest
import torch

from rollout import torch_engine
from rollout.engine.adaptive import AdaptiveK, CostModel, optimistic_costs
from rollout.engine.config import EngineConfig
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.conftest import random_heads, tiny_config
from tests.lossless import MIXED_PROMPTS as PROMPTS, chi2_pvalue, continuation_counts

COSTS = CostModel(head=0.1, verify=(1.0, 1.05, 1.1, 1.15))   # a compiled-CPU-like cost curve


def test_choice_maximises_expected_tokens_per_cost():
    ak = AdaptiveK(3, COSTS, prior=0.5)
    first = ak.choose()
    # prior acceptance 0.5: E(2) / cost = 1.75 / 1.3 beats k = 3 (1.875 / 1.45) and plain (1.0)
    assert first.k == 2 and first.reason == "best" and first.tokens_per_cost > first.plain_tokens_per_cost
    for _ in range(3):
        ak.observe([0, 0, 0], [8, 0, 0])          # 8 rows reached position 0, none accepted
    ks = [ak.choose() for _ in range(300)]
    assert [c.k for c in ks if c.reason == "best"] == [0] * sum(c.reason == "best" for c in ks)
    assert [c.k for c in ks if c.reason == "probe"][:6] == [3, 2, 1, 3, 2, 1]   # each k is timed again in turn
    # cheap probes (this cost model: a k = 1 probe loses 0.11 plain rounds, k = 3 0.39) back off only until
    # they lose ~probe_budget = 1% of the time: every 8-40 rounds, not every 128
    probes = [c.round - ks[0].round for c in ks if c.reason == "probe"]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 7 and 8 <= min(gaps) and max(gaps) <= 40
    lost = sum(ak.probe_loss(c.k, 0) for c in ks if c.reason == "probe")
    assert 0.005 <= lost / len(ks) <= 0.015
    dear = AdaptiveK(3, CostModel(head=1.0, verify=(1.0, 1.6, 2.2, 2.8)))   # probes lose 1.6-4.7 rounds each
    for _ in range(3):
        dear.observe([0, 0, 0], [8, 0, 0])
    ks_dear = [dear.choose() for _ in range(300)]
    probes = [c.round for c in ks_dear if c.reason == "probe"]
    # the 8th round probes, then every 16th, 32nd, 64th and 128th (the cap) round
    assert [b - a for a, b in zip(probes, probes[1:])] == [16, 32, 64, 128]
    ak.heads_changed()                            # new heads: probed again within probe_every rounds
    assert any(c.reason == "probe" for c in (ak.choose() for _ in range(8)))
    ak.observe([8, 8, 8], [8, 8, 8])
    ak.observe([8, 8, 8], [8, 8, 8])
    assert ak.choose().k > 0 and ak.probe_interval == 8   # drafting pays again: the interval restarts
    good = AdaptiveK(3, COSTS)
    for _ in range(10):
        good.observe([8, 8, 8], [8, 8, 8])
    assert good.choose().k == 3
    mid = AdaptiveK(3, CostModel(head=0.3, verify=(1.0, 1.05, 1.1, 1.15)))
    for _ in range(20):
        mid.observe([4, 1, 0], [8, 4, 1])           # a = 0.5, 0.25, 0
    assert mid.choose().k == 1                      # E(1)/cost = 1.5/1.35 beats k = 2, 3 and plain


def test_probes_above_the_best_k_keep_deeper_positions_measured():
    """While k = 1 wins, probes draft k = 3, then k = 2 (backing off as at k = 0), so that positions 2-3
    and the longer rounds keep being measured; when those turn out good, the choice moves there."""
    ak = AdaptiveK(3, CostModel(head=0.3, verify=(1.0, 1.05, 1.1, 1.15)))
    for _ in range(20):
        ak.observe([4, 1, 0], [8, 4, 1])           # a = 0.5, 0.25, 0: k = 1 wins (1.5 / 1.35)
    ks = [ak.choose() for _ in range(40)]
    assert {c.k for c in ks if c.reason == "best"} == {1}
    assert [(c.round - ks[0].round, c.k) for c in ks if c.reason == "probe"] == [(7, 3), (7 + 16, 2)]
    for _ in range(30):
        ak.observe([8, 8, 8], [8, 8, 8])           # what the probes would find with better heads
    moved = ak.choose()
    assert (moved.k, moved.reason) == (3, "best") and ak.probe_interval == ak.probe_every


def test_a_calls_last_rounds_at_small_buckets_do_not_restart_probing_at_the_large_one():
    """Rows finish unevenly, so a call ends with a few rounds at smaller buckets, where nothing was timed
    and the optimistic model says drafting pays. That is another bucket's best k: at batch 8, where
    drafting was measured at 2.5 plain rounds, probes keep backing off from call to call."""
    import math
    from collections import deque
    ak = AdaptiveK(3, COSTS)
    for _ in range(20):
        ak.observe([4, 2, 1], [8, 4, 2])                      # a = 0.5
    for k in (1, 2, 3):
        ak.log_ratios[(8, 0, k)] = deque([math.log(2.5)] * 4)
    probes_at_8 = []
    for call in range(6):
        for _ in range(60):
            c = ak.choose(bucket=8)
            probes_at_8 += [c.round] if c.reason == "probe" else []
        tail = [ak.choose(bucket=1, rows=1) for _ in range(2)]
        assert all(c.k > 0 for c in tail)                     # the small bucket drafts (model costs)
    # the interval doubles until a probe would lose more than probe_budget: 63-100 rounds at these costs
    gaps = [b - a for a, b in zip(probes_at_8, probes_at_8[1:])]
    assert gaps[:2] == [16, 32] and min(gaps[2:]) >= 60


def test_deeper_positions_are_shrunk_towards_the_position_before():
    """Position 1 measured at 0.4 over 200 rows; position 2 from 3 rows, none accepted; position 3 never
    reached. Each position is its rows plus prior_weight pseudo-rows at the estimate of the position
    before (not at a fixed 0.5, which held never-reached positions at 0.5 whatever position 1 said)."""
    ak = AdaptiveK(3, COSTS, prior=0.5, prior_weight=2.0)
    assert ak.acceptance() == pytest.approx([0.5, 0.5, 0.5])
    for _ in range(25):
        ak.observe([3.2, 0, 0], [8, 0, 0])
    ak.observe([0, 0, 0], [0, 3, 0])
    a1, a2, a3 = ak.acceptance()
    assert a1 == pytest.approx(0.4, abs=0.01)
    assert a2 == pytest.approx(2 * a1 / 5, rel=0.01) and a3 == pytest.approx(a2)


def test_a_batch_values_drafts_by_its_slowest_row():
    """k = 1 at acceptance 0.4 for 1.25 plain rounds: +12% for one row, but 8 rows with 24 tokens to go wait
    for the slowest (~19.2 rounds instead of ~17.1): plain. Long generations shrink that tail."""
    ak = AdaptiveK(1, CostModel(head=0.0, verify=(1.0, 1.25)))
    for _ in range(40):
        ak.observe([4], [10])
    assert ak.acceptance()[0] == pytest.approx(0.4, abs=0.01)
    e = ak.expected_tokens(1)
    assert ak.batch_tokens(1, 1, 24) == e and ak.batch_tokens(0, 8, 24) == 1.0
    assert ak.batch_tokens(1, 8, 24) == pytest.approx(1.25, abs=0.01)
    assert ak.batch_tokens(1, 8, 24) < ak.batch_tokens(1, 2, 24) < e
    assert ak.batch_tokens(1, 8, 24) < ak.batch_tokens(1, 8, 2000) < e
    assert ak.choose(rows=1, remaining=24).k == 1
    batch = ak.choose(rows=8, remaining=24)
    assert batch.k == 0 and batch.reason == "best"


def test_drafting_must_beat_plain_by_a_margin():
    """Near break-even adaptive k decodes plainly: k = 1 predicted +3% (E = 1.5 for cost 1.46) is not worth
    what round times leave out; +10% is."""
    for cost, expected_k in ((1.46, 0), (1.36, 1)):
        ak = AdaptiveK(1, CostModel(head=0.0, verify=(1.0, cost)))
        for _ in range(20):
            ak.observe([4], [8])                           # acceptance 0.5: E(1) = 1.5
        choice = ak.choose()
        assert choice.k == expected_k and choice.reason == "best"


def test_measured_round_times_replace_the_forward_only_cost_model():
    """The model says k = 1 pays (E = 1.5 for cost 1.15); timed rounds say a k = 1 round takes 1.6
    plain rounds (accept/commit work the model does not count): adaptive k falls back to plain,
    keeps the times per batch bucket, and re-times a plain round every time_plain_every rounds."""
    ak = AdaptiveK(1, COSTS, time_plain_every=10)
    for _ in range(20):
        ak.observe([4], [8])                               # acceptance 0.5
    first = ak.choose(bucket=8)
    assert first.k == 1 and first.reason == "best"         # nothing timed yet: the model decides
    ak.observe_time(1, 5.0)                                # each (bucket, k)'s first round is warm-up: no sample
    assert not ak.log_ratios
    second = ak.choose(bucket=8)
    assert (second.k, second.reason) == (0, "time_plain")  # k = 1 needs a plain round next to it
    ak.observe_time(0, 0.300)                              # (the plain round's warm-up)
    assert ak.choose(bucket=8).reason == "time_plain"
    ak.observe_time(0, 0.100)
    ks = []
    for _ in range(5):                                     # k = 1 and plain alternate until 4 pairs are timed
        c = ak.choose(bucket=8)
        ks.append(c.k)
        ak.observe_time(c.k, 0.160 if c.k else 0.100)
    assert ks == [1, 0, 1, 0, 0] and len(ak.log_ratios[(8, 0, 1)]) == 4   # then it is priced: plain wins
    third = ak.choose(bucket=8)
    assert third.k == 0 and third.cost == pytest.approx(1.0) and ak.round_cost(1) == pytest.approx(1.6)
    assert ak.choose(bucket=16).k == 1                     # another bucket: not timed, the model again
    fast = AdaptiveK(1, COSTS, time_plain_every=10)
    for _ in range(20):
        fast.observe([4], [8])
    fast.warmed_up = {(8, 0), (8, 1)}
    reasons = []
    for _ in range(30):                                    # k = 1 measured at 1.1 plain rounds: it pays
        c = fast.choose(bucket=8)
        fast.observe_time(c.k, 0.110 if c.k else 0.100)
        reasons.append(c.reason)
    assert fast.round_cost(1) == pytest.approx(1.1)
    # plain rounds alternate with k = 1 until min_pairs pairs are timed, then one every time_plain_every rounds
    assert reasons[:4] == ["time_plain", "best"] * 2 and reasons.count("best") >= 24
    assert 3 <= reasons.count("time_plain") <= 6
    ak.observe_time(1, float("nan"))                       # bad samples are ignored
    assert len(ak.log_ratios[(8, 0, 1)]) == 4 and ak.last_time is None


def test_round_costs_come_from_adjacent_rounds_so_that_machine_drift_cancels():
    """The machine slows down 3x over 200 rounds (this VM drifts by tens of percent within seconds) while
    k = 1 costs 1.1 plain rounds throughout. Plain rounds run once per time_plain_every rounds, so
    recent plain times are older than recent k = 1 times; only ratios of adjacent rounds stay at 1.1
    (medians of each k's own recent times gave 1.25 here), and one slow outlier does not move them."""
    ak = AdaptiveK(1, COSTS, time_plain_every=8)
    for _ in range(20):
        ak.observe([4], [8])
    ak.warmed_up = {(8, 0), (8, 1)}
    for i in range(200):
        c = ak.choose(bucket=8)
        speed = 1 + 2 * i / 200
        ak.observe_time(c.k, speed * (0.110 if c.k else 0.100) * (5.0 if i == 150 else 1.0))
    assert ak.round_cost(1) == pytest.approx(1.1, rel=0.03)
    probe = AdaptiveK(3, COSTS, time_plain_every=1000)      # a k timed only next to rounds of another k
    probe.warmed_up = {(1, k) for k in range(4)}
    probe.choose(bucket=1)
    for k, t in [(0, 1.0), (1, 1.15), (0, 1.0), (1, 1.15), (0, 1.0), (1, 1.15), (3, 1.38), (1, 1.15), (3, 1.38),
                 (1, 1.15)]:
        probe.observe_time(k, t)
    assert probe.round_cost(3) == pytest.approx(1.38) and probe.round_cost(2) == COSTS.round_cost(2)


def _weak_heads(policy):
    """Untrained heads drafting from a one-token draft vocabulary: acceptance ~ p(that token)."""
    heads = random_heads(policy, 2, seed=1)
    heads.set_draft_vocab(torch.tensor([17]))
    return heads


def test_untrained_heads_settle_at_plain_decoding_apart_from_probes(tiny_policy, monkeypatch):
    # the given cost model alone decides (measured round times of a tiny model are noise: tested below)
    monkeypatch.setattr(AdaptiveK, "observe_time", lambda self, k, seconds: None)
    monkeypatch.setattr(torch_engine, "optimistic_costs", lambda k_max: COSTS)
    engine = TorchEngine(tiny_policy, _weak_heads(tiny_policy), config=EngineConfig(adaptive_k=True, probe_every=8))
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True,
                                                  num_draft_tokens=3, seed=0))
    ks = [(c.k, c.reason) for c in out.k_choices]
    assert ks[0][0] > 0 and ks[0][1] == "best"       # optimistic prior: drafts at first
    settled = next(i for i, (k, _) in enumerate(ks) if k == 0)
    assert settled <= 3
    after = ks[settled:]
    assert all(k == 0 for k, why in after if why == "best")
    probes = [i for i, (_, why) in enumerate(after) if why == "probe"]
    probe_ks = [k for k, why in after if why == "probe"]
    assert probes and probe_ks == [3, 2, 1, 3, 2, 1][:len(probe_ks)]    # each k is re-measured in turn
    assert len(after) > 3 * len(probes)
    comp = out.completions[0]
    assert len(comp.round_accepted) == len(comp.round_draft_tokens) == len(comp.draft_entropies)
    assert all(len(e) == k for e, k in zip(comp.draft_entropies, comp.round_draft_tokens))


def test_adaptive_k_is_lossless_at_temperature_zero_while_k_changes(tiny_policy, tiny_heads, monkeypatch):
    # drafting rarely pays: k moves
    monkeypatch.setattr(torch_engine, "optimistic_costs", lambda k_max: CostModel(head=0.5, verify=(1.0, 1.3, 1.6, 1.9)))
    engine = TorchEngine(tiny_policy, tiny_heads, config=EngineConfig(adaptive_k=True, probe_every=2))
    greedy = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    plain = engine.generate(PROMPTS, greedy)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True,
                                                  num_draft_tokens=3))
    assert len({c.k for c in out.k_choices}) > 1
    assert [c.tokens for c in plain.completions] == [c.tokens for c in out.completions]


def test_adaptive_k_is_lossless_at_temperature_one(monkeypatch):
    cfg = tiny_config(vocab_size=5)
    policy = random_model(cfg, seed=3)
    monkeypatch.setattr(torch_engine, "optimistic_costs", lambda k_max: CostModel(head=0.5, verify=(1.0, 1.3, 1.6)))
    engine = TorchEngine(policy, random_heads(policy, 1, seed=5), config=EngineConfig(adaptive_k=True, probe_every=2))
    n = 4000
    plain = continuation_counts(engine, SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=1), n)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=2, num_draft_tokens=2)
    out = engine.generate([[4, 2]] * n, sp)
    assert len({c.k for c in out.k_choices}) > 1
    assert chi2_pvalue(plain, [tuple(c.tokens) for c in out.completions]) > 1e-3


def test_one_adaptive_k_carries_acceptance_and_round_times_across_calls(tiny_policy, monkeypatch):
    """An RL worker's calls are short: the second call starts where the first left off (no new prior,
    no new timings), and nothing is measured outside the rounds that decode."""
    monkeypatch.setattr(AdaptiveK, "observe_time", lambda self, k, seconds: None)   # tiny-model timings are noise
    engine = TorchEngine(tiny_policy, _weak_heads(tiny_policy), config=EngineConfig(adaptive_k=True, probe_every=8))
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, num_draft_tokens=3, seed=0)
    first = engine.generate(PROMPTS, sp)
    adaptive = engine.adaptive
    estimate = adaptive.acceptance()
    assert estimate[0] < 0.5                              # the weak heads were measured below the prior
    second = engine.generate(PROMPTS, replace(sp, seed=1))
    assert engine.adaptive is adaptive
    assert second.k_choices[0].round == first.k_choices[-1].round + 1
    assert second.k_choices[0].acceptance == tuple(round(a, 4) for a in estimate)
    assert second.k_choices[0].k == 0                     # no optimistic restart: still plain decoding
    assert adaptive.costs == optimistic_costs(3)          # no forwards were timed up front


def test_bench_decode_reports_every_setting_and_the_cost_curve(tiny_policy, tiny_heads, capsys):
    """bench-decode's study on a tiny model: a row per setting and batch, ratios to plain, V(1) = 1."""
    from experiments.bench_decode import BenchDecodeConfig, bench_engine, make_engine
    cfg = BenchDecodeConfig(num_draft_tokens=[2, 1], batch_sizes=[1, 2], max_new_tokens=8, repeats=2,
                            verify_ns=[1, 2, 4], cost_repeats=3)
    rows = bench_engine(make_engine(tiny_policy, tiny_heads, compile=False), PROMPTS, cfg, "tiny")
    assert [(r["batch"], r["setting"]) for r in rows] == [
        (b, s) for b in (1, 2) for s in ("plain", "k=2", "adaptive<=2", "k=1")]
    for r in rows:
        assert r["V"][1] == 1.0 and set(r["V"]) == {1, 2, 4} and all(v > 0 for v in r["forward_ms"].values())
        assert r["tok_s"] > 0 and len(r["all_tok_s"]) == 2
        assert (r["ratio_to_plain"] == 1.0) == (r["setting"] == "plain")
        assert (r["acceptance"] is None) == (r["setting"] == "plain")
    assert "V(4)=" in capsys.readouterr().out
