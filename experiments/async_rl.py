"""The main job: asynchronous GRPO with MTP-head speculative rollouts, heads kept fresh, acceptance monitored.

    python -m experiments.async_rl configs/async_rl.yaml [key=value ...]
    python -m experiments.async_rl configs/smoke.yaml            # tiny random model, seconds

Rollouts of step t+1 are generated in a background thread while step t trains (one step
off-policy); the trained weights go to the rollout workers after every update. The run
directory (`out_dir`) ends up with config.yaml, the monitor's monitor.jsonl / summary.csv /
tb/ / PNGs, and rl.jsonl + rl_over_steps.png with reward and entropy per task domain.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import ray
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from mtp_heads.eagle3_drafter import Eagle3Heads
from mtp_heads.heads import MTPHeads
from mtp_heads.shipped import resolve_heads
from rollout.accelerator import RolloutAccelerator, is_eagle3_dir
from rollout.config_loader import config_help, packaged_config, wants_help, write_resolved
from rollout.monitor.records import json_safe
from rollout.models.loaders import DEFAULT_MODEL
from rollout.ray_guard import local_ray
from rollout.run_dir import RunLock, check_not_busy, check_writable, read_json, read_jsonl
from rollout.types import RolloutBatch, SamplingParams
from trainers.config import USAGE, RunConfig, inside_run_dir, load_run_config, run_dir_relative
from trainers.grpo import GRPOTrainer, Prefetcher
from trainers.rl_policy import Policy, load_rl_policy
from trainers.run_state import (CHECKPOINTS, LOGS, MONITOR_STATE, Checkpoint, resume_checkpoint, rewind_run_dir,
                                   save_checkpoint)
from trainers.tasks import REASONING_GYM, Task, TaskSource

logger = logging.getLogger(__name__)

CHECKPOINT_WAIT_S = 30.0   # longest a checkpoint waits for the co-trainer's in-flight work
DEFAULT_CONFIG = packaged_config("async_rl")


class CoTrainerLost(RuntimeError):
    """The head co-trainer died for good during the run (and cotrainer_required is true)."""


def make_heads(policy: Policy, cfg: RunConfig) -> MTPHeads | Eagle3Heads:
    """The run's starting heads from `heads` (shipped, init, a checkpoint path or an EAGLE-3 drafter
    directory); heads made for another model are refused naming the key, the file and the mismatch."""
    acc = cfg.accelerator
    try:
        heads, desc = resolve_heads(policy.model, cfg.heads, model=acc.model, num_depths=acc.num_depths,
                                    seed=cfg.seed)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("heads=") else f"heads={cfg.heads}: {e}") from None
    logger.info("heads: %s", desc)
    return heads


def rollouts(accel: RolloutAccelerator, source: TaskSource, policy: Policy, cfg: RunConfig,
             step: int) -> tuple[list[Task], RolloutBatch]:
    """G completions for each of the step's prompts; tasks repeated so that groups are contiguous."""
    g = cfg.grpo
    tasks = [t for t in source.sample(g.prompts_per_step, step) for _ in range(g.group_size)]
    batch = accel.generate([policy.codec.encode_prompt(t.prompt) for t in tasks],
                           cfg.sampling.params(step, cfg.total_steps, cfg.seed), domains=[t.domain for t in tasks])
    return tasks, batch


def evaluate(accel: RolloutAccelerator, source: TaskSource, policy: Policy, cfg: RunConfig, step: int) -> dict:
    """Greedy held-out score of the workers' current policy: one completion per held-out prompt.

    Sent to the worker actors directly, not through accel.generate, so that the monitor and the
    co-trainer's replay see rollouts only; each worker runs it after the calls queued before it
    (the step's policy sync included)."""
    tasks = source.heldout
    sp = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, temperature=0.0, num_draft_tokens=0,
                        seed=cfg.seed * 100_003 + step)
    workers = accel.workers
    chunks = [tasks[i::len(workers)] for i in range(len(workers))]
    refs = [w.generate.remote([policy.codec.encode_prompt(t.prompt) for t in c], sp)
            for w, c in zip(workers, chunks) if c]
    comps = [c for part in ray.get(refs) for c in part.completions]
    scores = [source.score(t, policy.codec.decode(c.tokens))
              for t, c in zip((t for c in chunks if c for t in c), comps)]
    return {"eval_reward": float(np.mean(scores)), "eval_pass1": float(np.mean([s >= 1.0 for s in scores]))}


