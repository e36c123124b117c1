"""The rollout history's two backends side by side: arctic-inference's C++ suffix tree and the
pure-Python trie, fed the same rollout streams.

    python -m experiments.bench_history [key=value ...]     (--help lists the keys)

The streams are GRPO-shaped: `prompts` prompts of 40 tokens, `group` rows each, `epochs` passes,
every row's response `tokens` long, appended a token at a time per round as the engine does, with a
`propose` for every row before each round. Responses come from an order-2 Markov chain over a
2,000-token vocabulary whose next-token distributions put 0.6 on one token (a low-entropy policy:
siblings and epochs repeat each other, so matches and drafts happen). Each backend's append and
propose time per call (medians over repeats, the backends interleaved), its memory at the end and
the tokens it holds are printed, with the share of proposals that drafted and the drafts' agreement
between the backends.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, fields

import numpy as np

from rollout.config_loader import config_help, load_config, wants_help
from rollout.engine.history import RolloutHistory, arctic_available

VOCAB = 2000
PROMPT_LEN = 40


@dataclass(frozen=True)
class BenchHistoryConfig:
    """The history backends side by side on synthetic GRPO-shaped streams."""

    prompts: int = 32       # distinct prompts
    group: int = 8          # rows per prompt (one call each)
    epochs: int = 2         # passes over the prompts (one policy version each)
    tokens: int = 256       # response length of every row
    repeats: int = 3        # runs per backend (interleaved); medians are printed

    def __post_init__(self):
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")


def streams(prompts: int, group: int, epochs: int, tokens: int,
            seed: int = 0) -> list[list[tuple[list[int], list[int]]]]:
    """Per call (one call = one prompt's group in one epoch): [(prompt, response)] x group."""
    rng = np.random.default_rng(seed)
    favourite = rng.integers(0, VOCAB, size=(VOCAB, VOCAB), dtype=np.int32)   # [V, V]: the chain's likeliest next
    prompt_list = [rng.integers(0, VOCAB, size=PROMPT_LEN).tolist() for _ in range(prompts)]
    calls = []
    for _ in range(epochs):
        for p in prompt_list:
            rows = []
            for _ in range(group):
                a, b = p[-2], p[-1]
                out = []
                for _ in range(tokens):
                    nxt = int(favourite[a, b]) if rng.random() < 0.6 else int(rng.integers(0, VOCAB))
                    out.append(nxt)
                    a, b = b, nxt
                rows.append((p, out))
            calls.append(rows)
    return calls


def run(backend: str, calls, epochs: int, k: int = 3) -> dict:
    history = RolloutHistory(backend=backend)
    per_epoch = len(calls) // epochs
    append_s = propose_s = 0.0
    proposals = 0
    drafts = []
    for i, rows in enumerate(calls):
        handles = history.begin_call([p for p, _ in rows], i // per_epoch)     # one policy version per epoch
        length = len(rows[0][1])
        for t in range(length):
            t0 = time.perf_counter()
            for h in handles:
                d = history.propose(h, k)
                drafts.append(tuple(d.tokens) if d is not None else ())
            t1 = time.perf_counter()
            for h, (_, out) in zip(handles, rows):
                history.append(h, [out[t]])
            t2 = time.perf_counter()
            propose_s += t1 - t0
            append_s += t2 - t1
            proposals += len(handles)
        history.end_call()
    drafted = sum(1 for d in drafts if d)
    stats = history.stats()
    return dict(append_us=1e6 * append_s / proposals, propose_us=1e6 * propose_s / proposals,
                drafted=drafted / proposals, memory_mb=stats["memory_bytes"] / 2**20, tokens=stats["tokens"],
                drafts=drafts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(config_help(BenchHistoryConfig, usage=__doc__), end="")
        return 0
    cfg, _ = load_config(BenchHistoryConfig, argv)
    backends = ["python"] + (["arctic"] if arctic_available() else [])
    calls = streams(cfg.prompts, cfg.group, cfg.epochs, cfg.tokens)
    runs = {b: [] for b in backends}
    for _ in range(cfg.repeats):
        for b in backends:
            runs[b].append(run(b, calls, cfg.epochs))
    print(f"streams: {cfg.prompts} prompts x {cfg.group} rows x {cfg.epochs} epochs x {cfg.tokens} tokens; "
          f"k = 3; medians of {cfg.repeats} repeats")
    for b, rs in runs.items():
        med = lambda key: statistics.median(r[key] for r in rs)   # noqa: E731
        print(f"{b:<7} append {med('append_us'):6.1f} us/row-round  propose {med('propose_us'):6.1f} us/row-round"
              f"  drafted {med('drafted'):.2f} of proposals  memory {med('memory_mb'):7.1f} MiB"
              f"  tokens {rs[0]['tokens']}")
    if len(backends) == 2:
        a, b = runs["python"][0]["drafts"], runs["arctic"][0]["drafts"]
        print(f"drafts equal between the backends: {np.mean([x == y for x, y in zip(a, b)]):.3f} of proposals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
