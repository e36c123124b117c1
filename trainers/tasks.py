"""Verifiable-reward tasks: a fixed prompt set from reasoning-gym (or a user's own function).

RL needs prompts whose answers a program can check. reasoning-gym generates them per dataset
(chain sums, leg counting, spelling backwards, ...) with a scorer that gives partial credit,
so the mix of datasets and their parameters is the difficulty knob. The training set is FIXED
(`num_prompts` items, visited `epochs` times in a new order each epoch) so that learning shows as
a rising reward on prompts seen before, and a held-out split that is never trained on measures
generalisation. A task is text only; turning it into token ids is the codec's job
(trainers/codec.py).

Sampling is deterministic: the prompts of step s depend only on (seed, s), so a resumed or
repeated run sees the same prompts.

A custom source `tasks.source=my.module:make_tasks` replaces reasoning-gym: `make_tasks()`
returns `(items, reward_fn)` with items dicts holding `question` and `answer` (optionally
`dataset`) and `reward_fn(completion_text, item) -> float`.
"""
from __future__ import annotations

import copy
import difflib
import functools
import importlib
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

REASONING_GYM = "reasoning_gym"
DEFAULT_INSTRUCTION = 'Think step by step. End with a line of the form "Answer: <answer>", for example "Answer: 42".'
# "Answer: x", "**Answer:** x", "the answer is x", "The final answer is: x" (the last one counts)
_ANSWER = re.compile(r"\banswer\b\s*(?:is\b\s*:?|:)\s*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# The main job's mix: small problems on which SmolLM2-135M earns some reward with variance inside a
# group of 8 at T = 1 (`mtp-rollout survey-tasks`, docs/rl-job.md "Choosing datasets").
DEFAULT_MIX: dict[str, dict[str, Any]] = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
                         "allow_parentheses": False, "allow_negation": False},
    "count_bits": {"min_n": 1, "max_n": 16},
    "letter_counting": {"min_words": 3, "max_words": 5},
}


@dataclass(frozen=True)
class Task:
    """One prompt, its reference answer and the source's item (what the scorer reads)."""

    domain: str                        # the dataset name (the monitor's per-domain tables key off it)
    prompt: str                        # question + instruction
    answer: str                        # the reference answer
    item: dict = field(default_factory=dict, compare=False, hash=False, repr=False)   # the source's item


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts come from, how many, how often they are revisited, and how they are scored."""

    source: str = REASONING_GYM        # `reasoning_gym`, or `module:function` returning (items, reward_fn)
    datasets: tuple[str, ...] = tuple(DEFAULT_MIX)   # reasoning-gym datasets
    weights: tuple[float, ...] = ()    # share of the prompts per dataset ([] = equal shares)
    params: dict[str, dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(DEFAULT_MIX))   # per dataset
    num_prompts: int = 64              # size of the fixed training prompt set
    epochs: int = 2                    # passes over it (sets the RL steps when `steps` is null)
    heldout_prompts: int = 16          # held-out prompts, never trained on (none in the training set)
    eval_every: int = 5                # score the held-out prompts greedily every N steps and after the last; 0 = never
    format_reward: float = 0.0         # added when the completion has an `Answer: ...` line
    instruction: str = DEFAULT_INSTRUCTION   # appended to every question
    seed: int = 0                      # prompt set and epoch orders: step s always gets the same prompts

    def __post_init__(self) -> None:
        for key, value, low in (("num_prompts", self.num_prompts, 1), ("epochs", self.epochs, 1),
                                ("heldout_prompts", self.heldout_prompts, 0), ("eval_every", self.eval_every, 0)):
            if value < low:
                raise ValueError(f"tasks.{key} must be >= {low}, got {value}")
        if self.source == REASONING_GYM:
            check_datasets(self)
        else:
            _parse_source(self.source)
        if self.weights and (len(self.weights) != len(self.datasets) or min(self.weights) < 0
                             or sum(self.weights) <= 0):
            raise ValueError(f"tasks.weights must be empty or one non-negative weight per dataset "
                             f"({len(self.datasets)}), not all zero; got {list(self.weights)}")


def num_rl_steps(tasks: TaskConfig, prompts_per_step: int, steps: int | None = None) -> int:
    """RL steps of a run: `steps` if given, else enough to cover num_prompts x epochs."""
    return steps if steps is not None else math.ceil(tasks.num_prompts * tasks.epochs / prompts_per_step)


# ------------------------------------------------------------------------------ checks


def dataset_names() -> list[str]:
    """reasoning-gym's registered dataset names."""
    from reasoning_gym.factory import DATASETS
    return sorted(DATASETS)


