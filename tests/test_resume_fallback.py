"""Resume never loses a run to one damaged file: the newest `keep_checkpoints` checkpoints are kept,
each verified by its sha256 sums, resume falls back to the newest intact one naming what it skipped
and why, and says which logged steps it cuts. A run directory that is moved or copied resumes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments import cli
from experiments.async_rl import with_default_config
from rollout.config_loader import write_resolved
from rollout.ray_guard import records_dir
from rollout.run_dir import read_jsonl
from tests.test_safe_runs import ENV, ROOT, SMOKE, _steps, error_lines, run_cli
from trainers.config import load_run_config, run_dir_relative
from trainers.run_state import (CHECKPOINTS, check_checkpoint, latest_checkpoint, resume_checkpoint,
                                rewind_run_dir, save_checkpoint)


def _save(run_dir: Path, step: int, keep: int = 2):
    """A checkpoint after `step` with rl.jsonl holding steps 0..step, as the driver leaves it."""
    with open(run_dir / "rl.jsonl", "a", encoding="utf-8") as log:
        log.write(json.dumps({"step": step, "policy_version": step + 1, "train": {"entropy": 1.0},
                              "reward_by_domain": {"chain_sum": 0.5}, "rollout_entropy_by_domain": {"chain_sum": 1.0}})
                  + "\n")
    return save_checkpoint(run_dir, step, trained={"w": torch.full((3,), float(step))}, previous={}, optimizer={},
                           heads={"h": torch.zeros(2)}, head_version=step, cotrainer=None, keep=keep)


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / CHECKPOINTS).iterdir())


def test_the_newest_checkpoints_are_kept_and_a_damaged_one_is_skipped_naming_why(tmp_path):
    for step in range(4):
        _save(tmp_path, step)
    assert _names(tmp_path) == ["step-000002", "step-000003"]            # keep_checkpoints=2 by default
    newest = tmp_path / CHECKPOINTS / "step-000003" / "trainer.pt"
    newest.write_bytes(newest.read_bytes()[:100])                        # cut short, as by a full disk or a kill
    ckpt, skipped = resume_checkpoint(tmp_path)
    assert ckpt.step == 2 and latest_checkpoint(tmp_path).step == 2
    assert len(skipped) == 1 and skipped[0].startswith("checkpoints/step-000003: trainer.pt is 100 bytes")
    assert ckpt.load("trainer.pt")["trained"]["w"].tolist() == [2.0] * 3


@pytest.mark.parametrize("damage,why", [
    (lambda d: (d / "heads.pt").write_bytes(os.urandom((d / "heads.pt").stat().st_size)), "heads.pt does not match"),
    (lambda d: (d / "state.json").write_text('{"step": 3, "pol'), "state.json is damaged"),
    (lambda d: (d / "state.json").unlink(), "unfinished (no state.json"),
    (lambda d: (d / "trainer.pt").unlink(), "trainer.pt is missing"),
])
def test_every_kind_of_damage_falls_back_to_the_previous_checkpoint(tmp_path, damage, why):
    for step in range(4):
        _save(tmp_path, step)
    damage(tmp_path / CHECKPOINTS / "step-000003")
    ckpt, skipped = resume_checkpoint(tmp_path)
    assert ckpt.step == 2 and len(skipped) == 1 and why in skipped[0], skipped


def test_a_checkpoint_whose_logs_were_cut_is_skipped(tmp_path):
    for step in range(3):
        _save(tmp_path, step)
    rl = tmp_path / "rl.jsonl"
    rl.write_bytes(rl.read_bytes()[:-5])
    ckpt, skipped = resume_checkpoint(tmp_path)
    assert ckpt.step == 1 and "rl.jsonl is" in skipped[0] and "shorter" in skipped[0]


def test_keep_one_keeps_only_the_newest_and_a_rewound_runs_later_checkpoints_go(tmp_path):
    for step in range(3):
        _save(tmp_path, step, keep=1)
    assert _names(tmp_path) == ["step-000002"]
    for step in range(3, 6):
        _save(tmp_path, step, keep=3)
    assert _names(tmp_path) == ["step-000003", "step-000004", "step-000005"]
    third, _ = check_checkpoint(tmp_path / CHECKPOINTS / "step-000003")
    dropped = rewind_run_dir(tmp_path, third, None)
    assert dropped == [4, 5] and _names(tmp_path) == ["step-000003"]
    assert [r["step"] for r in read_jsonl(tmp_path / "rl.jsonl")] == [0, 1, 2, 3]


def test_rewinding_to_no_checkpoint_reports_every_logged_step(tmp_path):
    for step in range(3):
        _save(tmp_path, step)
    for path in (tmp_path / CHECKPOINTS).iterdir():
        (path / "state.json").write_text("not json")
    ckpt, skipped = resume_checkpoint(tmp_path)
    assert ckpt is None and len(skipped) == 2
    assert rewind_run_dir(tmp_path, None, None) == [0, 1, 2]
    assert (tmp_path / "rl.jsonl").read_text() == "" and _names(tmp_path) == []


# ------------------------------------------------------------------ a moved or copied run directory


def test_config_yaml_keeps_paths_inside_the_run_dir_relative_to_it(tmp_path):
    _, resolved = load_run_config([SMOKE, f"out_dir={tmp_path / 'a'}"])
    text = run_dir_relative(resolved)
    assert "checkpoint_dir: ${out_dir}/cotrainer" in text and str(tmp_path / "a") + "/" not in text
    write_resolved(text, tmp_path / "b")
    cfg, _ = load_run_config(with_default_config([f"out_dir={tmp_path / 'b'}", "resume=true"]))
    assert cfg.accelerator.cotrainer.checkpoint_dir == f"{tmp_path / 'b'}/cotrainer"
    assert cfg.accelerator.monitor.out_dir == str(tmp_path / "b")


def test_a_moved_run_dir_resumes_in_its_new_place(tmp_path, capsys, monkeypatch):
    """config.yaml as written before paths were stored relative (absolute paths inside the old
    out_dir) still resumes: those paths follow the directory. A finished run resumes to 'done'."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a finished run needs no Ray"))
    old, new = tmp_path / "old", tmp_path / "new"
    write_resolved(load_run_config([SMOKE, f"out_dir={old}", "steps=2"])[1], old)
    for step in range(2):
        _save(old, step)
    shutil.move(old, new)
    assert cli.main(["run", f"out_dir={new}", "resume=true", "progress=false"]) == 0, capsys.readouterr().err
    assert "all 2 steps are done" in capsys.readouterr().out
    cfg, _ = load_run_config(with_default_config([f"out_dir={new}", "resume=true"]))
    assert cfg.accelerator.cotrainer.checkpoint_dir == f"{new}/cotrainer" and not old.exists()
    assert cli.main(["run", f"out_dir={new}", "resume=true", "grpo.lr=0.5"]) == 2     # other changes: refused
    assert "grpo.lr: 0.001 -> 0.5" in error_lines(capsys.readouterr().err)[0]


