"""Safe runs and clear errors: one run per out_dir, checks before any work, resume after
kill -9, Ray stopped with its driver, errors that name the bad input, CLI exit codes."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from experiments import cli
from trainers.run_state import latest_checkpoint
from rollout import ray_guard
from rollout.run_dir import RunDirBusy, RunLock, check_writable, read_json, read_jsonl
from rollout.types import SamplingParams, validate_request

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs/smoke.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.cli", *args], cwd=ROOT, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("mtp-rollout ")]


# ------------------------------------------------------------------ bad config: refused before any file or Ray

BAD_RUN_OVERRIDES = [
    ("sampling.top_p=0", "sampling.top_p"),
    ("sampling.num_draft_tokens=-1", "sampling.num_draft_tokens"),
    ("sampling.max_new_tokens=100000", "sampling.max_new_tokens"),
    ("sampling.max_new_tokens=1.5", "sampling.max_new_tokens"),
    ("sampling.top_k=2.5", "sampling.top_k"),
    ("sampling.temperature.start=nan", "sampling.temperature.start"),
    ("sampling.top_p=nan", "sampling.top_p"),
    ("grpo.lr=inf", "grpo.lr"),
    ("sampling.temperature=1", "sampling.temperature"),
    ("heads=path", "heads=<the checkpoint path itself>"),          # retired spellings name the new one
    ("heads=pretrained", "heads=shipped"),
    ("heads=/nonexistent/heads.safetensors", "heads"),
    ("accelerator.heads=shipped", "accelerator.heads"),            # it follows heads; set alone it conflicts
    ("tasks.datasets=[chain_summ]", "chain_sum"),                  # the closest registered names
    ("tasks.params.chain_sum.max_terms=0", "tasks.params.chain_sum"),   # reasoning-gym's own check, named
    ("tasks.weights=[1,2,3]", "tasks.weights"),                    # smoke.yaml lists 2 datasets
    ("tasks.num_prompts=0", "tasks.num_prompts"),
    ("tasks.source=tests.custom_tasks:missing", "tasks.source"),  # imported and called before any file
    ("tasks.source=tests.custom_tasks", "tasks.source"),
    ("accelerator.cotrainer.loss=mse", "cotrainer.loss='mse'"),     # was first seen by the co-trainer actor
]


@pytest.mark.parametrize("override,key", BAD_RUN_OVERRIDES, ids=[o for o, _ in BAD_RUN_OVERRIDES])
def test_bad_run_config_is_refused_before_any_file_or_ray(tmp_path, capsys, monkeypatch, override, key):
    import ray

    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(1) or pytest.fail("Ray started before the check"))
    out = tmp_path / "run"
    assert cli.main(["run", SMOKE, f"out_dir={out}", "progress=false", override]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and key in lines[0], lines
    assert not out.exists()                                        # nothing written, not even the lock
    assert not started and not ray.is_initialized()


def test_generate_refuses_bad_sampling_flags_before_loading(capsys):
    for flags, name in ((["--temperature", "nan"], "--temperature"), (["--top-p", "0"], "--top-p"),
                        (["--k", "-1"], "--k"), (["--max-new-tokens", "0"], "--max-new-tokens")):
        assert cli.main(["generate", "--model", "/nonexistent-model", *flags]) == 2
        lines = error_lines(capsys.readouterr().err)
        assert len(lines) == 1 and name in lines[0], lines


def test_generate_flags_are_aliases_of_config_keys():
    from experiments.generate import DEFAULT_PROMPTS, GenerateJobConfig, load_generate_config
    cfg, _ = load_generate_config(["--prompt", "What is the capital of France?", "--temperature", "0"])
    assert cfg.prompts == ["What is the capital of France?"] and cfg.temperature == 0.0
    assert cfg.heads == "shipped" and cfg.num_draft_tokens == 3            # configs/generate.yaml
    cfg, _ = load_generate_config(["--k", "2", "--prompt", "a: b", "--prompt", "c", "--top-p=0.9", "--heads", "init",
                                   "--num-depths", "2", "--draft-mode", "greedy", "max_new_tokens=5"])
    assert (cfg.num_draft_tokens, cfg.prompts, cfg.top_p, cfg.heads, cfg.num_depths, cfg.draft_mode,
            cfg.max_new_tokens) == (2, ["a: b", "c"], 0.9, "init", 2, "greedy", 5)
    assert load_generate_config([])[0] == GenerateJobConfig() and DEFAULT_PROMPTS
    with pytest.raises(ValueError, match="heads=pretrained is no longer accepted.*flag --heads"):
        load_generate_config(["--heads", "pretrained"])
    with pytest.raises(ValueError, match="unknown flag --kk"):
        load_generate_config(["--kk", "2"])


# ------------------------------------------------------------------ one run per out_dir


def test_second_run_on_a_locked_out_dir_is_refused_and_mixes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rollout.run_dir import RunLock; "
                               "RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)",
                               str(out)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert cli.main(["run", SMOKE, f"out_dir={out}", "progress=false"]) == 2
        line = error_lines(capsys.readouterr().err)[0]
        assert f"pid {holder.pid}" in line and "one run per directory" in line
        assert {p.name for p in out.iterdir()} == {".lock"}
        with pytest.raises(RunDirBusy):
            RunLock(out).acquire()
    finally:
        holder.kill()                                  # a crash: the kernel drops the flock
        holder.wait()
    lock = RunLock(out).acquire()                      # the stale lock is taken over, saying whose it was
    assert lock.took_over["pid"] == holder.pid
    lock.release()
    with RunLock(out) as again:                        # a clean release leaves nothing stale
        assert again.took_over is None


def test_run_lock_is_exclusive_within_one_process(tmp_path):
    with RunLock(tmp_path / "r"):
        with pytest.raises(RunDirBusy, match="one run per directory"):
            RunLock(tmp_path / "r").acquire()


def test_resume_needs_a_run_and_the_same_config(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", SMOKE, f"out_dir={out}", "resume=true"]) == 2
    assert "holds no run to resume" in error_lines(capsys.readouterr().err)[0]
    from rollout.config_loader import write_resolved
    from trainers.config import load_run_config
    write_resolved(load_run_config([SMOKE, f"out_dir={out}"])[1], out)      # as a run that crashed at once
    assert cli.main(["run", SMOKE, f"out_dir={out}", "resume=true", "grpo.lr=0.5"]) == 2
    line = error_lines(capsys.readouterr().err)[0]
    assert "grpo.lr: 0.001 -> 0.5" in line


# ------------------------------------------------------------------ writable paths, checked first


def test_unwritable_paths_fail_before_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_writable(blocker / "sub", "cache")
    env_cache = str(blocker / "cache")
    old = os.environ.get("MTP_ROLLOUT_CACHE")
    os.environ["MTP_ROLLOUT_CACHE"] = env_cache
    try:   # heads=shipped for a model without shipped heads: the missing cached file is named before loading
        assert cli.main(["run", SMOKE, f"out_dir={tmp_path / 'r'}", "heads=shipped"]) == 2
        line = error_lines(capsys.readouterr().err)[0]
        assert "heads=shipped" in line and "heads.safetensors is missing" in line, line
        # model=/nonexistent: had either run got as far as loading the model, the error would name that path
        assert cli.main(["train-heads", "model=/nonexistent", f"out_dir={blocker / 'h'}"]) == 2
        assert "out_dir" in error_lines(capsys.readouterr().err)[0]
        assert cli.main(["train-heads", "model=/nonexistent", f"out_dir={tmp_path / 'heads'}"]) == 2
        assert "the cache ($MTP_ROLLOUT_CACHE)" in error_lines(capsys.readouterr().err)[0]
    finally:
        if old is None:
            os.environ.pop("MTP_ROLLOUT_CACHE")
        else:
            os.environ["MTP_ROLLOUT_CACHE"] = old
    with pytest.raises(ValueError, match="out_dir"):
        RunLock(blocker / "run").acquire()


# ------------------------------------------------------------------ damaged files are named


def test_damaged_run_files_and_heads_are_named(tmp_path):
    from mtp_heads.checkpoint import read_meta
    from rollout.monitor import AcceptanceMonitor, MonitorConfig

    state = tmp_path / "monitor_state.json"
    state.write_text('{"step": 3, "all": {"wid')
    with pytest.raises(ValueError, match="monitor_state.json"):
        read_json(state, "monitor state")
    (tmp_path / "monitor.jsonl").write_text('{"step": 0, "event": "x", "detail": {}, "time": 0}\n')
    with pytest.raises(ValueError, match="monitor_state.json"):
        AcceptanceMonitor(MonitorConfig(out_dir=str(tmp_path), tensorboard=False, plots=False))
    rl = tmp_path / "rl.jsonl"
    rl.write_text('{"step": 0}\n{"step": 1, "rew\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"rl.jsonl:2: corrupt"):
        read_jsonl(rl)
    rl.write_text('{"step": 0}\n{"step": 1, "rew')             # a crash mid-write: the tail is dropped
    assert read_jsonl(rl) == [{"step": 0}]
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(os.urandom(256))
    with pytest.raises(ValueError, match="garbage.safetensors"):
        read_meta(garbage)
    from safetensors.torch import save_file
    bad_header = tmp_path / "bad_header.safetensors"
    save_file({"x": torch.zeros(2)}, str(bad_header), metadata={"mtp_rollout_heads": "{not json"})
    with pytest.raises(ValueError, match="bad_header.safetensors.*not valid JSON"):
        read_meta(bad_header)


# ------------------------------------------------------------------ inputs at the engine boundary


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", 8.0), ("max_new_tokens", True), ("num_draft_tokens", 2.0), ("top_k", 5.0),
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")), ("seed", 1.5),
    ("temperature", "1.0"), ("top_p", None),
])
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("prompts,words", [
    ([[5.7, 6.2]], "position 0: token ids must be integers, got 5.7"),
    ([[5, True]], "position 1: token ids must be integers, got True"),
    ([["5", 6]], "got '5'"),
    ([[5, None]], "got None"),
    (["hello"], "tokenize text first"),
    ([None], "prompt 0 must be a sequence"),
    ([torch.tensor([[1, 2]])], "1-D"),
    ([torch.tensor([1.0, 2.0])], "integer token ids, got dtype torch.float32"),
    (torch.tensor([[1, 2]]), "prompts must be a list"),
    ([[1, 2], [3, 99]], "prompt 1 has token ids outside the vocabulary"),
])
def test_token_ids_must_be_integers(prompts, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate_request(prompts, SamplingParams(max_new_tokens=4), vocab_size=64, context_length=64,
                         has_heads=False)


def test_integer_tensors_and_numpy_ids_are_accepted():
    validate_request([torch.tensor([1, 2, 3]), np.array([4, 5], dtype=np.int32), [np.int64(7), 8]],
                     SamplingParams(max_new_tokens=4), vocab_size=64, context_length=64, has_heads=False)


# ------------------------------------------------------------------ the CLI's exit codes


def _fake_command(monkeypatch, main):
    module = types.ModuleType("fake_job")
    module.main = main
    monkeypatch.setitem(sys.modules, "fake_job", module)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_job", "test"))


def test_cli_exit_codes_one_line_errors_and_debug(monkeypatch, capsys):
    _fake_command(monkeypatch, lambda argv: {"report": 1})          # train-heads returns its report
    assert cli.main(["fake"]) == 0

    def bad(argv):
        raise ValueError("sampling.top_p must be in (0, 1],\ngot 0")
    _fake_command(monkeypatch, bad)
    assert cli.main(["fake"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("mtp-rollout fake: error: sampling.top_p must be in (0, 1], got 0 "
                           "[--debug shows the traceback]")
    assert cli.main(["--debug", "fake"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err

    def broken(argv):
        raise RuntimeError("boom")
    _fake_command(monkeypatch, broken)
    assert cli.main(["fake"]) == 1
    assert "failed (RuntimeError): boom" in capsys.readouterr().err
    assert cli.main(["no-such-command"]) == 2


# ------------------------------------------------------------------ clean-ray


def test_clean_ray_stops_recorded_processes_of_dead_drivers_only(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_guard, "records_dir", lambda: tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    from tests.test_ray_exposure import _spawn
    orphan = _spawn("ray::IDLE")         # looks like a Ray worker: clean-ray stops only those
    kept = _spawn("ray::IDLE")
    try:
        ct = psutil.Process(orphan.pid).create_time()
        (tmp_path / f"{dead.pid}.json").write_text(json.dumps(
            {"driver_pid": dead.pid, "driver_create_time": 1.0, "processes": {str(orphan.pid): ct}}))
        me = psutil.Process()
        (tmp_path / f"{me.pid}.json").write_text(json.dumps(      # a live driver: left alone
            {"driver_pid": me.pid, "driver_create_time": me.create_time(),
             "processes": {str(kept.pid): psutil.Process(kept.pid).create_time()}}))
        assert ray_guard.clean(grace_s=2) == (1, 1)
        assert orphan.wait(timeout=10) is not None
        assert kept.poll() is None
        assert not (tmp_path / f"{dead.pid}.json").exists() and (tmp_path / f"{me.pid}.json").exists()
    finally:
        for p in (orphan, kept):
            p.kill()
            p.wait()


# ------------------------------------------------------------------ co-trainer state for run checkpoints


def test_cotrainer_state_roundtrip_continues_identically(tmp_path):
    """state() -> load_state() on a fresh co-trainer: the next refresh gives bitwise the same heads
    as the original's (optimizer moments, refresh policy, replay and RNG all carried)."""
    from mtp_heads.heads import init_heads
    from rollout.models.decoder import random_model
    from rollout.models.flat_weights import pack
    from tests.conftest import tiny_config
    from mtp_heads.cotrainer import CoTrainerConfig, HeadCoTrainer
    from mtp_heads.drafters import DrafterSpec
    from mtp_heads.refresh import StepObservation

    policy = random_model(tiny_config(), seed=0)
    heads = init_heads(policy, num_depths=2, seed=0)
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(2, 64, (5,), generator=gen).tolist(), torch.randint(2, 64, (12,), generator=gen).tolist())
            for _ in range(8)]

    def fresh(d):
        cfg = CoTrainerConfig(refresh=("every_n_steps",), every_n_steps=1, steps_per_refresh=3, batch_tokens=40,
                              lr=3e-3, checkpoint_dir=str(tmp_path / d))
        return HeadCoTrainer(cfg, policy.config, pack(policy.state_dict()), 0, pack(heads.state_dict()),
                             DrafterSpec(2), 0)

    a = fresh("a")
    a.add_rollouts(seqs)
    for step in range(3):
        a.observe(StepObservation(step, 1.0, 0.5, a.head_version))
    b = fresh("b")
    b.load_state(a.state())
    assert b.head_version == a.head_version == 2 and len(b.replay) == len(a.replay)
    assert (tmp_path / "b" / "heads_latest.safetensors").exists()    # a later restart resumes from it too
    ra, rb = (t.observe(StepObservation(3, 1.0, 0.5, t.head_version)) for t in (a, b))
    assert ra.refreshed and rb.refreshed and ra.losses == rb.losses
    for k, v in a.heads.state_dict().items():
        assert torch.equal(v, b.heads.state_dict()[k]), k


