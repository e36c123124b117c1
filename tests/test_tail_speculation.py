"""TAIL calls (rollout.engine.call_gate): plain decoding in the call's full batch, drafting once the rows that
are left move into a smaller bucket, the heads' caches and the rollout history caught up at that switch.
Never a change in what is generated, on both attention kernels."""
from dataclasses import replace

import pytest
import torch

import rollout.engine.round as round_module
from rollout.engine.call_gate import MIN_CALLS, PLAIN, TAIL
from rollout.engine.config import EngineConfig, bucket
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.conftest import random_heads
from tests.lossless import MIXED_PROMPTS, chi2_pvalue, lossy_rejection_sample
from tests.test_per_row_drafting import eager_chooser
from tests.test_torch_engine import ATTENTION, attention_config


def tail_calls(engine: TorchEngine, num_rows: int) -> None:
    """The engine's gate as after speculating calls of num_rows' bucket that cost twice plain decoding's price:
    its next calls run TAIL."""
    b = bucket(num_rows, engine.config.batch_buckets)
    engine.gate.calibrate(b, 1.0, 1.0)                        # the gate judges a bucket once its price is checked
    for _ in range(MIN_CALLS):
        engine.gate.record(b, 0.0, 1.0, 2.0)


def stopping_sampling(policy, prompts, **overrides) -> SamplingParams:
    """T = 0 sampling with a stop token some rows emit early and others late or never (compactions mid-call)."""
    unstopped = TorchEngine(policy).generate(prompts, SamplingParams(max_new_tokens=40, temperature=0,
                                                                     ignore_eos=True))
    stop = unstopped.completions[0].tokens[6]
    return replace(SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop,)),
                   **overrides)


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("mode", ["greedy", "rejection"])
@pytest.mark.parametrize("sources", [("heads",), ("heads", "history")])
def test_temperature_zero_tail_calls_equal_plain_decoding(attention, mode, sources, monkeypatch):
    """A TAIL call switches to drafting at its first compaction (different lengths per row): its tokens equal
    plain decoding's; its rounds before the switch drafted nothing. With history, a second TAIL call drafts
    from the first call's rollouts, which reached the history at the switch (the siblings' tokens at T = 0
    are the rows' own: the chooser takes them over the heads')."""
    eager_chooser(monkeypatch)
    policy = random_model(attention_config(attention, vocab_size=32), seed=1)
    prompts = MIXED_PROMPTS * 2                               # 8 rows: a group of siblings per prompt
    base = stopping_sampling(policy, prompts)
    plain = TorchEngine(policy).generate(prompts, base)
    lengths = sorted(len(c.tokens) for c in plain.completions)
    assert lengths[0] < lengths[len(lengths) // 2]            # half the rows or more finish before the rest
    engine = TorchEngine(policy, random_heads(policy, 2, seed=2), config=EngineConfig(draft_sources=sources))
    tail_calls(engine, len(prompts))
    sp = replace(base, num_draft_tokens=4, draft_mode=mode)
    first, second = engine.generate(prompts, sp), engine.generate(prompts, sp)
    for out in (first, second):
        assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
        assert out.speculation_tail_only and not out.speculation_paused
        assert out.spec_stats().num_drafts > 0
        for c in out.completions:      # the rows that ended first (their bucket of 8 rows) drafted nothing
            if len(c.tokens) < lengths[len(lengths) // 2 - 1]:
                assert sum(c.round_draft_tokens) == 0
    drafted = {s for c in first.completions + second.completions for s in c.round_sources}
    assert sources[-1] in drafted and drafted <= set(sources)
    if sources == ("heads",):
        return
    assert second.history_sizes["responses"] == 2 * len(prompts)
    history_accepted = sum(n for c in second.completions for n, s in zip(c.round_accepted, c.round_sources)
                           if s == "history")
    assert history_accepted > 0


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_the_switch_fills_the_heads_caches_as_a_prefill_over_the_tokens_so_far_would(attention, monkeypatch):
    """At the switch every committed position of the heads' caches holds what a prefill over the rows' tokens
    so far gives: the plain rounds before it lost nothing the heads read (float32)."""
    policy = random_model(attention_config(attention, vocab_size=32), seed=1)
    engine = TorchEngine(policy, random_heads(policy, 2, seed=2))
    prompts = MIXED_PROMPTS * 2
    sp = stopping_sampling(policy, prompts, num_draft_tokens=3)
    switched = []
    start = engine._start_drafting

    def capture(ctx, st, results, prompts, history):
        handles = start(ctx, st, results, prompts, history)
        switched.append({name: getattr(st, name).clone() for name in ("seq", "committed", "finished")}
                        | {name: [t.clone() for t in getattr(st, name)] for name in ("head_len", "head_hidden")})
        return handles
    monkeypatch.setattr(engine, "_start_drafting", capture)
    tail_calls(engine, len(prompts))
    engine.generate(prompts, sp)
    st, = switched
    live = (~st["finished"]).nonzero().squeeze(1).tolist()
    assert live
    committed = st["committed"].tolist()
    context = [st["seq"][b, :committed[b] - 1].tolist() for b in live]   # what the target cache holds
    fresh = TorchEngine(policy, engine.heads)
    _, ref, _ = fresh._prefill(context, replace(sp, max_new_tokens=1))
    for j, (head_len, hidden) in enumerate(zip(st["head_len"], st["head_hidden"]), start=1):
        for i, b in enumerate(live):
            n = committed[b] - j
            assert int(head_len[b]) == n
            # the prefill's pending token is its own first sample: compare the positions before it
            torch.testing.assert_close(hidden[b, :n - 1], ref.head_hidden[j - 1][i, :n - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_sequence_distribution_unchanged_by_drafting_from_the_switch_on(attention, monkeypatch):
    """T = 1, every row drafting from the switch on (buckets of 4000 and 3999 rows: the first row that stops
    moves the rest into the smaller bucket after the first round): the first 4 tokens have plain sampling's
    distribution (chi-square), and a lossy verifier fails the same test."""
    eager_chooser(monkeypatch)
    cfg = attention_config(attention, vocab_size=5)
    policy = random_model(cfg, seed=3)
    config = EngineConfig(batch_buckets=(1, 3999, 4000))
    engine = TorchEngine(policy, random_heads(policy, 1, seed=5), config=config)
    n, prompt = 4000, [[4, 2, 4, 2, 4]]
    sp = SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True, stop_token_ids=(3,), seed=1)
    first4 = lambda batch: [tuple(c.tokens[:4]) for c in batch.completions]    # noqa: E731
    plain = first4(TorchEngine(policy, config=config).generate(prompt * n, sp))
    sp = replace(sp, seed=2, num_draft_tokens=2)
    tail_calls(engine, n)
    out = engine.generate(prompt * n, sp)
    assert out.speculation_tail_only and out.spec_stats().num_drafts > n
    assert chi2_pvalue(plain, first4(out)) > 1e-3
    monkeypatch.setattr(round_module, "rejection_sample", lossy_rejection_sample)
    lossy = engine.generate(prompt * n, sp)
    assert lossy.speculation_tail_only and chi2_pvalue(plain, first4(lossy)) < 1e-6


def test_a_tail_call_whose_rows_never_move_is_a_plain_call_and_checks_the_price(monkeypatch):
    """Rows that could stop but all run to max_new_tokens never leave the full batch: the TAIL call is plain
    decoding (its tokens), counts as paused, checks the plain price, and its tokens still reach the history."""
    policy = random_model(attention_config("sdpa"), seed=0)
    engine = TorchEngine(policy, random_heads(policy, 2, seed=0))
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, num_draft_tokens=2, seed=3)      # EOS may stop rows
    engine.generate(MIXED_PROMPTS, sp)                        # the cost model times this bucket's rounds
    tail_calls(engine, len(MIXED_PROMPTS))
    modes, checked = [], []
    mode = engine.gate.mode
    monkeypatch.setattr(engine.gate, "mode", lambda *a, **k: modes.append(mode(*a, **k)) or modes[-1])
    calibrate = engine.gate.calibrate
    monkeypatch.setattr(engine.gate, "calibrate", lambda *a: checked.append(a) or calibrate(*a))
    out = engine.generate(MIXED_PROMPTS, sp)
    plain = TorchEngine(policy).generate(MIXED_PROMPTS, replace(sp, num_draft_tokens=0))
    assert {len(c.tokens) for c in plain.completions} == {sp.max_new_tokens}     # no row stopped early
    assert modes == [TAIL] and len(checked) == 1
    assert out.speculation_paused and not out.speculation_tail_only and out.spec_stats().num_drafts == 0
    assert [c.tokens for c in out.completions] == [c.tokens for c in plain.completions]
    assert out.plain_estimate_s == out.wall_time_s
    assert out.history_sizes["responses"] == 2 * len(MIXED_PROMPTS)


def test_a_switched_tail_call_is_priced_as_a_tail_call_and_reaches_the_monitor_as_one(monkeypatch, tmp_path):
    from rollout.monitor.monitor import AcceptanceMonitor, MonitorConfig

    policy = random_model(attention_config("sdpa", vocab_size=32), seed=1)
    engine = TorchEngine(policy, random_heads(policy, 2, seed=2))
    prompts = MIXED_PROMPTS * 2
    sp = stopping_sampling(policy, prompts, num_draft_tokens=3, temperature=1.0, seed=0)
    engine.generate(prompts, sp)
    # drafting at T = 1 follows the chooser's timing, so which buckets the rows pass through varies from run to
    # run: every bucket they may reach gets a plain price (twice: a shape's first round is no sample)
    for b in [b for b in engine.config.batch_buckets if b <= len(prompts)]:
        for _ in range(2):
            engine.chooser.costs.observe(b, b, 0, 1e-3)
    tail_calls(engine, len(prompts))
    recorded = []
    record = engine.gate.record
    monkeypatch.setattr(engine.gate, "record", lambda *a: recorded.append(a) or record(*a))
    out = engine.generate(prompts, sp)
    (call_bucket, prefill_s, priced_s, spent_s, mode), = recorded
    plain_s = prefill_s + priced_s * engine.gate.calibration(call_bucket)
    assert out.speculation_tail_only and mode == TAIL and call_bucket == len(prompts)
    assert priced_s > 0 and spent_s > 0 and out.plain_estimate_s == pytest.approx(out.wall_time_s * plain_s / spent_s)
    assert engine.gate.ratio(call_bucket, TAIL) == pytest.approx(plain_s / spent_s)
    with AcceptanceMonitor(MonitorConfig(str(tmp_path), plots=False, tensorboard=False, n_boot=0)) as mon:
        record = mon.record_step(0, out)
    assert record["speculation_tail_only"] is True and record["speculation_paused"] is False


def test_tail_calls_only_where_rows_can_stop_early_and_the_drafter_reads_final_states():
    """Rows that cannot stop early (no EOS, no stop token) all finish in the same round: a TAIL call would be plain
    decoding with a drafting engine's overheads. A drafter reading the policy's intermediate layers would need
    their states at every position, which plain rounds do not keep. Either way a stretch's calls run PLAIN."""
    policy = random_model(attention_config("sdpa"), seed=0)
    engine = TorchEngine(policy, random_heads(policy, 1, seed=0))
    stops = SamplingParams(max_new_tokens=8, num_draft_tokens=2)
    assert engine._tail_possible(stops)
    assert engine._tail_possible(replace(stops, ignore_eos=True, stop_token_ids=(5,)))
    assert not engine._tail_possible(replace(stops, ignore_eos=True))
    engine.heads.aux_layer_ids = (0, 1)
    assert not engine._tail_possible(stops)
    assert TorchEngine(policy, config=EngineConfig(draft_sources=("history",)))._tail_possible(stops)


def test_a_plain_call_whose_rows_move_into_smaller_buckets_stays_plain(monkeypatch):
    """Where TAIL calls lose too the gate runs PLAIN calls: rows that finish and move into smaller buckets do not
    switch drafting on; the call counts as paused, checks the plain price and its tokens reach the history."""
    policy = random_model(attention_config("sdpa", vocab_size=32), seed=1)
    engine = TorchEngine(policy, random_heads(policy, 2, seed=2))
    prompts = MIXED_PROMPTS * 2
    sp = stopping_sampling(policy, prompts, num_draft_tokens=3)
    first = engine.generate(prompts, sp)                      # the cost model times this bucket's rounds
    b = bucket(len(prompts), engine.config.batch_buckets)
    engine.gate.calibrate(b, 1.0, 1.0)
    for _ in range(MIN_CALLS):
        engine.gate.record(b, 0.0, 1.0, 2.0)
        engine.gate.record(b, 0.0, 1.0, 2.0, TAIL)
    compactions, checked = [], []
    compact = engine._compact
    monkeypatch.setattr(engine, "_compact", lambda *a: compactions.append(1) or compact(*a))
    calibrate = engine.gate.calibrate
    monkeypatch.setattr(engine.gate, "calibrate", lambda *a: checked.append(a) or calibrate(*a))
    out = engine.generate(prompts, sp)
    assert compactions and len(checked) == 1
    assert out.speculation_paused and not out.speculation_tail_only and out.spec_stats().num_drafts == 0
    assert [c.tokens for c in out.completions] == [c.tokens for c in TorchEngine(policy).generate(
        prompts, replace(sp, num_draft_tokens=0)).completions]
    assert out.history_sizes["responses"] == 2 * first.history_sizes["responses"] > 0


def test_a_plain_calls_rounds_teach_the_cost_model_after_its_check(monkeypatch):
    """A PLAIN call's rounds are plain decoding's own: the engine's cost model learns its plain prices from them,
    but only once the call has checked the model's price, so the check compares the call with the price from
    before it."""
    policy = random_model(attention_config("sdpa", vocab_size=32), seed=1)
    engine = TorchEngine(policy, random_heads(policy, 2, seed=2))
    prompts = MIXED_PROMPTS * 2
    sp = stopping_sampling(policy, prompts, num_draft_tokens=3)
    engine.generate(prompts, sp)                              # a speculating call: the engine's chooser and costs
    events = []
    costs, calibrate = engine.chooser.costs, engine.gate.calibrate
    observe = costs.observe
    monkeypatch.setattr(costs, "observe", lambda *a, **k: events.append(("observe", a)) or observe(*a, **k))
    monkeypatch.setattr(engine.gate, "calibrate", lambda *a: events.append(("check", a)) or calibrate(*a))
    monkeypatch.setattr(engine.gate, "mode", lambda *a, **k: PLAIN)
    out = engine.generate(prompts, sp)
    assert out.speculation_paused and out.spec_stats().num_drafts == 0
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "check" and kinds.count("check") == 1 and len(kinds) > 1     # the check first, then its rounds
    rounds = [a for kind, a in events if kind == "observe"]
    assert all(a[2] == 0 and a[1] <= a[0] for a in rounds)          # plain rounds: no head steps, one token a row
    assert {a[0] for a in rounds} >= {bucket(len(prompts), engine.config.batch_buckets)}


@pytest.mark.parametrize("tail", [False, True])
def test_a_calls_history_holds_what_remember_would_store_of_its_completions(tail):
    """Speculating from the start (first tokens from the prefill, the rest round by round) or from the switch
    (every token so far at once): the history ends as if the completions had been handed to `remember`, the
    path of plain calls and of a replacement worker. Rows that stop on their first token included."""
    policy = random_model(attention_config("sdpa", vocab_size=32), seed=1)
    heads = random_heads(policy, 2, seed=2)
    engine = TorchEngine(policy, heads)
    prompts = MIXED_PROMPTS * 2
    unstopped = TorchEngine(policy).generate(prompts, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
    stop = unstopped.completions[1].tokens[0]                 # a row that stops on its first token
    sp = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop,), num_draft_tokens=3)
    if tail:
        tail_calls(engine, len(prompts))
    out = engine.generate(prompts, sp)
    assert out.speculation_tail_only is tail and not out.speculation_paused
    assert min(len(c.tokens) for c in out.completions) == 1
    replica = TorchEngine(policy, heads)
    replica.remember([(p, c.tokens, 0) for p, c in zip(prompts, out.completions)])
    assert out.history_sizes == {k: v for k, v in replica.history.stats().items() if k != "backend"}
