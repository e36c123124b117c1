"""Checkpoints of the async RL job, so that `mtp-rollout run out_dir=... resume=true` continues a
killed or interrupted run from its last checkpoint with every step logged exactly once.

    <out_dir>/checkpoints/step-000004/
        trainer.pt            trained policy tensors after step 4 (version 5), the tensors of version 4
                              (which generate step 5's rollouts, one step off-policy), AdamW state
        heads.pt              the heads the workers ran and their version
        cotrainer.pt          the head co-trainer's state (heads, optimizer, refresh policy, replay), if any
        monitor_state.json    the monitor's cumulative histograms after step 4
        state.json            written last: step, versions, and the byte length of monitor.jsonl and
                              rl.jsonl after step 4 (resume cuts them back to it)

A directory without state.json is an unfinished write and is ignored; each file is written to
a temporary name and renamed into place, and older checkpoints are deleted only after a newer
one is complete, so a crash at any moment leaves a complete checkpoint (or none).
"""
from __future__ import annotations

import io
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_heads.cotrainer import HEADS_NAME, STATE_NAME
from rollout.fileio import atomic_write
from rollout.run_dir import read_json, truncate_to

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE = "state.json"
LOGS = ("monitor.jsonl", "rl.jsonl")           # append-only logs, cut back to the checkpoint on resume
MONITOR_STATE = "monitor_state.json"
COTRAINER_FILES = (HEADS_NAME, str(Path(HEADS_NAME).with_suffix(".json")), STATE_NAME)
FORMAT = 1


def _own_storage(obj):
    """Tensors unpacked from one flat weight buffer (rollout.models.flat_weights) are views of one byte storage
    with different dtypes, which torch.save refuses: give each its own storage."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _own_storage(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_own_storage(v) for v in obj)
    return obj


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(_own_storage(obj), buf)
    return buf.getvalue()


@dataclass
class Checkpoint:
    """A complete checkpoint directory and its state.json."""

    path: Path
    step: int                  # last completed RL step
    policy_version: int        # of the trained policy after that step (= step + 1)
    head_version: int
    log_bytes: dict[str, int]

    def load(self, name: str):
        path = self.path / name
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged file
            raise ValueError(f"checkpoint file {path} is unreadable ({type(e).__name__}: {e}); delete "
                             f"{self.path} to resume from an earlier checkpoint") from None


def save_checkpoint(run_dir: Path, step: int, *, trained: dict, previous: dict, optimizer: dict,
                    heads: dict, head_version: int, cotrainer: dict | None) -> Checkpoint:
    """Write step `step`'s checkpoint (see module docstring), then delete the older ones."""
    root = run_dir / CHECKPOINTS
    path = root / f"step-{step:06d}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    atomic_write(path / "trainer.pt", _torch_bytes({"trained": trained, "previous": previous,
                                                     "optimizer": optimizer}))
    atomic_write(path / "heads.pt", _torch_bytes({"heads": heads, "head_version": head_version}))
    if cotrainer is not None:
        atomic_write(path / "cotrainer.pt", _torch_bytes(cotrainer))
    if (run_dir / MONITOR_STATE).exists():
        atomic_write(path / MONITOR_STATE, (run_dir / MONITOR_STATE).read_bytes())
    logs = {name: (run_dir / name).stat().st_size if (run_dir / name).exists() else 0 for name in LOGS}
    state = {"format": FORMAT, "step": step, "policy_version": step + 1, "head_version": head_version,
             "log_bytes": logs, "time": time.time()}
    atomic_write(path / STATE, json.dumps(state, indent=1) + "\n")      # commits the checkpoint
    for old in root.iterdir():
        if old != path and old.name.startswith("step-"):
            shutil.rmtree(old, ignore_errors=True)
    return Checkpoint(path, step, step + 1, head_version, logs)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint (unfinished directories are ignored)."""
    root = run_dir / CHECKPOINTS
    done = sorted(p for p in root.glob("step-*") if (p / STATE).is_file()) if root.is_dir() else []
    if not done:
        return None
    s = read_json(done[-1] / STATE, "checkpoint state")
    try:
        return Checkpoint(done[-1], int(s["step"]), int(s["policy_version"]), int(s["head_version"]),
                          {k: int(v) for k, v in s["log_bytes"].items()})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint state {done[-1] / STATE} is incomplete ({e!r}); delete {done[-1]} "
                         "to resume from an earlier checkpoint") from None


def rewind_run_dir(run_dir: Path, ckpt: Checkpoint | None, cotrainer_dir: str | None) -> None:
    """Put the run's files back to the checkpoint: logs cut to their length then, the monitor's
    state restored, the co-trainer's own checkpoint files removed (the resumed co-trainer is given
    the checkpoint's state and rewrites them). No checkpoint: back to an empty run."""
    for name in LOGS:
        truncate_to(run_dir / name, ckpt.log_bytes.get(name, 0) if ckpt else 0)
    saved = ckpt.path / MONITOR_STATE if ckpt else None
    if saved is not None and saved.exists():
        atomic_write(run_dir / MONITOR_STATE, saved.read_bytes())
    else:
        (run_dir / MONITOR_STATE).unlink(missing_ok=True)
    if cotrainer_dir:
        for name in COTRAINER_FILES:
            (Path(cotrainer_dir) / name).unlink(missing_ok=True)
    for stale in ("summary.csv",):     # rewritten from the cut logs
        (run_dir / stale).unlink(missing_ok=True)
