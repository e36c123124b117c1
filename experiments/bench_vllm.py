"""vLLM with our MTP heads vs vLLM plain vs the torch engine, on the default model.

    python -m experiments.bench_vllm [--heads auto|init|PATH] [--k 3] [--draft-mode rejection]
                                     [--temperature 1.0] [--max-new-tokens 64] [--repeats 3] [--batch 1 8]

Runs, per batch size, `repeats` generations of the same chat prompts with: the torch engine
(speculative, its own heads: all D depths), vLLM plain (k = 0) and vLLM speculative (depth 1 of
the heads reused for k drafts). Prints median tokens/s, ratios against vLLM plain, acceptance
rate / length / per position. The torch engine
runs first: starting vLLM lowers torch's thread count in this process. One vLLM instance at a time.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from experiments.generate import DEFAULT_PROMPTS, resolve_heads
from rollout.models.loaders import DEFAULT_MODEL, apply_chat_template
from rollout.models.policy import load_policy
from rollout.torch_engine import TorchEngine
from rollout.types import DRAFT_MODES, SamplingParams, SpecDecodingStats
from rollout.vllm import VLLMEngine, VLLMEngineConfig

PROMPTS = DEFAULT_PROMPTS + [
    "List four animals that live in the ocean.",
    "What is 12 times 7? Explain briefly.",
    "Write a haiku about autumn leaves.",
    "Give two tips for learning a new language.",
    "Explain what a prime number is to a child.",
    "Name three uses of a paperclip.",
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--heads", default="auto", help="checkpoint path, 'init' or 'auto' (trained if cached)")
    ap.add_argument("--num-depths", type=int, default=3, help="depths of the 'auto' heads checkpoint")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-mode", choices=DRAFT_MODES, default="rejection")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--compile", action="store_true", help="vLLM without enforce_eager (torch.compile)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="of the torch engine and the teacher-forced pass")
    ap.add_argument("--gpu-mem-util", type=float, default=0.3, help="vLLM gpu_memory_utilization (GPU only)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (DESIGN.md: more threads than free cores make OMP spin; 2 on 2 shared "
                         "cores measured 0.16 tok/s)")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args(argv)


def _stats(batches) -> SpecDecodingStats:
    total = SpecDecodingStats()
    for b in batches:
        total = total.merge(b.spec_stats())
    return total


def _run(engine, prompts, sp: SamplingParams, repeats: int) -> tuple[float, SpecDecodingStats]:
    """Median tokens/s over `repeats` (seeds differ), and the merged acceptance counters."""
    engine.generate(prompts, sp)                           # warm-up (allocations, prefix cache)
    rates, batches = [], []
    for r in range(repeats):
        batch = engine.generate(prompts, SamplingParams(**{**sp.__dict__, "seed": 1000 + r}))
        rates.append(batch.tokens_per_s)
        batches.append(batch)
    return statistics.median(rates), _stats(batches)


def _fmt(s: SpecDecodingStats) -> str:
    if not s.num_drafts:
        return ""
    pos = " ".join(f"{a:.2f}" for a in s.conditional_acceptance)
    return f"acc {s.acceptance_rate:.3f} tau {s.acceptance_length:.2f} per-pos [{pos}]"


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    policy, loaded = load_policy(args.model, "float32")
    heads, heads_desc = resolve_heads(policy, args.model, args.heads, args.num_depths)
    policy, heads = policy.to(args.device), heads.to(args.device)
    chats = [apply_chat_template(loaded, [{"role": "user", "content": p}]) for p in PROMPTS]
    sp = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, draft_mode=args.draft_mode,
              ignore_eos=True)
    vocab = getattr(heads, "draft_vocab", None)
    print(f"model {args.model} float32 on {args.device} | heads {heads_desc} (D={heads.num_depths}, draft vocab "
          f"{'full' if vocab is None else len(vocab)}) | k={args.k} {args.draft_mode} "
          f"T={args.temperature} | {args.max_new_tokens} new tokens | {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} torch threads")
    results: dict = {"args": vars(args), "heads": heads_desc, "rows": []}
    by_batch = {b: [chats[i % len(chats)] for i in range(b)] for b in args.batch}

    if not args.skip_torch:
        eng = TorchEngine(policy, heads)
        for b, prompts in by_batch.items():
            tps, st = _run(eng, prompts, SamplingParams(num_draft_tokens=args.k, **sp), args.repeats)
            results["rows"].append({"engine": "torch-spec", "batch": b, "tok_s": tps, "acc": st.acceptance_rate,
                                    "tau": st.acceptance_length, "per_pos": st.conditional_acceptance})
            print(f"torch spec  B={b}: {tps:7.1f} tok/s  {_fmt(st)}")

    cfg = VLLMEngineConfig(enforce_eager=not args.compile, gpu_memory_utilization=args.gpu_mem_util)
    for k in (0, args.k):
        eng = VLLMEngine(policy, heads, config=cfg)
        for b, prompts in by_batch.items():
            tps, st = _run(eng, prompts, SamplingParams(num_draft_tokens=k, **sp), args.repeats)
            name = "vllm-spec" if k else "vllm-plain"
            results["rows"].append({"engine": name, "batch": b, "tok_s": tps, "acc": st.acceptance_rate if k else None,
                                    "tau": st.acceptance_length if k else None,
                                    "per_pos": st.conditional_acceptance if k else None})
            print(f"{name:11s} B={b}: {tps:7.1f} tok/s  {_fmt(st)}")
            if k:   # vLLM's own counters for the last call, as a cross-check of the per-request ones
                print(f"            vLLM counters (last call): {_fmt(eng.last_stats)}")
        eng.close()

    rate = {(r["engine"], r["batch"]): r["tok_s"] for r in results["rows"]}
    for b in args.batch:
        plain = rate[("vllm-plain", b)]
        line = f"B={b}: vLLM spec / vLLM plain = {rate[('vllm-spec', b)] / plain:.2f}"
        if ("torch-spec", b) in rate:
            line += f"; torch spec / vLLM plain = {rate[('torch-spec', b)] / plain:.2f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