@functools.lru_cache(maxsize=256)
def _check_dataset(name: str, params_json: str) -> None:
    import reasoning_gym as rg
    names = dataset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        raise ValueError(f"tasks.datasets: unknown reasoning-gym dataset {name!r}"
                         + (f"; closest: {', '.join(close)}" if close else f"; choose from {', '.join(names)}"))
    try:
        rg.create_dataset(name, size=1, seed=0, **json.loads(params_json))[0]
    except Exception as e:  # noqa: BLE001 - reasoning-gym raises assertions, TypeErrors, ValueErrors
        msg = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"tasks.params.{name}: reasoning-gym rejects {json.loads(params_json)}: {msg}") from None


def check_datasets(cfg: TaskConfig) -> None:
    """Unknown dataset names (with the closest registered ones) and parameters reasoning-gym
    rejects fail here, at config load, not minutes into a run."""
    if not cfg.datasets:
        raise ValueError("tasks.datasets is empty; name at least one reasoning-gym dataset")
    if len(set(cfg.datasets)) != len(cfg.datasets):
        raise ValueError(f"tasks.datasets lists a dataset twice: {list(cfg.datasets)}")
    for name in cfg.datasets:
        params = cfg.params.get(name) or {}
        if not isinstance(params, dict):
            raise ValueError(f"tasks.params.{name} must be a mapping of reasoning-gym parameters, got {params!r}")
        _check_dataset(name, json.dumps(dict(params), sort_keys=True, default=list))


def _parse_source(spec: str) -> tuple[str, str]:
    module, sep, func = spec.partition(":")
    if not sep or not module or not func:
        raise ValueError(f"tasks.source={spec!r}: use {REASONING_GYM!r} or 'module.path:function'")
    return module, func


def load_custom_source(spec: str) -> tuple[list[dict], Callable[[str, dict], float]]:
    """(items, reward_fn) of a `module:function` source; a bad spec fails naming tasks.source."""
    module, func = _parse_source(spec)
    try:
        fn = getattr(importlib.import_module(module), func)
    except ImportError as e:
        raise ValueError(f"tasks.source={spec!r}: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise ValueError(f"tasks.source={spec!r}: module {module!r} has no {func!r}") from None
    out = fn()
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple)) and callable(out[1])
            and all(isinstance(i, dict) and "question" in i and "answer" in i for i in out[0])):
        raise ValueError(f"tasks.source={spec!r}: {func}() must return (items, reward_fn) with items a list of "
                         "dicts holding 'question' and 'answer' and reward_fn(completion, item) -> float")
    return list(out[0]), out[1]


# ------------------------------------------------------------------------------ scoring


def extract_answer(completion: str) -> str | None:
    """The last stated answer ("Answer: x", "the answer is x"), without surrounding `**`, spaces or a
    final period; None when the completion states none."""
    found = _ANSWER.findall(completion)
    if not found:
        return None
    text = found[-1].strip()
    while True:
        stripped = text.strip().strip("*").strip().removesuffix(".").strip()
        if stripped == text:
            break
        text = stripped
    return text or None


def last_number(completion: str) -> str | None:
    """The last number in the text (thousands commas dropped): a small policy often ends its
    arithmetic with "... = 12." instead of an answer line."""
    found = _NUMBER.findall(completion.replace(",", ""))
    return found[-1] if found else None


def is_number(text: str) -> bool:
    return _NUMBER.fullmatch(text.strip()) is not None


