"""verl 0.9.1 rolling out through our accelerator, on a CPU, through verl's own code paths:
`AgentLoopManager.generate_sequences` (agent loop worker -> LLMServerClient -> our replica's server
actor) and `CheckpointEngineManager.update_weights` (the `mtp_object_store` backend -> verl's
CheckpointEngineWorker -> our adapter -> the accelerator's sync_policy).

Stubbed: verl's trainer (RayPPOTrainer and its FSDP/Megatron actor workers need a GPU). Its place as
the weights' sender is taken by StubTrainer, a verl Worker holding a tiny policy that streams its
tensors into the checkpoint backend, which is what verl's actor worker does after an update.
Everything else here is verl's own code, our replica and real MTP heads on a tiny random llama.
"""
from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest
import ray
import torch
from omegaconf import open_dict

from rollout.models.decoder import random_model
from rollout.ray_guard import local_ray as guarded_ray
from tests.conftest import export_tiny_chat_model, tiny_chat_llama_config

from verl.checkpoint_engine.base import CheckpointEngineManager, CheckpointEngineRegistry
from verl.experimental.agent_loop import AgentLoopManager
from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout.llm_server import LLMServerManager

from rollout.integrations.verl import NAME, server_name
from rollout.integrations.verl_checkpoint import BACKEND

RESPONSE_LENGTH = 8
NUM_DRAFT = 2
CALL_TIMEOUT_S = 300      # every verl call is bounded: a hang fails the test instead of CI


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF dir of policy v0, policy v0, policy v1, tmp root) for a tiny random llama."""
    cfg = tiny_chat_llama_config()
    v0, v1 = random_model(cfg, seed=0), random_model(cfg, seed=1)
    root = tmp_path_factory.mktemp("verl")
    hf = export_tiny_chat_model(v0, root / "hf")
    return hf, v0, v1, root


def verl_config(hf, out_dir):
    """verl's own ppo_trainer config with what a user sets for this backend (docs/integrations.md#verl)."""
    import os

    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        config = compose(config_name="ppo_trainer")
    r = config.actor_rollout_ref.rollout
    config.actor_rollout_ref.model.path = str(hf)
    r.name, r.nnodes, r.n_gpus_per_node, r.tensor_model_parallel_size = NAME, 1, 1, 1
    r.prompt_length, r.response_length, r.calculate_log_probs = 32, RESPONSE_LENGTH, True
    r.temperature, r.agent.num_workers = 1.0, 1
    r.checkpoint_engine.backend = BACKEND
    with open_dict(r):    # `custom` is verl's free extension key, absent from its YAML: `+...custom.mtp_rollout...`
        r.custom = {NAME: {"out_dir": str(out_dir), "num_draft_tokens": NUM_DRAFT, "seed": 0, "accelerator": {
            "heads": "init", "num_depths": NUM_DRAFT,     # our MTP heads, freshly initialised on the policy
            # every call drafts: the tests read acceptance, and on this tiny model the engine would run calls plain
            "workers": {"num_workers": 1, "num_cpus_per_worker": 1, "plain_when_slower": False},
            "cotrainer": {"steps_per_refresh": 2, "batch_tokens": 64, "replay_capacity": 16},
            "monitor": {"n_boot": 10, "tensorboard": False, "plot_every": 0, "plots": False}}}}
    return config


