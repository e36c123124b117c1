"""verl (0.9.1) rolling out through a RolloutAccelerator: a rollout replica, its server actor and
the weight-sync adapter, registered as `rollout.name: mtp_rollout`.

verl reaches a rollout backend through two seams, and this module fills both:

- Rollouts: verl's agent loops call `LLMServerClient.generate`, which picks a replica's server
  actor and awaits `server.generate(request_id, prompt_ids=..., sampling_params=...) -> TokenOutput`.
  `MTPRolloutReplica` (standalone mode, no GPU needed) starts one `MTPRolloutServer` actor that
  owns a RolloutAccelerator: its workers, its head co-trainer and its monitor run in verl's Ray
  cluster as in our own loop, the monitor writing into `custom.mtp_rollout.out_dir`. Requests
  that arrive together (verl sends one per sample) are batched into one `accel.generate` call.
- Weights: verl's `CheckpointEngineManager.update_weights(global_steps)` has a
  `CheckpointEngineWorker` beside each replica feed the received weight stream to the adapter
  registered for the rollout name, here `MTPRolloutAdapter.update_weights`. It hands the
  tensors to the server, which closes the step as the TRL path does (`end_step(global_steps - 1)`
  for the rollouts made since the last update, then `sync_policy(version=global_steps)`): the
  rollouts after update n carry policy version n. On a CPU (or any disaggregated run) the weights
  travel with the `mtp_object_store` checkpoint backend (rollout.integrations.verl_checkpoint).

Log-probs: ours are the policy's raw log-probs at temperature 1. verl's default
`rollout.logprobs_mode` is `processed_logprobs` (after temperature / top-k / top-p): the same
numbers only at temperature 1 without top-k / top-p, so another setting is refused at start,
naming the key. Not supported: the hybrid engine (rollout and trainer sharing GPUs with a memory
hand-over); only `standalone` replicas of one process each.

The `verl.plugins` entry point imports this module in every process that imports verl; the
import registers everything (`register`).
"""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import ray
import torch
import verl.workers.rollout.base as verl_rollout_base
from omegaconf import OmegaConf
from verl.single_controller.ray import RayResourcePool, RayWorkerGroup
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from rollout.accelerator import AcceleratorConfig, RolloutAccelerator
from rollout.models.flat_weights import FlatWeights, pack, unpack
from rollout.types import Completion, SamplingParams

NAME = "mtp_rollout"                 # actor_rollout_ref.rollout.name
BATCH_WINDOW_S = 0.05                # how long the server gathers requests into one batch
SERVER_CALL_TIMEOUT_S = 600.0        # the adapter's wait for the server to take new weights
WRAPPER_PREFIXES = ("module.", "_orig_mod.")   # what DDP / torch.compile put before HF parameter names
# verl's sampling keys and the value that means "off" (anything else is refused, naming the key)
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def server_name(replica_rank: int) -> str:
    """The server actor's Ray name: how the adapter in verl's CheckpointEngineWorker finds it."""
    return f"mtp_rollout_server_{replica_rank}"


@dataclasses.dataclass(frozen=True)
class VerlSettings:
    """`actor_rollout_ref.rollout.custom.mtp_rollout`: the accelerator and how it drafts."""

    out_dir: str                                     # run directory: monitor/ and heads/ go there
    accelerator: dict = dataclasses.field(default_factory=dict)   # AcceleratorConfig keys (model is verl's)
    num_draft_tokens: int = 3
    draft_mode: str = "rejection"
    seed: int | None = 0                             # batch n samples with seed + n; None: unseeded


