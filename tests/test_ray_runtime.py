"""Ray runtime: flat weight shipping, refresh policies, the co-trainer, and the facade on a local
Ray with tiny random models (versions, entropy-triggered refresh, faults, lossless heads)."""
import os
import subprocess
import sys
import textwrap
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
from rollout.cotrainer_client import COTRAINER_NICENESS
from rollout import ray_guard
from rollout.monitor import AcceptanceMonitor, MonitorConfig
from rollout.torch_engine import TorchEngine
from rollout.types import RolloutBatch, SamplingParams
from rollout.models.flat_weights import pack, unpack
from rollout.worker_pool import PromptRouter, chunk_sampling
from rollout.workers import WorkerConfig
from tests.conftest import random_heads, tiny_model
from tests.test_ray_exposure import has_actor, kill9_leaves_no_ray
from mtp_heads.cotrainer import CoTrainerConfig, HeadCoTrainer
from mtp_heads.drafters import DrafterSpec
from mtp_heads.refresh import StepObservation, build_refresh_policy

PROMPTS = [[2 + i, 3, 4 + i, 5] for i in range(4)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local_ray():
    with ray_guard.local_ray(num_cpus=2, log_to_driver=False):
        yield


@pytest.fixture(scope="module")
def models():
    policy = tiny_model(seed=0)
    return policy, init_heads(policy, num_depths=2, seed=0)


def make_cfg(tmp_path, workers=None, **cotrainer) -> AcceleratorConfig:
    ct = dict(steps_per_refresh=3, batch_tokens=128, replay_capacity=16, lr=3e-3,
              checkpoint_dir=str(tmp_path / "ckpt"))
    ct.update(cotrainer)
    return AcceleratorConfig(   # every call drafts: these tests read acceptance (the gate would pause the tiny model)
        workers=workers or WorkerConfig(num_workers=1, num_cpus_per_worker=1, plain_when_slower=False),
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


def test_prompts_are_routed_by_group_and_stick_to_their_worker_across_calls():
    """Every row of a prompt (a GRPO group) goes to one worker, new prompts to the least loaded one, and the
    same prompt to the same worker in later calls (its earlier epochs are in that worker's history)."""
    router = PromptRouter(2)
    groups = [[i, i + 1] for i in range(4)]
    epoch0 = [g for g in groups for _ in range(8)]
    first = router.route(epoch0)
    assert sorted(i for part in first for i in part) == list(range(32))
    assert [len(p) for p in first] == [16, 16]
    slot_of = {tuple(epoch0[i]): s for s, part in enumerate(first) for i in part}
    assert all(len({tuple(epoch0[i]) for i in part}) == 2 for part in first)          # whole groups
    epoch1 = [g for g in reversed(groups) for _ in range(8)]
    again = router.route(epoch1)
    assert all(slot_of[tuple(epoch1[i])] == s for s, part in enumerate(again) for i in part)
    router.route([[9, 9]] * 8 + [[0, 1]] * 8)                  # a new prompt beside a known one: the other slot
    assert router.route([[9, 9]])[1 - slot_of[(0, 1)]] == [0]


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
    (lambda: WorkerConfig(draft_lengths="adaptive"), "draft_lengths"),
    (lambda: WorkerConfig(draft_sources=("heads", "ngram")), "draft_sources"),
    (lambda: WorkerConfig(vllm_draft_method="medusa"), "vllm_draft_method"),
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
    ct = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()),
                           DrafterSpec(2), 0)
    ct.add_rollouts([(c.prompt, c.tokens) for c in batch.completions])
    assert not ct.observe(StepObservation(0, 1.0, 0.5, 0)).refreshed
    res = ct.observe(StepObservation(1, 1.0, 0.5, 0))
    assert res.refreshed and res.head_version == 1 and res.reason.startswith("every_n_steps")
    assert res.losses[-1] < res.losses[0]
    again = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()),
                           DrafterSpec(2), 0)
    assert again.head_version == 1 and again.resumed_from is not None
    for k, t in unpack(res.weights).items():
        assert torch.equal(again.heads.state_dict()[k], t)
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    _, meta = load_heads(tmp_path / "heads_latest.safetensors", policy)   # usable as heads_path
    assert meta.head_version == 1 and meta.loss == "tv"