def eval_due(cfg: RunConfig, step: int) -> bool:
    """Held-out evaluation after step `step`: every tasks.eval_every steps and after the last."""
    every = cfg.tasks.eval_every
    return every > 0 and cfg.tasks.heldout_prompts > 0 and ((step + 1) % every == 0 or step + 1 == cfg.total_steps)


def groups_with_variance(rewards: list[float], group_size: int) -> float:
    """Share of the step's GRPO groups whose rewards differ: the others give zero advantage."""
    groups = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    return float(np.mean(groups.max(axis=1) > groups.min(axis=1)))


def by_domain(tasks: list[Task], values: list[float]) -> dict[str, float]:
    groups = defaultdict(list)
    for t, v in zip(tasks, values):
        groups[t.domain].append(v)
    return {d: float(np.mean(v)) for d, v in sorted(groups.items())}


def _fmt(x) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def check_config(cfg: RunConfig) -> None:
    """Every check that needs no model: run before the lock, any file or Ray. Errors name the key."""
    check_finite_config(cfg)
    if is_eagle3_dir(cfg.heads, cfg.accelerator.model):  # an EAGLE-3 drafter: a readable config, one layer
        from mtp_heads.eagle3_checkpoint import read_config
        from mtp_heads.shipped import drafter_location
        try:
            read_config(Path(drafter_location(cfg.heads, cfg.accelerator.model)).expanduser())
        except ValueError as e:
            raise ValueError(f"heads={cfg.heads}: {e}") from None
        if cfg.accelerator.num_depths != 1:
            raise ValueError(f"heads={cfg.heads} is an EAGLE-3 drafter (one recurrent layer) but accelerator."
                             f"num_depths={cfg.accelerator.num_depths}; set accelerator.num_depths=1")
    path = heads_file(cfg)
    if path is not None:                                # a heads file: readable header, right depth
        from mtp_heads.checkpoint import read_meta
        try:
            meta = read_meta(path)
        except ValueError as e:
            raise ValueError(f"heads={cfg.heads}: {e}") from None
        if meta.num_depths != cfg.accelerator.num_depths:
            raise ValueError(f"heads={cfg.heads}: {path} holds {meta.num_depths} MTP depths but "
                             f"accelerator.num_depths={cfg.accelerator.num_depths}; set accelerator.num_depths="
                             f"{meta.num_depths}")
    if cfg.tasks.source != REASONING_GYM:                # imports and calls the user's function
        TaskSource(cfg.tasks)
    for step in sorted({0, cfg.total_steps - 1}):       # the temperature schedule's ends
        try:
            cfg.sampling.params(step, cfg.total_steps, cfg.seed).validate()
        except ValueError as e:
            raise ValueError(f"config key sampling.{e} (at step {step})") from None


def heads_file(cfg: RunConfig) -> Path | None:
    """The heads file `heads` names (the shipped or cached heads for `shipped`), None for `init`, an
    EAGLE-3 drafter directory or a shipped file that is missing (check_paths says so)."""
    from mtp_heads.shipped import shipped_heads_path, trained_heads_path

    if cfg.heads == "init" or is_eagle3_dir(cfg.heads, cfg.accelerator.model):
        return None
    if cfg.heads == "shipped":
        path = shipped_heads_path(cfg.accelerator.model) or trained_heads_path(cfg.accelerator.model)
        return path if path.is_file() else None
    path = Path(cfg.heads).expanduser()
    if not path.is_file():
        raise ValueError(f"heads={cfg.heads!r}: no such heads file or EAGLE-3 directory; use shipped, init or a "
                         "checkpoint path")
    return path


