"""Checkpoints of the async RL job, so that `mtp-rollout run out_dir=... resume=true` continues a
killed or interrupted run from its last intact checkpoint with every step logged exactly once.

    <out_dir>/checkpoints/step-000004/
        trainer.pt            trained policy tensors after step 4 (version 5), the tensors of version 4
                              (which generate step 5's rollouts, one step off-policy), AdamW state
        heads.pt              the heads the workers ran and their version (an EAGLE-3 drafter: its version)
        eagle3/               an EAGLE-3 drafter the workers ran, in vLLM's layout (config.json, model.safetensors)
        cotrainer.pt          the head co-trainer's state (heads, optimizer, refresh policy, replay), if any
        monitor_state.json    the monitor's cumulative histograms after step 4
        state.json            written last: step, versions, the byte length of monitor.jsonl and
                              rl.jsonl after step 4 (resume cuts them back to it), and the size and
                              sha256 of every file above

A directory without state.json is an unfinished write. Each file is written to a temporary name
and renamed into place, the new checkpoint is read back and checked against its sha256 sums, and
only then are checkpoints beyond the newest `keep` deleted: a crash, or a file damaged later, at
any moment leaves an intact older checkpoint to fall back to (resume_checkpoint names what it skips).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from mtp_heads.cotrainer import remove_checkpoint
from mtp_heads.drafters import DrafterSpec, drafter_from_flat
from mtp_heads.eagle3_checkpoint import WEIGHTS_FILE, eagle3_files, read_config
from mtp_heads.eagle3_drafter import Eagle3Heads
from mtp_heads.heads import MTPHeads
from rollout.fileio import atomic_write
from rollout.models.config import ModelConfig
from rollout.models.flat_weights import own_storage, pack
from rollout.run_dir import truncate_to

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE = "state.json"
LOGS = ("monitor.jsonl", "rl.jsonl")           # append-only logs, cut back to the checkpoint on resume
MONITOR_STATE = "monitor_state.json"
FORMAT = 2                                    # 1: no file sums (checked by loading the files)
REQUIRED = ("trainer.pt", "heads.pt")
EAGLE3_DIR = "eagle3"                         # an EAGLE-3 drafter's directory in a checkpoint



def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(own_storage(obj), buf)
    return buf.getvalue()


@dataclass
class Checkpoint:
    """A complete checkpoint directory and its state.json."""

    path: Path
    step: int                  # last completed RL step
    policy_version: int        # of the trained policy after that step (= step + 1)
    head_version: int
    log_bytes: dict[str, int]

    def heads(self, policy_config: ModelConfig, num_depths: int, dtype: str = "float32") -> MTPHeads | Eagle3Heads:
        """The drafter the workers ran at this checkpoint: MTP heads of `num_depths` depths from heads.pt,
        or the EAGLE-3 drafter of its directory (checked against the policy like any EAGLE-3 directory)."""
        saved = self.load("heads.pt")
        if EAGLE3_DIR in saved:
            where = self.path / saved[EAGLE3_DIR]
            spec, tensors = DrafterSpec(eagle3_config=read_config(where)), _load_safetensors(where / WEIGHTS_FILE)
        else:
            spec, tensors, where = DrafterSpec(num_depths=num_depths), saved["heads"], self.path / "heads.pt"
        return drafter_from_flat(policy_config, spec, pack(tensors), dtype, where=str(where))

    def load(self, name: str):
        path = self.path / name
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged file
            raise ValueError(f"checkpoint file {path} is unreadable ({type(e).__name__}: {e})") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def heads_files(heads: dict, head_version: int, drafter: DrafterSpec) -> dict[str, bytes]:
    """heads.pt, and for an EAGLE-3 drafter its directory in vLLM's layout, which alone holds its weights
    (a resumed run, vLLM or `heads=<checkpoint>/eagle3` load it as it is)."""
    if drafter.kind == "mtp":
        return {"heads.pt": _torch_bytes({"heads": heads, "head_version": head_version})}
    files = eagle3_files(drafter.eagle3_config, heads)
    return {"heads.pt": _torch_bytes({"head_version": head_version, EAGLE3_DIR: EAGLE3_DIR}),
            **{f"{EAGLE3_DIR}/{name}": data for name, data in files.items()}}


def _load_safetensors(path: Path) -> dict:
    """A checkpoint's safetensors file; a damaged one is an error naming it."""
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise ValueError(f"checkpoint file {path} is unreadable ({type(e).__name__}: {e})") from None


def save_checkpoint(run_dir: Path, step: int, *, trained: dict, previous: dict, optimizer: dict,
                    heads: dict, head_version: int, cotrainer: dict | None, keep: int = 2,
                    drafter: DrafterSpec = DrafterSpec()) -> Checkpoint:
    """Write step `step`'s checkpoint (see module docstring), verify it, then delete all but the
    newest `keep` (and any left from steps after this one by an earlier, rewound attempt). `drafter`
    says what `heads` holds (accel.drafter_spec): MTP heads' tensors or an EAGLE-3 drafter's."""
    if keep < 1:
        raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
    root = run_dir / CHECKPOINTS
    path = root / f"step-{step:06d}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    contents = {"trainer.pt": _torch_bytes({"trained": trained, "previous": previous, "optimizer": optimizer}),
                **heads_files(heads, head_version, drafter)}
    if cotrainer is not None:
        contents["cotrainer.pt"] = _torch_bytes(cotrainer)
    if (run_dir / MONITOR_STATE).exists():
        contents[MONITOR_STATE] = (run_dir / MONITOR_STATE).read_bytes()
    for name, data in contents.items():
        atomic_write(path / name, data)
    files = {name: {"bytes": len(data), "sha256": _sha256(data)} for name, data in contents.items()}
    logs = {name: (run_dir / name).stat().st_size if (run_dir / name).exists() else 0 for name in LOGS}
    state = {"format": FORMAT, "step": step, "policy_version": step + 1, "head_version": head_version,
             "log_bytes": logs, "files": files, "time": time.time()}
    atomic_write(path / STATE, json.dumps(state, indent=1) + "\n")      # commits the checkpoint
    ckpt, problem = check_checkpoint(path)
    if ckpt is None:
        raise RuntimeError(f"checkpoint {path} does not read back as written ({problem}); the older "
                           "checkpoints are kept")
    _prune(root, step, keep)
    return ckpt


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix("step-"))
    except ValueError:
        return None


