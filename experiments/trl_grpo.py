"""TRL's GRPOTrainer on the default model, rolling out through the accelerator.

    python -m experiments.trl_grpo [configs/trl_grpo.yaml] [key=value ...]
    python -m experiments.trl_grpo --help                 # every key, its default and meaning

The model (SmolLM2-135M-Instruct by default) is exported once to an HF directory with our
exporter; transformers loads it for TRL's trainer and our decoder for the rollout workers, so
both start from the same weights. Prompts and verifiable rewards come from the `tasks` source
(trainers/tasks.py: reasoning-gym or a `module:function`), as in `mtp-rollout run`.
rollout.integrations.trl.TRLRollout is TRL's rollout function and the callback that syncs the
trained layers after each optimizer step and writes the monitor's record of each step.
The run directory gets config.yaml, the monitor's files and figures, trl_log.jsonl (TRL's
logged rows) and summary.json; with compare_without_speculation=true a second run with the
same settings but k=0 goes to <out_dir>/no_spec and both are printed side by side.

A killed or interrupted run continues with `out_dir=<dir> resume=true` from its last checkpoint
(<out_dir>/trl/checkpoint-<step>, every checkpoint_every steps: TRL's own checkpoint plus the
rollout side, rollout.integrations.trl.ROLLOUT_STATE); the monitor log is cut back to it, so every
step is logged once. A local Ray is guarded and listens on loopback only (rollout.ray_guard).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from mtp_heads.drafters import DrafterSpec, drafter_from_flat
from mtp_heads.eagle3_drafter import Eagle3Heads
from mtp_heads.heads import MTPHeads
from mtp_heads.shipped import check_heads_spec, resolve_heads
from rollout.accelerator import AcceleratorConfig, RolloutAccelerator
from rollout.config_loader import RESOLVED_NAME, packaged_config, preset_main, wants_help, write_resolved
from rollout.models.decoder import CausalLM
from rollout.models.flat_weights import pack
from rollout.models.loaders import load_policy
from rollout.monitor import AcceptanceMonitor
from rollout.ray_guard import local_ray
from rollout.run_dir import RunLock
from rollout.types import DRAFT_MODES
from trainers.config import run_dir_accelerator
from trainers.tasks import REASONING_GYM, TaskConfig, TaskSource

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = packaged_config("trl_grpo")
USAGE = "usage: python -m experiments.trl_grpo [configs/trl_grpo.yaml] [key=value ...]"


@dataclasses.dataclass(frozen=True)
class TRLTrainConfig:
    """The policy update: GRPOConfig fields under TRL's own names."""

    max_steps: int = 4                  # optimizer steps (= RL steps: one generation per step)
    prompts_per_step: int = 2           # distinct prompts per step
    num_generations: int = 4            # completions per prompt (G)
    learning_rate: float = 1e-5         # AdamW learning rate of the trained layers
    max_completion_length: int = 24     # new tokens per completion at most
    temperature: float = 1.0            # 1.0: the rollout log-probs are exactly the ones TRL scores
    beta: float = 0.0                   # KL coefficient to a reference model (0: none is loaded)
    loss_type: str = "dapo"             # TRL's loss_type
    entropy_coef: float = 0.0           # TRL's entropy bonus
    train_last_layers: int = 2          # train the last N decoder layers and the final norm; -1 = all

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.prompts_per_step < 1 or self.num_generations < 2:
            raise ValueError("trl needs max_steps >= 1, prompts_per_step >= 1 and num_generations >= 2, got "
                             f"{self.max_steps}, {self.prompts_per_step}, {self.num_generations}")


