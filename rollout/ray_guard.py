"""A local Ray started by a driver stops with it, also after SIGKILL, and listens on loopback only.

`ray.init()` starts gcs_server, raylet, the dashboard and runtime-env agents and the workers as
descendants of the driver; when the driver is killed they are re-parented and live on (the
agents even ignore SIGTERM). `start_guard()` spawns a small watcher in its own session that
records the driver's descendants every second (pid and start time, in
<tmp>/mtp-rollout-ray-<uid>/<driver pid>.json, a folder only this user may use); once the driver is
gone it sends SIGTERM to the recorded processes that are still alive, SIGKILL after a grace period,
and deletes the record.

If the watcher was killed too (e.g. the whole process group was), `mtp-rollout clean-ray` does
the same for every record whose driver is gone. A recorded pid is only signalled while it still is
the recorded Ray process of this user (same start time, same uid, a Ray binary or `ray::` process):
other Ray clusters and recycled pids on the machine are left alone.

A local Ray started here takes 127.0.0.1 as its node address (`loopback_node_ip`): its gRPC servers,
agents and Prometheus metrics servers then bind to loopback instead of every interface. A Ray
reached through an address (a cluster) is joined as it is.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from pathlib import Path

import psutil

from rollout.fileio import atomic_write

GRACE_S = 3.0
START_ATTEMPTS = 2     # ray.init of a local Ray that still did not start
REGISTER_WAIT_S = 180.0   # how long a starting local raylet may take to register on a loaded machine
LOOPBACK = "127.0.0.1"
RAY_BINARIES = ("gcs_server", "raylet")

logger = logging.getLogger(__name__)


def records_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"mtp-rollout-ray-{os.getuid()}"


def secure_records_dir(path: Path | None = None) -> Path:
    """The records folder, created 0700. A folder anyone else could have written records into (owned
    by another user, a symlink, writable by group or others) is refused: clean-ray signals the pids
    listed there. Read access alone (older versions made it 0755) is taken away."""
    path = records_dir() if path is None else Path(path)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"Ray records folder {path} is not a directory (a symlink or a file); "
                         "refusing to use it: remove it")
    if st.st_uid != os.getuid():
        raise ValueError(f"Ray records folder {path} belongs to uid {st.st_uid}, not to this user "
                         f"(uid {os.getuid()}); refusing to use it: have it removed")
    if st.st_mode & 0o022:
        raise ValueError(f"Ray records folder {path} is writable by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); refusing to use it: remove it")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
        logger.info("Ray records folder %s: mode %o -> 700", path, stat.S_IMODE(st.st_mode))
    return path


def _alive(pid: int, create_time: float) -> psutil.Process | None:
    """The process if `pid` still is the one that started at `create_time` (pids get recycled)."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.Error:
        return None


@lru_cache(maxsize=1)
def _ray_package_dir() -> str | None:
    spec = importlib.util.find_spec("ray")
    return os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else None


def _is_ray(p: psutil.Process) -> bool:
    """Ray's own processes only: gcs_server, raylet, `ray::` workers and agents, and the Python
    daemons run from the ray package (dashboard, monitor, log monitor)."""
    try:
        name, cmd = p.name(), p.cmdline()
    except psutil.Error:
        return False
    ray_dir = _ray_package_dir()
    return (name in RAY_BINARIES or name.startswith("ray::") or bool(cmd and cmd[0].startswith("ray::"))
            or (ray_dir is not None and any(part.startswith(ray_dir) for part in cmd[:3])))


def _ours(pid: int, create_time: float) -> psutil.Process | None:
    """The process if it still is the recorded one (start time) and a Ray process of this user."""
    p = _alive(pid, create_time)
    try:
        if p is None or p.uids().real != os.getuid() or not _is_ray(p):
            return None
    except psutil.Error:
        return None
    return p


def stop_processes(recorded: dict[int, float], grace_s: float = GRACE_S) -> int:
    """SIGTERM, then SIGKILL after grace_s, the recorded (pid -> start time) processes that still are
    Ray processes of this user; anything else under a recorded pid is left alone."""
    procs = [p for pid, ct in recorded.items() if (p := _ours(int(pid), float(ct))) is not None]
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


