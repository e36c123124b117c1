"""Ray runtime: flat weight shipping, refresh policies, the co-trainer, and the facade on a local
Ray with tiny random models (versions, entropy-triggered refresh, faults, lossless heads)."""
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from mtp_heads.checkpoint import load_heads
from mtp_heads.heads import init_heads
from rollout.accelerator import AcceleratorConfig, RolloutAccelerator
from rollout.monitor import AcceptanceMonitor, MonitorConfig
from rollout.torch_engine import TorchEngine
from rollout.types import RolloutBatch, SamplingParams
from rollout.models.flat_weights import pack, unpack
from rollout.worker_pool import chunk_sampling, split_evenly
from rollout.workers import WorkerConfig
from tests.conftest import random_heads, tiny_model
from mtp_heads.cotrainer import CoTrainerConfig, HeadCoTrainer
from mtp_heads.refresh import StepObservation, build_refresh_policy

PROMPTS = [[2 + i, 3, 4 + i, 5] for i in range(4)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def models():
    policy = tiny_model(seed=0)
    return policy, init_heads(policy, num_depths=2, seed=0)


def make_cfg(tmp_path, workers=None, **cotrainer) -> AcceleratorConfig:
    ct = dict(steps_per_refresh=3, batch_tokens=128, replay_capacity=16, lr=3e-3,
              checkpoint_dir=str(tmp_path / "ckpt"))
    ct.update(cotrainer)
    return AcceleratorConfig(
        workers=workers or WorkerConfig(num_workers=1, num_cpus_per_worker=1),
        cotrainer=CoTrainerConfig(**ct),
        monitor=MonitorConfig(out_dir=str(tmp_path / "monitor"), n_boot=20, tensorboard=False, plot_every=0,
                              plots=False),
        num_depths=2)


def events(accel, kind):
    return [r for r in AcceptanceMonitor.load_records(accel.cfg.monitor.out_dir) if r.get("event") == kind]


def sp(temperature, seed=0, k=2, n=12):
    return SamplingParams(max_new_tokens=n, temperature=temperature, num_draft_tokens=k, seed=seed)


# ------------------------------------------------------------------------- no Ray needed

def test_flat_weights_roundtrip_one_buffer_any_dtype():
    named = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(4),
             "s": torch.tensor(2.5), "e": torch.zeros(0, 3)}
    flat = pack(named)
    assert flat.buffer.dtype == np.uint8 and flat.buffer.ndim == 1
    assert all(e.offset % 64 == 0 for e in flat.index)
    back = unpack(flat)
    for k, t in named.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t)
    assert back["a"].data_ptr() == torch.from_numpy(flat.buffer).data_ptr()   # a view, no copy
    with pytest.raises(ValueError, match="no tensors"):
        pack({})


def test_facade_is_importable_from_the_package_without_loading_ray_for_low_layers():
    import subprocess
    import sys

    import rollout
    import rollout.accelerator

    assert rollout.RolloutAccelerator is rollout.accelerator.RolloutAccelerator
    from rollout import RolloutAccelerator
    assert RolloutAccelerator is rollout.accelerator.RolloutAccelerator
    code = "import sys, rollout, rollout.verify, rollout.monitor; assert 'ray' not in sys.modules, 'ray loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("n,parts", [(16, 2), (5, 3), (2, 4), (1, 1), (7, 7)])
def test_prompt_chunks_cover_every_prompt_once_balanced(n, parts):
    chunks = split_evenly(n, parts)
    assert [i for r in chunks for i in r] == list(range(n))
    assert len(chunks) == min(n, parts) and all(len(r) for r in chunks)
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


