"""On-policy samples: prompts for the policy's own completions, and the examples made from them.

Prompts are ShareGPT first user turns and RL task prompts (passed in as text by the caller:
mtp_heads does not import trainers). Each prompt carries a key that decides its split with the
same rule as the teacher-forced conversations: a ShareGPT prompt keeps its conversation's key,
so a held-out conversation's user turn is never sampled for training.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mtp_heads.data.builder import Example, completion_example
from mtp_heads.data.sharegpt import ChatEncoder, Conversation
from mtp_heads.data.splits import split_of

# generate(prompts, seed) -> one completion (token ids, EOS included when emitted) per prompt
GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


@dataclass(frozen=True)
class Prompt:
    key: str               # split key: "sharegpt:<conversation key>" or "task:<prompt text>"
    ids: tuple[int, ...]   # chat-template tokens ending in the assistant generation prompt


def sharegpt_prompts(convs: Sequence[Conversation], encoder: ChatEncoder, max_prompt_tokens: int) -> list[Prompt]:
    """The first user turn of each conversation (system turns before it kept), when short enough."""
    out = []
    for c in convs:
        head = []
        for m in c.messages:
            head.append(m)
            if m["role"] == "user":
                break
        if head[-1]["role"] != "user" or not head[-1]["content"].strip():
            continue
        ids = encoder.prompt_ids(head)
        if len(ids) <= max_prompt_tokens:
            out.append(Prompt(c.key, tuple(ids)))
    return out


def task_prompts(texts: Sequence[str], encoder: ChatEncoder) -> list[Prompt]:
    """RL task prompts as single user turns, each distinct text once."""
    return [Prompt(f"task:{t}", tuple(encoder.prompt_ids([{"role": "user", "content": t}])))
            for t in dict.fromkeys(texts)]


def mix_prompts(chat: Sequence[Prompt], tasks: Sequence[Prompt], task_fraction: float, split: str,
                heldout_fraction: float, seed: int = 0) -> list[Prompt]:
    """Prompts of `split`, about task_fraction of them tasks, in a seeded order."""
    chat = [p for p in chat if split_of(p.key, heldout_fraction) == split]
    tasks = [p for p in tasks if split_of(p.key, heldout_fraction) == split]
    n_tasks = min(len(tasks), int(round(len(chat) * task_fraction / max(1e-9, 1 - task_fraction))))
    chosen = list(chat) + list(tasks[:n_tasks])
    order = np.random.default_rng([seed, 7]).permutation(len(chosen))
    return [chosen[i] for i in order]


def onpolicy_examples(generate: GenerateFn, max_len: int, seed: int) -> Callable[[list[Prompt], int], list[Example]]:
    """make_examples for build_shards: sample completions for a shard's prompts (seed per shard)."""

    def make(prompts: list[Prompt], shard_index: int) -> list[Example]:
        completions = generate([list(p.ids) for p in prompts], seed * 1_000_003 + shard_index)
        out = []
        for p, comp in zip(prompts, completions):
            ex = completion_example(p.key, p.ids, comp)
            out.append(Example(ex.key, ex.tokens[:max_len], ex.assistant[:max_len]))
        return out

    return make
