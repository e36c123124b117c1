"""Crash-safe file writes shared by every part that leaves files behind (checkpoints, monitor
CSV/PNG/state, resolved configs, reports).

A reader (a resuming run, a dashboard, a co-trainer restart) must see either the old file or
the new one, never half of one: the bytes go to a temporary file in the same directory, are
fsync'ed, and os.replace moves them into place (atomic on POSIX and Windows within one
filesystem). The directory entry is fsync'ed too where the platform allows it, so the rename
survives a power cut.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` (str is UTF-8 encoded) to `path` atomically; returns the path.

    Parent directories are created. The temporary file is removed if anything fails.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    # os.open with 0o666 honours the umask (mkstemp would make the file private to its writer)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(target.parent)
    return target


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself; not supported on every platform/filesystem (then a no-op)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks (checkpoints and stores run to gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