def _prune(root: Path, step: int, keep: int) -> None:
    """Delete unfinished checkpoints, those after `step` and all but the newest `keep` up to it."""
    kept = 0
    for old in sorted((p for p in root.glob("step-*") if _step_of(p) is not None), key=_step_of, reverse=True):
        if _step_of(old) <= step and (old / STATE).is_file() and kept < keep:
            kept += 1
        else:
            shutil.rmtree(old, ignore_errors=True)


def check_checkpoint(path: Path) -> tuple[Checkpoint | None, str]:
    """(the checkpoint, "") if `path` is complete and every file is as written, else (None, why not)."""
    if not (path / STATE).is_file():
        return None, "unfinished (no state.json: stopped while it was written)"
    try:
        s = json.loads((path / STATE).read_text(encoding="utf-8"))
        ckpt = Checkpoint(path, int(s["step"]), int(s["policy_version"]), int(s["head_version"]),
                          {k: int(v) for k, v in s["log_bytes"].items()})
        files = s.get("files")
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        return None, f"state.json is damaged ({type(e).__name__}: {e})"
    if files is None:                                   # format 1: no sums; the files must at least load
        for name in REQUIRED + ("cotrainer.pt",):
            if name in REQUIRED and not (path / name).is_file():
                return None, f"{name} is missing"
            try:
                ckpt.load(name)
            except ValueError as e:
                return None, str(e)
        return ckpt, ""
    for name in REQUIRED:
        if name not in files:
            return None, f"state.json lists no {name}"
    for name, want in files.items():
        try:
            data = (path / name).read_bytes()
        except FileNotFoundError:
            return None, f"{name} is missing"
        except OSError as e:
            return None, f"{name} is unreadable ({e.strerror or e})"
        if len(data) != want.get("bytes"):
            return None, f"{name} is {len(data)} bytes, {want.get('bytes')} were written"
        if _sha256(data) != want.get("sha256"):
            return None, f"{name} does not match its sha256 (damaged after it was written)"
    return ckpt, ""


def resume_checkpoint(run_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest intact checkpoint whose logs the run still has, and one line per newer
    checkpoint directory skipped, saying why (resume names them; rewind_run_dir deletes them)."""
    root = run_dir / CHECKPOINTS
    paths = sorted((p for p in root.glob("step-*") if p.is_dir() and _step_of(p) is not None), key=_step_of,
                   reverse=True) if root.is_dir() else []
    skipped = []
    for path in paths:
        ckpt, problem = check_checkpoint(path)
        if ckpt is not None:
            short = [f"{name} is {size} bytes, shorter than the {ckpt.log_bytes[name]} it had then"
                     for name in LOGS if (size := _size(run_dir / name)) < ckpt.log_bytes.get(name, 0)]
            if not short:
                return ckpt, skipped
            problem = "; ".join(short)
        skipped.append(f"{path.relative_to(run_dir)}: {problem}")
    return None, skipped


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest intact checkpoint (see resume_checkpoint), or None."""
    return resume_checkpoint(run_dir)[0]


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def steps_after(run_dir: Path, ckpt: Checkpoint | None) -> list[int]:
    """The RL steps logged after `ckpt` (all of them without one): what resuming from it cuts and redoes."""
    steps = set()
    for name in LOGS:
        path = run_dir / name
        if not path.exists():
            continue
        with open(path, "rb") as f:
            f.seek(ckpt.log_bytes.get(name, 0) if ckpt else 0)
            tail = f.read()
        for line in tail.decode("utf-8", "replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue                                # a line cut by the kill
            if isinstance(rec, dict) and "event" not in rec and isinstance(rec.get("step"), int):
                steps.add(rec["step"])
    return sorted(steps)


def rewind_run_dir(run_dir: Path, ckpt: Checkpoint | None, cotrainer_dir: str | None) -> list[int]:
    """Put the run's files back to the checkpoint: logs cut to their length then, the monitor's
    state restored, the co-trainer's own checkpoint files removed (the resumed co-trainer is given
    the checkpoint's state and rewrites them), checkpoint directories after it (skipped ones)
    deleted. No checkpoint: back to an empty run. Returns the logged steps it cut (steps_after)."""
    dropped = steps_after(run_dir, ckpt)
    root = run_dir / CHECKPOINTS
    for later in root.glob("step-*") if root.is_dir() else []:
        if ckpt is None or (later != ckpt.path and (_step_of(later) is None or _step_of(later) > ckpt.step)):
            shutil.rmtree(later, ignore_errors=True)
    for name in LOGS:
        truncate_to(run_dir / name, ckpt.log_bytes.get(name, 0) if ckpt else 0)
    saved = ckpt.path / MONITOR_STATE if ckpt else None
    if saved is not None and saved.exists():
        atomic_write(run_dir / MONITOR_STATE, saved.read_bytes())
    else:
        (run_dir / MONITOR_STATE).unlink(missing_ok=True)
    if cotrainer_dir:
        remove_checkpoint(cotrainer_dir)
    for stale in ("summary.csv",):     # rewritten from the cut logs
        (run_dir / stale).unlink(missing_ok=True)
    return dropped
