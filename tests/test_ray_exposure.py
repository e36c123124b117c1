"""What a local Ray of this package exposes and what clean-ray may touch: every listening socket of
a single-machine Ray is on loopback, every ray.init goes through the guard, the records folder is
this user's alone, and a recorded pid is only signalled while it is still our Ray process."""
from __future__ import annotations

import ast
import ipaddress
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from rollout import ray_guard

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "mtp_heads", "trainers", "experiments")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _label(p: psutil.Process) -> str:
    """gcs_server, raylet, ray::<what> or the Ray daemon's script (monitor.py, dashboard.py)."""
    cmd = p.cmdline()
    scripts = [os.path.basename(a) for a in cmd if a.endswith(".py")]
    return scripts[0] if scripts and not p.name().startswith("ray::") else p.name()


def _listeners() -> list[tuple[str, str, int]]:
    """(process, address, port) of every TCP listener and bound UDP socket of this process and its
    descendants."""
    me = psutil.Process()
    procs = {p.pid: p for p in me.children(recursive=True)}
    procs[me.pid] = me
    labels = {}
    for pid, p in procs.items():
        try:
            labels[pid] = _label(p)
        except psutil.Error:
            pass
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.pid in labels and c.laddr and (c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM):
            out.append((labels[c.pid], c.laddr.ip, c.laddr.port))
    return sorted(set(out))


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


# ------------------------------------------------------------------ ports


