"""The main job: asynchronous GRPO with MTP-head speculative rollouts, heads kept fresh, acceptance monitored.

    python -m experiments.async_rl configs/async_rl.yaml [key=value ...]
    python -m experiments.async_rl configs/smoke.yaml            # tiny random model, seconds

Rollouts of step t+1 are generated in a background thread while step t trains (one step
off-policy); the trained weights go to the rollout workers after every update. The run
directory (`out_dir`) ends up with config.yaml, the monitor's monitor.jsonl / summary.csv /
tb/ / PNGs, and rl.jsonl + rl_over_steps.png with reward and entropy per task domain.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mtp_heads.heads import MTPHeads, init_heads
from rollout.accelerator import RolloutAccelerator
from rollout.types import RolloutBatch
from rollout.config_loader import config_help, wants_help, write_resolved
from trainers.config import USAGE, RunConfig, load_run_config
from trainers.grpo import GRPOTrainer, Prefetcher
from trainers.policy import Policy, load_rl_policy
from trainers.tasks import Task, TaskSampler, score

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "async_rl.yaml"


def _pretrained_heads(policy: Policy, cfg: RunConfig) -> MTPHeads:
    """The heads shipped for this model (mtp_heads.shipped); for other models the cached result of
    `mtp-rollout train-heads`, trained (and cached) first if missing."""
    from experiments.pretrain_heads import load_or_train_default_heads

    acc = cfg.accelerator
    if policy.loaded is None:
        raise ValueError(f"heads=pretrained needs a real model with a tokenizer, not {acc.model!r}; use heads=init")
    heads, meta = load_or_train_default_heads(policy.model, policy.loaded, model_spec=acc.model,
                                              overrides=(f"train.num_depths={acc.num_depths}",),
                                              progress=cfg.progress)
    logger.info("pre-trained heads: %d depths, %s loss, %d steps", meta.num_depths, meta.loss, meta.steps)
    return heads


HEAD_SOURCES: dict[str, Callable[[Policy, RunConfig], MTPHeads | None]] = {
    "pretrained": _pretrained_heads,
    "init": lambda policy, cfg: init_heads(policy.model, cfg.accelerator.num_depths, seed=cfg.seed),
    "path": lambda policy, cfg: None,     # the accelerator loads accelerator.heads_path
}


def rollouts(accel: RolloutAccelerator, sampler: TaskSampler, policy: Policy, cfg: RunConfig,
             step: int) -> tuple[list[Task], RolloutBatch]:
    """G completions for each of the step's prompts; tasks repeated so that groups are contiguous."""
    g = cfg.grpo
    tasks = [t for t in sampler.sample(g.prompts_per_step, step) for _ in range(g.group_size)]
    batch = accel.generate([policy.codec.encode_prompt(t.prompt) for t in tasks],
                           cfg.sampling.params(step, cfg.steps, cfg.seed), domains=[t.domain for t in tasks])
    return tasks, batch


def by_domain(tasks: list[Task], values: list[float]) -> dict[str, float]:
    groups = defaultdict(list)
    for t, v in zip(tasks, values):
        groups[t.domain].append(v)
    return {d: float(np.mean(v)) for d, v in sorted(groups.items())}


