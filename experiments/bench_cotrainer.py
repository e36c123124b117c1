"""Rollout throughput with the head co-trainer training vs idle, interleaved in one run.

Question: does co-training the MTP heads slow the rollouts down? The co-trainer only ever
gets fire-and-forget calls, so any cost is contention for cores and memory bandwidth. This
measures the worst case: in "on" rounds the co-trainer runs TV training steps for the whole
generate call; in "off" rounds it is idle (it still receives the rollouts, as always).
Rounds alternate off/on so that drift of a shared machine hits both alike; medians and the
on/off ratio are printed and written as JSON.

    python -m experiments.bench_cotrainer                  # SmolLM2-135M, 1 worker + co-trainer
    python -m experiments.bench_cotrainer --tiny --rounds 2   # seconds: a random tiny model
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import threading
import time

import ray
import torch

from rollout.accelerator import AcceleratorConfig, RolloutAccelerator
from rollout.monitor import MonitorConfig
from rollout.types import SamplingParams
from rollout.workers import WorkerConfig
from trainers.cotrainer import CoTrainerConfig

QUESTIONS = ["What is 17 plus 25?", "Reverse the word 'rollout'.", "Name three primary colours.",
             "Write one sentence about the sea.", "What is the capital of France?",
             "Spell 'entropy' in capital letters.", "Count from one to five.", "What is 9 times 7?"]


def build_models(args):
    """(policy, prompts): SmolLM2-135M-Instruct with chat prompts, or a random tiny model."""
    if args.tiny:
        from rollout.models.config import ModelConfig
        from rollout.models.decoder import random_model
        cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        return random_model(cfg, seed=0), [[3 + i, 7, 11 + i, 5] for i in range(args.prompts)]
    from rollout.models.decoder import build_model
    from rollout.models.loaders import apply_chat_template, load_model
    loaded = load_model(args.model)
    policy = build_model(loaded.config, loaded.state_dict, torch.float32)
    prompts = [apply_chat_template(loaded, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
               for i in range(args.prompts)]
    return policy, prompts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--heads-path", default=None, help="pre-trained heads (mtp_heads.checkpoint); default: init_heads")
    ap.add_argument("--num-depths", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="random tiny model (smoke test of this script)")
    ap.add_argument("--rounds", type=int, default=5, help="off/on pairs")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=2, help="draft tokens per round")
    ap.add_argument("--batch-tokens", type=int, default=512, help="co-trainer tokens per training step")
    ap.add_argument("--worker-cpus", type=float, default=1)
    ap.add_argument("--cotrainer-cpus", type=float, default=1)
    ap.add_argument("--ray-address", default=None)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)

    if args.ray_address is None:
        ray.init(num_cpus=max(2, math.ceil(args.worker_cpus + args.cotrainer_cpus)), include_dashboard=False,
                 log_to_driver=False)
    else:
        ray.init(address=args.ray_address, include_dashboard=False)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    policy, prompts = build_models(args)
    tmp = tempfile.mkdtemp(prefix="bench_cotrainer_")
    cfg = AcceleratorConfig(
        workers=WorkerConfig(num_workers=1, num_cpus_per_worker=args.worker_cpus),
        cotrainer=CoTrainerConfig(refresh=("never",), batch_tokens=args.batch_tokens, num_cpus=args.cotrainer_cpus,
                                  replay_capacity=64),
        monitor=MonitorConfig(out_dir=os.path.join(tmp, "monitor"), n_boot=100, tensorboard=False, plots=False),
        model=args.model, heads_path=args.heads_path, num_depths=args.num_depths, ray_address=args.ray_address)
    accel = RolloutAccelerator.from_config(cfg, policy=policy)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, num_draft_tokens=args.k,
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
        ray.shutdown()
    result = {
        "model": "tiny-random" if args.tiny else args.model, "heads": args.heads_path or "init_heads",
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens, "k": args.k, "rounds": args.rounds,
        "worker_cpus": args.worker_cpus, "cotrainer_cpus": args.cotrainer_cpus, "batch_tokens": args.batch_tokens,
        "median_off_tok_s": statistics.median(off), "median_on_tok_s": statistics.median(on),
        "ratio_of_medians": statistics.median(on) / statistics.median(off),
        "median_pair_ratio": statistics.median(o / f for o, f in zip(on, off)),
        "off_tok_s": off, "on_tok_s": on, "cotrainer_steps_per_on_round": steps_during, "cotrainer_step_s": step_s, "acceptance_rate": stats.acceptance_rate,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, ray {ray.__version__}",
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
    }
    print(f"median off {result['median_off_tok_s']:.2f} tok/s, on {result['median_on_tok_s']:.2f} tok/s, "
          f"ratio {result['ratio_of_medians']:.3f} (median of pair ratios {result['median_pair_ratio']:.3f}); "
          f"load average {load0[0]:.1f} -> {result['loadavg_end'][0]:.1f} on {os.cpu_count()} cores")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
