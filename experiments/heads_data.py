"""Self-generated head training data: the policy's own rollouts with its hidden states.

For policies without a token store (mtp_heads.data), the heads train on what the policy itself
writes: sample completions (TorchEngine, k = 0, temperature T) for chat prompts and, when the
caller passes them, RL-task prompts; keep each sequence's tokens and the policy's final-norm state
at every position (SamplingParams.return_hidden_states plus one teacher-forced forward per
distinct prompt). Generation dominates the cost on a CPU, so the result is cached as an .npz
keyed by model, prompts and settings. Lives in experiments/ because it needs an engine.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mtp_heads.token_data import TokenData
from rollout.models.decoder import CausalLM
from rollout.models.default_model import cache_dir
from rollout.models.flat_weights import weights_digest
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams

DATA_FORMAT = 2

# Varied user turns (explanations, lists, code, maths, stories): the chat traffic heads must draft.
BUILTIN_PROMPTS: tuple[str, ...] = (
    "Explain why the sky is blue.",
    "Write a short poem about the ocean.",
    "What are three tips for staying healthy?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "How do I reverse a list in Python?",
    "What is the capital of France, and what is it famous for?",
    "Give me a recipe for pancakes.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a virus and a bacterium?",
    "List five animals that live in the desert.",
    "How does a rainbow form?",
    "Write a Python function that checks whether a number is prime.",
    "What causes the seasons on Earth?",
    "Describe your ideal weekend.",
    "Tell me a short story about a brave little mouse.",
    "What is machine learning?",
    "How many minutes are there in a day? Show your work.",
    "Give me three ideas for a birthday party.",
    "Why do cats purr?",
    "Explain what a black hole is.",
    "Write an email asking my manager for a day off.",
    "What are the benefits of reading books?",
    "How do airplanes stay in the air?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is 17 times 23?",
    "Name the planets of the solar system in order.",
    "Write a limerick about a cat who loves coffee.",
    "How can I improve my sleep?",
    "What is the water cycle?",
    "Explain the rules of chess briefly.",
    "Write a SQL query that counts the rows in a table called users.",
    "What is the Pythagorean theorem?",
    "Suggest a name for a coffee shop and explain why.",
    "What are the main causes of climate change?",
    "Describe how to make a paper airplane.",
    "Why is exercise important?",
    "What is the difference between weather and climate?",
    "Give me a motivational quote and explain it.",
    "How do vaccines work?",
)


@dataclass(frozen=True)
class GenerateConfig:
    """Which rollouts to generate when there is no token store (and for the held-out evaluation)."""

    num_sequences: int = 128            # training rollouts
    num_eval_sequences: int = 16        # held-out rollouts (other prompts, other seeds)
    max_new_tokens: int = 96            # completion length cap
    gen_batch_size: int = 32            # rollouts generated at once
    temperature: float = 1.0            # sampling temperature of the rollouts
    task_fraction: float = 0.0          # share of prompts taken from `task_prompts` (passed in by the caller)
    seed: int = 0                       # sampling seed

    def __post_init__(self) -> None:
        """Values that would only fail after the model loads, named by their key in train-heads."""
        for name in ("num_sequences", "num_eval_sequences", "max_new_tokens", "gen_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.generate.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"data.generate.temperature must be finite and >= 0, got {self.temperature}")
        if not 0 <= self.task_fraction <= 1:
            raise ValueError(f"data.generate.task_fraction must be in [0, 1], got {self.task_fraction}")


def prompt_texts(n: int, *, held_out: bool, task_prompts: Sequence[str] = (),
                 task_fraction: float = 0.0) -> list[str]:
    """n user messages; held_out picks disjoint ones (cycled when n exceeds them).

    Built-in prompts are split 4:1 into train/held-out; `task_prompts` (e.g. the RL tasks' prompts,
    passed in by the caller) fill `task_fraction` of the n, split the same way.
    """
    texts = [t for i, t in enumerate(BUILTIN_PROMPTS) if (i % 5 == 0) == held_out]
    tasks = [t for i, t in enumerate(task_prompts) if (i % 5 == 0) == held_out]
    n_tasks = min(int(round(n * task_fraction)), len(tasks))
    return tasks[:n_tasks] + [texts[i % len(texts)] for i in range(n - n_tasks)]


def chat_prompts(encode: Callable[[str], list[int]], n: int, *, held_out: bool, task_prompts: Sequence[str] = (),
                 task_fraction: float = 0.0) -> list[list[int]]:
    """prompt_texts(...) as token lists through `encode` (a codec's encode_prompt: the model's chat
    template, or bytes for the tiny test model)."""
    chosen = prompt_texts(n, held_out=held_out, task_prompts=task_prompts, task_fraction=task_fraction)
    return [encode(t) for t in chosen]


def data_cache_path(policy: CausalLM, prompts: list[list[int]], cfg: GenerateConfig, split: str) -> Path:
    """$MTP_ROLLOUT_CACHE/pretrain_data/<key>.npz, key = hash(weights, prompts, settings, split)."""
    blob = json.dumps({"format": DATA_FORMAT, "arch": policy.config.fingerprint(), "weights": weights_digest(policy),
                       "prompts": prompts, "cfg": asdict(cfg), "split": split}, sort_keys=True)
    return cache_dir() / "pretrain_data" / f"{split}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}.npz"


def generate_token_data(policy: CausalLM, prompts: list[list[int]], cfg: GenerateConfig, *, seed: int,
                        progress: bool = True) -> TokenData:
    """Sample one completion per prompt (k = 0, temperature cfg.temperature) with the states."""
    engine = TorchEngine(policy)
    d = policy.config.hidden_size
    prompt_hidden: dict[tuple[int, ...], np.ndarray] = {}
    tokens, hidden, lengths, prompt_lens = [], [], [], []
    bar = tqdm(total=len(prompts), desc="generate", unit="seq", disable=not progress)
    started, made = time.perf_counter(), 0
    for b0 in range(0, len(prompts), cfg.gen_batch_size):
        chunk = prompts[b0:b0 + cfg.gen_batch_size]
        sp = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            seed=seed * 1_000_003 + b0, return_hidden_states=True)
        batch = engine.generate(chunk, sp)
        for prompt, comp in zip(chunk, batch.completions):
            key = tuple(prompt)
            if key not in prompt_hidden:
                with torch.inference_mode():
                    ids = torch.tensor([prompt], dtype=torch.long, device=policy.lm_head_weight.device)
                    prompt_hidden[key] = policy.hidden_states(ids)[0].float().cpu().numpy()
            P = len(prompt)
            tokens.append(np.asarray(list(prompt) + comp.tokens, dtype=np.int32))
            hidden.append(np.concatenate([prompt_hidden[key][:P - 1], comp.hidden_states,
                                          np.zeros((1, d), np.float32)]))
            lengths.append(P + len(comp.tokens))
            prompt_lens.append(P)
            made += len(comp.tokens)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{made / (time.perf_counter() - started):.0f}")
    bar.close()
    return TokenData(np.concatenate(tokens), np.concatenate(hidden).astype(np.float32),
                     np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                     np.asarray(prompt_lens, dtype=np.int32))


def cached_token_data(policy: CausalLM, prompts: list[list[int]], cfg: GenerateConfig, split: str, *,
                      seed: int, progress: bool = True) -> TokenData:
    """generate_token_data, reusing the .npz from an earlier run with the same key."""
    path = data_cache_path(policy, prompts, cfg, split)
    if path.is_file():
        return TokenData.load(path)
    data = generate_token_data(policy, prompts, cfg, seed=seed, progress=progress)
    data.save(path)
    return data


def prepare_generated_data(policy: CausalLM, encode: Callable[[str], list[int]], cfg: GenerateConfig,
                           task_prompts: Sequence[str] = (), progress: bool = True) -> tuple[TokenData, TokenData]:
    """(train, held-out) rollouts of the policy on prompts rendered by `encode`, from the cache when present."""
    train_prompts = chat_prompts(encode, cfg.num_sequences, held_out=False, task_prompts=task_prompts,
                                 task_fraction=cfg.task_fraction)
    eval_prompts = chat_prompts(encode, cfg.num_eval_sequences, held_out=True, task_prompts=task_prompts,
                                task_fraction=cfg.task_fraction)
    train = cached_token_data(policy, train_prompts, cfg, "train", seed=cfg.seed, progress=progress)
    held = cached_token_data(policy, eval_prompts, cfg, "eval", seed=cfg.seed + 1, progress=progress)
    return train, held
