"""Rollout throughput with the head co-trainer training vs idle, interleaved in one run.

Question: does co-training the MTP heads slow the rollouts down? The co-trainer only ever
gets fire-and-forget calls, so any cost is contention for cores and memory bandwidth. This
measures the worst case: in "on" rounds the co-trainer runs TV training steps for the whole
generate call; in "off" rounds it is idle (it still receives the rollouts, as always).
Rounds alternate off/on so that drift of a shared machine hits both alike; medians and the
on/off ratio are printed and written as JSON.

    python -m experiments.bench_cotrainer configs/bench_cotrainer.yaml [key=value ...]
    python -m experiments.bench_cotrainer model=tiny-random heads=init rounds=2   # seconds: a random tiny model
    python -m experiments.bench_cotrainer --help                        # every key
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from mtp_heads.cotrainer import CoTrainerConfig
from rollout.accelerator import AcceleratorConfig, RolloutAccelerator
from rollout.config_loader import config_help, load_config, packaged_config, wants_help, write_resolved
from rollout.fileio import atomic_write
from rollout.monitor import MonitorConfig
from rollout.ray_guard import local_ray
from rollout.types import SamplingParams
from rollout.workers import WorkerConfig
from trainers.rl_policy import load_rl_policy

QUESTIONS = ["What is 17 plus 25?", "Reverse the word 'rollout'.", "Name three primary colours.",
             "Write one sentence about the sea.", "What is the capital of France?",
             "Spell 'entropy' in capital letters.", "Count from one to five.", "What is 9 times 7?"]
DEFAULT_CONFIG = packaged_config("bench_cotrainer")
RESULT_NAME = "bench_cotrainer.json"
USAGE = "python -m experiments.bench_cotrainer [configs/bench_cotrainer.yaml] [key=value ...]"


@dataclass(frozen=True)
class BenchCotrainerConfig:
    """One off/on throughput comparison."""

    model: str = "smollm2-135m"         # policy: a model spec, or `tiny-random` (a seconds-long smoke run)
    heads: str = "shipped"              # shipped | init (untrained) | a heads checkpoint path
    num_depths: int = 1                 # MTP depths D of the heads
    rounds: int = 5                     # off/on pairs
    prompts: int = 8                    # prompts per generate call (chat-formatted questions)
    max_new_tokens: int = 48            # tokens per completion (EOS ignored)
    num_draft_tokens: int = 2           # draft tokens per round
    batch_tokens: int = 512             # co-trainer tokens per training step
    worker_cpus: float = 1              # Ray CPUs of the rollout worker
    cotrainer_cpus: float = 1           # Ray CPUs of the co-trainer
    ray_address: str | None = None      # Ray cluster address; null: a local Ray sized for both actors
    out_dir: str | None = None          # write <out_dir>/bench_cotrainer.json (result + resolved config) and
                                        # config.yaml; null: print only

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.prompts < 1 or self.max_new_tokens < 1 or self.num_draft_tokens < 1:
            raise ValueError("rounds, prompts, max_new_tokens and num_draft_tokens must all be >= 1")
        from mtp_heads.shipped import check_heads_spec
        check_heads_spec("heads", self.heads)


def build_models(cfg: BenchCotrainerConfig):
    """(policy, prompts): the policy and its chat-formatted (or byte, for tiny-random) prompts."""
    policy = load_rl_policy(cfg.model, "float32", seed=0)
    return policy.model, [policy.codec.encode_prompt(QUESTIONS[i % len(QUESTIONS)]) for i in range(cfg.prompts)]


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    rest = [a for a in argv if not wants_help([a])]
    layers = rest if any("=" not in a for a in rest) else [str(DEFAULT_CONFIG), *rest]
    if wants_help(argv):        # the defaults shown are those a run with this argv uses
        print(config_help(BenchCotrainerConfig, usage=USAGE, argv=layers), end="")
        return None
    args, resolved = load_config(BenchCotrainerConfig, layers)
    sized = {} if args.ray_address is not None else {
        "num_cpus": max(2, math.ceil(args.worker_cpus + args.cotrainer_cpus)), "log_to_driver": False}
    with local_ray(args.ray_address, **sized):       # a local Ray is guarded and on loopback (rollout.ray_guard)
        return _bench(args, resolved)


def _bench(args: BenchCotrainerConfig, resolved) -> dict:
    """The interleaved off/on rounds on a started Ray; the result as printed and written."""
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    policy, prompts = build_models(args)
    tmp = tempfile.mkdtemp(prefix="bench_cotrainer_")
    cfg = AcceleratorConfig(
        workers=WorkerConfig(num_workers=1, num_cpus_per_worker=args.worker_cpus),
        cotrainer=CoTrainerConfig(refresh=("never",), batch_tokens=args.batch_tokens, num_cpus=args.cotrainer_cpus,
                                  replay_capacity=64),
        monitor=MonitorConfig(out_dir=os.path.join(tmp, "monitor"), n_boot=100, tensorboard=False, plots=False),
        model=args.model, heads=args.heads, num_depths=args.num_depths, ray_address=args.ray_address)
    accel = RolloutAccelerator.from_config(cfg, policy=policy)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, num_draft_tokens=args.num_draft_tokens,
                              ignore_eos=True, seed=0)
    try:
        for _ in range(2):                                   # warm-up; also fills the co-trainer's replay buffer
            warm = accel.generate(prompts, sampling)
            t_step = time.perf_counter()
            ray.get(accel.cotrainer.train.remote(1))
            step_s = time.perf_counter() - t_step
        print(f"setup {time.perf_counter() - t0:.0f}s; generate {warm.wall_time_s:.1f}s "
              f"({warm.tokens_per_s:.1f} tok/s); one co-trainer step {step_s:.2f}s")
        off, on, steps_during = [], [], []
        for r in range(args.rounds):
            off.append(accel.generate(prompts, sampling).tokens_per_s)
            done, count = threading.Event(), [0]

            def keep_training():                             # back-to-back steps while the 'on' generate runs
                while not done.is_set():
                    ray.get(accel.cotrainer.train.remote(1))
                    count[0] += 1

            trainer = threading.Thread(target=keep_training)
            trainer.start()
            time.sleep(0.2)                                  # let the first step start
            batch = accel.generate(prompts, sampling)
            done.set()
            trainer.join()                                   # not timed: the next 'off' round starts idle
            on.append(batch.tokens_per_s)
            steps_during.append(count[0])
            print(f"round {r}: off {off[-1]:.2f} tok/s, on {on[-1]:.2f} tok/s "
                  f"(ratio {on[-1] / off[-1]:.3f}; {count[0]} co-trainer steps)")
        stats = accel.generate(prompts, sampling).spec_stats()
    finally:
        accel.shutdown()
    result = {
        "model": args.model, "heads": args.heads,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens, "rounds": args.rounds,
        "worker_cpus": args.worker_cpus, "cotrainer_cpus": args.cotrainer_cpus, "batch_tokens": args.batch_tokens,
        "median_off_tok_s": statistics.median(off), "median_on_tok_s": statistics.median(on),
        "ratio_of_medians": statistics.median(on) / statistics.median(off),
        "median_pair_ratio": statistics.median(o / f for o, f in zip(on, off)),
        "off_tok_s": off, "on_tok_s": on, "cotrainer_steps_per_on_round": steps_during, "cotrainer_step_s": step_s,
        "acceptance_rate": stats.acceptance_rate, "config": resolved,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, ray {ray.__version__}",
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
    }
    print(f"median off {result['median_off_tok_s']:.2f} tok/s, on {result['median_on_tok_s']:.2f} tok/s, "
          f"ratio {result['ratio_of_medians']:.3f} (median of pair ratios {result['median_pair_ratio']:.3f}); "
          f"load average {load0[0]:.1f} -> {result['loadavg_end'][0]:.1f} on {os.cpu_count()} cores")
    if args.out_dir:
        atomic_write(Path(args.out_dir) / RESULT_NAME, json.dumps(result, indent=2) + "\n")
        write_resolved(resolved, args.out_dir)
    return result


if __name__ == "__main__":
    main()