def _fmt(x) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def run(cfg: RunConfig, resolved) -> Path:
    run_dir = Path(cfg.out_dir)
    if (run_dir / "monitor.jsonl").exists():
        raise ValueError(f"{run_dir} already holds a run; pass another out_dir=...")
    write_resolved(resolved, run_dir)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer_threads)
    policy = load_rl_policy(cfg.accelerator.model, cfg.accelerator.dtype, cfg.seed)
    if cfg.heads not in HEAD_SOURCES:
        raise ValueError(f"heads={cfg.heads!r} is unknown; choose one of {sorted(HEAD_SOURCES)}")
    heads = HEAD_SOURCES[cfg.heads](policy, cfg)
    trainer = GRPOTrainer(policy.model, cfg.grpo, cfg.steps)
    sampler = TaskSampler(cfg.tasks)
    accel = RolloutAccelerator.from_config(cfg.accelerator, policy=policy.model, heads=heads)
    prefetch = Prefetcher(lambda step: rollouts(accel, sampler, policy, cfg, step))
    t_start = time.perf_counter()
    try:
        with open(run_dir / "rl.jsonl", "a", encoding="utf-8") as log:
            prefetch.submit(0)
            bar = tqdm(range(cfg.steps), disable=not cfg.progress, desc="async GRPO", dynamic_ncols=True)
            for step in bar:                                   # ---- the driver loop ----
                t0 = time.perf_counter()
                tasks, batch = prefetch.result()               # made by policy version step-1
                wait_s = time.perf_counter() - t0
                rewards = [score(t, policy.codec.decode(c.tokens)) for t, c in zip(tasks, batch.completions)]
                rollout_entropy = [float(np.mean(c.entropies)) if c.entropies else float("nan")
                                   for c in batch.completions]
                rec = accel.end_step(step, {"reward": float(np.mean(rewards)),
                                            "reward_by_domain": by_domain(tasks, rewards)})
                if step + 1 < cfg.steps:
                    prefetch.submit(step + 1)                  # overlaps with the update below
                t1 = time.perf_counter()
                stats = trainer.step(batch, rewards, step)
                accel.sync_policy(trainer.trained_weights(), version=step + 1)
                row = {"step": step, "reward": float(np.mean(rewards)),
                       "reward_by_domain": by_domain(tasks, rewards),
                       "rollout_entropy_by_domain": by_domain(tasks, rollout_entropy),
                       "temperature": cfg.sampling.temperature.at(step, cfg.steps), "train": stats,
                       "rollout_wait_s": wait_s, "train_s": time.perf_counter() - t1,
                       "rollout_s": batch.wall_time_s, "policy_version": step + 1}
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.set_postfix(reward=_fmt(row["reward"]), H=_fmt(rec.get("entropy_drafted")),
                                acc=_fmt(rec.get("acceptance_rate")), tau=_fmt(rec.get("acceptance_length")),
                                slope=_fmt((rec.get("slope_step_run") or {}).get("slope")))
    finally:
        prefetch.close()
        accel.shutdown()
    plot_rl(run_dir)
    print(f"run finished in {time.perf_counter() - t_start:.0f}s; run directory {run_dir}\n"
          f"figures: {run_dir / 'acceptance_vs_entropy.png'}, {run_dir / 'over_steps.png'}, "
          f"{run_dir / 'rl_over_steps.png'}")
    return run_dir


def plot_rl(run_dir: Path) -> Path:
    """rl_over_steps.png: reward and rollout entropy per domain over the steps of rl.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (run_dir / "rl.jsonl").read_text().splitlines() if x.strip()]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.5))
    for r in rows:
        r["policy_entropy"] = {"all tokens": r["train"].get("entropy", float("nan"))}
    for ax, key, label in ((axes[0], "reward_by_domain", "reward"),
                           (axes[1], "rollout_entropy_by_domain", "rollout entropy, after temperature (nats)"),
                           (axes[2], "policy_entropy", "policy entropy at T=1, trainer (nats)")):
        for d in sorted({d for r in rows for d in r[key]}):
            pts = [(r["step"], r[key][d]) for r in rows if d in r[key]]
            ax.plot(*zip(*pts), marker=".", label=d)
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = run_dir / "rl_over_steps.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def with_default_config(argv: list[str]) -> list[str]:
    """Put configs/async_rl.yaml first when argv names no YAML file (only key=value overrides)."""
    return list(argv) if any("=" not in a for a in argv) else [str(DEFAULT_CONFIG), *argv]


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mtp-rollout run`: argv = YAML files and key=value overrides; without a
    YAML file the main job's configs/async_rl.yaml comes first."""
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(config_help(RunConfig, usage=USAGE), end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg, resolved = load_run_config(with_default_config(argv))
    run(cfg, resolved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
