"""`mtp-rollout refresh-study` in its small setting (configs/refresh_study_tiny.yaml, the tiny random
model): every schedule runs and is summarised with its refreshes and co-trainer cost, the `never`
schedule runs without a co-trainer, and a re-run reuses finished runs. The science is the SmolLM2 run."""
import json
from pathlib import Path

import pytest

from experiments.refresh_study import RefreshStudyConfig, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("refresh")
    argv = [str(ROOT / "configs/refresh_study_tiny.yaml"), f"out_dir={out}"]
    assert main(argv) == 0
    return out, argv


@pytest.mark.slow
@pytest.mark.ray
def test_every_schedule_is_run_and_costed(study):
    out, _ = study
    records = {r["schedule"]: r for r in json.loads((out / "refresh.json").read_text())}
    assert list(records) == ["never", "every_1"]
    for r in records.values():
        assert r["steps"] == 4 and len(r["per_step"]) == 4 and r["tokens"] > 0
        assert 0 <= r["acceptance_rate"] <= 1 and r["acceptance_length"] >= 1
    never, every = records["never"], records["every_1"]
    assert never["refresh_steps"] == [] and never["cotrainer_train_s"] == 0
    assert "enabled: false" in (out / "runs" / "never" / "config.yaml").read_text()
    # every step after the first triggers a refresh (the first sets the schedule's clock), each one's
    # training time is counted; when its heads reach the workers depends on the async co-trainer's pace
    assert every["refresh_steps"] == [1, 2, 3] and every["cotrainer_train_s"] > 0
    assert len(every["published_at"]) == 3 and all(p >= s for p, s in zip(every["published_at"], every["refresh_steps"]))
    md = (out / "refresh.md").read_text()
    assert "| never | 4 | 0 (-) |" in md and "| every_1 | 4 |" in md
    assert len((out / "refresh.csv").read_text().strip().splitlines()) == 3
    assert (out / "refresh.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.ray
def test_a_rerun_reuses_finished_runs(study):
    out, argv = study
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/rl.jsonl")}
    assert len(stamps) == 2
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_a_study_needs_a_schedule():
    with pytest.raises(ValueError, match="schedules"):
        RefreshStudyConfig(schedules={})


@pytest.mark.parametrize("override, named", [("rl=[steps]", "key=value"), ("schedules.a=[x]", "schedules.a")])
def test_bad_input_is_refused_naming_the_key(override, named, tmp_path):
    with pytest.raises(ValueError, match=named):
        main([str(ROOT / "configs/refresh_study_tiny.yaml"), f"out_dir={tmp_path}", override])
    assert not any(tmp_path.iterdir())


def test_a_misspelt_key_in_one_schedule_fails_at_load_time_naming_it(tmp_path):
    from rollout.config_loader import load_config
    from experiments.refresh_study import RefreshStudyConfig
    bad = "schedules.every_1=[accelerator.cotrainer.every_n_step=1]"
    with pytest.raises(ValueError) as e:
        load_config(RefreshStudyConfig, [str(ROOT / "configs/refresh_study_tiny.yaml"), bad])
    assert "schedule 'every_1'" in str(e.value) and "accelerator.cotrainer.every_n_step" in str(e.value)
    with pytest.raises(ValueError, match="schedule 'never'.*sampling.draftmode"):      # `rl` reaches every schedule
        main([str(ROOT / "configs/refresh_study_tiny.yaml"), f"out_dir={tmp_path / 'r'}",
              "rl=[steps=4,sampling.draftmode=greedy]"])
    assert not (tmp_path / "r").exists()


def test_help_lists_every_key(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for f in RefreshStudyConfig.__dataclass_fields__:
        assert f in text
