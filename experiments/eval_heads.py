"""Evaluation that needs an engine: measured acceptance per draft mode, batch-1 decode speed and the
cost of one speculative round's pieces. The cheap teacher-forced evaluation lives in
mtp_heads.evaluate; this module is for experiments and the train-heads report.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from mtp_heads.checkpoint import draft_vocab_of
from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM
from rollout.engine.config import EngineConfig
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams


def engine_acceptance(policy: CausalLM, heads: MTPHeads, prompts: list[list[int]], *, k: int = 3,
                      temperature: float = 1.0, max_new_tokens: int = 128, batch_size: int = 8,
                      modes: Sequence[str] = ("greedy", "rejection"), seed: int = 0) -> dict[str, dict]:
    """The engine's measured acceptance at k drafts per round, per draft mode."""
    engine = TorchEngine(policy, heads, config=EngineConfig(draft_lengths="fixed"))   # the heads at k, every row
    out = {}
    for mode in modes:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, num_draft_tokens=k,
                            draft_mode=mode, seed=seed)
        stats, wall, ntok = None, 0.0, 0
        for b0 in range(0, len(prompts), batch_size):
            batch = engine.generate(prompts[b0:b0 + batch_size], sp)
            s = batch.spec_stats()
            stats = s if stats is None else stats.merge(s)
            wall += batch.wall_time_s
            ntok += batch.num_tokens
        out[mode] = {"acceptance_rate": stats.acceptance_rate, "acceptance_length": stats.acceptance_length,
                     "conditional_acceptance": stats.conditional_acceptance, "rounds": stats.num_drafts,
                     "tokens_per_s": ntok / wall if wall else float("nan")}
    return out


def decode_speedup(policy: CausalLM, heads: MTPHeads, prompts: list[list[int]], *, k: int = 3,
                   temperature: float = 1.0, max_new_tokens: int = 128, draft_mode: str = "rejection",
                   repeats: int = 1, seed: int = 0) -> dict:
    """Batch-1 tokens/s of plain decoding (k = 0) vs speculative (k), prompt by prompt, interleaved
    so that load from other processes hits both alike."""
    engine = TorchEngine(policy, heads, config=EngineConfig(draft_lengths="fixed"))   # the heads at k, every row
    times = {0: [0.0, 0], k: [0.0, 0]}
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            for kk in (0, k):
                sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, num_draft_tokens=kk,
                                    draft_mode=draft_mode, seed=seed + 1000 * r + i, ignore_eos=True)
                batch = engine.generate([prompt], sp)
                times[kk][0] += batch.wall_time_s
                times[kk][1] += batch.num_tokens
    base, spec = times[0][1] / times[0][0], times[k][1] / times[k][0]
    return {"k": k, "plain_tokens_per_s": base, "spec_tokens_per_s": spec, "speedup": spec / base,
            "draft_mode": draft_mode, "max_new_tokens": max_new_tokens, "prompts": len(prompts) * repeats}


@torch.inference_mode()
def draft_cost(policy: CausalLM, heads: MTPHeads, *, context: int = 96, k: int = 3, repeats: int = 15) -> dict:
    """Batch-1 wall times (ms, medians) of the pieces of one speculative round.

    target_1 / target_k1: policy forward over 1 / k+1 new tokens after `context` cached ones;
    head_block: one depth's block on 1 token; lm_head_full / lm_head_draft: logits over V / the
    draft vocabulary. Speedup ~ tau * target_1 / (target_k1 + k * (head_block + lm_head)).
    """
    dev = policy.lm_head_weight.device
    d = policy.config.hidden_size
    ids = torch.randint(3, policy.config.vocab_size, (1, context + k + 1), device=dev)
    cache = policy.new_cache(1, context + k + 2)
    policy.hidden_states(ids[:, :context], cache)
    hcache = heads.new_caches(1, context + k + 2, policy.lm_head_weight.dtype, dev)[0]
    pos = torch.tensor([[context]], device=dev)
    h = torch.randn(1, 1, d, device=dev, dtype=policy.lm_head_weight.dtype)
    heads.depth_forward(0, policy, torch.randn(1, context, d, device=dev), ids[:, 1:context + 1],
                        torch.arange(context, device=dev)[None], hcache)
    vocab = draft_vocab_of(heads)
    W_draft = policy.lm_head_weight if vocab is None else policy.lm_head_weight.index_select(0, vocab)
    start = torch.tensor([context], device=dev)

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return 1000 * float(np.median(ts))

    out = {
        "target_1": timed(lambda: policy.hidden_states(ids[:, context:context + 1], cache, start)),
        "target_k1": timed(lambda: policy.hidden_states(ids[:, context:context + k + 1], cache, start)),
        "head_block": timed(lambda: heads.depth_forward(0, policy, h, ids[:, context:context + 1], pos, hcache)),
        "lm_head_full": timed(lambda: torch.softmax(policy.compute_logits(h[:, 0]), -1)),
        "lm_head_draft": timed(lambda: torch.softmax(F.linear(h[:, 0], W_draft).float(), -1)),
        "draft_vocab_size": int(W_draft.shape[0]), "k": k, "context": context,
    }
    return out
