"""Beyond one machine: rollout workers on the two nodes of a local Ray cluster
(`ray.cluster_utils.Cluster`); one node is removed in the middle of a step, and the step still
returns every prompt's completion, made on the surviving node."""
from __future__ import annotations

import threading
import time

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from mtp_heads.heads import init_heads
from rollout.accelerator import AcceleratorConfig, CoTrainerConfig, RolloutAccelerator, WorkerConfig
from rollout.models.decoder import random_model
from rollout.monitor import MonitorConfig
from rollout.ray_guard import REGISTER_WAIT_S, patient_node_registration, stop_ray_descendants
from rollout.types import SamplingParams
from tests.conftest import tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NEW_TOKENS = 600     # long enough that both chunks are still decoding when the node goes


def _start_cluster() -> tuple[Cluster, object]:
    with patient_node_registration(REGISTER_WAIT_S):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        return cluster, cluster.add_node(num_cpus=1)


@pytest.fixture
def two_nodes():
    for attempt in (1, 2):     # Ray gives a raylet a fixed 30 s to register; a loaded machine may need a retry
        try:
            cluster, node = _start_cluster()
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a slow start
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            stop_ray_descendants()          # what the failed start left (no other Ray runs in this test)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, node
    ray.shutdown()
    cluster.shutdown()


def _node_pids(node) -> set[int]:
    """Processes started by one node's raylet (its workers)."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    return {p.pid for p in raylet.children(recursive=True)}


def test_node_removed_mid_step_loses_no_prompt(two_nodes, tmp_path):
    cluster, node = two_nodes
    policy = random_model(tiny_config(vocab_size=64, hidden_size=64, max_position_embeddings=1024), seed=0)
    heads = init_heads(policy, num_depths=1)
    cfg = AcceleratorConfig(
        workers=WorkerConfig(num_workers=2, num_cpus_per_worker=1, max_retries=2),
        cotrainer=CoTrainerConfig(enabled=False),
        monitor=MonitorConfig(out_dir=str(tmp_path), tensorboard=False, plots=False),
        model="tiny", num_depths=1, ray_address=cluster.address)
    accel = RolloutAccelerator.from_config(cfg, policy=policy, heads=heads)
    try:
        pids = {s["worker_id"]: s["pid"] for s in ray.get([w.stats.remote() for w in accel.workers])}
        on_removed = [i for i, pid in pids.items() if pid in _node_pids(node)]
        assert len(on_removed) == 1, f"workers {pids} are not spread over both nodes"
        victim = psutil.Process(pids[on_removed[0]])

        prompts = [[3 + i, 5, 7 + i] for i in range(8)]
        sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, num_draft_tokens=2, ignore_eos=True, seed=1)
        result = {}
        step = threading.Thread(target=lambda: result.update(batch=accel.generate(prompts, sp)))
        step.start()
        cpu0 = sum(victim.cpu_times()[:2])
        while sum(victim.cpu_times()[:2]) - cpu0 < 0.5:        # its chunk is being decoded
            assert step.is_alive(), "the step ended before the node could be removed: raise NEW_TOKENS"
            time.sleep(0.05)
        cluster.remove_node(node)
        step.join(timeout=300)
        assert not step.is_alive(), "the step did not complete on the surviving node"

        batch = result["batch"]
        assert [c.prompt for c in batch.completions] == prompts              # every prompt, in order
        assert all(len(c.tokens) == NEW_TOKENS for c in batch.completions)
        restarts = [e for e in accel.monitor.events if e["event"] == "worker_restarted"]
        assert [e["detail"]["worker"] for e in restarts] == on_removed     # the lost chunk was retried
        assert sum(n["Alive"] for n in ray.nodes()) == 1
        rec = accel.end_step(0)
        assert rec["num_completions"] == len(prompts)
    finally:
        accel.shutdown(timeout=0)