def accelerator_config(settings: VerlSettings, model_path: str) -> AcceleratorConfig:
    """AcceleratorConfig from `custom.mtp_rollout.accelerator` (its keys, nested as in our YAML), with verl's
    model and the run directory's monitor/ and heads/ unless set there; a bad key is an error naming it."""
    from mtp_heads.cotrainer import CoTrainerConfig
    from rollout.monitor import MonitorConfig
    from rollout.workers import WorkerConfig

    where = f"actor_rollout_ref.rollout.custom.{NAME}.accelerator"
    acc = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.accelerator.items()}
    out = Path(settings.out_dir)
    parts = {"workers": (WorkerConfig, {}), "monitor": (MonitorConfig, {"out_dir": str(out / "monitor")}),
             "cotrainer": (CoTrainerConfig, {"checkpoint_dir": str(out / "heads")})}
    try:
        for key, (cls, defaults) in parts.items():
            given = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(acc.get(key) or {}).items()}
            acc[key] = cls(**{**defaults, **given})
        if "model" in acc:
            raise ValueError("model is verl's actor_rollout_ref.model.path; do not set it here")
        return AcceleratorConfig(**acc, model=model_path)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def settings_from(rollout_config) -> VerlSettings:
    custom = (getattr(rollout_config, "custom", None) or {}).get(NAME)
    if custom is None:
        raise ValueError(f"actor_rollout_ref.rollout.custom.{NAME} is missing: set at least its out_dir "
                         "(the run directory for the monitor's files and the heads)")
    custom = OmegaConf.to_container(custom, resolve=True) if OmegaConf.is_config(custom) else dict(custom)
    try:
        return VerlSettings(**custom)
    except TypeError as e:
        raise ValueError(f"actor_rollout_ref.rollout.custom.{NAME}: {e}") from None


def check_logprobs_mode(rollout_config) -> None:
    """Our log-probs are raw at temperature 1; refuse a verl setting that expects other numbers."""
    mode = rollout_config.logprobs_mode
    if not rollout_config.calculate_log_probs or mode == "raw_logprobs":
        return
    if mode != "processed_logprobs":
        raise ValueError(f"actor_rollout_ref.rollout.logprobs_mode={mode!r}: {NAME} returns raw log-probs "
                         "(use raw_logprobs, or processed_logprobs at temperature 1)")
    processed_differs = {"temperature": rollout_config.temperature != 1.0,
                         "top_k": rollout_config.top_k not in (-1, 0), "top_p": rollout_config.top_p != 1.0}
    bad = [k for k, v in processed_differs.items() if v]
    if bad:
        raise ValueError(f"actor_rollout_ref.rollout.logprobs_mode=processed_logprobs with {bad} set "
                         f"({', '.join(f'{k}={getattr(rollout_config, k)}' for k in bad)}): {NAME} returns the "
                         "policy's raw log-probs at temperature 1; set logprobs_mode=raw_logprobs or "
                         "temperature=1, top_k=-1, top_p=1")


def sampling_from_verl(params: dict[str, Any], *, response_length: int, settings: VerlSettings) -> SamplingParams:
    """verl's per-request sampling dict -> SamplingParams (max_tokens defaults to response_length,
    top_k -1 = off)."""
    params = dict(params)
    for key, neutral in NEUTRAL_SAMPLING.items():
        value = params.pop(key, neutral)
        if value is not None and float(value) != neutral:
            raise ValueError(f"sampling_params[{key!r}]={value}: {NAME} implements temperature / top-k / top-p "
                             f"only (speculative decoding stays lossless for those); leave {key} at {neutral}")
    max_tokens = params.pop("max_tokens", None)
    max_tokens = params.pop("max_new_tokens", None) if max_tokens is None else max_tokens
    max_tokens = response_length if max_tokens is None else max_tokens
    params.pop("logprobs", None)
    top_k = int(params.pop("top_k", -1) or -1)
    sp = SamplingParams(max_new_tokens=int(max_tokens), temperature=float(params.pop("temperature", 1.0)),
                        top_k=0 if top_k < 0 else top_k, top_p=float(params.pop("top_p", 1.0)),
                        num_draft_tokens=settings.num_draft_tokens, draft_mode=settings.draft_mode)
    if params:
        raise ValueError(f"sampling_params keys {sorted(params)} are not supported by {NAME}")
    sp.validate()
    return sp


def token_output(c: Completion, with_logprobs: bool) -> TokenOutput:
    stats = c.spec_stats()
    return TokenOutput(token_ids=list(c.tokens), log_probs=list(c.logprobs) if with_logprobs else None,
                       stop_reason="completed",
                       extra_fields={"global_steps": c.policy_version, "policy_version": c.policy_version,
                                     "head_version": c.head_version, "acceptance_rate": stats.acceptance_rate,
                                     "acceptance_length": stats.acceptance_length,
                                     "num_draft_tokens": c.num_draft_tokens, "finish_reason": c.finish_reason,
                                     # what verl's trainer reads into its rollout/spec_accept_* metrics
                                     "spec_num_draft_tokens": stats.num_draft_tokens,
                                     "spec_num_accepted_tokens": stats.num_accepted_tokens,
                                     "spec_num_verify_steps": stats.num_drafts})


