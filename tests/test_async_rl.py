"""The async RL job end to end on a local Ray (num_cpus=2) with the smoke config's tiny model."""
import json
from pathlib import Path

import pytest
import torch

from experiments.async_rl import main
from rollout.monitor import AcceptanceMonitor
from rollout.ray_guard import local_ray as guarded_ray

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_groups_with_variance_counts_groups_whose_rewards_differ():
    from experiments.async_rl import groups_with_variance
    assert groups_with_variance([0, 0, 1, 0, 0.5, 0.5], 2) == pytest.approx(1 / 3)
    assert groups_with_variance([0, 0, 0, 0], 4) == 0.0


@pytest.fixture(scope="module")
def local_ray():
    threads = torch.get_num_threads()
    with guarded_ray(num_cpus=2, log_to_driver=False):     # retries a start that timed out on a loaded machine
        yield
    torch.set_num_threads(threads)


def test_smoke_job_runs_one_step_off_policy_and_fills_the_run_dir(local_ray, tmp_path):
    run_dir = tmp_path / "run"
    assert main([str(ROOT / "configs/smoke.yaml"), f"out_dir={run_dir}", "progress=false", "steps=4"]) == 0
    for name in ("config.yaml", "monitor.jsonl", "summary.csv", "acceptance_vs_entropy.png", "over_steps.png",
                 "rl.jsonl", "rl_over_steps.png"):
        assert (run_dir / name).is_file(), name
    assert any((run_dir / "tb").iterdir())
    steps = [r for r in AcceptanceMonitor.load_records(run_dir) if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    # rollouts of step s ran with the policy of step s-1: one step off-policy, versions stamped
    assert [r["policy_version_max"] for r in steps] == [0, 0, 1, 2]
    assert [r["policy_version_min"] for r in steps] == [0, 0, 1, 2]
    assert all(r["num_draft_tokens"] > 0 and 0 <= r["acceptance_rate"] <= 1 for r in steps)
    assert all(set(r["extra"]["reward_by_domain"]) == set(r["domains"]) for r in steps)
    rows = [json.loads(x) for x in (run_dir / "rl.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert all(0 <= r["reward"] <= 1 and r["train"]["num_tokens"] > 0 for r in rows)
    assert all(0 <= r["truncated_share"] <= 1 and 0 <= r["groups_with_reward_variance"] <= 1 for r in rows)
    # smoke.yaml: tasks.eval_every=2, so the held-out split is scored after steps 1 and 3 (the last)
    assert [r["step"] for r in rows if "eval_reward" in r] == [1, 3]
    assert all(0 <= r["eval_pass1"] <= r["eval_reward"] + 1e-9 <= 1 + 1e-9 for r in rows if "eval_reward" in r)
    with pytest.raises(ValueError, match="already holds a run"):
        main([str(ROOT / "configs/smoke.yaml"), f"out_dir={run_dir}", "progress=false"])