def largest_remainder(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights`, rounded so the parts add up (ties: earlier first)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(int)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:total - counts.sum()]] += 1
    return counts.tolist()


def _seed(*parts) -> int:
    return int(np.random.SeedSequence([zlib.crc32(str(p).encode()) for p in parts]).generate_state(1)[0])


# ------------------------------------------------------------------------------ the prompt set


class TaskSource:
    """The fixed training prompts, the held-out prompts and the reward of a completion.

    Step s with P prompts per step takes positions s*P .. s*P+P-1 of the epoch order: epoch
    e = position // num_prompts, each epoch a permutation of the training set drawn from (seed, e)."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        if cfg.source == REASONING_GYM:
            self._datasets: dict[str, Any] = {}
            weights = list(cfg.weights) or [1.0] * len(cfg.datasets)
            self.train = self._draw("train", largest_remainder(cfg.num_prompts, weights), exclude=set())
            self.heldout = self._draw("heldout", largest_remainder(cfg.heldout_prompts, weights),
                                      exclude={t.item["question"] for t in self.train})
            self._reward_fn = None
        else:
            items, self._reward_fn = load_custom_source(cfg.source)
            self.train, self.heldout = self._split_custom(items)

    def _task(self, item: dict) -> Task:
        return Task(str(item.get("dataset") or item.get("metadata", {}).get("source_dataset") or "custom"),
                    f"{item['question'].rstrip()}\n\n{self.cfg.instruction}", str(item["answer"]), item)

    def _draw(self, split: str, counts: list[int], exclude: set[str]) -> list[Task]:
        import reasoning_gym as rg
        out = []
        for name, n in zip(self.cfg.datasets, counts):
            if n == 0:
                continue
            params = dict(self.cfg.params.get(name) or {})
            if split == "train":
                ds = rg.create_dataset(name, size=n, seed=_seed(self.cfg.seed, split, name), **params)
                self._datasets[name] = ds
                out += [self._task({**ds[i], "dataset": name}) for i in range(n)]
                continue
            seen, picked = set(exclude), []
            for attempt in range(3):          # regenerate with more candidates when too many collide
                size = (2 * n + 8) * 4 ** attempt
                ds = rg.create_dataset(name, size=size, seed=_seed(self.cfg.seed, split, name, attempt), **params)
                self._datasets.setdefault(name, ds)
                for i in range(size):
                    item = ds[i]
                    if item["question"] not in seen:
                        seen.add(item["question"])
                        picked.append({**item, "dataset": name})
                        if len(picked) == n:
                            break
                if len(picked) == n:
                    break
            if len(picked) < n:
                raise ValueError(f"tasks.heldout_prompts: {name} gives only {len(picked)} distinct questions outside "
                                 f"the training set, {n} wanted; widen tasks.params.{name} or hold out fewer")
            out += [self._task(i) for i in picked]
        return out

    def _split_custom(self, items: list[dict]) -> tuple[list[Task], list[Task]]:
        cfg = self.cfg
        order = np.random.default_rng(_seed(cfg.seed, "custom")).permutation(len(items))
        train = [items[i] for i in order[:cfg.num_prompts]]
        seen = {i["question"] for i in train}
        heldout = []
        for i in order[cfg.num_prompts:]:
            if len(heldout) < cfg.heldout_prompts and items[i]["question"] not in seen:
                seen.add(items[i]["question"])
                heldout.append(items[i])
        if len(train) < cfg.num_prompts or len(heldout) < cfg.heldout_prompts:
            raise ValueError(f"tasks.source={cfg.source!r} gives {len(items)} items: too few for tasks.num_prompts="
                             f"{cfg.num_prompts} plus tasks.heldout_prompts={cfg.heldout_prompts} distinct questions")
        return [self._task(i) for i in train], [self._task(i) for i in heldout]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Indices of the training set in epoch `epoch`'s order."""
        return np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.train))

    def sample(self, n: int, step: int) -> list[Task]:
        """The n prompts of RL step `step` (>= 0) with n prompts per step."""
        if n < 1 or step < 0:
            raise ValueError(f"need n >= 1 tasks and step >= 0, got n={n}, step={step}")
        size = len(self.train)
        positions = range(step * n, step * n + n)
        orders = {e: self.epoch_order(e) for e in {p // size for p in positions}}
        return [self.train[orders[p // size][p % size]] for p in positions]

    def score(self, task: Task, completion: str) -> float:
        """Reward of one completion text: the source's score (reasoning-gym: of the stated answer,
        or, for a numeric reference answer, of the last number when none is stated; 0 without
        either) plus format_reward when an answer is stated."""
        answer = extract_answer(completion)
        bonus = self.cfg.format_reward * (answer is not None)
        if self._reward_fn is not None:
            return float(self._reward_fn(completion, task.item)) + bonus
        if answer is None and is_number(task.answer):
            answer = last_number(completion)
        if answer is None:
            return 0.0
        ds = self._datasets.get(task.domain)
        if ds is None:
            import reasoning_gym as rg
            ds = self._datasets[task.domain] = rg.create_dataset(task.domain, size=1, seed=0,
                                                                 **dict(self.cfg.params.get(task.domain) or {}))
        score = float(ds.score_answer(answer, task.item))
        # above 1 only by rounding in a sum of partial credits (spell_backward: a right prefix plus extra
        # letters scores 1.0000000000000002): partial credit, so just below 1, never a pass
        return (score if score <= 1.0 else float(np.nextafter(1.0, 0.0))) + bonus