def test_a_refresh_that_is_worse_on_the_newest_rollouts_is_not_published(models, tmp_path):
    """The co-trainer validates each refresh on the newest quarter of its replay, which it does not
    train on: a learning rate that wrecks the heads (here 3.0) is caught, the heads stay as they were
    and keep their version; a sound one is published with both losses recorded."""
    policy, heads = models
    batch = TorchEngine(policy, heads).generate(PROMPTS, sp(1.0, n=16))
    rollouts = [(c.prompt, c.tokens) for c in batch.completions] * 2
    for lr, published in ((3.0, False), (3e-3, True)):
        cfg = CoTrainerConfig(refresh=("every_n_steps",), every_n_steps=1, steps_per_refresh=4, batch_tokens=64,
                              lr=lr, checkpoint_dir=str(tmp_path / str(lr)))
        ct = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()),
                           DrafterSpec(2), 0)
        ct.add_rollouts(rollouts)
        ct.observe(StepObservation(0, 1.0, 0.5, 0))
        res = ct.observe(StepObservation(1, 1.0, 0.5, 0))
        entry = ct.history[-1]
        assert res.refreshed is published and len(res.losses) == 4
        if published:
            assert res.head_version == 1 and entry["heldout_after"] < entry["heldout_before"]
        else:
            assert res.head_version == 0 and res.weights is None and entry["rejected"]
            assert res.reason.startswith("rejected (every_n_steps") and "held-out loss" in res.reason
            assert all(torch.equal(ct.heads.state_dict()[k], t) for k, t in heads.state_dict().items())


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
        ct = HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()),
                           DrafterSpec(2), 0)
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
        # the co-trainer yields the CPU to the rollout path; the workers keep normal priority
        ours = os.nice(0)
        assert ray.get(accel.workers[0].__ray_call__.remote(lambda self: os.nice(0))) == ours   # not Ray's 15
        assert ray.get(accel.cotrainer.__ray_call__.remote(lambda self: os.nice(0))) == min(19, ours + COTRAINER_NICENESS)

        # outputs never depend on the heads: greedy tokens equal with very different heads
        before = accel.generate(PROMPTS, sp(0.0))
        published = random_heads(policy, 2, seed=5).state_dict()
        accel.publish_heads(published, version=7)
        after = accel.generate(PROMPTS, sp(0.0))
        assert [c.tokens for c in after.completions] == [c.tokens for c in before.completions]
        assert {c.head_version for c in before.completions} == {1}
        assert {c.head_version for c in after.completions} == {7}
        assert not (before.speculation_paused or after.speculation_paused)
        assert before.spec_stats().num_draft_tokens > 0 and after.spec_stats().num_draft_tokens > 0
        # the second call drafted with the published heads (not acceptance rates, which two heads can share)
        drafting = ray.get(accel.workers[0].__ray_call__.remote(lambda self: {k: v.clone() for k, v in
                                                                              self.engine.heads.state_dict().items()}))
        assert all(torch.equal(drafting[k], v.to(drafting[k].dtype)) for k, v in published.items())
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
    # fixed draft lengths: a retried chunk repeats its tokens exactly (per-row drafting keeps the distribution,
    # not the tokens: docs/reliability.md, "What is reproducible")
    workers = WorkerConfig(num_workers=2, num_cpus_per_worker=0.5, max_retries=2, draft_lengths="fixed")
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
def test_two_workers_draft_from_history_and_a_restarted_worker_keeps_it(local_ray, models, tmp_path):
    """num_workers=2, per-row drafting with heads and history: at T = 0 the tokens equal plain decoding, each
    group is decoded on one worker, a second epoch of the same prompts drafts from history, and a worker
    killed and replaced gets its prompts' recent rollouts, so history drafts continue on it at once."""
    policy, heads = models
    cfg = make_cfg(tmp_path, WorkerConfig(num_workers=2, num_cpus_per_worker=1), enabled=False)
    accel = RolloutAccelerator.from_config(cfg, policy=policy, heads=heads)
    prompts = [[5 + i, 6, 7, 8] for i in range(2) for _ in range(4)]
    try:
        plain = accel.generate(prompts, sp(0.0, k=0, n=24))
        first = accel.generate(prompts, sp(0.0, k=3, n=24))
        assert [c.tokens for c in first.completions] == [c.tokens for c in plain.completions]
        stats = [ray.get(w.stats.remote()) for w in accel.workers]
        assert all(s["num_generate"] == 2 for s in stats)          # one group each, both calls
        slot = accel._pool.router.route([prompts[0]]).index([0])
        ray.kill(accel.workers[slot])
        again = accel.generate(prompts, sp(0.0, k=3, n=24))          # the dead worker's chunk is retried elsewhere
        assert [c.tokens for c in again.completions] == [c.tokens for c in plain.completions]
        third = accel.generate(prompts, sp(0.0, k=3, n=24))          # its replacement decodes its prompts again,
        assert [c.tokens for c in third.completions] == [c.tokens for c in plain.completions]
        assert ray.get(accel.workers[slot].stats.remote())["num_generate"] == 1
        history = [n for c in third.completions[:4] for n, s in zip(c.round_accepted, c.round_sources) if s == "history"]
        assert history and sum(history) > 0                           # from the rollouts it was handed at start
        rec = accel.end_step(0)
    finally:
        accel.shutdown()
    assert rec["num_completions"] == 32 and "drafting" in rec


# ------------------------------------------------------------------------- Ray stops with a killed driver


@pytest.mark.ray
@pytest.mark.slow          # a fresh interpreter, TRL's imports and a new Ray: ~30-60 s
def test_python_api_driver_killed_leaves_no_ray(tmp_path):
    """RolloutAccelerator.from_config starts a guarded local Ray: kill -9 of the driver stops it."""
    script = textwrap.dedent(f"""
        import time
        from mtp_heads.heads import init_heads
        from rollout.accelerator import AcceleratorConfig, CoTrainerConfig, RolloutAccelerator, WorkerConfig
        from rollout.monitor import MonitorConfig
        from tests.conftest import tiny_model
        policy = tiny_model(seed=0)
        cfg = AcceleratorConfig(workers=WorkerConfig(num_workers=1, num_cpus_per_worker=0.5),
                                cotrainer=CoTrainerConfig(enabled=False),
                                monitor=MonitorConfig(out_dir={str(tmp_path / 'monitor')!r}, tensorboard=False,
                                                      plots=False),
                                num_depths=2)
        accel = RolloutAccelerator.from_config(cfg, policy=policy, heads=init_heads(policy, num_depths=2, seed=0))
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "local"})
    kill9_leaves_no_ray(proc, has_actor("ray::RolloutWor"))