def check_finite_config(cfg, prefix: str = "") -> None:
    """NaN or inf in any number of a (nested) config dataclass is an error naming the key."""
    for f in dataclasses.fields(cfg):
        v, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            check_finite_config(v, f"{key}.")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"config key {key} must be a finite number, got {v}")
        elif isinstance(v, (tuple, list)) and any(isinstance(x, float) and not math.isfinite(x) for x in v):
            raise ValueError(f"config key {key} must hold finite numbers, got {list(v)}")


def check_paths(cfg: RunConfig) -> None:
    """The run directory and the caches the run will write into must be writable now, not after
    minutes of work; nothing is created here."""
    from mtp_heads.shipped import shipped_heads_path, trained_heads_path
    from rollout.models.default_model import cache_dir, needs_download

    acc = cfg.accelerator
    for key, path in (("out_dir", cfg.out_dir), ("accelerator.cotrainer.checkpoint_dir", acc.cotrainer.checkpoint_dir),
                      ("accelerator.monitor.out_dir", acc.monitor.out_dir)):
        if path:
            check_writable(path, key)
    if acc.model == DEFAULT_MODEL and needs_download():
        check_writable(cache_dir(), "the model cache ($MTP_ROLLOUT_CACHE)")
    if cfg.heads == "shipped" and shipped_heads_path(acc.model) is None and \
            not trained_heads_path(acc.model).is_file():
        raise ValueError(f"heads=shipped: the package ships no heads for {acc.model!r} and none were trained "
                         f"({trained_heads_path(acc.model)} is missing); run `mtp-rollout train-heads "
                         f"model={acc.model}` first, pass heads=<checkpoint path>, or use heads=init")


def check_lengths(cfg: RunConfig, policy: Policy) -> None:
    """Prompt + max_new_tokens must fit the model's context (every training and held-out prompt)."""
    context = policy.model.config.max_position_embeddings
    source = TaskSource(cfg.tasks)
    longest = max(len(policy.codec.encode_prompt(t.prompt)) for t in source.train + source.heldout)
    if longest + cfg.sampling.max_new_tokens > context:
        raise ValueError(f"config key sampling.max_new_tokens={cfg.sampling.max_new_tokens} is too large: with "
                         f"prompts of up to {longest} tokens it exceeds the model's context of {context} tokens")


def holds_run(run_dir: Path) -> list[str]:
    """What makes out_dir a run's directory (empty logs of a run that failed to start do not)."""
    return [n for n in ("config.yaml", CHECKPOINTS) if (run_dir / n).exists()] + \
        [n for n in LOGS if (run_dir / n).exists() and (run_dir / n).stat().st_size > 0]


def _flat(node, prefix: str = ""):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


RESUME_FREE = ("resume", "progress", "checkpoint_every", "keep_checkpoints", "cotrainer_required")


