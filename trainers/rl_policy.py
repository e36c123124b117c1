"""The policy the RL loop trains: where its weights come from and which of them are trained.

On 2 CPU cores a full backward through a 135M model per step is too slow for a 15-minute
job, so only the last N decoder layers (and the final norm) are trained by default: the
earlier layers are frozen and build no autograd graph at all. The shared embedding / LM
head stays frozen too, which keeps the MTP heads' input and output spaces fixed while the
policy's hidden states move (the drift the head co-trainer exists for).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout.models.config import ModelConfig
from rollout.models.decoder import CausalLM, random_model
from rollout.models.dtypes import AUTO, parse_dtype
from rollout.models.loaders import LoadedModel, load_policy
from trainers.codec import ByteCodec, ChatCodec, TextCodec

# a byte-level tiny model: seconds per RL step on a CPU (smoke job, tests)
TINY_RANDOM = ModelConfig(vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          eos_token_ids=(10,))


@dataclass
class Policy:
    """A frozen policy as loaded, and the codec that turns task text into its token ids."""

    model: CausalLM
    codec: TextCodec
    source: str
    loaded: LoadedModel | None = None   # tokenizer and chat template of a real model (head pre-training needs it)


def _tiny_random(dtype: torch.dtype, seed: int) -> Policy:
    return Policy(random_model(TINY_RANDOM, seed=seed, dtype=dtype), ByteCodec(TINY_RANDOM.vocab_size),
                  "tiny-random")


# names that are not a file or model of rollout.models.loaders
BUILTIN_POLICIES: dict[str, Callable[[torch.dtype, int], Policy]] = {"tiny-random": _tiny_random}


def load_rl_policy(spec: str, dtype: str = AUTO, seed: int = 0) -> Policy:
    """spec: 'tiny-random' (seeded), or anything rollout.models.loaders.load_model accepts."""
    if spec in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[spec](parse_dtype(dtype), seed)
    model, loaded = load_policy(spec, dtype)
    return Policy(model, ChatCodec(loaded), loaded.source, loaded)


def trainable_copy(model: CausalLM, train_last_layers: int, train_final_norm: bool = True,
                   train_embeddings: bool = False) -> tuple[CausalLM, list[str]]:
    """A deep copy of `model` with only the chosen parameters requiring grad; their names.

    train_last_layers: how many of the last decoder layers to train; -1 = all of them.
    """
    n_layers = model.config.num_hidden_layers
    if not (train_last_layers == -1 or 0 <= train_last_layers <= n_layers):
        raise ValueError(f"grpo.train_last_layers must be -1 (all) or in [0, {n_layers}], got {train_last_layers}")
    first = 0 if train_last_layers == -1 else n_layers - train_last_layers
    prefixes = [f"model.layers.{i}." for i in range(first, n_layers)]
    if train_final_norm:
        prefixes.append("model.norm.")
    if train_embeddings:
        prefixes += ["model.embed_tokens.", "lm_head."]
    trainable = copy.deepcopy(model).float()
    names = []
    for name, p in trainable.named_parameters():
        p.requires_grad_(any(name.startswith(pre) for pre in prefixes))
        if p.requires_grad:
            names.append(name)
    if not names:
        raise ValueError("no policy parameter is trainable: set grpo.train_last_layers > 0, "
                         "grpo.train_final_norm or grpo.train_embeddings")
    return trainable.train(), names
