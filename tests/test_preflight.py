"""`mtp-rollout run` checks its input before any work: bad co-trainer values, heads that do not fit
the model and unwritable paths exit 2 with one line naming the key and value, before Ray starts,
before the model loads where the check needs no model, and with nothing written to out_dir."""
from __future__ import annotations

import pytest
import torch

from experiments import async_rl, cli
from mtp_heads.checkpoint import HeadMeta, save_heads
from mtp_heads.heads import init_heads
from rollout.models.decoder import random_model
from tests.conftest import tiny_config
from tests.test_safe_runs import SMOKE, error_lines
from trainers.rl_policy import TINY_RANDOM


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started before the check"))
    yield
    assert not ray.is_initialized()


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(async_rl, "load_rl_policy", lambda *a, **k: pytest.fail("the model loaded before the check"))


def refused(capsys, out, *overrides) -> str:
    """The run's exit status is 2 with one error line, and out_dir was not even created."""
    assert cli.main(["run", SMOKE, f"out_dir={out}", "progress=false", *overrides]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    return lines[0]


COTRAINER_VALUES = [
    ("accelerator.cotrainer.loss=mse", "cotrainer.loss='mse'"),
    ("accelerator.cotrainer.lr=-1", "cotrainer.lr must be > 0, got -1"),
    ("accelerator.cotrainer.every_n_steps=0", "cotrainer.every_n_steps must be >= 1, got 0"),
    ("accelerator.cotrainer.entropy_delta=-0.5", "cotrainer.entropy_delta must be > 0 nats, got -0.5"),
    ("accelerator.cotrainer.acceptance_epsilon=2", "cotrainer.acceptance_epsilon must be in (0, 1), got 2"),
    ("accelerator.cotrainer.steps_per_refresh=0", "cotrainer.steps_per_refresh must be >= 1, got 0"),
    ("accelerator.cotrainer.temperature=0", "cotrainer.temperature must be > 0, got 0"),
    ("accelerator.cotrainer.refresh=[]", "cotrainer.refresh is empty"),
]


@pytest.mark.parametrize("override,words", COTRAINER_VALUES, ids=[o for o, _ in COTRAINER_VALUES])
def test_cotrainer_values_are_refused_before_ray(tmp_path, capsys, no_ray, no_model, override, words):
    """The co-trainer actor used to be the first to look at these: it died after Ray started."""
    line = refused(capsys, tmp_path / "run", override)
    assert words in line, line


def _heads_file(path, config, num_depths: int):
    heads = init_heads(random_model(config, seed=0), num_depths=num_depths, seed=0)
    save_heads(path, heads, HeadMeta.for_heads(heads, loss="tv"))
    return path


def test_heads_of_another_model_are_refused_before_ray_and_before_any_file(tmp_path, capsys, no_ray):
    other = _heads_file(tmp_path / "other_model.safetensors", tiny_config(), num_depths=2)   # smoke: 2 depths
    line = refused(capsys, tmp_path / "run", f"heads={other}")
    assert f"heads={other}" in line and "fingerprint" in line, line


def test_heads_of_another_depth_are_refused_before_the_model_loads(tmp_path, capsys, no_ray, no_model):
    one_depth = _heads_file(tmp_path / "d1.safetensors", TINY_RANDOM, num_depths=1)
    line = refused(capsys, tmp_path / "run", f"heads={one_depth}")
    assert f"heads={one_depth}" in line and "accelerator.num_depths=2" in line, line


def test_a_damaged_heads_file_is_named_with_its_key(tmp_path, capsys, no_ray, no_model):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\0" * 64)
    line = refused(capsys, tmp_path / "run", f"heads={bad}")
    assert line.count(f"heads={bad}") == 1 and "not a readable head checkpoint" in line, line


@pytest.mark.parametrize("key", ["out_dir", "accelerator.cotrainer.checkpoint_dir", "accelerator.monitor.out_dir"])
def test_unwritable_run_paths_are_refused_before_any_work(tmp_path, capsys, no_ray, no_model, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "run" if key == "out_dir" else tmp_path / "run"
    line = refused(capsys, out, f"{key}={blocker / 'sub'}")
    assert f"{key} {blocker / 'sub'} is not writable" in line, line


def test_an_unwritable_model_cache_is_refused_before_out_dir_is_made(tmp_path, capsys, monkeypatch, no_ray, no_model):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(blocker / "cache"))
    line = refused(capsys, tmp_path / "run", "accelerator.model=smollm2-135m", "accelerator.num_depths=1")
    assert "$MTP_ROLLOUT_CACHE" in line and str(blocker / "cache") in line, line


def test_keep_checkpoints_must_keep_one(tmp_path, capsys, no_ray, no_model):
    line = refused(capsys, tmp_path / "run", "keep_checkpoints=0")
    assert "keep_checkpoints must be >= 1, got 0" in line, line


def test_heads_file_of_the_right_model_passes_the_checks(tmp_path):
    """The checks do not refuse what the run accepts (smoke's model and depth)."""
    from trainers.config import load_run_config

    good = _heads_file(tmp_path / "good.safetensors", TINY_RANDOM, num_depths=2)
    cfg, _ = load_run_config([SMOKE, f"out_dir={tmp_path / 'run'}", f"heads={good}"])
    async_rl.check_config(cfg)
    async_rl.check_paths(cfg)
    policy = async_rl.load_rl_policy(cfg.accelerator.model, "float32", cfg.seed)
    assert async_rl.make_heads(policy, cfg).num_depths == 2
    assert not (tmp_path / "run").exists()


def _eagle3_dir(path, config):
    from mtp_heads.eagle3 import init_eagle3
    from mtp_heads.eagle3_checkpoint import save_eagle3

    return save_eagle3(path, init_eagle3(random_model(config, seed=0), draft_vocab=torch.arange(2, 40)))


def test_an_eagle3_drafter_of_this_model_passes_the_checks_and_drafts_in_the_run(tmp_path):
    """run takes heads=<EAGLE-3 directory> as it takes a heads file: the checks pass and the run's heads
    are the drafter, with its aux layers and draft vocabulary (tests/test_eagle3_rollouts.py runs it)."""
    from mtp_heads.eagle3_drafter import Eagle3Heads
    from trainers.config import load_run_config

    drafter_dir = _eagle3_dir(tmp_path / "eagle3", TINY_RANDOM)
    cfg, _ = load_run_config([SMOKE, f"out_dir={tmp_path / 'run'}", f"heads={drafter_dir}", "accelerator.num_depths=1"])
    async_rl.check_config(cfg)
    async_rl.check_paths(cfg)
    heads = async_rl.make_heads(async_rl.load_rl_policy(cfg.accelerator.model, "float32", cfg.seed), cfg)
    assert isinstance(heads, Eagle3Heads) and heads.drafter.draft_vocab_size == 38
    assert not (tmp_path / "run").exists()


def test_an_eagle3_drafter_of_another_model_is_refused_naming_its_file_and_the_mismatch(tmp_path, capsys, no_ray):
    drafter_dir = _eagle3_dir(tmp_path / "eagle3", tiny_config())            # hidden 32; tiny-random's is 64
    line = refused(capsys, tmp_path / "run", f"heads={drafter_dir}", "accelerator.num_depths=1")
    assert f"heads={drafter_dir}" in line and f"{drafter_dir / 'config.json'}" in line, line
    assert "hidden_size 32 != the policy's 64" in line, line


def test_an_eagle3_drafter_with_more_depths_is_refused_before_the_model_loads(tmp_path, capsys, no_ray, no_model):
    drafter_dir = _eagle3_dir(tmp_path / "eagle3", TINY_RANDOM)
    line = refused(capsys, tmp_path / "run", f"heads={drafter_dir}")           # smoke.yaml: num_depths 2
    assert f"heads={drafter_dir} is an EAGLE-3 drafter" in line and "set accelerator.num_depths=1" in line, line


def test_an_eagle3_drafter_with_a_vllm_history_method_is_refused_naming_the_setting(tmp_path, capsys, no_ray,
                                                                                     no_model):
    drafter_dir = _eagle3_dir(tmp_path / "eagle3", TINY_RANDOM)
    line = refused(capsys, tmp_path / "run", f"heads={drafter_dir}", "accelerator.num_depths=1",
                   "accelerator.workers.engine=vllm", "accelerator.workers.vllm_draft_method=ngram")
    assert f"heads={drafter_dir} is an EAGLE-3 drafter" in line and "vllm_draft_method=ngram" in line, line
