"""Pre-train MTP heads for a policy by self-distillation, evaluate them, cache them.

    python -m experiments.pretrain_heads                          # default heads of the default model
    python -m experiments.pretrain_heads --loss ce --steps 300 --out /tmp/ce.safetensors
    python -m experiments.pretrain_heads --resume --out /tmp/ce.safetensors
    python -m experiments.pretrain_heads --draft-vocab 8192 --speedup-prompts 4

Writes the heads (safetensors + .json header), `<out>.train.pt` (optimizer state for --resume)
and `<out>.run.json` (resolved settings, training summary and every evaluation number).
Generated rollouts are cached under $MTP_ROLLOUT_CACHE/pretrain_data, so reruns skip generation.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from mtp_heads.checkpoint import _atomic_write, default_heads_path, read_meta
from mtp_heads.pretrain import (HEAD_INITS, OBJECTIVES, DataConfig, PretrainPlan, TokenData, TrainConfig, chat_prompts,
                                decode_speedup, draft_cost, engine_acceptance, pretrain, teacher_forced_acceptance)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d, t = DataConfig(), TrainConfig()
    ap = argparse.ArgumentParser(prog="mtp-rollout train-heads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="named model, .gguf file or HF directory")
    ap.add_argument("--out", default=None, help="checkpoint path (default: the cached default heads)")
    ap.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    ap.add_argument("--depths", type=int, default=t.num_depths)
    ap.add_argument("--loss", default=t.loss, choices=sorted(OBJECTIVES))
    ap.add_argument("--steps", type=int, default=t.steps)
    ap.add_argument("--seqs-per-step", type=int, default=t.seqs_per_step)
    ap.add_argument("--lr", type=float, default=t.lr)
    ap.add_argument("--warmup-steps", type=int, default=t.warmup_steps)
    ap.add_argument("--init", default=t.init, choices=sorted(HEAD_INITS), help="how the heads start")
    ap.add_argument("--draft-vocab", type=int, default=t.draft_vocab_size, help="0 = full vocabulary")
    ap.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every)
    ap.add_argument("--num-sequences", type=int, default=d.num_sequences)
    ap.add_argument("--eval-sequences", type=int, default=d.num_eval_sequences)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--gen-batch", type=int, default=d.gen_batch_size)
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--eval-k", type=int, default=3, help="drafts per round in the engine evaluation")
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for the engine evaluation (0 = skip)")
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--speedup-prompts", type=int, default=0, help="batch-1 k=0 vs k speed test prompts (0 = skip)")
    ap.add_argument("--data-only", action="store_true", help="generate (and cache) the data, then stop")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the checkpoint at --out, no training")
    ap.add_argument("--train-eval-sequences", type=int, default=16,
                    help="training sequences also scored teacher-forced (train vs held-out gap = data-limited)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def plan_from_args(a: argparse.Namespace) -> PretrainPlan:
    data = DataConfig(num_sequences=a.num_sequences, num_eval_sequences=a.eval_sequences,
                      max_new_tokens=a.max_new_tokens, gen_batch_size=a.gen_batch, temperature=a.temperature,
                      seed=a.seed)
    train = TrainConfig(num_depths=a.depths, loss=a.loss, steps=a.steps, seqs_per_step=a.seqs_per_step, lr=a.lr,
                        warmup_steps=a.warmup_steps, init=a.init, temperature=a.temperature,
                        draft_vocab_size=a.draft_vocab,
                        checkpoint_every=a.checkpoint_every, seed=a.seed)
    return PretrainPlan(model=a.model, data=data, train=train)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from rollout.models.decoder import build_model
    from rollout.models.loaders import load_model
    plan = plan_from_args(a)
    out = Path(a.out) if a.out else default_heads_path(a.model, a.depths, a.loss)
    from rollout.run_dir import check_writable
    check_writable(out.parent, "--out directory")     # before minutes of data generation and training
    t0 = time.perf_counter()
    loaded = load_model(a.model)
    policy = build_model(loaded.config, loaded.state_dict)
    report: dict = {"plan": {"model": plan.model, "data": asdict(plan.data), "train": asdict(plan.train)},
                    "out": str(out), "threads": torch.get_num_threads()}
    if a.data_only:
        from mtp_heads.pretrain import prepare_data
        train, held = prepare_data(policy, loaded, plan.data, progress=not a.no_progress)
        report["data"] = {"train_tokens": train.num_completion_tokens(), "eval_tokens": held.num_completion_tokens(),
                          "seconds": time.perf_counter() - t0}
        print(json.dumps(report["data"]))
        return report
    t_train = time.perf_counter()
    if a.eval_only:
        from mtp_heads.checkpoint import load_heads
        from mtp_heads.pretrain import prepare_data
        train, held = prepare_data(policy, loaded, plan.data, progress=not a.no_progress)
        heads, meta = load_heads(out, policy)
    else:
        heads, meta, train, held, result = pretrain(policy, loaded, plan, out, resume=a.resume,
                                                    progress=not a.no_progress)
        report["losses"] = result.losses
        report["train_rows_per_s"] = result.rows_per_s
    report["train"] = {"steps": meta.steps, "train_tokens": train.num_completion_tokens(),
                       "eval_tokens": held.num_completion_tokens(), "draft_vocab_size": meta.draft_vocab_size,
                       "seconds_total": time.perf_counter() - t0,
                       "seconds_data_and_train": time.perf_counter() - t_train}
    report["teacher_forced"] = teacher_forced_acceptance(policy, heads, held, plan.train.temperature)
    if a.train_eval_sequences:
        subset = TokenData.concat([_one(train, i) for i in range(min(a.train_eval_sequences, len(train)))])
        report["teacher_forced_train"] = teacher_forced_acceptance(policy, heads, subset, plan.train.temperature)
    prompts = chat_prompts(loaded, max(a.eval_prompts, a.speedup_prompts), held_out=True, task_fraction=0.25,
                           seed=a.seed + 7)
    if a.eval_prompts:
        report["engine"] = engine_acceptance(policy, heads, prompts[:a.eval_prompts], k=a.eval_k,
                                             temperature=plan.train.temperature, max_new_tokens=a.eval_new_tokens,
                                             seed=a.seed)
    if a.speedup_prompts:
        report["draft_cost_ms"] = draft_cost(policy, heads, k=a.eval_k)
        report["speedup"] = decode_speedup(policy, heads, prompts[:a.speedup_prompts], k=a.eval_k,
                                           temperature=plan.train.temperature, max_new_tokens=a.eval_new_tokens,
                                           seed=a.seed)
    report["meta"] = asdict(read_meta(out))
    report["seconds_total"] = time.perf_counter() - t0
    run_json = out.with_suffix(".run.json")
    _atomic_write(run_json, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2) + "\n"))
    print(summary(report))
    print(f"heads: {out}\nreport: {run_json}")
    return report


def _one(data: TokenData, i: int) -> TokenData:
    tokens, hidden, prompt_len = data.sequence(i)
    return TokenData(tokens, hidden, np.array([0, len(tokens)], dtype=np.int64), np.array([prompt_len], dtype=np.int32))


def summary(report: dict) -> str:
    t = report["train"]
    lines = [f"loss={report['plan']['train']['loss']} steps={t['steps']} train_tokens={t['train_tokens']} "
             f"draft_vocab={t['draft_vocab_size'] or 'full'}"]
    for d in report["teacher_forced"]:
        lines.append(f"  depth {d['depth']}: teacher-forced acceptance rejection={d['rejection']:.3f} "
                     f"greedy={d['greedy']:.3f} ({d['rows']} held-out rows)")
    for d in report.get("teacher_forced_train", []):
        lines.append(f"  depth {d['depth']}: on training sequences rejection={d['rejection']:.3f} "
                     f"greedy={d['greedy']:.3f} ({d['rows']} rows)")
    for mode, r in report.get("engine", {}).items():
        cond = " ".join(f"{c:.3f}" for c in r["conditional_acceptance"])
        lines.append(f"  engine {mode:9s}: acceptance rate {r['acceptance_rate']:.3f}, "
                     f"length {r['acceptance_length']:.2f}, per position [{cond}]")
    if "speedup" in report:
        s = report["speedup"]
        lines.append(f"  batch-1 decode: {s['plain_tokens_per_s']:.2f} -> {s['spec_tokens_per_s']:.2f} tok/s "
                     f"({s['speedup']:.2f}x, k={s['k']}, {s['draft_mode']})")
    if "draft_cost_ms" in report:
        c = report["draft_cost_ms"]
        lines.append(f"  batch-1 ms: target 1 tok {c['target_1']:.1f}, target k+1 tok {c['target_k1']:.1f}, "
                     f"head block {c['head_block']:.1f}, LM head full {c['lm_head_full']:.1f}, "
                     f"draft vocab ({c['draft_vocab_size']}) {c['lm_head_draft']:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