# ------------------------------------------------------------------ a co-trainer gone for good (slow)


@pytest.mark.slow
@pytest.mark.ray
def test_a_run_whose_cotrainer_is_gone_for_good_says_so_and_fails_unless_allowed(tmp_path, capsys, monkeypatch):
    """The co-trainer is killed at step 1 with no restart left: the run still makes every step (the
    rollouts go on with the last heads), then says so and exits 1; cotrainer_required=false: exit 0."""
    import ray
    from rollout.accelerator import RolloutAccelerator
    from rollout.ray_guard import local_ray

    end_step = RolloutAccelerator.end_step

    def killing_end_step(self, step, extra=None):
        if step == 1 and self.cotrainer is not None:
            ray.kill(self.cotrainer, no_restart=True)
        return end_step(self, step, extra)

    monkeypatch.setattr(RolloutAccelerator, "end_step", killing_end_step)
    args = [SMOKE, "progress=false", "steps=4", "accelerator.cotrainer.max_restarts=0"]
    threads = torch.get_num_threads()
    with local_ray(num_cpus=2, log_to_driver=False):
        assert cli.main(["run", *args, f"out_dir={tmp_path / 'a'}"]) == 1
        out, err = capsys.readouterr()
        assert "head co-trainer: gone since step" in out and "max_restarts=0" in out, (out, err[-3000:])
        line = error_lines(err)[-1]
        assert "failed (CoTrainerLost)" in line and "cotrainer_required=false" in line, line
        assert [r["step"] for r in read_jsonl(tmp_path / "a" / "rl.jsonl")] == [0, 1, 2, 3]
        events = [r["event"] for r in read_jsonl(tmp_path / "a" / "monitor.jsonl") if "event" in r]
        assert "cotrainer_failed" in events and "cotrainer_restarted" not in events

        assert cli.main(["run", *args, f"out_dir={tmp_path / 'b'}", "cotrainer_required=false"]) == 0
        assert "head co-trainer: gone since step" in capsys.readouterr().out
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ kill -9, resume, Ray cleanup (slow)