@dataclasses.dataclass(frozen=True)
class TRLRunConfig:
    """One TRL GRPO run with speculative rollouts from the accelerator."""

    accelerator: AcceleratorConfig = dataclasses.field(default_factory=run_dir_accelerator)
    trl: TRLTrainConfig = dataclasses.field(default_factory=TRLTrainConfig)
    tasks: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    num_draft_tokens: int = 3           # k drafted per round by the MTP heads; 0 = plain decoding
    draft_mode: str = "rejection"       # greedy | rejection
    heads: str = "shipped"              # shipped (the package's or train-heads' cached heads) | init | a checkpoint path
    hf_dir: str = ""                    # HF export of accelerator.model; "" = <cache>/hf/<model name>
    out_dir: str = "runs/trl_grpo/${now:%Y%m%d-%H%M%S}"   # the run directory; must not hold another run
    compare_without_speculation: bool = False   # then a second run, k=0, same settings, in <out_dir>/no_spec
    trainer_threads: int = 1            # torch threads of TRL's update in the driver
    seed: int = 0
    checkpoint_every: int = 5           # optimizer steps between checkpoints in <out_dir>/trl/ (and after the
                                        # last); 0 = none
    resume: bool = False                # continue out_dir's run from its last checkpoint

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        check_heads_spec("heads", self.heads)
        if self.accelerator.heads != self.heads:
            raise ValueError(f"accelerator.heads={self.accelerator.heads!r} differs from heads={self.heads!r}; "
                             "set heads=... (accelerator.heads follows it)")


# ------------------------------------------------------------------------------ setup


def make_heads(cfg: TRLRunConfig, policy: CausalLM) -> MTPHeads | Eagle3Heads:
    acc = cfg.accelerator
    return resolve_heads(policy, cfg.heads, model=acc.model, num_depths=acc.num_depths, seed=cfg.seed)[0]


def task_data(cfg: TRLRunConfig):
    """(dataset, reward function) from the task source: prompts_per_step prompts per step in step
    order (TRL's shuffling is off), and the source's reward of each chat completion. The dataset
    carries an index into the step-ordered tasks, since the sources' items differ in shape."""
    import datasets

    source = TaskSource(cfg.tasks)
    tasks = [t for s in range(cfg.trl.max_steps) for t in source.sample(cfg.trl.prompts_per_step, s)]

    def task_reward(prompts, completions, task_index, **_) -> list[float]:
        return [source.score(tasks[i], c[-1]["content"]) for c, i in zip(completions, task_index)]

    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": t.prompt}] for t in tasks],
                                       "task_index": list(range(len(tasks))), "domain": [t.domain for t in tasks]})
    return data, task_reward


# ------------------------------------------------------------------------------ one run


def train(cfg: TRLRunConfig, run_dir: Path, hf_dir: Path, policy: CausalLM,
          heads: MTPHeads | Eagle3Heads | None, num_draft_tokens: int) -> dict:
    """One TRL GRPO run, from its last checkpoint when out_dir holds one (resume=true); returns its
    summary (also written to <run_dir>/summary.json)."""
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from rollout.integrations.trl import (TRLRollout, latest_checkpoint, read_rollout_state, restore_run_files,
                                          train_last_layers)

    if cfg.resume and (run_dir / "summary.json").is_file():
        print(f"{run_dir}: all {cfg.trl.max_steps} steps are done; nothing to resume")
        return json.loads((run_dir / "summary.json").read_text())
    t = cfg.trl
    acc_cfg = sub_run_accelerator(cfg, run_dir)
    ckpt = latest_checkpoint(run_dir / "trl") if cfg.resume else None
    saved = read_rollout_state(ckpt) if ckpt is not None else None
    versions = {}
    if cfg.resume:              # monitor files back to the checkpoint (or to nothing), co-trainer files off
        restore_run_files(saved, run_dir, acc_cfg.cotrainer.checkpoint_dir)
        print(f"resuming {run_dir} " + (f"after step {saved['global_step'] - 1}" if saved else "from step 0"))
    if saved is not None:       # the heads the workers ran at the checkpoint
        spec = DrafterSpec.from_dict(saved["drafter"]) if "drafter" in saved else DrafterSpec(acc_cfg.num_depths)
        heads = drafter_from_flat(policy.config, spec, pack(saved["heads"]), "float32")
        versions = {"policy_version": int(saved["global_step"]), "head_version": int(saved["head_version"])}
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    train_last_layers(model, t.train_last_layers)
    args = GRPOConfig(
        output_dir=str(run_dir / "trl"), max_steps=t.max_steps, per_device_train_batch_size=t.prompts_per_step
        * t.num_generations, num_generations=t.num_generations, learning_rate=t.learning_rate,
        max_completion_length=t.max_completion_length, temperature=t.temperature, beta=t.beta, loss_type=t.loss_type,
        entropy_coef=t.entropy_coef, shuffle_dataset=False, logging_steps=1, report_to="none",
        save_strategy="steps" if cfg.checkpoint_every else "no", save_steps=max(cfg.checkpoint_every, 1),
        use_cpu=True, bf16=False, seed=cfg.seed, disable_tqdm=True, dataloader_num_workers=0)
    t0 = time.perf_counter()
    accel = RolloutAccelerator.from_config(acc_cfg, policy=policy, heads=heads, **versions)
    try:
        rollout = TRLRollout(accel, num_draft_tokens=num_draft_tokens, draft_mode=cfg.draft_mode, seed=cfg.seed)
        dataset, reward = task_data(cfg)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args,
                              processing_class=transformers.AutoTokenizer.from_pretrained(hf_dir),
                              train_dataset=dataset, rollout_func=rollout, callbacks=[rollout, keep_latest_checkpoint()])
        trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
    finally:
        accel.shutdown()                                  # closes the monitor: CSV and figures
    wall = time.perf_counter() - t0
    with open(run_dir / "trl_log.jsonl", "w", encoding="utf-8") as f:
        for row in trainer.state.log_history:
            f.write(json.dumps(row) + "\n")
    return summarize(run_dir, num_draft_tokens, wall)


