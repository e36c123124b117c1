"""Building the token store shard by shard: resumable, and rebuilding what is corrupt.

Shard i of a (source, split) holds the examples made from items[i * n : (i + 1) * n] of a
fixed, seeded item list (conversations or prompts), so its content depends only on i: a
build that is interrupted, or that is re-run with a larger token target, keeps every intact
shard, rebuilds a corrupt or partial one (saying which) and appends new ones.

`add_rollouts` is the hook for RL rollouts (source "rollout"): the co-trainer's replay hands
it token ids and the policy's hidden states, and it appends them as one shard per call.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mtp_heads.data.sharegpt import loss_mask_of
from mtp_heads.data.splits import split_of
from mtp_heads.data.teacher_force import teacher_force, to_bf16_bits
from mtp_heads.data.token_store import SOURCES, ShardArrays, StoreWriter, shard_name
from rollout.models.decoder import CausalLM


@dataclass(frozen=True)
class Example:
    """One sequence before teacher forcing."""

    key: str                 # conversation / prompt id (decides the split)
    tokens: np.ndarray       # [T] int32
    assistant: np.ndarray    # [T] bool, token t is assistant/completion text


@dataclass
class BuildReport:
    source: str
    split: str
    shards_kept: int = 0
    shards_built: int = 0
    shards_rebuilt: int = 0
    tokens: int = 0            # in the (source, split) after the build
    tokens_built: int = 0      # teacher-forced by this call
    seconds: float = 0.0       # spent building shards

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_built / self.seconds if self.seconds else 0.0


def build_shards(writer: StoreWriter, policy: CausalLM, *, source: str, split: str, items: Sequence,
                 make_examples: Callable[[list, int], list[Example]], items_per_shard: int,
                 target_tokens: int, params: dict | None = None, max_batch_tokens: int = 4096,
                 log: Callable[[str], None] = print) -> BuildReport:
    """Shards of (source, split) until they hold >= target_tokens tokens or the items run out.

    make_examples(items_of_shard, shard_index) -> examples (teacher-forced here); it must be
    deterministic in its arguments for a resumed build to equal an uninterrupted one. params
    (JSON-able) are the settings behind make_examples; existing shards made with others are refused.
    """
    params = {**(params or {}), "items_per_shard": items_per_shard, "num_items": len(items)}
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    report = BuildReport(source, split)
    num_shards = -(-len(items) // items_per_shard)
    for i in range(num_shards):
        if report.tokens >= target_tokens:
            break
        name = shard_name(source, split, i)
        problem = writer.check(name)
        if problem is None:
            entry = writer.manifest()["shards"][name]
            if entry.get("params") != params:
                raise ValueError(f"shard {name} of {writer.root} was built with {entry.get('params')}, "
                                 f"this build asks for {params}; use another store root")
            report.shards_kept += 1
            report.tokens += entry["num_tokens"]
            continue
        if problem != "not built":
            log(f"shard {name} is corrupt or partial ({problem}): deleting and rebuilding it")
            writer.drop(name)
            report.shards_rebuilt += 1
        t0 = time.perf_counter()
        chunk = list(items[i * items_per_shard:(i + 1) * items_per_shard])
        examples = [e for e in make_examples(chunk, i) if len(e.tokens) >= 2 and e.assistant[1:].any()]
        if not examples:
            log(f"shard {name}: no usable examples in its {len(chunk)} items, skipped")
            continue
        hidden = teacher_force(policy, [e.tokens for e in examples], max_batch_tokens)
        data = ShardArrays.from_sequences([(e.tokens, h, loss_mask_of(e.assistant), source, e.key)
                                 for e, h in zip(examples, hidden)])
        entry = writer.add_shard(name, split, data, params)
        dt = time.perf_counter() - t0
        report.shards_built += 1
        report.tokens += entry["num_tokens"]
        report.tokens_built += entry["num_tokens"]
        report.seconds += dt
        log(f"shard {name}: {entry['num_sequences']} seqs, {entry['num_tokens']} tokens "
            f"({entry['num_loss_tokens']} in the loss) in {dt:.0f} s = {entry['num_tokens'] / dt:.0f} tok/s; "
            f"{source}/{split} now {report.tokens} tokens")
    return report


def completion_example(key: str, prompt: Sequence[int], completion: Sequence[int]) -> Example:
    """A prompt + completion sequence whose completion tokens are the assistant text."""
    tokens = np.asarray(list(prompt) + list(completion), dtype=np.int32)
    assistant = np.zeros(len(tokens), dtype=bool)
    assistant[len(prompt):] = True
    return Example(key, tokens, assistant)


def add_rollouts(writer: StoreWriter, rollouts: Sequence[tuple[Sequence[int], torch.Tensor | np.ndarray, int, str]],
                 *, heldout_fraction: float = 0.02) -> list[str]:
    """Append RL rollouts as source "rollout"; returns the names of the shards written.

    rollouts: (tokens [T] ids, hidden [T, d] the policy's final-norm states (float tensor, or
    uint16 bf16 bits), prompt_len, key) each; key (e.g. the prompt text) decides the split
    with the same rule as every other source. One shard per split per call; one process at a
    time adds rollouts to a store. Typical use: add_rollouts(StoreWriter.existing(root), batch).
    """
    by_split: dict[str, list] = {"train": [], "heldout": []}
    for tokens, hidden, prompt_len, key in rollouts:
        ex = completion_example(key, list(tokens)[:prompt_len], list(tokens)[prompt_len:])
        bits = hidden if isinstance(hidden, np.ndarray) and hidden.dtype == np.uint16 else to_bf16_bits(
            torch.as_tensor(hidden))
        if len(bits) != len(ex.tokens):
            raise ValueError(f"rollout {key!r}: {len(ex.tokens)} tokens but {len(bits)} hidden states")
        by_split[split_of(key, heldout_fraction)].append((ex.tokens, bits, loss_mask_of(ex.assistant), "rollout", key))
    names = []
    for split, seqs in by_split.items():
        if not seqs:
            continue
        taken = {n for n in writer.manifest()["shards"] if n.startswith(f"rollout-{split}-")}
        i = len(taken)
        while shard_name("rollout", split, i) in taken:
            i += 1
        names.append(shard_name("rollout", split, i))
        writer.add_shard(names[-1], split, ShardArrays.from_sequences(seqs))
    return names
