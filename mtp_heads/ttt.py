"""Training-time test: the heads' forward over whole sequences, unrolled exactly as the engine drafts.

The engine (rollout.torch_engine.TorchEngine._draft) drafts k tokens after position t (the last
position whose policy state h_t is known) like this:

* steps s = 1..D (distinct depths): depth s at position i reads depth s-1's output at i (h_i for
  s = 1) and token x_{i+s}, at RoPE position i, attending causally to its own keys at positions
  <= i. Over a whole sequence that is plain teacher forcing, every position at once.
* steps s > D (recurrence): depth D is applied again to its own step-(s-1) output and the next
  token x_{t+s}, at position t+s-D, and its attention sees depth D's step-D keys at positions
  <= t plus the keys of its own chain from steps D+1..s (EAGLE-3's training-time-test mask).
  A depth with several blocks does this per block, each attending to its own keys.

With D = 1 this is the EAGLE-style recurrent drafter that vLLM runs. `unroll` computes, for every
chain start t of a sequence at once, the output of every step s = 1..k, so that a loss at every
step trains the head for the inputs it sees when drafting.

The step inputs are the sequence's own tokens x_{t+s}, not the head's drafts: the policy's
distribution after a drafted-but-different token is not in the data (it would need a policy
forward per draft), and a drafted token that differs from x_{t+s} is rejected at verification
with the probability the loss at that step already measures, so training on the data's tokens is
training on the path that acceptance continues on.
"""
from __future__ import annotations

import math

import torch

from mtp_heads.heads import MTPHeads
from rollout.models.decoder import CausalLM, DecoderLayer


def _qkv(block: DecoderLayer, policy: CausalLM, x: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # x [B, n, d] the block's input (residual stream); positions [B, n] -> q [B, H, n, hd],
    # k, v [B, H, n, hd] (K/V repeated over query groups: the chain attention below adds per-chain keys,
    # so it cannot read a shared cache the way rollout.models.decoder.Attention does)
    attn = block.self_attn
    q, k, v = attn.project_qkv(block.input_layernorm(x), policy.model.rotary(positions))
    groups = attn.n_heads // attn.n_kv
    return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _finish(block: DecoderLayer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    # x [B, n, d] the block's input; attn_out [B, H, n, hd] -> the block's output [B, n, d]
    attn = block.self_attn
    B, H, n, hd = attn_out.shape
    x = x + attn.o_proj(attn_out.transpose(1, 2).reshape(B, n, H * hd))
    return x + block.mlp(block.post_attention_layernorm(x))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q, k, v [B, H, n, hd]: query i sees keys j <= i
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def chain_attention(q: torch.Tensor,                                   # [B, H, n, hd] step s, chain t = 0..n-1
                     base: tuple[torch.Tensor, torch.Tensor],           # depth D's keys/values [B, H, nb, hd], nb >= n
                     chain: list[tuple[torch.Tensor, torch.Tensor]],    # steps D+1..s: [B, H, n_r >= n, hd] each
                     ) -> torch.Tensor:                                 # [B, H, n, hd]
    """Chain t attends to base keys at positions <= t and to its own keys of the recurrent steps
    (EAGLE-3's training-time-test mask; mtp_heads.eagle3_train uses it for EAGLE-3 drafters too)."""
    kb, vb = base
    n, nb = q.shape[2], kb.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, kb.transpose(-1, -2)) * scale                              # [B, H, n, nb]
    visible = torch.arange(nb, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    own = [(q * k[:, :, :n]).sum(-1, keepdim=True) * scale for k, _ in chain]          # [B, H, n, 1] each
    w = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1)
    out = torch.matmul(w[..., :nb], vb)
    for r, (_, v) in enumerate(chain):
        out = out + w[..., nb + r:nb + r + 1] * v[:, :, :n]
    return out


def unroll(heads: MTPHeads, policy: CausalLM,
           hidden: torch.Tensor,   # [B, T, d] policy final-norm states; hidden[:, t] predicts tokens[:, t+1]
           tokens: torch.Tensor,   # [B, T] int64
           steps: int) -> list[torch.Tensor]:
    """Head outputs of draft steps s = 1..steps for every chain start t.

    Returns one tensor per step (fewer when the sequence is too short): step s is [B, T-s, d],
    row t is the head's state after reading x_{t+1..t+s}; it drafts x_{t+s+1} and its teacher is
    the policy's distribution at position t+s, softmax(W hidden[:, t+s] / T).
    For steps <= num_depths this equals MTPHeads.teacher_forced.
    """
    B, T, _ = hidden.shape
    D = heads.num_depths
    dev = hidden.device
    outs: list[torch.Tensor] = []
    prev, base = hidden, []
    for s in range(1, min(steps, D) + 1):
        n = T - s
        if n <= 0:
            return outs
        depth, positions = heads.depths[s - 1], torch.arange(n, device=dev).expand(B, n)
        x, base = depth.input(prev[:, :n], policy.model.embed_tokens(tokens[:, s:s + n])), []
        for block in depth.blocks:
            q, k, v = _qkv(block, policy, x, positions)
            x = _finish(block, x, causal_attention(q, k, v))
            base.append((k, v))                       # depth D's keys per block, for the recurrence
        prev = depth.norm(x)
        outs.append(prev)
    depth = heads.depths[D - 1]
    chains: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in depth.blocks]
    for s in range(D + 1, steps + 1):
        n = T - s
        if n <= 0:
            break
        positions = (torch.arange(n, device=dev) + (s - D)).expand(B, n)
        x = depth.input(prev[:, :n], policy.model.embed_tokens(tokens[:, s:s + n]))
        for block, block_base, chain in zip(depth.blocks, base, chains):
            q, k, v = _qkv(block, policy, x, positions)
            chain.append((k, v))
            x = _finish(block, x, chain_attention(q, block_base, chain))
        prev = depth.norm(x)
        outs.append(prev)
    return outs