def sub_run_accelerator(cfg: TRLRunConfig, run_dir: Path) -> AcceleratorConfig:
    """The accelerator of the run in run_dir: its monitor there, and the comparison run's co-trainer
    in its own folder (it must not resume from the first run's heads)."""
    acc = cfg.accelerator
    cot = acc.cotrainer
    if cot.checkpoint_dir and run_dir != Path(cfg.out_dir):
        cot = dataclasses.replace(cot, checkpoint_dir=str(run_dir / "cotrainer"))
    return dataclasses.replace(acc, cotrainer=cot, monitor=dataclasses.replace(acc.monitor, out_dir=str(run_dir)))


def keep_latest_checkpoint():
    """A TrainerCallback, listed after TRLRollout, that deletes older checkpoint-<step> folders once
    the newest holds the rollout side as well (TRL's save_total_limit would delete them first)."""
    from transformers import TrainerCallback

    from rollout.integrations.trl import ROLLOUT_STATE, checkpoint_dir

    class KeepLatestCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            newest = checkpoint_dir(args, state.global_step)
            if (newest / ROLLOUT_STATE).is_file():
                for old in Path(args.output_dir).glob("checkpoint-*"):
                    if old != newest:
                        shutil.rmtree(old, ignore_errors=True)
            return control

    return KeepLatestCheckpoint()


def summarize(run_dir: Path, k: int, wall_s: float) -> dict:
    steps = [r for r in AcceptanceMonitor.load_records(run_dir) if "event" not in r]
    col = lambda key: [r.get(key) for r in steps]                                    # noqa: E731
    out = {"num_draft_tokens": k, "wall_s": wall_s, "steps": col("step"), "rollout_s": col("wall_time_s"),
           "tokens_per_s": col("tokens_per_s"), "acceptance_rate": col("acceptance_rate"),
           "acceptance_length": col("acceptance_length"), "entropy": col("entropy_drafted"),
           "reward": [r["extra"].get("reward") for r in steps], "policy_version": col("policy_version_max"),
           "head_version": col("head_version_max")}
    # the first rollout pays the workers' warm-up: medians over the later steps compare runs
    for key in ("rollout_s", "tokens_per_s"):
        out[f"{key}_median_after_first"] = float(np.median(out[key][1:] or out[key]))
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def _fmt(xs) -> str:
    return " ".join("nan" if x is None or x != x else f"{x:.3g}" for x in xs)


def report(runs: list[dict]) -> str:
    lines = []
    for s in runs:
        lines += [f"k={s['num_draft_tokens']}: wall {s['wall_s']:.0f}s, rollout s/step [{_fmt(s['rollout_s'])}] "
                  f"(median after the first {s['rollout_s_median_after_first']:.2f}s), tokens/s "
                  f"[{_fmt(s['tokens_per_s'])}]",
                  f"      acceptance [{_fmt(s['acceptance_rate'])}], tau [{_fmt(s['acceptance_length'])}], "
                  f"reward [{_fmt(s['reward'])}], policy versions {s['policy_version']}"]
    if len(runs) == 2:
        a, b = runs
        lines.append(f"k={a['num_draft_tokens']} vs k=0, medians over the steps after the first: rollout time "
                     f"{a['rollout_s_median_after_first'] / b['rollout_s_median_after_first']:.2f}x, tokens/s "
                     f"{a['tokens_per_s_median_after_first'] / b['tokens_per_s_median_after_first']:.2f}x "
                     "(> 1 tokens/s: speculation is faster)")
    return "\n".join(lines)


