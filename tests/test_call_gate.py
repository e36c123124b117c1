"""The call gate: batch sizes whose speculating calls cost more than plain decoding run without speculating in
the full batch (TAIL calls, or PLAIN where those lose too), re-checked now and then; a paused call is plain
decoding (its tokens, its speed) and still feeds the rollout history."""
from dataclasses import replace

import pytest

import math

from rollout.engine.call_gate import (CALIBRATE_BELOW, CALIBRATE_EVERY, DECAY, FIRST_SKIP, MAX_SKIP, MIN_CALLS,
                                      PLAIN, SPECULATE, TAIL, CallGate)
from rollout.engine.config import EngineConfig
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from tests.lossless import MIXED_PROMPTS


def checked(*buckets: int) -> CallGate:
    """A gate whose buckets have had their plain price checked once (it judges a bucket only then), the price
    found right."""
    gate = CallGate()
    for b in buckets:
        gate.calibrate(b, 1.0, 1.0)
    return gate


def plain_stretch(gate: CallGate, bucket: int, tail: bool = True) -> int:
    """How many calls of `bucket` run without speculating from their start before the next one does (each
    PLAIN one checks the price, as the engine's plain calls do)."""
    n = 0
    while (mode := gate.mode(bucket, tail)) != SPECULATE:
        if mode == PLAIN:
            gate.calibrate(bucket, 1.0, 1.0)
        n += 1
    return n


def test_a_bucket_is_gated_after_its_priced_calls_lose_and_its_stretches_double_while_rechecks_lose():
    gate = checked(16, 8)
    gate.record(16, 0.0, priced_seconds=1.0, seconds=1.2)
    assert MIN_CALLS == 2 and plain_stretch(gate, 16) == 0          # one priced call decides nothing
    gate.record(16, 0.0, 1.0, 1.2)
    assert gate.ratio(16) < 1 and plain_stretch(gate, 16) == FIRST_SKIP
    stretches = []
    for _ in range(6):                                               # every re-check loses again
        gate.record(16, 0.0, 1.0, 1.2)
        stretches.append(plain_stretch(gate, 16))
    assert stretches == [min(FIRST_SKIP * 2 ** i, MAX_SKIP) for i in range(1, 7)]
    assert plain_stretch(gate, 8) == 0                               # buckets are judged apart


def test_a_recheck_that_pays_ends_the_pause_and_the_next_loss_starts_short_again():
    gate = checked(16)
    for _ in range(4):
        gate.record(16, 0.0, 1.0, 1.2)
        plain_stretch(gate, 16)
    gate.record(16, 0.0, 3.0, 1.0)                                        # speculation paid, clearly
    assert gate.ratio(16) > 1 and plain_stretch(gate, 16) == 0
    gate.record(16, 0.0, 1.0, 2.0)
    assert plain_stretch(gate, 16) == FIRST_SKIP


def test_unpriced_calls_are_ignored_and_new_heads_end_every_pause():
    gate = checked(4)
    gate.record(4, 0.0, float("nan"), 1.0)
    gate.record(4, 0.0, 0.0, 1.0)
    assert gate.ratio(4) != gate.ratio(4)                            # nan: nothing priced
    gate.record(4, 0.0, 1.0, 2.0)
    gate.record(4, 0.0, 1.0, 2.0)
    assert plain_stretch(gate, 4) == FIRST_SKIP
    gate.record(4, 0.0, 1.0, 2.0)                                         # the re-check loses: a longer stretch is due...
    gate.heads_changed()
    assert plain_stretch(gate, 4) == 0                               # ...but new heads are re-checked at once
    gate.record(4, 0.0, 1.0, 2.0)
    assert plain_stretch(gate, 4) == FIRST_SKIP                      # and a loss pauses again, short


def test_where_speculation_barely_pays_a_plain_call_checks_the_price_now_and_then():
    gate = CallGate()
    barely, clearly = 1.0 + (CALIBRATE_BELOW - 1) / 2, CALIBRATE_BELOW + 0.2
    for _ in range(MIN_CALLS):
        gate.record(16, 0.0, barely, 1.0)
        gate.record(8, 0.0, clearly, 1.0)
    for b in (16, 8):                                    # every bucket's price is checked once it is priced...
        assert gate.mode(b) == PLAIN
        gate.calibrate(b, 1.0, 1.0)
        assert gate.mode(b) == SPECULATE                 # (one call, not a stretch)
    plain_calls = []
    for call in range(3 * CALIBRATE_EVERY):              # ...then after every CALIBRATE_EVERY speculating calls
        gate.record(16, 0.0, barely, 1.0)
        gate.record(8, 0.0, clearly, 1.0)
        assert gate.mode(8) == SPECULATE                 # clearly paying: no more calls spent on checking
        if gate.mode(16) == PLAIN:
            plain_calls.append(call)
            gate.calibrate(16, 1.0, 1.0)
            assert gate.mode(16) == SPECULATE
    assert plain_calls == [CALIBRATE_EVERY - 1, 2 * CALIBRATE_EVERY - 1, 3 * CALIBRATE_EVERY - 1]


