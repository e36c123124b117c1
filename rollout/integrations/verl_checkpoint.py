"""verl checkpoint backend `mtp_object_store`: trained weights to rollout replicas through Ray's object store.

verl's own backends move weights with NCCL / NIXL / HCCL between GPUs, or hand a generator over
inside one process (`naive`); none crosses processes on a CPU. This one does, and needs no
collective group, so it also serves disaggregated GPU runs whose rollout side is our replica:

- `build_topology` (in verl's CheckpointEngineManager process) starts one small mailbox actor per
  weight update and tells every worker its name and rank;
- the sender of rank 0 (verl's actor worker) packs the whole weight stream into one flat byte
  buffer (rollout.models.flat_weights), puts it into the object store once and posts the reference
  to the mailbox; the other trainer ranks drain their stream (FSDP gathers need every rank) and send nothing;
- each receiver (verl's CheckpointEngineWorker beside our replica) awaits the reference and yields
  the tensors to the server adapter's `update_weights`.

Select it with `actor_rollout_ref.rollout.checkpoint_engine.backend=mtp_object_store`.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from rollout.models.flat_weights import pack, unpack

BACKEND = "mtp_object_store"
RECEIVE_TIMEOUT_S = 600.0   # a receiver waits this long for the sender's weights, then fails naming the backend


class WeightMailbox:
    """One weight update's hand-over point: the sender posts an object reference, receivers await it."""

    def __init__(self):
        self._posted = asyncio.Event()
        self._refs: list = []

    async def post(self, refs: list) -> None:      # refs wrapped in a list so Ray does not resolve them
        self._refs = refs
        self._posted.set()

    async def fetch(self) -> list:
        await self._posted.wait()
        return self._refs


@CheckpointEngineRegistry.register(BACKEND)
class ObjectStoreCheckpointEngine(CheckpointEngine):
    """See the module docstring. One instance per verl worker (trainer ranks and rollout workers)."""

    _live_mailboxes: dict[str, Any] = {}     # in the manager's process: handles that keep mailboxes alive

    def __init__(self, bucket_size: int = 0, **_engine_kwargs):
        self.bucket_size = bucket_size        # unused: the object store takes the whole buffer at once
        self.rank: int | None = None
        self.mailbox: str | None = None

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        for handle in cls._live_mailboxes.values():   # the previous update's mailbox is done
            ray.kill(handle)
        cls._live_mailboxes.clear()
        name = f"mtp_weight_mailbox_{uuid.uuid4().hex[:12]}"
        cls._live_mailboxes[name] = ray.remote(WeightMailbox).options(name=name, num_cpus=0).remote()
        actor = {"rank": list(range(actor_wg_world_size)), "mailbox": [name] * actor_wg_world_size}
        rollout = {"rank": [actor_wg_world_size + i for i in range(rollout_world_size)],
                   "mailbox": [name] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, mailbox: str, **_kwargs) -> None:
        self.rank, self.mailbox = rank, mailbox

    def finalize(self) -> None:
        self.rank, self.mailbox = None, None

    def _mailbox(self):
        if self.mailbox is None:
            raise RuntimeError(f"checkpoint backend {BACKEND!r}: weights moved before init_process_group "
                               "(CheckpointEngineManager.update_weights sets it up)")
        return ray.get_actor(self.mailbox)

    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        named: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.rank == 0:
                named[name] = tensor.detach().to("cpu")
        if self.rank == 0:
            if not named:
                raise ValueError(f"checkpoint backend {BACKEND!r}: the trainer sent no weights")
            await self._mailbox().post.remote([ray.put(pack(named))])
        return {}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        try:
            (ref,) = await asyncio.wait_for(self._mailbox().fetch.remote(), RECEIVE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"checkpoint backend {BACKEND!r}: no weights from the trainer's rank 0 within "
                               f"{RECEIVE_TIMEOUT_S:g} s (global_steps={global_steps})") from None
        for name, tensor in unpack(await ref).items():
            yield name, tensor
