"""Verifiable-reward tasks generated on the fly, one registry entry per domain.

RL needs prompts whose answers a program can check, and the monitor reports acceptance
per domain, so the domains should differ in how predictable their answers are:
arithmetic (digits, low entropy once the model commits) versus string manipulation
(spelling a word backwards or in capitals). A task is text only; turning it into token
ids is the codec's job (trainers/codec.py).

Sampling is deterministic: the tasks of step s depend only on (seed, s), so a resumed or
repeated run sees the same prompts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Task:
    """One prompt and what a correct completion must contain."""

    domain: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class TaskConfig:
    """Which domains to draw from and how hard the tasks are."""

    domains: tuple[str, ...] = ("arithmetic", "reverse", "uppercase")   # task domains drawn each step
    weights: tuple[float, ...] = ()    # sampling weight per domain ([] = uniform)
    max_operand: int = 50              # arithmetic operands in [0, max_operand]
    operations: str = "+-"             # arithmetic operators drawn from (subset of `+-*`)
    max_word_length: int = 6           # longest word in the string tasks
    seed: int = 0                      # task seed: step s always gets the same tasks

    def __post_init__(self) -> None:
        unknown = [d for d in self.domains if d not in DOMAINS]
        if not self.domains or unknown:
            raise ValueError(f"tasks.domains has unknown or no domains {unknown or list(self.domains)}; "
                             f"choose from {sorted(DOMAINS)}")
        if self.weights and (len(self.weights) != len(self.domains) or min(self.weights) < 0
                             or sum(self.weights) <= 0):
            raise ValueError(f"tasks.weights must be empty or one non-negative weight per domain "
                             f"({len(self.domains)}), not all zero; got {list(self.weights)}")
        if self.max_operand < 1:
            raise ValueError(f"tasks.max_operand must be >= 1, got {self.max_operand}")
        if not self.operations or set(self.operations) - set(OPERATIONS):
            raise ValueError(f"tasks.operations must be a non-empty subset of {''.join(OPERATIONS)!r}, "
                             f"got {self.operations!r}")
        if self.max_word_length < 3:
            raise ValueError(f"tasks.max_word_length must be >= 3, got {self.max_word_length}")


class Domain(Protocol):
    """A family of tasks: how to draw one and how to score a completion of it."""

    name: str

    def make(self, rng: np.random.Generator, cfg: TaskConfig) -> Task: ...

    def reward(self, completion: str, task: Task) -> float: ...


# ------------------------------------------------------------------------------ arithmetic

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INT = re.compile(r"-?\d+")


_QUESTION = re.compile(r"What is (\d+)([-+*])(\d+)\?")


def first_integer(text: str) -> int | None:
    """The first integer in `text` (a model's answer usually leads; later numbers are chatter)."""
    m = _INT.search(text.replace(",", ""))
    return int(m.group()) if m else None


def without_restatement(completion: str, prompt: str) -> str:
    """Drop restatements of the question's expression ("17 + 25 = 42" -> " = 42")."""
    q = _QUESTION.search(prompt)
    if q is None:
        return completion
    a, op, b = q.groups()
    return re.sub(rf"(?<!\d){a}\s*{re.escape(op)}\s*{b}(?!\d)", " ", completion)


class Arithmetic:
    """'What is 17+25? Answer with a number.' -> reward 1 iff the first integer, once a restated
    '17 + 25' is set aside, is 42."""

    name = "arithmetic"

    def make(self, rng: np.random.Generator, cfg: TaskConfig) -> Task:
        a, b = (int(x) for x in rng.integers(0, cfg.max_operand + 1, size=2))
        op = cfg.operations[int(rng.integers(len(cfg.operations)))]
        return Task(self.name, f"What is {a}{op}{b}? Answer with a number.", str(OPERATIONS[op](a, b)))

    def reward(self, completion: str, task: Task) -> float:
        return float(first_integer(without_restatement(completion, task.prompt)) == int(task.answer))


# ------------------------------------------------------------------------------ strings

WORDS = (
    "cat", "dog", "sun", "map", "cup", "pen", "box", "red", "sky", "tree", "book", "fish", "lamp", "door",
    "bird", "milk", "rain", "star", "ship", "moon", "table", "chair", "apple", "water", "house", "light",
    "green", "river", "plant", "stone", "bread", "music", "cloud", "tiger", "pencil", "garden", "window",
    "orange", "planet", "bottle", "summer", "silver", "forest", "rocket", "yellow", "candle",
)
_WORD = re.compile(r"[A-Za-z]+")


def _pick_word(rng: np.random.Generator, cfg: TaskConfig) -> str:
    pool = [w for w in WORDS if len(w) <= cfg.max_word_length]
    return pool[int(rng.integers(len(pool)))]


class Reverse:
    """"Reverse the word 'table'." -> reward 1 iff 'elbat' appears as a word (any case)."""

    name = "reverse"

    def make(self, rng: np.random.Generator, cfg: TaskConfig) -> Task:
        word = _pick_word(rng, cfg)
        return Task(self.name, f"Reverse the letters of the word '{word}'. Answer with the reversed word only.",
                    word[::-1])

    def reward(self, completion: str, task: Task) -> float:
        return float(task.answer.lower() in (w.lower() for w in _WORD.findall(completion)))


class Uppercase:
    """"Write the word 'table' in uppercase." -> reward 1 iff 'TABLE' appears as a word (exact case)."""

    name = "uppercase"

    def make(self, rng: np.random.Generator, cfg: TaskConfig) -> Task:
        word = _pick_word(rng, cfg)
        return Task(self.name, f"Write the word '{word}' in uppercase letters. Answer with the word only.",
                    word.upper())

    def reward(self, completion: str, task: Task) -> float:
        return float(task.answer in _WORD.findall(completion))


DOMAINS: dict[str, Domain] = {d.name: d for d in (Arithmetic(), Reverse(), Uppercase())}


# ------------------------------------------------------------------------------ sampling


class TaskSampler:
    """Draws the tasks of each RL step; the same (seed, step) always gives the same tasks."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        w = np.asarray(cfg.weights or [1.0] * len(cfg.domains), dtype=np.float64)
        self._probs = w / w.sum()

    def sample(self, n: int, step: int) -> list[Task]:
        """n tasks for RL step `step` (>= 0)."""
        if n < 1 or step < 0:
            raise ValueError(f"need n >= 1 tasks and step >= 0, got n={n}, step={step}")
        rng = np.random.default_rng([self.cfg.seed, step])
        names = rng.choice(len(self.cfg.domains), size=n, p=self._probs)
        return [DOMAINS[self.cfg.domains[i]].make(rng, self.cfg) for i in names]


def score(task: Task, completion: str) -> float:
    """Reward of one completion text for its task, in [0, 1]."""
    return DOMAINS[task.domain].reward(completion, task)