RESUME_FREE_KEYS = ("resume", "checkpoint_every", "trainer_threads")   # may differ in a resumed run


def holds_run(run_dir: Path) -> list[str]:
    """What makes out_dir a run's directory."""
    return [n for n in (RESOLVED_NAME, "trl", AcceptanceMonitor.JSONL) if (run_dir / n).exists()]


def _flat(node, prefix: str = ""):
    for k, v in (node or {}).items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def check_resume(resolved: str, run_dir: Path) -> None:
    """A resumed run must be the same run: the same config but for RESUME_FREE_KEYS."""
    saved_path = run_dir / RESOLVED_NAME
    if not saved_path.is_file():
        raise ValueError(f"resume=true but out_dir {run_dir} holds no run to resume (no {RESOLVED_NAME})")
    try:
        saved = dict(_flat(yaml.safe_load(saved_path.read_text(encoding="utf-8"))))
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{saved_path} is not a readable config ({e})") from None
    now = dict(_flat(yaml.safe_load(resolved)))
    diff = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if k not in RESUME_FREE_KEYS and saved.get(k) != now.get(k)]
    if diff:
        raise ValueError(f"resume=true with another config than {saved_path}: {'; '.join(diff)[:800]}. Resume with "
                         f"the same settings (only {', '.join(RESUME_FREE_KEYS)} may change)")


def run(cfg: TRLRunConfig, resolved: str) -> list[dict]:
    from rollout.integrations.trl import hf_model_dir

    run_dir = Path(cfg.out_dir)
    if cfg.tasks.source != REASONING_GYM:                # imports and calls the user's function, before any file
        TaskSource(cfg.tasks)
    with RunLock(run_dir):
        if cfg.resume:
            check_resume(resolved, run_dir)
        elif holds_run(run_dir):
            raise ValueError(f"out_dir {run_dir} already holds a run ({', '.join(holds_run(run_dir))}); resume it "
                             f"with `mtp-rollout trl-grpo out_dir={run_dir} resume=true`, or pass another out_dir=...")
        else:
            write_resolved(resolved, run_dir)
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.trainer_threads)
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        policy, _ = load_policy(cfg.accelerator.model, "float32")
        hf_dir = hf_model_dir(cfg.accelerator.model, cfg.hf_dir or None)
        heads = make_heads(cfg, policy)
        with local_ray(cfg.accelerator.ray_address):      # one Ray for both runs; guarded, loopback only
            runs = [train(cfg, run_dir, hf_dir, policy, heads, cfg.num_draft_tokens)]
            if cfg.compare_without_speculation:
                runs.append(train(cfg, run_dir / "no_spec", hf_dir, policy, heads, 0))
    print(report(runs))
    print(f"figures: {run_dir / AcceptanceMonitor.PNG_SCATTER}, {run_dir / AcceptanceMonitor.PNG_STEPS}")
    return runs


def with_run_config(argv: list[str]) -> list[str]:
    """`out_dir=<dir> resume=true` alone resumes with the run's own <dir>/config.yaml."""
    if any("=" not in a for a in argv):
        return list(argv)
    kv = dict(a.split("=", 1) for a in argv)
    saved = Path(kv.get("out_dir", "")) / RESOLVED_NAME
    if kv.get("resume", "").lower() in ("true", "1", "yes") and "out_dir" in kv and saved.is_file():
        return [str(saved), *argv]
    return list(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point (`mtp-rollout trl-grpo`): YAML files and key=value overrides; without a YAML
    file configs/trl_grpo.yaml comes first (with `resume=true`, the run's own config.yaml)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not wants_help(argv):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return preset_main(TRLRunConfig, DEFAULT_CONFIG, lambda cfg, resolved: run(cfg, resolved), with_run_config(argv),
                       usage=USAGE)


if __name__ == "__main__":
    sys.exit(main())
