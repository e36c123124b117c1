"""`mtp-rollout survey-tasks` on the tiny random model: every (dataset, temperature) gets a record whose
statistics follow from its completions, prompts come from the task source as `run` renders them, and
bad candidates are refused before any file is written."""
from __future__ import annotations

import json

import pytest

from experiments import cli
from experiments.survey_tasks import SurveyConfig, survey_dataset
from trainers.rl_policy import load_rl_policy
from trainers.tasks import TaskSource

SMALL = "params={chain_sum: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}"


def test_the_command_writes_one_record_per_dataset_and_temperature(tmp_path, capsys):
    out = tmp_path / "s"
    assert cli.main(["survey-tasks", "model=tiny-random", "dtype=float32", "datasets=[chain_sum,count_bits]", SMALL,
                     "prompts_per_dataset=2", "group_size=3", "temperatures=[1.0,0.5]", "max_new_tokens=8",
                     "batch_size=4", f"out_dir={out}"]) == 0
    records = [json.loads(line) for line in (out / "survey.jsonl").read_text().splitlines()]
    assert [(r["dataset"], r["temperature"]) for r in records] == [
        ("chain_sum", 1.0), ("count_bits", 1.0), ("chain_sum", 0.5), ("count_bits", 0.5)]
    for r in records:
        assert r["prompts"] == 2 and r["group_size"] == 3 and 0 < r["mean_tokens"] <= 8
        assert 0.0 <= r["pass1"] <= r["mean_reward"] + 1e-12 <= 1.0 + 1e-12
        assert r["groups_with_variance"] in (0.0, 0.5, 1.0) and 0.0 <= r["truncated"] <= 1.0
    assert "| chain_sum | 0.5 | 2 x 3 |" in (out / "survey.md").read_text()
    assert (out / "config.yaml").is_file()


def test_a_record_counts_reward_variance_per_group(monkeypatch):
    """Rewards fixed by a stand-in scorer: group 1 all 0, group 2 mixed -> half the groups vary."""
    cfg = SurveyConfig(model="tiny-random", datasets=["chain_sum"], prompts_per_dataset=2, group_size=2,
                       max_new_tokens=4, batch_size=8, params={"chain_sum": {"min_terms": 2, "max_terms": 2}})
    source = TaskSource(cfg.tasks("chain_sum"))
    rewards = iter([0.0, 0.0, 1.0, 0.25])
    monkeypatch.setattr(source, "score", lambda task, text: next(rewards))
    rec = survey_dataset(load_rl_policy("tiny-random", "float32"), source, cfg, 1.0)
    assert rec["groups_with_variance"] == 0.5 and rec["mean_reward"] == pytest.approx(1.25 / 4)
    assert rec["pass1"] == 0.25


@pytest.mark.parametrize("override,named", [("datasets=[chain_summ]", "chain_sum"),
                                            ("params={chain_sum: {min_terms: 0}}", "tasks.params.chain_sum"),
                                            ("group_size=1", "group_size")])
def test_bad_candidates_are_refused_before_any_file(override, named, tmp_path, capsys):
    out = tmp_path / "s"
    assert cli.main(["survey-tasks", "model=tiny-random", override, f"out_dir={out}"]) == 2
    assert named in capsys.readouterr().err and not out.exists()