def check_resume(cfg: RunConfig, resolved, run_dir: Path) -> None:
    """A resumed run must be the same run: same config but for RESUME_FREE and where the run
    directory is (a moved or copied one resumes; its paths inside it follow it)."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        raise ValueError(f"resume=true but out_dir {run_dir} holds no run to resume (no config.yaml)")
    try:
        saved = OmegaConf.create(run_dir_relative(saved_path.read_text(encoding="utf-8")))
        OmegaConf.update(saved, "out_dir", cfg.out_dir, merge=False)
        saved = OmegaConf.to_container(saved, resolve=True)
    except Exception as e:  # noqa: BLE001 - yaml/omegaconf errors
        raise ValueError(f"{saved_path} is not a readable config ({' '.join(str(e).split())})") from None
    now = json.loads(json.dumps(OmegaConf.to_container(OmegaConf.create(resolved), resolve=True)))
    saved, now = dict(_flat(saved)), dict(_flat(now))
    free = {*RESUME_FREE, "out_dir"}
    diff = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if k not in free and saved.get(k) != now.get(k)]
    if diff:
        raise ValueError(f"resume=true with another config than {saved_path}: {'; '.join(diff)[:800]}. "
                         f"Resume with the same settings (only {', '.join(RESUME_FREE)} may change)")


def check_run_dir(cfg: RunConfig, resolved, run_dir: Path) -> None:
    """out_dir holds this run to resume, or no run at all; reads only."""
    if cfg.resume:
        check_resume(cfg, resolved, run_dir)
    elif holds_run(run_dir):
        raise ValueError(f"out_dir {run_dir} already holds a run ({', '.join(holds_run(run_dir))}); resume it "
                         f"with `mtp-rollout run out_dir={run_dir} resume=true`, or pass another out_dir=...")


def run(cfg: RunConfig, resolved) -> Path:
    """The job. Every check of the input (config, run directory, paths, the model's context, the
    heads against the model) runs before the lock is taken, a file is written or Ray starts."""
    check_config(cfg)
    run_dir = Path(cfg.out_dir)
    check_not_busy(run_dir)
    check_run_dir(cfg, resolved, run_dir)
    check_paths(cfg)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer_threads)
    policy = load_rl_policy(cfg.accelerator.model, cfg.accelerator.dtype, cfg.seed)
    check_lengths(cfg, policy)
    heads = None if cfg.resume else make_heads(policy, cfg)
    lost = None
    with RunLock(run_dir):
        check_run_dir(cfg, resolved, run_dir)         # again: another run may have started meanwhile
        ckpt = resume(cfg, run_dir) if cfg.resume else None
        if ckpt is not None and ckpt.step + 1 >= cfg.total_steps:
            print(f"{run_dir}: all {cfg.total_steps} steps are done; nothing to resume")
        else:
            if ckpt is None and heads is None:
                heads = make_heads(policy, cfg)
            with local_ray(cfg.accelerator.ray_address):
                lost = _train(cfg, policy, heads, run_dir, ckpt, None if cfg.resume else resolved)
        plot_rl(run_dir)
    print(f"run directory {run_dir}\nfigures: {run_dir / 'acceptance_vs_entropy.png'}, "
          f"{run_dir / 'over_steps.png'}, {run_dir / 'rl_over_steps.png'}")
    if lost is not None:
        print(f"head co-trainer: {lost}")
        if cfg.cotrainer_required:
            raise CoTrainerLost(f"{lost}; pass cotrainer_required=false to accept a run without head refreshes")
    return run_dir


def resume(cfg: RunConfig, run_dir: Path) -> Checkpoint | None:
    """Back to the newest intact checkpoint, saying which ones were skipped and why, and which
    logged steps are cut (they are redone)."""
    ckpt, skipped = resume_checkpoint(run_dir)
    for line in skipped:
        logger.warning("resume: skipping checkpoint %s", line)
    dropped = rewind_run_dir(run_dir, ckpt, cfg.accelerator.cotrainer.checkpoint_dir)
    for name in LOGS:                           # damaged before the checkpoint: say which file, now
        read_jsonl(run_dir / name)
    if (run_dir / MONITOR_STATE).exists():
        read_json(run_dir / MONITOR_STATE, "monitor state")
    where = f"after step {ckpt.step} ({ckpt.path.relative_to(run_dir)})" if ckpt else \
        "from step 0 (" + ("no intact checkpoint" if skipped else "no checkpoint yet") + ")"
    lines = [f"resuming {run_dir} {where}"]
    lines += [f"  skipped checkpoint {line}" for line in skipped]
    if dropped:
        which = f"step {dropped[0]}" if len(dropped) == 1 else f"steps {dropped[0]}..{dropped[-1]}"
        lines.append(f"  cut {len(dropped)} logged step{'s' if len(dropped) > 1 else ''} ({which}) from "
                     f"{' and '.join(LOGS)}: {'they are' if len(dropped) > 1 else 'it is'} run again")
    print("\n".join(lines))
    return ckpt


def _train(cfg: RunConfig, policy: Policy, heads: MTPHeads | Eagle3Heads | None, run_dir: Path,
           ckpt: Checkpoint | None, resolved) -> str | None:
    """The driver loop, from step 0 or from the step after `ckpt`. A fresh run's config.yaml is
    written once the actors are up: a run that failed to start leaves no run behind. Returns what
    happened to a head co-trainer that died for good (cotrainer_lost), else None."""
    steps = cfg.total_steps
    trainer = GRPOTrainer(policy.model, cfg.grpo, steps)
    source = TaskSource(cfg.tasks)
    start, versions, pending_sync, cotrainer_state = 0, {}, None, None
    if ckpt is not None:   # the workers get the weights that made step ckpt.step+1's rollouts, the trainer its own state
        t = ckpt.load("trainer.pt")
        trainer.model.load_state_dict(t["trained"], strict=False)
        trainer.optimizer.load_state_dict(t["optimizer"])
        policy.model.load_state_dict(t["previous"], strict=False)
        heads = ckpt.heads(policy.model.config, cfg.accelerator.num_depths, cfg.accelerator.dtype)
        start, versions = ckpt.step + 1, {"policy_version": ckpt.step, "head_version": ckpt.head_version}
        pending_sync = (t["trained"], ckpt.policy_version)
        cotrainer_state = ckpt.load("cotrainer.pt")
    accel = RolloutAccelerator.from_config(cfg.accelerator, policy=policy.model, heads=heads, **versions)
    if cotrainer_state is not None and accel.cotrainer is not None:
        ray.get(accel.cotrainer.load_state.remote(cotrainer_state))
    if resolved is not None:
        write_resolved(run_dir_relative(resolved), run_dir)
    lost_at = None
    prefetch = Prefetcher(lambda step: rollouts(accel, source, policy, cfg, step))
    t_start = time.perf_counter()
    try:
        with open(run_dir / "rl.jsonl", "a", encoding="utf-8") as log:
            prefetch.submit(start)
            bar = tqdm(range(start, steps), disable=not cfg.progress, desc="async GRPO", dynamic_ncols=True,
                       initial=start, total=steps)
            for step in bar:                                   # ---- the driver loop ----
                t0 = time.perf_counter()
                tasks, batch = prefetch.result()               # made by policy version step-1
                wait_s = time.perf_counter() - t0
                rewards = [source.score(t, policy.codec.decode(c.tokens)) for t, c in zip(tasks, batch.completions)]
                rollout_entropy = [float(np.mean(c.entropies)) if c.entropies else float("nan")
                                   for c in batch.completions]
                rec = accel.end_step(step, {"reward": float(np.mean(rewards)),
                                            "reward_by_domain": by_domain(tasks, rewards)})
                checkpoint = cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps)
                cotrainer_ref = accel.cotrainer.state.remote() if checkpoint and accel.cotrainer else None
                if pending_sync is not None:                   # resumed: the version trained before the stop
                    accel.sync_policy(*pending_sync)
                    pending_sync = None
                if step + 1 < steps:
                    prefetch.submit(step + 1)                  # overlaps with the update below
                previous = trainer.trained_weights() if checkpoint else None
                t1 = time.perf_counter()
                stats = trainer.step(batch, rewards, step)
                accel.sync_policy(trainer.trained_weights(), version=step + 1)
                evaluation = evaluate(accel, source, policy, cfg, step) if eval_due(cfg, step) else {}
                row = {"step": step, "reward": float(np.mean(rewards)),
                       "reward_by_domain": by_domain(tasks, rewards),
                       "rollout_entropy_by_domain": by_domain(tasks, rollout_entropy),
                       "truncated_share": float(np.mean([c.finish_reason == "length" for c in batch.completions])),
                       "groups_with_reward_variance": groups_with_variance(rewards, cfg.grpo.group_size),
                       **evaluation,
                       "temperature": cfg.sampling.temperature.at(step, steps), "train": stats,
                       "rollout_wait_s": wait_s, "train_s": time.perf_counter() - t1,
                       "rollout_s": batch.wall_time_s, "rollout_tokens": batch.num_tokens,
                       "rollout_plain_estimate_s": json_safe(batch.plain_estimate_s),   # nan -> null
                       "rollout_history": batch.history_sizes,
                       "rollout_speculation_paused": batch.speculation_paused,
                       "rollout_speculation_tail_only": batch.speculation_tail_only,
                       "policy_version": step + 1}
                log.write(json.dumps(row) + "\n")
                log.flush()
                if checkpoint:
                    _checkpoint(run_dir, step, trainer, previous, accel, cotrainer_ref, cfg.keep_checkpoints)
                if lost_at is None and cotrainer_lost(cfg, accel):
                    lost_at = step
                    logger.error("step %d: the head co-trainer is gone for good; the heads stay at version %d",
                                 step, accel.head_version)
                bar.set_postfix(reward=_fmt(row["reward"]), H=_fmt(rec.get("entropy_drafted")),
                                acc=_fmt(rec.get("acceptance_rate")), tau=_fmt(rec.get("acceptance_length")),
                                slope=_fmt((rec.get("slope_step_run") or {}).get("slope")),
                                spec=_fmt(rec.get("speedup_estimate")),
                                **{k: _fmt(v) for k, v in evaluation.items()})
        head_version = accel.head_version
    finally:
        prefetch.close()
        accel.shutdown()
    print(f"steps {start}..{steps - 1} finished in {time.perf_counter() - t_start:.0f}s")
    print(rollout_speed(read_jsonl(run_dir / "rl.jsonl")))
    if lost_at is None:
        return None
    return (f"gone since step {lost_at}: it died and its accelerator.cotrainer.max_restarts="
            f"{cfg.accelerator.cotrainer.max_restarts} restarts were used up, so the heads stayed at version "
            f"{head_version} (its errors are in {run_dir / 'monitor.jsonl'})")


def rollout_speed(rows: list[dict]) -> str:
    """The summary's line on rollout speed: tokens/s over the run's steps, and how much faster than
    plain decoding by the engine's own estimate (RolloutBatch.plain_estimate_s). A run cannot time
    the plain decoding it did not do; docs/rl-job.md compares the estimate with a plain run."""
    tokens = sum(r.get("rollout_tokens", 0) for r in rows)
    seconds = sum(r["rollout_s"] for r in rows)
    line = f"rollouts: {tokens} tokens in {seconds:.0f}s of generate ({tokens / seconds:.1f} tok/s)" \
        if seconds > 0 else "rollouts: none timed"
    # a step has no estimate where its rows passed through a batch bucket no plain round was timed in:
    # the ratio is then over the steps that have one, and says so
    known = [r for r in rows if r.get("rollout_plain_estimate_s") is not None and r["rollout_s"] > 0]
    if known:
        plain, timed = sum(r["rollout_plain_estimate_s"] for r in known), sum(r["rollout_s"] for r in known)
        over = "" if len(known) == len(rows) else f" over the {len(known)} of {len(rows)} steps that have an estimate"
        line += (f"; the engine estimates plain decoding at {plain:.0f}s{over}: speculation {plain / timed:.2f}x "
                 "(from its own round timings: docs/rl-job.md says how far to trust it)")
    paused = sum(bool(r.get("rollout_speculation_paused")) for r in rows)
    if paused:
        line += (f"\nspeculation paused in {paused} of {len(rows)} steps: their batch size's speculating calls had "
                 "cost more than plain decoding, or a plain call checked the engine's estimate (once early on, then "
                 "where speculation paid little) (accelerator.workers.plain_when_slower)")
    tails = sum(bool(r.get("rollout_speculation_tail_only")) for r in rows)
    if tails:
        line += (f"\nspeculation in the calls' tails only in {tails} of {len(rows)} steps: their full batch decoded plain, "
                 "where speculating had cost more, and the rows left once others had finished drafted in a smaller batch")
    history = rows[-1].get("rollout_history") if rows else None
    if history:
        line += (f"\nrollout history: {history['tokens']} tokens of {history['responses']} responses to "
                 f"{history['prompts']} prompts, {history['memory_bytes'] / 2**20:.1f} MiB")
    return line


def cotrainer_lost(cfg: RunConfig, accel: RolloutAccelerator) -> bool:
    """The run has a co-trainer and it is dead beyond its restarts (the facade drops its handle then)."""
    return cfg.accelerator.cotrainer.enabled and accel.cotrainer is None


def _checkpoint(run_dir: Path, step: int, trainer: GRPOTrainer, previous: dict, accel: RolloutAccelerator,
                cotrainer_ref, keep: int) -> None:
    """After step `step`: apply the co-trainer's decision on this step (its state was asked for
    right after end_step, so it matches), then save everything a resume needs. A refresh still
    training after CHECKPOINT_WAIT_S is not waited for: the checkpoint then holds the heads in use
    and no co-trainer state (a resume restarts the co-trainer from those heads), so the head path
    never holds up the run for long."""
    accel.flush(timeout=CHECKPOINT_WAIT_S)
    cotrainer = None
    if cotrainer_ref is not None:
        try:
            cotrainer = ray.get(cotrainer_ref, timeout=CHECKPOINT_WAIT_S)
        except Exception as e:  # noqa: BLE001 - a dead or stuck co-trainer: resume restarts it from the heads
            logger.warning("checkpoint at step %d without the co-trainer's state (%s)", step, e)
    heads, head_version = accel.current_heads()
    save_checkpoint(run_dir, step, trained=trainer.trained_weights(), previous=previous,
                    optimizer=trainer.optimizer.state_dict(), heads=heads, head_version=head_version,
                    cotrainer=cotrainer, keep=keep, drafter=accel.drafter_spec)


def plot_rl(run_dir: Path) -> Path:
    """rl_over_steps.png: reward and rollout entropy per domain over the steps of rl.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(run_dir / "rl.jsonl")
    if not rows:
        return run_dir / "rl_over_steps.png"
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
    """Put a YAML file first when argv names none (only key=value overrides): the run's own
    <out_dir>/config.yaml with resume=true, else configs/async_rl.yaml."""
    if any("=" not in a for a in argv):
        return list(argv)
    kv = dict(a.split("=", 1) for a in argv)
    saved = Path(kv.get("out_dir", "")) / "config.yaml"
    if kv.get("resume", "").lower() in ("true", "1", "yes") and "out_dir" in kv and saved.is_file():
        try:      # a config.yaml written with absolute paths inside its run directory: they follow out_dir
            moved = inside_run_dir(saved.read_text(encoding="utf-8"))
        except Exception:  # noqa: BLE001 - a damaged file is named by the config checks that follow
            moved = {}
        return [str(saved), *(f"{k}={v}" for k, v in moved.items()), *argv]
    return [str(DEFAULT_CONFIG), *argv]