class StubTrainer(Worker):
    """Stands in for verl's actor worker (which needs a GPU): after an 'update' it streams its policy's
    tensors into the checkpoint backend, as verl's actor workers do in update_weights."""

    def __init__(self, backend: str):
        super().__init__()
        self.checkpoint_engine = CheckpointEngineRegistry.new(backend, bucket_size=1 << 20)
        self.state: dict[str, torch.Tensor] = {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_policy(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str | None = None):
        return await self.checkpoint_engine.send_weights(iter(self.state.items()), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


@pytest.fixture(scope="module")
def stack(tiny):
    """Local guarded Ray (more logical CPUs than cores: verl's placement groups and the accelerator's
    actors must fit side by side), our replica behind verl's LLMServerManager, verl's AgentLoopManager."""
    hf, v0, v1, root = tiny
    config = verl_config(hf, root / "run")
    with guarded_ray(num_cpus=8, log_to_driver=False):
        servers = LLMServerManager.create(config)
        agents = AgentLoopManager.create(config, llm_client=servers.get_client())
        trainer_pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1, name_prefix="stub_")
        trainer = RayWorkerGroup(resource_pool=trainer_pool,
                                 ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(StubTrainer), backend=BACKEND),
                                 use_gpu=False, device_name="cpu")
        ckpt = CheckpointEngineManager(CheckpointEngineConfig(backend=BACKEND), trainer, servers.get_replicas())
        yield config, servers, agents, trainer, ckpt


def prompts(n: int) -> DataProto:
    raw = np.empty(n, dtype=object)                     # one chat (a list of messages) per row
    raw[:] = [[{"role": "user", "content": f"count to {i}"}] for i in range(n)]
    return DataProto(non_tensor_batch={"raw_prompt": raw,
                                       "agent_name": np.array(["single_turn_agent"] * n, dtype=object),
                                       "data_source": np.array(["tiny"] * n, dtype=object)})


def bounded(fn, *args, timeout=CALL_TIMEOUT_S):
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(fn, *args).result(timeout=timeout)


