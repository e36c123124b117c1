"""What a non-editable install carries: the wheel built from this checkout holds every package,
the job configs (found by name through rollout.config_loader.packaged_config), the shipped heads
and their card, and the `mtp-rollout` command; configs resolve from the installed copy, not the
checkout. Builds one wheel (no dependencies, ~10 s) and unpacks it; nothing is installed."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (path,) = out.glob("mtp_rollout-*.whl")
    return path


def test_the_wheel_carries_packages_configs_heads_and_the_command(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in ("rollout", "mtp_heads", "trainers", "experiments", "configs"):
        assert f"{pkg}/__init__.py" in names, pkg
    yamls = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert yamls and {f"configs/{y}" for y in yamls} <= names
    assert "mtp_heads/default_heads/smollm2-135m.safetensors" in names
    assert "mtp_heads/default_heads/smollm2-135m.md" in names
    for name in ("smollm2-135m-eagle3/config.json", "smollm2-135m-eagle3/model.safetensors", "smollm2-135m-eagle3.md"):
        assert f"mtp_heads/default_heads/{name}" in names, name
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "mtp-rollout = experiments.cli:main" in text
    assert not any(n.startswith("tests/") for n in names)


def test_configs_resolve_from_the_unpacked_wheel_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import rollout, rollout.config_loader as c; "
            "print(rollout.__version__); print(c.CONFIGS_DIR); print(c.packaged_config('async_rl'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
                         capture_output=True, text=True, check=True).stdout.split("\n")
    import rollout
    assert out[0] == rollout.__version__
    assert Path(out[1]) == site / "configs" and Path(out[2]).is_file() and Path(out[2]).parent == site / "configs"