def test_a_bucket_is_judged_once_its_price_is_checked_and_the_check_judges_the_calls_before_it():
    """Priced calls that read as losses on the model's price alone do not move a bucket off speculating: its first
    check comes first, and the corrected price judges them (the model's price read 4% high at batch 8 and 5% low
    at batch 16 stopping at EOS, experiments/LOG.md)."""
    gate = CallGate()
    for _ in range(MIN_CALLS):
        gate.record(16, 0.1, 0.9, 1.02)                  # 2% slower by the model's price
        gate.record(8, 0.1, 0.9, 1.02)
    assert gate.mode(16) == PLAIN and gate.mode(8) == PLAIN      # the first checks, not stretches
    gate.calibrate(16, 1.0, 1.05)                        # plain calls of 16 rows cost 5% more than priced: it paid
    gate.calibrate(8, 1.0, 0.95)                         # of 8 rows 5% less: it lost
    assert gate.ratio(16) == pytest.approx((0.1 + 0.9 * 1.05) / 1.02) and gate.ratio(16) > 1
    assert gate.ratio(8) == pytest.approx((0.1 + 0.9 * 0.95) / 1.02) and gate.ratio(8) < 1
    assert gate.mode(16) == SPECULATE
    assert [gate.mode(8) for _ in range(FIRST_SKIP)] == [TAIL] * FIRST_SKIP and gate.mode(8) == SPECULATE


def test_a_stretch_away_from_speculating_runs_tail_calls_judged_on_their_own():
    gate = checked(16)
    for _ in range(MIN_CALLS):
        gate.record(16, 0.0, 1.0, 1.2)                        # speculating from the start loses
    assert [gate.mode(16) for _ in range(FIRST_SKIP)] == [TAIL] * FIRST_SKIP
    assert gate.mode(16) == SPECULATE                    # the re-check
    assert gate.mode(16, tail=False) == SPECULATE        # (no stretch now)
    gate.record(16, 0.0, 1.0, 1.2)
    assert [gate.mode(16, tail=False) for _ in range(2 * FIRST_SKIP)] == [PLAIN] * 2 * FIRST_SKIP   # no tail possible
    gate = checked(16)
    for _ in range(MIN_CALLS):
        gate.record(16, 0.0, 1.0, 1.2)
        gate.record(16, 0.0, 1.0, 1.3, TAIL)                  # the tail loses too: its own stretch, PLAIN calls
    assert gate.ratio(16, TAIL) < 1
    assert [gate.mode(16) for _ in range(FIRST_SKIP)] == [PLAIN] * FIRST_SKIP   # both modes in a stretch
    assert gate.mode(16) == SPECULATE                    # the re-check...
    gate.record(16, 0.0, 1.0, 1.2)                            # ...loses again: a longer stretch away from speculating
    assert gate.mode(16) == TAIL                         # whose first call re-checks the tail, its own stretch over
    gate.record(16, 0.0, 2.0, 1.0, TAIL)                      # the tail paid there: it keeps being chosen
    assert gate.ratio(16, TAIL) > 1 and gate.mode(16) == TAIL


def test_where_the_tail_barely_pays_a_plain_call_checks_the_price_too():
    gate = checked(16)
    barely = 1.0 + (CALIBRATE_BELOW - 1) / 2
    for _ in range(MIN_CALLS):
        gate.record(16, 0.0, 1.0, 1.2)                   # speculating from the start loses: stretches of TAIL calls
    modes = []
    for _ in range(3 * CALIBRATE_EVERY):
        modes.append(mode := gate.mode(16))
        if mode == PLAIN:
            gate.calibrate(16, 1.0, 1.0)
        else:
            gate.record(16, 0.0, *((barely, 1.0, TAIL) if mode == TAIL else (1.0, 1.2)))
    first = modes.index(PLAIN)
    assert MIN_CALLS + first >= CALIBRATE_EVERY and modes[first - 1] == TAIL    # a TAIL call was due: checked
    assert modes.count(PLAIN) >= 2 and PLAIN not in (modes[first + 1], modes[-1])


def losing(engine: TorchEngine, bucket: int) -> None:
    """The engine's gate as after speculating calls of `bucket` that cost twice plain decoding's price."""
    engine.gate.calibrate(bucket, 1.0, 1.0)
    for _ in range(MIN_CALLS):
        engine.gate.record(bucket, 0.0, 1.0, 2.0)


def test_a_paused_call_is_plain_decoding_and_its_tokens_still_reach_the_history(tiny_policy, tiny_heads):
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, num_draft_tokens=3, seed=7)
    plain = TorchEngine(tiny_policy).generate(MIXED_PROMPTS, replace(sp, num_draft_tokens=0))
    engine = TorchEngine(tiny_policy, tiny_heads)
    earlier = TorchEngine(tiny_policy).generate(MIXED_PROMPTS, replace(sp, num_draft_tokens=0, seed=1))
    engine.remember([(p, c.tokens, 0) for p, c in zip(MIXED_PROMPTS, earlier.completions)])   # an earlier epoch
    losing(engine, len(MIXED_PROMPTS))
    paused = engine.generate(MIXED_PROMPTS, sp)
    assert paused.speculation_paused and paused.spec_stats().num_drafts == 0
    assert [c.tokens for c in paused.completions] == [c.tokens for c in plain.completions]
    assert paused.plain_estimate_s == paused.wall_time_s
    assert paused.history_sizes["responses"] == 2 * len(MIXED_PROMPTS)
    for _ in range(FIRST_SKIP - 1):
        assert engine.generate(MIXED_PROMPTS, sp).speculation_paused
    again = engine.generate(MIXED_PROMPTS, sp)                       # the re-check speculates
    assert not again.speculation_paused and again.spec_stats().num_drafts > 0
    assert engine.generate([MIXED_PROMPTS[0]], sp).spec_stats().num_drafts > 0   # another bucket: never gated