def test_chunks_sample_with_distinct_seeds_and_a_retry_keeps_its_own():
    sp0 = SamplingParams(max_new_tokens=4, seed=7)
    seeds = [chunk_sampling(sp0, c).seed for c in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert chunk_sampling(sp0, 2) == chunk_sampling(sp0, 2)           # deterministic per chunk
    assert chunk_sampling(SamplingParams(max_new_tokens=4, seed=None), 3).seed is None


@pytest.mark.parametrize("make,match", [
    (lambda: WorkerConfig(num_workers=0), "num_workers"), (lambda: WorkerConfig(engine="tensorrt"), "engine"),
    (lambda: WorkerConfig(max_retries=-1), "max_retries"), (lambda: CoTrainerConfig(refresh=("sometimes",)), "refresh"),
    (lambda: CoTrainerConfig(num_gpus=-1), "num_gpus"), (lambda: CoTrainerConfig(feature_weight=-1.0), "feature_weight"),
    (lambda: WorkerConfig(engine="vllm", adaptive_k=True), "adaptive_k"),
    (lambda: AcceleratorConfig(dtype="float8", monitor=MonitorConfig(out_dir="x")), "dtype"),
])
def test_runtime_configs_reject_bad_values_when_built(make, match):
    """Validation sits in the configs, so a YAML run fails at load time, before Ray starts."""
    with pytest.raises(ValueError, match=match):
        make()


def test_refresh_policies():
    class Cfg:
        refresh = ("entropy_rise", "acceptance_drop")
        entropy_delta, acceptance_epsilon, every_n_steps = 0.3, 0.1, 2

    pol = build_refresh_policy(Cfg)
    obs = lambda s, h, a, v=0: StepObservation(s, h, a, v)  # noqa: E731
    assert pol.decide(obs(0, 1.0, 0.8)) == (False, "")
    assert not pol.decide(obs(1, 1.29, 0.75))[0]                      # below both thresholds
    fire, reason = pol.decide(obs(2, 1.35, 0.78))
    assert fire and reason.startswith("entropy_rise")
    pol.on_refresh(obs(2, 1.35, 0.78), new_head_version=1)
    assert not pol.decide(obs(3, 1.4, 0.2, v=0))[0]                   # old heads: drop not judged
    assert not pol.decide(obs(4, 1.4, 0.7, v=1))[0]                   # level set with the new heads
    fire, reason = pol.decide(obs(5, 1.4, 0.55, v=1))
    assert fire and reason.startswith("acceptance_drop")
    clone = build_refresh_policy(Cfg)
    clone.load_state(pol.state())
    assert clone.state() == pol.state()
    Cfg.refresh = ("every_n_steps",)
    every = build_refresh_policy(Cfg)
    assert [every.decide(obs(s, 1, 1))[0] for s in range(3)] == [False, False, True]
    Cfg.refresh = ("never",)
    assert not build_refresh_policy(Cfg).decide(obs(0, 9, 0))[0]
    Cfg.refresh = ("entropy_spike",)
    with pytest.raises(ValueError, match="unknown refresh policies"):
        build_refresh_policy(Cfg)


def test_cotrainer_tv_refresh_lowers_loss_and_checkpoints(models, tmp_path):
    policy, heads = models
    batch = TorchEngine(policy, heads).generate(PROMPTS, sp(1.0, n=16))
    cfg = CoTrainerConfig(refresh=("every_n_steps",), every_n_steps=1, steps_per_refresh=8, batch_tokens=128,
                          lr=3e-3, checkpoint_dir=str(tmp_path))
    ct = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()), 2, 0)
    ct.add_rollouts([(c.prompt, c.tokens) for c in batch.completions])
    assert not ct.observe(StepObservation(0, 1.0, 0.5, 0)).refreshed
    res = ct.observe(StepObservation(1, 1.0, 0.5, 0))
    assert res.refreshed and res.head_version == 1 and res.reason.startswith("every_n_steps")
    assert res.losses[-1] < res.losses[0]
    again = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()), 2, 0)
    assert again.head_version == 1 and again.resumed_from is not None
    for k, t in unpack(res.weights).items():
        assert torch.equal(again.heads.state_dict()[k], t)
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    _, meta = load_heads(tmp_path / "heads_latest.safetensors", policy)   # usable as heads_path
    assert meta.head_version == 1 and meta.loss == "tv"


def test_cotrainer_refresh_stops_at_its_time_budget(models, monkeypatch):
    """refresh_budget_s bounds a refresh's wall time (one step at least), so the actor's queue of
    decisions, policy syncs and checkpoint requests keeps moving; without a budget all steps run."""
    import mtp_heads.cotrainer as cotrainer_module
    policy, heads = models
    batch = TorchEngine(policy, heads).generate(PROMPTS, sp(1.0, n=8))
    clock = iter(range(0, 10_000, 10))                       # every perf_counter() call: 10 s later
    monkeypatch.setattr(cotrainer_module.time, "perf_counter", lambda: float(next(clock)))
    for budget, steps in ((25.0, 3), (0.0, 6)):
        cfg = CoTrainerConfig(refresh=("every_n_steps",), every_n_steps=1, steps_per_refresh=6, batch_tokens=64,
                              refresh_budget_s=budget)
        ct = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()), 2, 0)
        ct.add_rollouts([(c.prompt, c.tokens) for c in batch.completions])
        ct.observe(StepObservation(0, 1.0, 0.5, 0))
        res = ct.observe(StepObservation(1, 1.0, 0.5, 0))
        assert res.refreshed and len(res.losses) == steps == ct.history[-1]["train_steps"]
    with pytest.raises(ValueError, match="refresh_budget_s must be >= 0"):
        CoTrainerConfig(refresh_budget_s=-1.0)


