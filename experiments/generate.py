"""`mtp-rollout generate`: chat with the policy through speculative decoding, with live progress.

    mtp-rollout generate --prompt "What is the capital of France?" --k 3 --temperature 0
"""
from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from mtp_heads.shipped import resolve_heads
from rollout.models.loaders import DEFAULT_MODEL, apply_chat_template, load_policy
from rollout.torch_engine import TorchEngine
from rollout.types import DRAFT_MODES, SamplingParams

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mtp-rollout generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="named model, .gguf file or HF directory")
    ap.add_argument("--heads", default="shipped", help="shipped (default) | init | a heads checkpoint path")
    ap.add_argument("--num-depths", type=int, default=None, help="depths of heads=init (default 1)")
    ap.add_argument("--prompt", action="append", help="user message (repeatable); default: four demo prompts")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round (0 = plain decoding)")
    ap.add_argument("--draft-mode", choices=DRAFT_MODES, default="rejection")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto (bfloat16 where the hardware computes it)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              num_draft_tokens=args.k, draft_mode=args.draft_mode, seed=args.seed)
    try:                                   # bad values fail before the model loads, named as flags
        sampling.validate()
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('_', '-').replace('num-draft-tokens (k)', 'k')}") from None
    torch.set_num_threads(max(1, torch.get_num_threads()))
    policy, loaded = load_policy(args.model, args.dtype)
    heads, heads_desc = resolve_heads(policy, args.heads, model=args.model, num_depths=args.num_depths)
    engine = TorchEngine(policy, heads if args.k > 0 else None)
    print(f"model: {args.model} ({loaded.config.num_hidden_layers} layers, d={loaded.config.hidden_size})  "
          f"heads: {heads_desc}  k={args.k} {args.draft_mode}")
    totals = {"accepted": 0, "proposed": 0}
    with tqdm(total=args.max_new_tokens * len(args.prompt or DEFAULT_PROMPTS), unit="tok") as bar:
        def progress(new_tokens: int, accepted: int, proposed: int) -> None:
            totals["accepted"] += accepted
            totals["proposed"] += proposed
            rate = totals["accepted"] / totals["proposed"] if totals["proposed"] else float("nan")
            bar.set_postfix(acceptance=f"{rate:.2f}")
            bar.update(new_tokens)

        answers = []
        for message in args.prompt or DEFAULT_PROMPTS:
            ids = apply_chat_template(loaded, [{"role": "user", "content": message}])
            batch = engine.generate([ids], sampling, progress=progress)
            answers.append((message, batch))
    for message, batch in answers:
        comp = batch.completions[0]
        stats = batch.spec_stats()
        print(f"\n>>> {message}\n{loaded.tokenizer.decode(comp.tokens, skip_special_tokens=True)}")
        print(f"[{len(comp.tokens)} tokens, {batch.tokens_per_s:.1f} tok/s"
              + (f", acceptance {stats.acceptance_rate:.2f}, tau {stats.acceptance_length:.2f}]" if args.k else "]"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
