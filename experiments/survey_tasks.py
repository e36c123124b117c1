"""`mtp-rollout survey-tasks`: which reasoning-gym datasets give the policy reward, with variance inside
a GRPO group, before an RL run is spent on them.

    mtp-rollout survey-tasks                                   # configs/survey_tasks.yaml: SmolLM2, 8 candidates
    mtp-rollout survey-tasks 'temperatures=[1.0]' prompts_per_dataset=4
    mtp-rollout survey-tasks --help                            # every key, its default and meaning

GRPO learns only from groups whose rewards differ: a dataset the policy always fails (or always
solves) gives zero advantage. For every candidate dataset (with its parameters) and temperature,
`prompts_per_dataset` prompts from the task source (trainers/tasks.py: the same rendering,
instruction and scoring as `mtp-rollout run`) are each sampled `group_size` times by plain
decoding; per dataset: mean reward, pass@1 (share scoring 1), the share of groups with non-zero
reward variance, the share of completions that state an answer, the share cut at max_new_tokens
and the mean length. Written into out_dir: config.yaml, survey.jsonl (one record per dataset and
temperature), survey.md (the table).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.config_loader import packaged_config, preset_main, write_resolved
from rollout.fileio import atomic_write
from rollout.models.loaders import DEFAULT_MODEL
from rollout.types import SamplingParams
from trainers.tasks import TaskConfig, TaskSource, extract_answer

DEFAULT_CONFIG = packaged_config("survey_tasks")


@dataclass(frozen=True)
class SurveyConfig:
    """The candidate datasets and how each is sampled."""

    model: str = DEFAULT_MODEL            # named model, .gguf file, HF directory or tiny-random
    dtype: str = "auto"                   # float32 | bfloat16 | auto
    datasets: list[str] = field(default_factory=lambda: ["chain_sum"])     # reasoning-gym candidates
    params: dict[str, dict[str, Any]] = field(default_factory=dict)       # their parameters (as tasks.params)
    prompts_per_dataset: int = 8          # prompts drawn per dataset (the task source's training split)
    group_size: int = 8                   # samples per prompt, as a GRPO group
    temperatures: list[float] = field(default_factory=lambda: [1.0])      # sampling temperatures surveyed
    max_new_tokens: int = 256             # completion length cap
    batch_size: int = 32                  # rows decoded at once
    seed: int = 0                         # prompts and sampling
    out_dir: str = "runs/survey_tasks/${now:%Y%m%d-%H%M%S}"   # config.yaml, survey.jsonl, survey.md

    def __post_init__(self) -> None:
        if self.prompts_per_dataset < 1 or self.group_size < 2 or self.batch_size < 1:
            raise ValueError(f"need prompts_per_dataset >= 1, group_size >= 2 and batch_size >= 1, got "
                             f"{self.prompts_per_dataset}, {self.group_size}, {self.batch_size}")
        if not self.temperatures or any(not t > 0 for t in self.temperatures):
            raise ValueError(f"temperatures must list values > 0, got {list(self.temperatures)}")
        for name in self.datasets:            # unknown datasets and rejected parameters fail here, named
            self.tasks(name)

    def tasks(self, dataset: str) -> TaskConfig:
        """The task source of one candidate: its prompts exactly as `run` would render them."""
        return TaskConfig(datasets=(dataset,), params={dataset: dict(self.params.get(dataset) or {})},
                          num_prompts=self.prompts_per_dataset, heldout_prompts=0, seed=self.seed)


def survey_dataset(policy, source: TaskSource, cfg: SurveyConfig, temperature: float) -> dict:
    """One (dataset, temperature) record from group_size samples of each training prompt."""
    from rollout.torch_engine import TorchEngine

    tasks = [t for t in source.train for _ in range(cfg.group_size)]
    engine = TorchEngine(policy.model)
    t0, completions = time.perf_counter(), []
    for lo in range(0, len(tasks), cfg.batch_size):
        chunk = tasks[lo:lo + cfg.batch_size]
        batch = engine.generate([policy.codec.encode_prompt(t.prompt) for t in chunk],
                                SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                                               seed=cfg.seed + lo))
        completions += batch.completions
    texts = [policy.codec.decode(c.tokens) for c in completions]
    rewards = [source.score(t, x) for t, x in zip(tasks, texts)]
    groups = [rewards[i:i + cfg.group_size] for i in range(0, len(rewards), cfg.group_size)]
    tokens = sum(len(c.tokens) for c in completions)
    wall = time.perf_counter() - t0
    return {"dataset": tasks[0].domain, "temperature": temperature, "prompts": len(groups),
            "group_size": cfg.group_size, "mean_reward": statistics.mean(rewards),
            "pass1": sum(r >= 1.0 for r in rewards) / len(rewards),
            "groups_with_variance": sum(max(g) > min(g) for g in groups) / len(groups),
            "stated_answer": sum(extract_answer(x) is not None for x in texts) / len(texts),
            "truncated": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "mean_tokens": tokens / len(completions), "tok_s": tokens / wall, "wall_s": wall,
            "example": texts[0][-300:]}


def table(records: list[dict]) -> str:
    lines = ["| dataset | T | prompts x group | mean reward | pass@1 | groups with reward variance | states an answer "
             "| cut at max_new_tokens | mean tokens |", "|" + "---|" * 9]
    for r in records:
        lines.append(f"| {r['dataset']} | {r['temperature']:g} | {r['prompts']} x {r['group_size']} | "
                     f"{r['mean_reward']:.3f} | {r['pass1']:.3f} | {r['groups_with_variance']:.2f} | "
                     f"{r['stated_answer']:.2f} | {r['truncated']:.2f} | {r['mean_tokens']:.0f} |")
    return "\n".join(lines) + "\n"


def run(cfg: SurveyConfig, resolved: str) -> list[dict]:
    import torch

    from trainers.rl_policy import load_rl_policy

    sources = {d: TaskSource(cfg.tasks(d)) for d in cfg.datasets}        # every candidate checked before work
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_resolved(resolved, out)
    torch.manual_seed(cfg.seed)
    policy = load_rl_policy(cfg.model, cfg.dtype, cfg.seed)
    records = []
    with open(out / "survey.jsonl", "a", encoding="utf-8") as log:
        for temperature in cfg.temperatures:
            for name, source in sources.items():
                rec = survey_dataset(policy, source, cfg, temperature)
                records.append(rec)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                print(f"{name} T={temperature:g}: reward {rec['mean_reward']:.3f}, groups with variance "
                      f"{rec['groups_with_variance']:.2f}, cut {rec['truncated']:.2f}, {rec['tok_s']:.0f} tok/s",
                      flush=True)
                atomic_write(out / "survey.md", table(records))
    print(table(records))
    print(f"out_dir {out}: survey.jsonl, survey.md")
    return records


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mtp-rollout survey-tasks`: YAML files and key=value overrides; without a YAML
    file configs/survey_tasks.yaml comes first."""
    return preset_main(SurveyConfig, DEFAULT_CONFIG, run, sys.argv[1:] if argv is None else argv, usage=__doc__)


if __name__ == "__main__":
    sys.exit(main())