# ------------------------------------------------------------------------- local Ray

@pytest.mark.ray
def test_loop_versions_entropy_refresh_and_lossless_heads(local_ray, models, tmp_path):
    policy, heads = models
    accel = RolloutAccelerator.from_config(make_cfg(tmp_path, entropy_delta=0.3), policy=policy, heads=heads)
    try:
        heads_seen = []
        for step, temperature in enumerate([0.6, 0.6, 0.6, 2.0, 2.0]):
            accel.sync_policy(policy.state_dict(), version=step + 1)
            batch = accel.generate(PROMPTS, sp(temperature, seed=step), domains=["a", "b", "a", "b"])
            assert len(batch.completions) == len(PROMPTS)
            assert {c.policy_version for c in batch.completions} == {step + 1}
            assert [c.prompt for c in batch.completions] == PROMPTS and batch.completions[1].domain == "b"
            heads_seen.append({c.head_version for c in batch.completions})
            rec = accel.end_step(step)
            assert rec["step"] == step and rec["policy_version_max"] == step + 1
            assert accel.flush(timeout=120)
            if step == 2:
                assert events(accel, "head_refresh") == []             # flat entropy: no refresh
        refreshes = events(accel, "head_refresh")
        assert len(refreshes) == 1 and refreshes[0]["step"] == 3
        assert refreshes[0]["detail"]["reason"].startswith("entropy_rise")
        assert heads_seen == [{0}, {0}, {0}, {0}, {1}]                  # the new heads from the next call on
        assert ray.get(accel.workers[0].stats.remote())["head_version"] == 1

        # outputs never depend on the heads: greedy tokens equal with very different heads
        before = accel.generate(PROMPTS, sp(0.0))
        accel.publish_heads(random_heads(policy, 2, seed=5).state_dict(), version=7)
        after = accel.generate(PROMPTS, sp(0.0))
        assert [c.tokens for c in after.completions] == [c.tokens for c in before.completions]
        assert {c.head_version for c in before.completions} == {1}
        assert {c.head_version for c in after.completions} == {7}
        assert before.spec_stats().acceptance_rate != after.spec_stats().acceptance_rate
    finally:
        accel.shutdown()


@pytest.mark.ray
def test_cotrainer_killed_rollouts_continue_and_restart_resumes(local_ray, models, tmp_path):
    policy, heads = models
    cfg = make_cfg(tmp_path, refresh=("every_n_steps",), every_n_steps=1)
    accel = RolloutAccelerator.from_config(cfg, policy=policy, heads=heads)
    try:
        for step in range(2):
            accel.generate(PROMPTS, sp(1.0, seed=step))
            accel.end_step(step)
            assert accel.flush(timeout=120)
        assert accel.head_version == 1
        ckpt_heads, meta = load_heads(tmp_path / "ckpt" / "heads_latest.safetensors", policy)
        assert meta.head_version == 1

        ray.kill(accel.cotrainer, no_restart=True)
        batch = accel.generate(PROMPTS, sp(1.0, seed=2))                 # rollouts go on, last heads
        assert len(batch.completions) == len(PROMPTS) and {c.head_version for c in batch.completions} == {1}
        accel.end_step(2)
        accel.flush(timeout=60)
        assert [e["step"] for e in events(accel, "cotrainer_failed")] == [2]
        assert len(events(accel, "cotrainer_restarted")) == 1

        stats = ray.get(accel.cotrainer.stats.remote(), timeout=120)
        assert stats["head_version"] == 1 and stats["resumed_from"].endswith("heads_latest.safetensors")
        restored = unpack(ray.get(accel.cotrainer.head_weights.remote()))
        assert all(torch.equal(restored[k], t) for k, t in ckpt_heads.state_dict().items())

        accel.generate(PROMPTS, sp(1.0, seed=3))                         # the new co-trainer carries on
        accel.end_step(3)
        assert accel.flush(timeout=120) and accel.head_version == 2
    finally:
        accel.shutdown()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.ray
