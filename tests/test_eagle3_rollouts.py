"""An EAGLE-3 drafter behind the Ray runtime: RolloutAccelerator's torch-engine workers draft with it and emit
plain decoding's tokens at T=0, the co-trainer refreshes it (with the drafter's own aux layers) and the refresh
reaches the workers, published weights change the drafts; `mtp-rollout run` checkpoints it in vLLM's eagle3
layout and resumes from that directory; a vLLM-engine worker drafts with it through vLLM's eagle3 method and
takes its refreshes."""
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from experiments.async_rl import main
from mtp_heads.cotrainer import CoTrainerConfig
from mtp_heads.drafters import drafter_spec
from mtp_heads.eagle3 import init_eagle3
from mtp_heads.eagle3_checkpoint import WEIGHTS_FILE, load_eagle3, save_eagle3
from mtp_heads.eagle3_drafter import Eagle3Heads
from mtp_heads.eagle3_train import last_layer_eagle3
from rollout import ray_guard
from rollout.accelerator import AcceleratorConfig, RolloutAccelerator
from rollout.models.decoder import random_model
from rollout.models.flat_weights import pack, unpack
from rollout.monitor import MonitorConfig
from rollout.run_dir import read_jsonl
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from rollout.workers import RolloutWorker, WorkerConfig
from tests.conftest import sharpened_tiny_policy
from trainers import run_state
from trainers.rl_policy import TINY_RANDOM

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs/smoke.yaml")
AUX = (0, 2, 3)           # not what the co-trainer would guess for 4 layers ((1, 2, 4)): it must be told
DRAFT_VOCAB = torch.tensor([i for i in range(64) if i % 4 != 3])    # a reduced vocabulary: d2t maps ids
PROMPTS = [[2 + i, 7, 4 + 3 * i, 5, 9 + i] for i in range(5)]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, num_draft_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def local_ray():
    threads = torch.get_num_threads()
    with ray_guard.local_ray(num_cpus=2, log_to_driver=False):
        yield
    torch.set_num_threads(threads)


def _accelerator(tmp_path, policy, drafter) -> RolloutAccelerator:
    cfg = AcceleratorConfig(
        workers=WorkerConfig(num_workers=1, num_cpus_per_worker=1, draft_lengths="fixed"),   # k drafts every round
        cotrainer=CoTrainerConfig(refresh=("every_n_steps",), every_n_steps=1, steps_per_refresh=3, batch_tokens=128,
                                  lr=1e-2, checkpoint_dir=str(tmp_path / "ckpt")),
        monitor=MonitorConfig(out_dir=str(tmp_path / "monitor"), n_boot=20, tensorboard=False, plot_every=0,
                              plots=False))
    return RolloutAccelerator.from_config(cfg, policy=policy, heads=Eagle3Heads(drafter))


def _worker_drafter(accel) -> dict[str, torch.Tensor]:
    return ray.get(accel.workers[0].__ray_call__.remote(lambda w: {k: v.clone() for k, v in
                                                                   w.engine.heads.state_dict().items()}))


@pytest.mark.ray
def test_workers_draft_with_an_eagle3_drafter_losslessly_and_take_its_refreshes(local_ray, tmp_path):
    policy = sharpened_tiny_policy(num_hidden_layers=4)
    drafter = last_layer_eagle3(policy, AUX, DRAFT_VOCAB, seed=0)
    plain = [c.tokens for c in TorchEngine(policy).generate(PROMPTS, replace(GREEDY, num_draft_tokens=0)).completions]
    accel = _accelerator(tmp_path, policy, drafter)
    try:
        first = accel.generate(PROMPTS[:2], GREEDY)
        assert [c.tokens for c in first.completions] == plain[:2]
        assert sum(sum(c.round_accepted) for c in first.completions) > 0        # the drafter's drafts are accepted
        assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in _worker_drafter(accel).items())
        accel.end_step(0)
        accel.generate(PROMPTS[2:3], GREEDY)     # 3 rollouts in the replay: too few for the held-out check,
        accel.end_step(1)                        # so step 1's refresh is published
        assert accel.flush(timeout=120) and accel.head_version == 1
        assert ray.get(accel.cotrainer.__ray_call__.remote(lambda ct: ct.heads.aux_layer_ids)) == AUX
        refreshed = unpack(ray.get(accel.cotrainer.head_weights.remote()))
        assert not torch.equal(refreshed["fc.weight"], drafter.fc.weight)

        after = accel.generate(PROMPTS, GREEDY)
        assert [c.tokens for c in after.completions] == plain
        assert {c.head_version for c in after.completions} == {1}
        assert ray.get(accel.workers[0].stats.remote())["head_version"] == 1
        assert all(torch.equal(v, refreshed[k]) for k, v in _worker_drafter(accel).items())   # the worker's drafter

        other = init_eagle3(policy, AUX, draft_vocab=DRAFT_VOCAB, seed=5)    # published from elsewhere
        accel.publish_heads(other.state_dict(), version=7)
        again = accel.generate(PROMPTS, GREEDY)
        assert [c.tokens for c in again.completions] == plain and {c.head_version for c in again.completions} == {7}
        assert [c.round_accepted for c in again.completions] != [c.round_accepted for c in after.completions]
        assert again.spec_stats().acceptance_rate < after.spec_stats().acceptance_rate
    finally:
        accel.shutdown()