def responses(out: DataProto) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, response ids, rollout log-probs) per row, padding removed."""
    rows = []
    plen = out.batch["prompts"].shape[1]
    for i in range(len(out)):
        mask = out.batch["attention_mask"][i]
        p = out.batch["prompts"][i][mask[:plen].bool()].tolist()
        rmask = out.batch["response_mask"][i].bool()
        rows.append((p, out.batch["responses"][i][rmask].tolist(), out.batch["rollout_log_probs"][i][rmask].tolist()))
    return rows


def recomputed_logprobs(policy, prompt: list[int], response: list[int]) -> list[float]:
    """log p(token) from the policy's raw logits (temperature 1), teacher-forced."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = policy(ids)                                    # [1, T, V] float32
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def monitor_lines(root) -> tuple[list[dict], list[dict]]:
    """(step records, events) of the monitor's JSONL in the run directory verl's replica was given."""
    lines = [json.loads(line) for line in (root / "run" / "monitor" / "monitor.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" not in r], [r for r in lines if "event" in r]


def test_agent_loop_generates_through_the_replica(tiny, stack):
    """verl's generate_sequences -> our replica: tokens with the generating policy's log-probs, its
    version in each row, and the step's acceptance in the monitor (written in the replica's process
    at verl's next weight update)."""
    hf, v0, v1, root = tiny
    config, servers, agents, trainer, ckpt = stack
    out = bounded(agents.generate_sequences, prompts(4))
    assert len(out) == 4
    rows = responses(out)
    for p, r, lp in rows:
        assert 1 <= len(r) <= RESPONSE_LENGTH
        assert np.allclose(lp, recomputed_logprobs(v0, p, r), atol=1e-4)      # raw, temperature 1
    assert list(out.non_tensor_batch["policy_version"]) == [0] * 4
    assert all(k == NUM_DRAFT for k in out.non_tensor_batch["num_draft_tokens"])
    assert all(0.0 <= a <= 1.0 for a in out.non_tensor_batch["acceptance_rate"])
    # verl's update after step 1 (global_steps=1) closes our step 0 with the monitor's record
    trainer.set_policy(v0.state_dict())
    bounded(ckpt.update_weights, 1)
    recs, events = monitor_lines(root)
    assert [r["step"] for r in recs] == [0], (recs, events)
    assert not [e for e in events if e["event"] == "cotrainer_failed"], events
    rec = recs[0]
    assert rec["extra"] == {"verl_global_steps": 1}
    assert rec["num_completions"] == 4 and rec["policy_version_max"] == 0
    assert rec["num_drafts"] > 0 and 0 <= rec["num_accepted_tokens"] <= rec["num_draft_tokens"]
    assert rec["acceptance_rate"] == pytest.approx(rec["num_accepted_tokens"] / rec["num_draft_tokens"])
    # the per-sample counts verl's trainer turns into rollout/spec_accept_rate and _length add up to ours
    assert sum(out.non_tensor_batch["spec_num_accepted_tokens"]) == rec["num_accepted_tokens"]
    assert sum(out.non_tensor_batch["spec_num_draft_tokens"]) == rec["num_draft_tokens"]
    assert all(v >= 1 for v in out.non_tensor_batch["spec_num_verify_steps"])
    stats = ray.get(ray.get_actor(server_name(0)).stats.remote(), timeout=60)
    assert stats["cotrainer_running"] and stats["monitor_dir"] == str(root / "run" / "monitor"), stats


def test_checkpoint_engine_update_moves_weights_and_version(tiny, stack):
    """verl's CheckpointEngineManager.update_weights(2) with new weights: the next rollouts come from
    them (log-probs recomputed with the new policy, not the old) and carry version 2."""
    hf, v0, v1, root = tiny
    config, servers, agents, trainer, ckpt = stack
    trainer.set_policy(v1.state_dict())
    bounded(ckpt.update_weights, 2)
    out = bounded(agents.generate_sequences, prompts(2))
    assert list(out.non_tensor_batch["policy_version"]) == [2, 2]
    assert list(out.non_tensor_batch["global_steps"]) == [2, 2]
    for p, r, lp in responses(out):
        assert np.allclose(lp, recomputed_logprobs(v1, p, r), atol=1e-4)
        assert not np.allclose(lp, recomputed_logprobs(v0, p, r), atol=1e-2)


def test_dead_server_fails_verl_request_clearly(stack):
    """The replica's server actor killed while verl's requests wait on it: generate_sequences fails
    with Ray's actor-died error (verl's LLMServerClient does not retry) within the bound; nothing hangs."""
    config, servers, agents, trainer, ckpt = stack
    server = ray.get_actor(server_name(0))
    ray.get(server.abort_all_requests.remote(), timeout=60)     # hold requests: they are in flight, not done
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(agents.generate_sequences, prompts(2))
        with pytest.raises(concurrent.futures.TimeoutError):
            fut.result(timeout=3)                               # held, as abort_all_requests promises
        ray.kill(server)
        with pytest.raises(Exception) as err:
            fut.result(timeout=CALL_TIMEOUT_S)
    assert "ActorDiedError" in repr(err.value) or "actor died" in str(err.value).lower(), repr(err.value)


def test_logprob_convention_mismatch_is_refused():
    """verl's default processed log-probs at another temperature (or with top-k / top-p) are not ours:
    refused before any actor starts, naming the keys; raw_logprobs, or temperature 1, pass."""
    from types import SimpleNamespace

    from rollout.integrations.verl import check_logprobs_mode

    def cfg(**kw):
        return SimpleNamespace(**{"logprobs_mode": "processed_logprobs", "calculate_log_probs": True,
                                  "temperature": 1.0, "top_k": -1, "top_p": 1.0, **kw})

    check_logprobs_mode(cfg())
    check_logprobs_mode(cfg(logprobs_mode="raw_logprobs", temperature=0.7, top_k=20))
    check_logprobs_mode(cfg(calculate_log_probs=False, temperature=0.7))     # no rollout log-probs returned
    with pytest.raises(ValueError, match=r"logprobs_mode=processed_logprobs with \['temperature'\]"):
        check_logprobs_mode(cfg(temperature=0.7))
    with pytest.raises(ValueError, match="top_k"):
        check_logprobs_mode(cfg(top_k=20))
    with pytest.raises(ValueError, match="processed_logits"):
        check_logprobs_mode(cfg(logprobs_mode="processed_logits"))