# ------------------------------------------------------------------------------ the server actor


class MTPRolloutServer:
    """verl's token-in-token-out server for one replica, answering through a RolloutAccelerator.

    An async Ray actor: requests queue up while a batch runs (in a thread, so the actor keeps
    answering) and go out together as the next batch, grouped by sampling parameters.
    """

    def __init__(self, settings: VerlSettings, model_path: str, response_length: int):
        self.settings, self.response_length = settings, response_length
        sampling_from_verl({}, response_length=response_length, settings=settings)   # bad draft settings fail here
        self.accel = RolloutAccelerator.from_config(accelerator_config(settings, model_path))     # Ray is verl's: joined, never stopped here
        self._pending: list[tuple[list[int], SamplingParams, bool, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._reject = False
        self._batches = 0
        self._generated = False              # rollouts since the last weight update (a step to close)

    def ready(self) -> dict:
        return {"policy_version": self.accel.policy_version, "head_version": self.accel.head_version}

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **_kwargs) -> TokenOutput:
        if image_data is not None or video_data is not None:
            raise ValueError(f"{NAME} generates from text tokens only; got image or video data")
        if not self._open.is_set():
            if self._reject:
                raise RuntimeError(f"{NAME} server is not taking requests (aborted with reject_request=True)")
            await self._open.wait()
        sp = sampling_from_verl(sampling_params, response_length=self.response_length, settings=self.settings)
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(([int(t) for t in prompt_ids], sp, bool(sampling_params.get("logprobs")), fut))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        """Batches until the queue is empty; a failed batch fails its requests, not the server."""
        try:
            while self._pending:
                await asyncio.sleep(BATCH_WINDOW_S)
                batch, self._pending = self._pending, []
                seed = None if self.settings.seed is None else self.settings.seed + self._batches
                self._batches += 1
                groups: dict[SamplingParams, list] = {}
                for item in batch:
                    groups.setdefault(dataclasses.replace(item[1], seed=seed), []).append(item)
                for sp, items in groups.items():
                    try:
                        out = await asyncio.to_thread(self.accel.generate, [p for p, *_ in items], sp)
                    except Exception as e:  # noqa: BLE001 - handed to each waiting request
                        for *_, fut in items:
                            if not fut.done():
                                fut.set_exception(e)
                        continue
                    self._generated = True
                    for (_, _, with_lp, fut), c in zip(items, out.completions):
                        if not fut.done():
                            fut.set_result(token_output(c, with_lp))
        finally:
            self._drainer = None

    async def _idle(self) -> None:
        while self._drainer is not None:
            await asyncio.sleep(BATCH_WINDOW_S)

    async def update_policy(self, weights: FlatWeights, version: int) -> dict:
        """verl's weight update n: the monitor record of the step whose rollouts just finished (n - 1),
        then the new weights (version n) to the workers and the co-trainer."""
        record = await asyncio.to_thread(self._close_step_and_sync, unpack(weights), int(version))
        return record

    def _close_step_and_sync(self, named: dict[str, torch.Tensor], version: int) -> dict:
        record = {}
        if self._generated:
            record = self.accel.end_step(max(version - 1, 0), {"verl_global_steps": version})
            self._generated = False
        self.accel.sync_policy(named, version=version)
        return record

    # -- verl's control calls ------------------------------------------------------------------

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Hold new requests until resume_generation (fail them with reject_request); a batch already
        running finishes with the weights it started with and carries their version."""
        self._reject = reject_request
        self._open.clear()
        await self._idle()

    async def resume_generation(self) -> None:
        self._reject = False
        self._open.set()

    async def sleep(self) -> None:
        await self.abort_all_requests()

    async def wake_up(self) -> None:
        await self.resume_generation()

    async def clear_kv_cache(self) -> None:
        """Our engines hold no cache between batches."""

    async def release_kv_cache(self) -> None:
        """Our engines hold no cache between batches."""

    async def resume_kv_cache(self) -> None:
        """Our engines hold no cache between batches."""

    async def start_profile(self, **_kwargs) -> None:
        """Profiling is the monitor's job here (tokens/s, acceptance per step)."""

    async def stop_profile(self) -> None:
        """See start_profile."""

    def stats(self) -> dict:
        return {"policy_version": self.accel.policy_version, "head_version": self.accel.head_version,
                "monitor_dir": str(self.accel.monitor.out_dir), "num_workers": len(self.accel.workers),
                "cotrainer_running": self.accel.cotrainer is not None, "batches": self._batches}

    def shutdown(self) -> None:
        self.accel.shutdown()


# ------------------------------------------------------------------------------ the replica


class MTPRolloutReplica(RolloutReplica):
    """A standalone replica on CPU resources: verl's CheckpointEngineWorker (weights in) and our
    server actor (requests in). Hybrid and colocated modes share GPUs with verl's trainer through a
    memory hand-over that our workers (own model copies) do not do: refused."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_hybrid(self, worker_group):
        raise NotImplementedError(f"rollout.name={NAME} runs standalone only: the hybrid engine's GPU memory "
                                  "hand-over is not supported (use a separate rollout resource pool)")

    async def init_hybrid_colocated(self, worker_group, resource_pool):
        await self.init_hybrid(worker_group)

    async def init_colocated(self, resource_pool):
        await self.init_hybrid(None)

    async def init_standalone(self):
        if self.world_size != 1:
            raise ValueError(f"rollout.name={NAME}: one process per replica (tensor/data/pipeline parallel size 1), "
                             f"got world size {self.world_size}; scale with custom.{NAME}.accelerator.workers")
        check_logprobs_mode(self.config)
        self.rollout_mode = RolloutMode.STANDALONE
        prefix = f"mtp_rollout_{self.replica_rank}{self.name_suffix}_"
        # one CPU per bundle (verl's default reserves 10): the accelerator's actors need the rest
        self.resource_pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, name_prefix=prefix,
                                             max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=self.resource_pool, ray_cls_with_init=self.get_ray_class_with_init_args(),
                               bin_pack=False, name_prefix=prefix, use_gpu=False, device_name="cpu")
        self.workers = group.workers
        await self.launch_servers()

    async def launch_servers(self):
        settings = settings_from(self.config)
        server = ray.remote(MTPRolloutServer).options(
            name=server_name(self.replica_rank), num_cpus=0, max_concurrency=self.max_concurrency,
        ).remote(settings, str(getattr(self.model_config, "local_path", None) or self.model_config.path),
                 int(self.config.response_length))
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{NAME}://replica-{self.replica_rank}"


# ------------------------------------------------------------------------------ the weight adapter


class MTPRolloutAdapter(BaseRollout):
    """verl's server adapter for `mtp_rollout`, built by CheckpointEngineWorker beside each replica."""

    def __init__(self, config, model_config, device_mesh=None, *args, replica_rank: int = 0, **kwargs):
        super().__init__(config, model_config, device_mesh)
        self.replica_rank = replica_rank
        self.is_leader_rank = True

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: int | None = None,
                             **_kwargs) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"{NAME} takes full named tensors; checkpoint backend wire format {wire_format!r} "
                             "is not supported (use backend mtp_object_store)")
        if global_steps is None:
            raise ValueError(f"{NAME}: update_weights without global_steps; the policy version would be unknown")
        named = {}
        async for name, tensor in ensure_async_iterator(weights):
            for prefix in WRAPPER_PREFIXES:
                name = name.removeprefix(prefix)
            named[name] = tensor
        if not named:
            raise ValueError(f"{NAME}: the checkpoint engine delivered no weights (global_steps={global_steps})")
        server = ray.get_actor(server_name(self.replica_rank))
        await asyncio.wait_for(server.update_policy.remote(pack(named), int(global_steps)), SERVER_CALL_TIMEOUT_S)

    async def resume(self, tags: list[str]) -> None:
        """Weights and caches stay in our workers' memory: nothing to bring back."""

    async def release(self) -> None:
        """See resume."""


# ------------------------------------------------------------------------------ registration


def register() -> None:
    """Make `rollout.name: mtp_rollout` and the `mtp_object_store` checkpoint backend known to verl
    (idempotent; runs when the `verl.plugins` entry point imports this module)."""
    import rollout.integrations.verl_checkpoint  # noqa: F401  registers the backend

    RolloutReplicaRegistry.register(NAME, lambda: MTPRolloutReplica)
    verl_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.MTPRolloutAdapter"


register()