@pytest.mark.ray
def test_a_run_checkpoints_its_eagle3_drafter_in_its_layout_and_resumes_from_it(local_ray, tmp_path, capsys,
                                                                                monkeypatch):
    start = init_eagle3(random_model(TINY_RANDOM, seed=0), draft_vocab=torch.arange(2, 200), seed=1)
    drafter_dir = save_eagle3(tmp_path / "drafter", start)
    run_dir = tmp_path / "run"
    args = [SMOKE, f"out_dir={run_dir}", "progress=false", f"heads={drafter_dir}", "accelerator.num_depths=1",
            "steps=2", "checkpoint_every=1", "accelerator.cotrainer.every_n_steps=1", "tasks.eval_every=0"]
    assert main(args) == 0
    last = run_state.latest_checkpoint(run_dir)
    assert last.step == 1 and "heads" not in last.load("heads.pt")                # the weights are in eagle3/ only
    saved = load_eagle3(last.path / "eagle3", random_model(TINY_RANDOM, seed=0))  # vLLM's layout, for this policy
    assert saved.aux_layer_ids == start.aux_layer_ids and saved.draft_vocab_size == 198
    refreshed = last.head_version > 0     # step 1's co-trainer refresh is kept unless the held-out rollouts reject it
    assert torch.equal(saved.fc.weight, start.fc.weight) != refreshed

    (last.path / "state.json").unlink()    # step 1's checkpoint unfinished: resume after step 0
    step0 = run_state.latest_checkpoint(run_dir)
    built, real = [], run_state.Checkpoint.heads
    monkeypatch.setattr(run_state.Checkpoint, "heads", lambda self, *a, **k: built.append(real(self, *a, **k)) or
                        built[-1])
    capsys.readouterr()
    assert main([*args, "resume=true"]) == 0
    assert "after step 0" in capsys.readouterr().out
    assert len(built) == 1 and isinstance(built[0], Eagle3Heads)               # the drafter of step 0's directory
    want = load_file(str(step0.path / "eagle3" / WEIGHTS_FILE))
    assert all(torch.equal(v, want[k]) for k, v in built[0].state_dict().items())
    assert [r["step"] for r in read_jsonl(run_dir / "rl.jsonl")] == [0, 1]
    assert (run_state.latest_checkpoint(run_dir).path / "eagle3" / WEIGHTS_FILE).is_file()


@pytest.mark.vllm
def test_a_vllm_worker_drafts_with_an_eagle3_drafter_through_vllms_eagle3_method_and_takes_refreshes():
    """The worker (no Ray needed) starts vLLM with draft_method eagle3 on the shipped drafter and routes head
    updates to update_drafter: from an untrained drafter to a trained one, acceptance rises, tokens stay."""
    from tests.test_vllm_eagle3 import AUX as VLLM_AUX, CFG, DRAFT_VOCAB as VLLM_VOCAB, _prompts, _trained_drafter

    policy = random_model(CFG, seed=0)
    trained, untrained = _trained_drafter(policy, seed=1), init_eagle3(policy, VLLM_AUX, VLLM_VOCAB, seed=5)
    prompts = _prompts()
    sp = replace(GREEDY, max_new_tokens=24)
    plain = [c.tokens for c in TorchEngine(policy).generate(prompts, replace(sp, num_draft_tokens=0)).completions]
    worker = RolloutWorker(0, WorkerConfig(engine="vllm"), policy.config, pack(policy.state_dict()), 0,
                           pack(untrained.state_dict()), drafter_spec(untrained), 0)
    try:
        assert type(worker.engine).__name__ == "VLLMEagle3Engine"
        before = worker.generate(prompts, sp)
        assert worker.update_heads(pack(trained.state_dict()), 3) == 3
        after = worker.generate(prompts, sp)
        assert [c.tokens for c in before.completions] == [c.tokens for c in after.completions] == plain
        assert {c.head_version for c in after.completions} == {3} and worker.stats()["head_version"] == 3
        assert after.spec_stats().acceptance_rate > before.spec_stats().acceptance_rate + 0.1
    finally:
        worker.engine.engine.close()