# ------------------------------------------------------------------ kill -9, a damaged checkpoint, a move (slow)


@pytest.mark.slow
@pytest.mark.ray
def test_kill9_then_damaged_last_checkpoint_falls_back_and_the_moved_run_completes(tmp_path):
    steps = 8
    killed, moved = tmp_path / "killed", tmp_path / "moved"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "run", SMOKE, "progress=false", f"steps={steps}",
                             "checkpoint_every=1", f"out_dir={killed}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900      # a hang guard only
    while not ((killed / "rl.jsonl").exists() and len((killed / "rl.jsonl").read_text().splitlines()) >= 4):
        assert proc.poll() is None, f"the run ended early: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # The run's Ray workers outlive the driver until its guard stops them (a poll and a grace period);
    # until then they may still write into the old folder, so the move waits for the guard.
    record = records_dir() / f"{proc.pid}.json"
    while record.exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    newest = latest_checkpoint(killed)
    assert newest is not None and newest.step < steps - 1
    done = sorted(p for p in (killed / CHECKPOINTS).iterdir() if (p / "state.json").is_file())
    assert len(done) >= 2 and done[-1] == newest.path                   # the previous one was kept
    (newest.path / "trainer.pt").write_bytes(b"\0" * 64)                # damaged after the kill
    fallback = int(done[-2].name.removeprefix("step-"))
    logged = set(_steps(killed)[0]) | set(_steps(killed)[2])             # a step may be in monitor.jsonl only
    cut = sorted(s for s in logged if s > fallback)
    shutil.move(killed, moved)

    resumed = run_cli("run", f"out_dir={moved}", "resume=true", "progress=false")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"after step {fallback} (checkpoints/{done[-2].name})" in resumed.stdout, resumed.stdout
    assert f"skipped checkpoint checkpoints/{newest.path.name}: trainer.pt is 64 bytes" in resumed.stdout
    assert len(cut) >= 1 and f"cut {len(cut)} logged step" in resumed.stdout, resumed.stdout
    rl_steps, versions, mon_steps = _steps(moved)
    assert rl_steps == mon_steps == list(range(steps)) and versions == list(range(1, steps + 1))
    assert not killed.exists()                                          # nothing went back to the old place
    assert latest_checkpoint(moved).step == steps - 1 and len(_names(moved)) == 2