def check_groups(argv: list[str]) -> None:
    """A single value where the schema has a group of keys (a schedule) is an error naming the key
    (omegaconf's own message names no key)."""
    schema = OmegaConf.structured(RunConfig)
    for arg in argv:
        if "=" in arg:
            key, value = arg.split("=", 1)
            _check_group(schema, key.strip(), value.strip().startswith("{"), f"override {arg!r}")
        elif Path(arg).is_file():
            try:
                layer = OmegaConf.to_container(OmegaConf.load(arg), resolve=False)
            except Exception as e:  # noqa: BLE001 - yaml errors
                raise ValueError(f"{arg}: not a readable YAML file ({' '.join(str(e).split())})") from None
            if not isinstance(layer, dict):
                raise ValueError(f"{arg}: a config file must be a mapping of keys, got {type(layer).__name__}")
            for key, is_group in _leaves(layer):
                _check_group(schema, key, is_group, arg)


def _leaves(node: dict, prefix: str = ""):
    for k, v in node.items():
        yield f"{prefix}{k}", isinstance(v, dict)
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")


def _check_group(schema, key: str, given_group: bool, where: str) -> None:
    node = OmegaConf.select(schema, key, default=None, throw_on_missing=False) if key else None
    if isinstance(node, DictConfig) and not given_group:
        subkeys = ", ".join(f"{key}.{k}" for k in node.keys())
        raise ValueError(f"{where}: config key {key} is a group of keys ({subkeys}), not a single value; "
                         f"set those keys, e.g. {key}.start=1.0 {key}.end=1.0 for a constant schedule")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mtp-rollout run`: argv = YAML files and key=value overrides; without a
    YAML file the main job's configs/async_rl.yaml comes first."""
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):      # the defaults shown are what this argv would run with (the preset's values)
        print(config_help(RunConfig, usage=USAGE, argv=with_default_config([a for a in argv if not wants_help([a])])),
              end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = with_default_config(argv)
    check_groups(argv)
    cfg, resolved = load_run_config(argv)
    run(cfg, resolved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