def watch(driver_pid: int, interval_s: float = 1.0) -> int:
    """Run by the guard process: follow the driver, clean up after it. Returns processes stopped."""
    try:
        driver = psutil.Process(driver_pid)
        driver_ct = driver.create_time()
        path = secure_records_dir() / f"{driver_pid}.json"
    except (psutil.Error, ValueError, OSError):
        return 0
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
    `stop_guard` after ray.shutdown). An unsafe records folder is refused here, in the driver."""
    secure_records_dir()
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


@contextmanager
def loopback_node_ip():
    """While a local Ray starts, its node address is 127.0.0.1. ray.init turns an explicit
    127.0.0.1 (`_node_ip_address`) back into the routable address; only Ray's single-machine mode
    (the one it uses on macOS and Windows, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) keeps loopback.
    With it, the gRPC servers of the GCS, raylet and workers, the dashboard and runtime-env agents,
    and the Prometheus servers of the autoscaler monitor, dashboard and agent all bind 127.0.0.1
    (tests/test_ray_exposure.py measures it)."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def starts_local_ray(address: str | None) -> bool:
    """True when ray.init(address) starts a new Ray on this machine, False when it joins one (an
    address, RAY_ADDRESS, or a cluster `ray start` left running here)."""
    if address not in (None, "local"):
        return False
    from ray._private import services
    return services.canonicalize_bootstrap_address(address) is None


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


class GuardedRay:
    """A Ray this process initialised (see init_ray); shutdown() stops it and its guard."""

    def __init__(self, guard: subprocess.Popen | None, local: bool):
        self.guard = guard
        self.local = local            # started here (loopback, guarded) rather than joined

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.guard is not None:
            stop_guard(self.guard)
            self.guard = None


def init_ray(address: str | None = None, **init_kwargs) -> GuardedRay | None:
    """ray.init for every caller of this package. A local Ray is guarded (stopped with this process,
    even after SIGKILL), listens on loopback only and gets more time to start on a loaded machine;
    a cluster address is joined as is. None when Ray is already initialised (a caller's or a test's:
    used as is and left running)."""
    import ray

    if ray.is_initialized():
        return None
    local = starts_local_ray(address)
    guard = start_guard() if local else None
    if local:
        init_kwargs.setdefault("dashboard_host", LOOPBACK)
        # Ray starts its workers at niceness 15 and the driver keeps 0: the rollout workers, on the RL
        # step's path as much as the trainer in the driver, lost the CPU to it. Workers keep the driver's
        # priority; the co-trainer lowers its own (rollout.cotrainer_client).
        init_kwargs["_system_config"] = {"worker_niceness": 0, **init_kwargs.get("_system_config", {})}
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                with patient_node_registration(REGISTER_WAIT_S if local else 0), \
                        (loopback_node_ip() if local else nullcontext()):
                    ray.init(address=address, include_dashboard=False, **init_kwargs)
                break
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a slow start
                if attempt == START_ATTEMPTS or not local or "timed out during startup" not in str(e):
                    raise
                # Ray waits a fixed 30 s for its raylet; on an overloaded machine that is not enough
                logger.warning("local Ray did not start in time (%s); stopping its processes, retrying", e)
                ray.shutdown()
                stop_ray_descendants()
    except BaseException:
        GuardedRay(guard, local).shutdown()
        raise
    return GuardedRay(guard, local)


@contextmanager
def local_ray(address: str | None = None, **init_kwargs):
    """init_ray for a job, shut down on exit (a Ray that was already initialised is left running)."""
    handle = init_ray(address, **init_kwargs)
    try:
        yield
    finally:
        if handle is not None:
            handle.shutdown()


def _read_record(path: Path) -> dict | None:
    """A record file this user wrote, parsed; None (and deleted when it is ours) otherwise."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            logger.warning("skipping %s: not a regular file of this user", path)
            return None
        rec = json.loads(path.read_text())
        return {"driver_pid": int(rec["driver_pid"]), "driver_create_time": float(rec["driver_create_time"]),
                "processes": {int(k): float(v) for k, v in rec["processes"].items()}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        path.unlink(missing_ok=True)
        return None


def clean(grace_s: float = GRACE_S) -> tuple[int, int]:
    """Stop the recorded Ray processes of every run whose driver is gone: (runs, processes).
    ValueError for a records folder another user could have written to."""
    runs = stopped = 0
    for path in sorted(secure_records_dir(records_dir()).glob("*.json")):
        rec = _read_record(path)
        if rec is None:
            continue
        if _alive(rec["driver_pid"], rec["driver_create_time"]) is not None:
            continue                               # still running: its own guard cleans up
        runs += 1
        stopped += stop_processes(rec["processes"], grace_s)
        path.unlink(missing_ok=True)
    return runs, stopped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtp-rollout clean-ray", description=__doc__.split("\n\n")[0])
    ap.add_argument("--watch", type=int, metavar="PID", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.watch is not None:
        watch(a.watch)
        return 0
    try:
        runs, stopped = clean()
    except ValueError as e:
        print(f"mtp-rollout clean-ray: {e}", file=sys.stderr)
        return 2
    print(f"stopped {stopped} leftover Ray process(es) of {runs} ended run(s) (records in {records_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
