"""A local Ray started by a driver stops with it, also after SIGKILL.

`ray.init()` starts gcs_server, raylet, the dashboard and runtime-env agents and the workers as
descendants of the driver; when the driver is killed they are re-parented and live on (the
agents even ignore SIGTERM). `start_guard()` spawns a small watcher in its own session that
records the driver's descendants every second (pid and start time, in
<tmp>/mtp-rollout-ray-<uid>/<driver pid>.json); once the driver is gone it sends SIGTERM to the
recorded processes that are still alive, SIGKILL after a grace period, and deletes the record.

If the watcher was killed too (e.g. the whole process group was), `mtp-rollout clean-ray` does
the same for every record whose driver is gone. Only processes this package recorded are ever
signalled: other Ray clusters on the machine are left alone.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

from rollout.fileio import atomic_write

GRACE_S = 3.0
START_ATTEMPTS = 2     # ray.init of a local Ray that still did not start
REGISTER_WAIT_S = 180.0   # how long a starting local raylet may take to register on a loaded machine

logger = logging.getLogger(__name__)


def records_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"mtp-rollout-ray-{os.getuid()}"


def _alive(pid: int, create_time: float) -> psutil.Process | None:
    """The process if `pid` still is the one that started at `create_time` (pids get recycled)."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.Error:
        return None


def stop_processes(recorded: dict[int, float], grace_s: float = GRACE_S) -> int:
    """SIGTERM, then SIGKILL after grace_s, the recorded (pid -> start time) processes still alive."""
    procs = [p for pid, ct in recorded.items() if (p := _alive(int(pid), ct)) is not None]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, survivors = psutil.wait_procs(procs, timeout=grace_s)
    for p in survivors:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(survivors, timeout=grace_s)
    return len(procs)


def _is_ray(p: psutil.Process) -> bool:
    """Ray's own processes only (gcs_server, raylet, agents, workers, its Python daemons)."""
    try:
        name = p.name()
        return (name in ("gcs_server", "raylet") or name.startswith("ray::")
                or any("/ray/" in part for part in p.cmdline()[:3]))
    except psutil.Error:
        return False


def watch(driver_pid: int, interval_s: float = 1.0) -> int:
    """Run by the guard process: follow the driver, clean up after it. Returns processes stopped."""
    try:
        driver = psutil.Process(driver_pid)
        driver_ct = driver.create_time()
    except psutil.Error:
        return 0
    records_dir().mkdir(parents=True, exist_ok=True)
    path = records_dir() / f"{driver_pid}.json"
    known: dict[int, float] = {}
    done = []
    signal.signal(signal.SIGUSR1, lambda *_: done.append(True))     # the driver shut Ray down itself
    while not done and _alive(driver_pid, driver_ct) is not None:
        try:
            kids = {p.pid: p.create_time() for p in driver.children(recursive=True) if _is_ray(p)}
        except psutil.Error:
            kids = {}
        if kids.keys() - known.keys():
            known.update(kids)
            atomic_write(path, json.dumps({"driver_pid": driver_pid, "driver_create_time": driver_ct,
                                           "processes": {str(k): v for k, v in known.items()}}))
        time.sleep(interval_s)
    stopped = stop_processes(known)
    path.unlink(missing_ok=True)
    return stopped


def start_guard() -> subprocess.Popen:
    """Start the watcher for this process (call before ray.init, so a kill during start-up is covered;
    `stop_guard` after ray.shutdown)."""
    return subprocess.Popen([sys.executable, "-m", "rollout.ray_guard", "--watch", str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


@contextmanager
def patient_node_registration(wait_s: float):
    """Ray gives a new local raylet a fixed 30 s to register with its GCS (ray._private.node), which an
    overloaded machine misses. While starting, the lookup it polls keeps retrying for up to wait_s."""
    from ray._private import services

    original = services.get_node
    if wait_s <= 0:
        yield
        return

    def get_node(*args, **kwargs):
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return original(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


def stop_ray_descendants() -> int:
    """Stop the Ray processes this process started (what a failed ray.init leaves behind)."""
    return stop_processes({p.pid: p.create_time() for p in psutil.Process().children(recursive=True) if _is_ray(p)})


def stop_guard(guard: subprocess.Popen, timeout: float = 15.0) -> None:
    """After a normal ray.shutdown(): the guard stops what is left of Ray, then exits."""
    if guard.poll() is None:
        guard.send_signal(signal.SIGUSR1)
        try:
            guard.wait(timeout)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait()


@contextmanager
def local_ray(address: str | None = None, **init_kwargs):
    """ray.init for a job, guarded when it starts a local Ray; shut down on exit. An already
    initialised Ray (a caller's, a test's) is used as is and left running."""
    import ray

    if ray.is_initialized():
        yield
        return
    guard = start_guard() if address is None else None
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                with patient_node_registration(REGISTER_WAIT_S if address is None else 0):
                    ray.init(address=address, include_dashboard=False, **init_kwargs)
                break
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a slow start
                if attempt == START_ATTEMPTS or address is not None or "timed out during startup" not in str(e):
                    raise
                # Ray waits a fixed 30 s for its raylet; on an overloaded machine that is not enough
                logger.warning("local Ray did not start in time (%s); stopping its processes, retrying", e)
                ray.shutdown()
                stop_ray_descendants()
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if guard is not None:
            stop_guard(guard)


def clean(grace_s: float = GRACE_S) -> tuple[int, int]:
    """Stop the recorded processes of every run whose driver is gone: (runs, processes)."""
    runs = stopped = 0
    for path in sorted(records_dir().glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if _alive(int(rec["driver_pid"]), float(rec["driver_create_time"])) is not None:
            continue                               # still running: its own guard cleans up
        runs += 1
        stopped += stop_processes({int(k): float(v) for k, v in rec["processes"].items()}, grace_s)
        path.unlink(missing_ok=True)
    return runs, stopped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtp-rollout clean-ray", description=__doc__.split("\n\n")[0])
    ap.add_argument("--watch", type=int, metavar="PID", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.watch is not None:
        watch(a.watch)
        return 0
    runs, stopped = clean()
    print(f"stopped {stopped} leftover Ray process(es) of {runs} ended run(s) (records in {records_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