@pytest.mark.ray
def test_a_local_ray_listens_on_loopback_only(monkeypatch):
    """gRPC (GCS, raylet, workers, agents) and the Prometheus servers of the autoscaler monitor, the
    dashboard process and the dashboard agent: none on 0.0.0.0, :: or the machine's address."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # the monitor's and dashboard's metrics ports are fixed; another Ray on the machine may hold them
    monitor_port, dashboard_port = _free_port(), _free_port()
    monkeypatch.setenv("AUTOSCALER_METRIC_PORT", str(monitor_port))
    monkeypatch.setenv("DASHBOARD_METRIC_PORT", str(dashboard_port))
    monkeypatch.setenv("RAY_ADDRESS", "local")           # a new Ray, not a `ray start` cluster found on the machine
    with ray_guard.local_ray(num_cpus=1, log_to_driver=False):
        @ray.remote(num_cpus=0)
        class Echo:
            def pid(self):
                return os.getpid()

        actor = Echo.remote()
        ray.get(actor.pid.remote(), timeout=120)
        deadline = time.monotonic() + 60      # the Python daemons open their metrics servers last
        while True:
            found = _listeners()
            ports = {port for _, _, port in found}
            if {monitor_port, dashboard_port} <= ports or time.monotonic() > deadline:
                break
            time.sleep(1)
        ray.kill(actor)
    names = {name for name, _, _ in found}
    assert {"gcs_server", "raylet", "monitor.py", "dashboard.py", "ray::DashboardAgent"} <= names, found
    assert {monitor_port, dashboard_port} <= ports, found
    exposed = [(name, ip, port) for name, ip, port in found if not _loopback(ip)]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_every_ray_init_goes_through_the_guard():
    """A local Ray started anywhere in the package is guarded and bound to loopback: only
    rollout/ray_guard.py calls ray.init."""
    calls = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "init"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray"):
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls and all(c.startswith("rollout/ray_guard.py:") for c in calls), calls


# ------------------------------------------------------------------ Ray stops with a killed driver
# (used by the kill -9 tests of the Python API, tests/test_ray_runtime.py, and of trl-grpo, tests/test_trl.py)


def ray_processes(pid: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if ray_guard._is_ray(p)]
    except psutil.Error:
        return []


def kill9_leaves_no_ray(proc: subprocess.Popen, ready, timeout_s: float = 240, within_s: float = 30) -> None:
    """Wait until ready(ray processes of proc) (the driver's Ray is up and its actors started), let
    the guard record them, kill -9 the driver, and assert every Ray process it had is gone within
    within_s seconds (Ray alone leaves them running for minutes), and so is the guard's record.
    The driver is killed on every way out, a failed wait included."""
    try:
        deadline = time.monotonic() + timeout_s
        while not ready(ray_processes(proc.pid)):
            assert proc.poll() is None, f"the driver exited early: {proc.stdout.read() if proc.stdout else ''}"
            assert time.monotonic() < deadline, "the driver's Ray did not come up in time"
            time.sleep(0.2)
        time.sleep(2.5)                                       # the guard records every second
        procs = ray_processes(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(procs, timeout=within_s)
        try:
            assert not alive, f"Ray processes outlived the killed driver: {[(p.pid, p.name()) for p in alive]}"
            deadline = time.monotonic() + 10
            while (ray_guard.records_dir() / f"{proc.pid}.json").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not (ray_guard.records_dir() / f"{proc.pid}.json").exists()
        finally:
            for p in alive:
                p.kill()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def has_actor(prefix: str):
    """ready() for kill9_leaves_no_ray: an actor process whose title starts with prefix is up."""
    def ready(procs: list[psutil.Process]) -> bool:
        for p in procs:
            try:
                if p.name().startswith(prefix):
                    return True
            except psutil.Error:
                pass
        return False
    return ready


# ------------------------------------------------------------------ the records folder


def test_records_folder_is_created_private(tmp_path):
    path = ray_guard.secure_records_dir(tmp_path / "records")
    assert path.is_dir() and (path.stat().st_mode & 0o777) == 0o700
    (tmp_path / "old").mkdir(mode=0o755)                 # an older version's folder: only read access to take
    os.chmod(tmp_path / "old", 0o755)
    assert (ray_guard.secure_records_dir(tmp_path / "old").stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_clean_ray_refuses_a_records_folder_others_may_write(tmp_path, monkeypatch, mode):
    folder = tmp_path / "records"
    folder.mkdir()
    os.chmod(folder, mode)
    monkeypatch.setattr(ray_guard, "records_dir", lambda: folder)
    with pytest.raises(ValueError, match="writable by group or others"):
        ray_guard.clean()
    assert ray_guard.main([]) == 2
    with pytest.raises(ValueError, match="writable by group or others"):
        ray_guard.start_guard()                         # a run refuses it too, before Ray starts


def test_clean_ray_refuses_a_records_folder_of_another_user(tmp_path, monkeypatch):
    folder = tmp_path / "records"
    folder.mkdir(mode=0o700)
    real = os.getuid()
    monkeypatch.setattr(ray_guard.os, "getuid", lambda: real + 1)    # the folder now belongs to someone else
    with pytest.raises(ValueError, match=f"belongs to uid {real}"):
        ray_guard.secure_records_dir(folder)
    monkeypatch.setattr(ray_guard, "records_dir", lambda: folder)
    with pytest.raises(ValueError, match="not to this user"):
        ray_guard.clean()


def test_clean_ray_refuses_a_symlinked_records_folder(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "records").symlink_to(target)
    monkeypatch.setattr(ray_guard, "records_dir", lambda: tmp_path / "records")
    with pytest.raises(ValueError, match="not a directory"):
        ray_guard.clean()


# ------------------------------------------------------------------ what clean-ray signals


def _spawn(argv0: str | None) -> subprocess.Popen:
    """A sleeping process; argv0 'ray::...' makes it look like a Ray worker (as setproctitle does)."""
    cmd = f"exec -a {argv0} sleep 120" if argv0 else "exec sleep 120"
    proc = subprocess.Popen(["bash", "-c", cmd])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:                    # until bash has exec'd sleep
        try:
            if psutil.Process(proc.pid).name() == "sleep":
                break
        except psutil.Error:
            pass
        time.sleep(0.02)
    return proc


def test_clean_ray_skips_recorded_pids_that_are_not_our_ray_processes(tmp_path, monkeypatch):
    """A dead driver's record lists: a Ray worker (stopped), a process that is no Ray process (left
    alone), and a Ray worker whose start time differs from the record (a recycled pid: left alone)."""
    folder = tmp_path / "records"
    monkeypatch.setattr(ray_guard, "records_dir", lambda: folder)
    ray_guard.secure_records_dir()
    worker, stranger, recycled = _spawn("ray::RolloutWorker"), _spawn(None), _spawn("ray::IDLE")
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        ct = {p.pid: psutil.Process(p.pid).create_time() for p in (worker, stranger, recycled)}
        ct[recycled.pid] -= 5.0
        (folder / f"{dead.pid}.json").write_text(json.dumps(
            {"driver_pid": dead.pid, "driver_create_time": 1.0, "processes": {str(k): v for k, v in ct.items()}}))
        assert ray_guard.clean(grace_s=2) == (1, 1)
        assert worker.wait(timeout=10) is not None
        assert stranger.poll() is None and recycled.poll() is None
        assert not (folder / f"{dead.pid}.json").exists()
    finally:
        for p in (worker, stranger, recycled):
            p.kill()
            p.wait()


def test_is_ray_knows_rays_own_processes_only():
    me = psutil.Process()
    assert not ray_guard._is_ray(me)                      # pytest: not Ray, even with ray imported
    fake = _spawn("ray::IDLE")
    try:
        assert ray_guard._is_ray(psutil.Process(fake.pid))
    finally:
        fake.kill()
        fake.wait()