def test_worker_killed_mid_generate_batch_complete(local_ray, models, tmp_path):
    policy, heads = models
    workers = WorkerConfig(num_workers=2, num_cpus_per_worker=0.5, max_retries=2)
    with pytest.raises(ValueError, match="CPUs"):
        RolloutAccelerator.from_config(make_cfg(tmp_path, WorkerConfig(num_workers=3)), policy=policy, heads=heads)
    accel = RolloutAccelerator.from_config(make_cfg(tmp_path, workers, enabled=False), policy=policy, heads=heads)
    try:
        name = "model.layers.0.mlp.down_proj.weight"          # a partial update: respawns need the rest too
        accel.sync_policy({name: policy.state_dict()[name] * 1.5}, version=5)
        prompts = [[2 + i % 7, 3, 4, 5 + i % 5] for i in range(16)]
        sampling = SamplingParams(max_new_tokens=160, temperature=1.0, num_draft_tokens=2, seed=11,
                                  ignore_eos=True)
        victim = accel.workers[0]
        pid = ray.get(victim.stats.remote())["pid"]
        cpu0 = _cpu_seconds(pid)
        reference = accel.generate(prompts, sampling)
        cpu1 = _cpu_seconds(pid)
        busy = (cpu1 - cpu0) / 3        # kill a third of the way into the same work
        out = {}
        runner = threading.Thread(target=lambda: out.update(batch=accel.generate(prompts, sampling)))
        runner.start()
        deadline = time.time() + 120
        while _cpu_seconds(pid) - cpu1 < busy and time.time() < deadline:
            time.sleep(0.005)
        ray.kill(victim, no_restart=True)
        runner.join(timeout=300)
        assert not runner.is_alive()
        batch = out["batch"]
        assert len(events(accel, "worker_restarted")) == 1
        assert [c.prompt for c in batch.completions] == prompts
        assert [c.tokens for c in batch.completions] == [c.tokens for c in reference.completions]
        assert all(len(c.tokens) == 160 and c.policy_version == 5 for c in batch.completions)
        assert ray.get(accel.workers[0].stats.remote())["pid"] != pid    # a replacement took the slot
        # the step record pools both generate() calls, and nothing of the killed attempt
        expected = RolloutBatch(reference.completions + batch.completions).spec_stats()
        rec = accel.end_step(0)
        assert rec["num_completions"] == 32 and rec["acceptance_rate"] == pytest.approx(expected.acceptance_rate)
    finally:
        accel.shutdown()


@pytest.mark.ray
def test_adaptive_k_workers_stay_lossless_and_the_monitor_logs_each_rounds_choice(local_ray, models, tmp_path):
    """workers.adaptive_k=true: the torch engine picks k per round; at T = 0 the tokens equal plain decoding,
    and the step record's draft_k counts every round's choice and reason (the rounds of all completions)."""
    policy, heads = models
    cfg = make_cfg(tmp_path, WorkerConfig(num_workers=1, num_cpus_per_worker=1, adaptive_k=True), enabled=False)
    accel = RolloutAccelerator.from_config(cfg, policy=policy, heads=heads)
    try:
        plain = accel.generate(PROMPTS, sp(0.0, k=0, n=16))
        adaptive = accel.generate(PROMPTS, sp(0.0, k=3, n=16))
        assert [c.tokens for c in adaptive.completions] == [c.tokens for c in plain.completions]
        assert adaptive.k_choices and all(0 <= c.k <= 3 for c in adaptive.k_choices)
        rec = accel.end_step(0)
    finally:
        accel.shutdown()
    draft_k = rec["draft_k"]
    assert draft_k["rounds"] == len(adaptive.k_choices) == sum(draft_k["rounds_per_k"].values())
    assert sum(draft_k["rounds_per_reason"].values()) == draft_k["rounds"]
    assert set(draft_k["rounds_per_reason"]) <= {"best", "probe", "time_plain"}
    assert draft_k["mean_k"] == pytest.approx(sum(c.k for c in adaptive.k_choices) / draft_k["rounds"])
    assert draft_k["last"]["k"] == adaptive.k_choices[-1].k and len(draft_k["last"]["acceptance"]) == 3
    stored = [r for r in AcceptanceMonitor.load_records(cfg.monitor.out_dir) if "event" not in r][-1]
    assert stored["draft_k"]["rounds_per_k"] == draft_k["rounds_per_k"]