@pytest.mark.parametrize("config", [EngineConfig(plain_when_slower=False), EngineConfig(draft_lengths="fixed")])
def test_studies_turn_the_gate_off_and_fixed_lengths_ignore_it(tiny_policy, tiny_heads, config):
    engine = TorchEngine(tiny_policy, tiny_heads, config=config)
    losing(engine, len(MIXED_PROMPTS))
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, num_draft_tokens=2, seed=0)
    out = engine.generate(MIXED_PROMPTS, sp)
    assert not out.speculation_paused and out.spec_stats().num_drafts > 0


def test_new_head_weights_end_a_pause(tiny_policy, tiny_heads):
    engine = TorchEngine(tiny_policy, tiny_heads)
    losing(engine, len(MIXED_PROMPTS))
    engine.update_heads(tiny_heads.state_dict(), version=1)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, num_draft_tokens=2, seed=0)
    assert not engine.generate(MIXED_PROMPTS, sp).speculation_paused


def test_paused_steps_reach_the_monitor_and_the_job_summary(tiny_policy, tiny_heads, tmp_path):
    from experiments.async_rl import rollout_speed
    from rollout.monitor.monitor import AcceptanceMonitor, MonitorConfig

    engine = TorchEngine(tiny_policy, tiny_heads)
    losing(engine, len(MIXED_PROMPTS))
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, num_draft_tokens=2, seed=0)
    batch = engine.generate(MIXED_PROMPTS, sp)
    with AcceptanceMonitor(MonitorConfig(str(tmp_path), plots=False, tensorboard=False, n_boot=0)) as mon:
        assert mon.record_step(0, batch)["speculation_paused"] is True
    rows = [{"rollout_s": 1.0, "rollout_tokens": 10, "rollout_speculation_paused": paused,
             "rollout_speculation_tail_only": tail} for paused, tail in ((True, False), (False, False), (True, False),
                                                                           (False, True))]
    assert "speculation paused in 2 of 4 steps" in rollout_speed(rows)
    assert "speculation in the calls' tails only in 1 of 4 steps" in rollout_speed(rows)
    assert "paused" not in rollout_speed(rows[1:2]) and "tails" not in rollout_speed(rows[1:2])


def test_a_paused_call_checks_the_cost_models_price_and_later_estimates_carry_the_correction(tiny_policy, tiny_heads,
                                                                                          monkeypatch):
    engine = TorchEngine(tiny_policy, tiny_heads)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, num_draft_tokens=2, seed=0)
    engine.generate(MIXED_PROMPTS, sp)                   # the cost model times this bucket's rounds
    priced, checked = [], []
    price = engine._plain_price
    monkeypatch.setattr(engine, "_plain_price", lambda *a: priced.append(price(*a)) or priced[-1])
    losing(engine, len(MIXED_PROMPTS))                   # (its price checked once, found right)
    calibrate = engine.gate.calibrate
    monkeypatch.setattr(engine.gate, "calibrate", lambda *a: checked.append(a) or calibrate(*a))
    paused = engine.generate(MIXED_PROMPTS, sp)
    assert paused.speculation_paused and len(priced) == 1 and math.isfinite(priced[0]) and priced[0] > 0
    (bucket, priced_s, spent_s), = checked
    assert bucket == len(MIXED_PROMPTS) and priced_s == priced[0] and 0 < spent_s <= paused.wall_time_s
    assert engine.gate.calibration(bucket) == pytest.approx(math.exp(math.log(spent_s / priced_s) / (DECAY + 1)))
    # a speculating call's estimate: the prefill as timed plus the model's price times the correction
    engine.gate = CallGate()
    engine.gate.calibrate(bucket, 1.0, 1.5)
    monkeypatch.setattr(engine, "_plain_price", lambda *a: 10.0)
    recorded = []
    record = engine.gate.record
    monkeypatch.setattr(engine.gate, "record", lambda *a: recorded.append(a) or record(*a))
    out = engine.generate(MIXED_PROMPTS, sp)
    (_, prefill_s, priced_s, spent_s, _), = recorded
    assert not out.speculation_paused and priced_s == 10.0 and 0 < prefill_s < spent_s
    assert out.plain_estimate_s == pytest.approx(out.wall_time_s * (prefill_s + 15.0) / spent_s)
    assert engine.gate.ratio(bucket) == pytest.approx((prefill_s + 15.0) / spent_s)
