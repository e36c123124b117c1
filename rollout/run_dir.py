"""One run per directory: an exclusive lock on out_dir, writable-path checks, and readers of the
run's own files that name the file when it is damaged.

    with RunLock(out_dir):        # refuses a second live run; takes over a crashed run's lock
        ...

The lock is `flock` on <out_dir>/.lock, so the kernel drops it when the holder dies (even by
SIGKILL): a lock file that still names a pid is only a record of a crash, and the next run takes
it over with a message. The file is never deleted (deleting a flock'ed file races with a second
process that already opened it).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class RunDirBusy(ValueError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """Exclusive, process-lifetime lock on a run directory (creates the directory)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._fd: int | None = None
        self.took_over: dict | None = None      # the crashed holder's record, when a stale lock was taken

    def acquire(self) -> "RunLock":
        check_writable(self.out_dir, "out_dir")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise _busy(self.out_dir, holder) from None
        stale = _read_holder(fd)
        if stale:
            self.took_over = stale
            msg = (f"out_dir {self.out_dir}: taking over the lock of pid {stale.get('pid')} "
                   f"(started {stale.get('started')}), which ended without releasing it (crash or kill)")
            logger.warning(msg)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the holder record (a clean exit leaves nothing stale) and unlock."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_not_busy(out_dir: str | os.PathLike) -> None:
    """Raise RunDirBusy now if a live process holds out_dir's lock; creates and writes nothing, so
    checks that run before a job takes its lock can refuse a busy directory first."""
    path = Path(out_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return                          # no lock file (or none readable): acquire() decides
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        raise _busy(Path(out_dir), _read_holder(fd)) from None
    finally:
        os.close(fd)


def _busy(out_dir: Path, holder: dict) -> RunDirBusy:
    who = f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder \
        else "another process"
    return RunDirBusy(f"out_dir {out_dir} is in use by {who}: one run per directory. "
                      "Wait for it to finish, or pass another out_dir=...")


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"pid": "?", "started": "?", "raw": raw[:200]}


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """Fail now, naming `what`, if files cannot be created at `path` (a directory that may not
    exist yet): long work should not end in a failed save. Probes with a real file, so read-only
    mounts are caught even for root."""
    path = Path(path).expanduser()
    probe_dir = path
    while not probe_dir.exists():
        if probe_dir.parent == probe_dir:
            break
        probe_dir = probe_dir.parent
    if probe_dir.exists() and not probe_dir.is_dir():
        raise ValueError(f"{what} {path} is not writable: {probe_dir} is a file, not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ValueError(f"{what} {path} is not writable ({probe_dir}: {e.strerror or e}); "
                         f"choose a writable location") from None
    return path


# ------------------------------------------------------------------------------ the run's files


def read_json(path: str | os.PathLike, what: str = "file") -> dict:
    """A JSON file, with errors that name it (truncated or corrupt files happen after crashes)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path} is not valid JSON ({e}); it may be truncated by a crash: "
                         "delete it, or restart the run in a new out_dir") from None


def read_jsonl(path: str | os.PathLike, *, allow_partial_tail: bool = True) -> list[dict]:
    """Records of a JSONL log; a truncated last line (crash mid-write) is dropped, any other bad
    line is corruption and raises ValueError naming file and line."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if allow_partial_tail and i == len(lines) - 1:      # no newline after it: an interrupted write
                logger.warning("%s:%d: dropping a truncated last line", path, i + 1)
                break
            raise ValueError(f"{path}:{i + 1}: corrupt record ({e}); the log is damaged: restart the run "
                             "in a new out_dir, or resume=true to cut it back to the last checkpoint") from None
    return out


def truncate_to(path: str | os.PathLike, size: int) -> None:
    """Cut a log back to `size` bytes (its length at the last checkpoint); a missing file is created."""
    path = Path(path)
    with open(path, "a+b") as f:
        have = f.seek(0, os.SEEK_END)
        if have < size:
            raise ValueError(f"{path} is {have} bytes, shorter than the {size} bytes it had at the last "
                             "checkpoint: the log was cut or replaced; cannot resume into this out_dir")
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())