def _steps(run_dir: Path) -> tuple[list[int], list[int], list[int]]:
    rl = read_jsonl(run_dir / "rl.jsonl")
    mon = [r for r in read_jsonl(run_dir / "monitor.jsonl") if "event" not in r]
    return [r["step"] for r in rl], [r["policy_version"] for r in rl], [r["step"] for r in mon]


@pytest.mark.slow
@pytest.mark.ray
def test_kill9_mid_run_then_resume_gives_every_step_once(tmp_path):
    # refresh=never keeps the heads fixed and fixed draft lengths keep drafting off measured round times
    # (docs/reliability.md, "What is reproducible"), so both runs must end with bitwise the same policy
    steps = 8
    args = [SMOKE, "progress=false", f"steps={steps}", "checkpoint_every=2", "accelerator.cotrainer.refresh=[never]",
            "accelerator.workers.draft_lengths=fixed"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "run", *args, f"out_dir={killed}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 1500   # a hang guard only: a loaded 2-core machine took minutes to start Ray
    ray_procs = []
    while True:     # kill once step 2 is logged: usually the checkpoint is after step 1 and step 2 is redone
        rl = killed / "rl.jsonl"
        if rl.exists() and len(rl.read_text().splitlines()) >= 3:
            break
        assert proc.poll() is None, f"the run ended early: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        # listed before the kill, not between the poll and the kill: a smoke step takes well under a second
        # now, and listing the processes there once let the run reach its last checkpoint first
        ray_procs = [p for p in psutil.Process(proc.pid).children(recursive=True) if ray_guard._is_ray(p)]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    assert any(p.name() == "raylet" for p in ray_procs)
    proc.wait()
    _, alive = psutil.wait_procs(ray_procs, timeout=60)        # the guard stops the driver's local Ray
    assert not alive, f"Ray processes outlived the killed driver: {[(p.pid, p.name()) for p in alive]}"
    # a fast machine may finish step 3 and its checkpoint between the poll and the kill: resume must
    # start from whichever checkpoint is on disk, and the run must not have ended yet
    ckpt = latest_checkpoint(killed)
    assert ckpt is not None and ckpt.step < steps - 1, ckpt

    refused = run_cli("run", *args, f"out_dir={killed}")      # no silent restart into a run directory
    assert refused.returncode == 2 and "resume=true" in error_lines(refused.stderr)[0]
    resumed = run_cli("run", f"out_dir={killed}", "resume=true", "progress=false")   # config.yaml of the run
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"after step {ckpt.step}" in resumed.stdout

    straight = tmp_path / "straight"
    done = run_cli("run", *args, f"out_dir={straight}")
    assert done.returncode == 0, done.stderr[-3000:]

    for run_dir in (killed, straight):
        rl_steps, versions, mon_steps = _steps(run_dir)
        assert rl_steps == list(range(steps)) and mon_steps == list(range(steps))   # each step exactly once
        assert versions == list(range(1, steps + 1))
    mon = {d: [(r["policy_version_min"], r["policy_version_max"])
               for r in read_jsonl(d / "monitor.jsonl") if "event" not in r] for d in (killed, straight)}
    assert mon[killed] == mon[straight] == [(0, 0)] + [(v, v) for v in range(steps - 1)]
    final = {d: json.loads((latest_checkpoint(d).path / "state.json").read_text()) for d in (killed, straight)}
    assert final[killed]["policy_version"] == final[straight]["policy_version"] == steps
    assert final[killed]["step"] == steps - 1
    weights = {d: torch.load(latest_checkpoint(d).path / "trainer.pt", weights_only=True) for d in (killed, straight)}
    for part in ("trained", "previous"):
        for name, t in weights[straight][part].items():
            assert torch.equal(weights[killed][part][name], t), (part, name)
    assert not math.isnan(read_jsonl(killed / "rl.jsonl")[-1]["reward"])


# ------------------------------------------------------------------ the README contract


def _bash_blocks(text: str) -> list[str]:
    parts = text.split("```bash\n")[1:]
    return [p.split("```")[0].strip() for p in parts]


def test_ci_runs_the_readme_quick_start_commands_as_written():
    quick = (ROOT / "README.md").read_text().split("## Quick start")[1].split("\n## ")[0]
    setup, test = _bash_blocks(quick)[:2]
    assert setup.endswith(" && mtp-rollout run") and "vllm" in setup and "uninstall -y" in setup
    ci = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    assert setup.removesuffix(" && mtp-rollout run") in ci
    assert test in ci and ci.index(test) > ci.index(setup.removesuffix(" && mtp-rollout run"))
    assert test == "python -m pytest -q tests"


def test_checkpoint_saves_heads_unpacked_from_one_flat_buffer(tmp_path):
    """Published heads arrive as views of one byte buffer with different dtypes (bf16 weights, int64
    draft vocabulary); the run checkpoint must save and restore them exactly."""
    from trainers.run_state import latest_checkpoint, save_checkpoint
    from rollout.models.flat_weights import pack, unpack

    heads = unpack(pack({"w": torch.randn(4, 3).to(torch.bfloat16), "draft_vocab": torch.arange(5)}))
    save_checkpoint(tmp_path, 0, trained={}, previous={}, optimizer={}, heads=heads, head_version=2, cotrainer=None)
    saved = latest_checkpoint(tmp_path).load("heads.pt")
    assert saved["head_version"] == 2
    assert all(torch.equal(saved["heads"][k], v) and saved["heads"][k].dtype == v.dtype for k, v in heads.items())
