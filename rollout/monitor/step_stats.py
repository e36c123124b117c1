"""Per-group step statistics (the whole batch, or one task domain) and their history.

One RL step's completions become step means (acceptance rate, tau, conditional acceptance,
entropy at drafted positions, the policy's max-probability per emitted token); each group keeps those means across steps for the slopes
over steps and the windowed acceptance, plus its cumulative per-position histogram.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from rollout.monitor.positions import EntropyHistogram, PositionPoints, position_points
from rollout.monitor.records import as_float
from rollout.types import Completion, SpecDecodingStats

def mean_or_nan(xs) -> float:
    a = np.asarray(xs, dtype=np.float64)
    return float(a.mean()) if a.size else float("nan")


def max_prob_stats(completions: Sequence[Completion]) -> dict[str, float]:
    """Mean max_v p(v) over emitted tokens and the share above 0.9: how often a point-mass draft (greedy,
    or a token copied from other rollouts) can pass at best, as RL sharpens or flattens p. Completions
    without max_probs (a producer that does not record them) count for nothing; none at all gives NaN."""
    mp = np.fromiter(chain.from_iterable(c.max_probs for c in completions), np.float64)      # [N tokens]
    if not mp.size:
        return {"max_prob_mean": float("nan"), "max_prob_over_0_9": float("nan")}
    return {"max_prob_mean": float(mp.mean()), "max_prob_over_0_9": float((mp > 0.9).mean())}


def group_stats(completions: Sequence[Completion]) -> tuple[dict[str, Any], PositionPoints]:
    """Step means of one group of completions (the whole batch or one domain)."""
    stats = SpecDecodingStats()
    for c in completions:
        stats = stats.merge(c.spec_stats())
    pts = position_points(completions)
    block = {
        "num_completions": len(completions),
        "num_tokens": sum(len(c.tokens) for c in completions),
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_nonfinite_rounds": stats.num_nonfinite_rounds,   # rounds that fell back to a plain token (bad heads)
        "acceptance_rate": stats.acceptance_rate,
        "acceptance_length": stats.acceptance_length,
        "cond_acceptance": stats.conditional_acceptance,
        "entropy_drafted": mean_or_nan(pts.entropy[pts.reached]),
        "entropy_token": mean_or_nan([h for c in completions for h in c.entropies]),
        **max_prob_stats(completions),
    }
    return block, pts


def by_domain(completions: Sequence[Completion]) -> dict[str, list[Completion]]:
    """Group by Completion.domain; {} when no completion is labelled."""
    if all(c.domain is None for c in completions):
        return {}
    groups: dict[str, list[Completion]] = {}
    for c in completions:
        groups.setdefault("unlabelled" if c.domain is None else str(c.domain), []).append(c)
    return groups


@dataclass
class GroupHistory:
    """What one group keeps across steps: step means for the across-step slopes, draft
    counts for the windowed acceptance, and the cumulative per-position histogram."""

    hist: EntropyHistogram
    step: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)

    def append(self, step: int, block: dict[str, Any]) -> None:
        """block: a group's step record (live or read back from the JSONL)."""
        self.step.append(int(step))
        self.entropy.append(as_float(block["entropy_drafted"]))
        self.acceptance.append(as_float(block["acceptance_rate"]))
        self.accepted.append(int(block["num_accepted_tokens"]))
        self.proposed.append(int(block["num_draft_tokens"]))

    def rewind(self, step: int) -> None:
        """Forget step means at or after `step` (a run resumed from an earlier checkpoint)."""
        keep = sum(s < step for s in self.step)
        for xs in (self.step, self.entropy, self.acceptance, self.accepted, self.proposed):
            del xs[keep:]

    def window_acceptance(self, window: int) -> float:
        """Pooled accepted / proposed over the last `window` steps of this group."""
        proposed = sum(self.proposed[-window:])
        return sum(self.accepted[-window:]) / proposed if proposed else float("nan")



def batch_versions(comps: Sequence[Completion]) -> dict[str, int | None]:
    """Policy and head version range over a batch (workers may lag each other)."""
    pv = [c.policy_version for c in comps]
    hv = [c.head_version for c in comps]
    return {"policy_version_min": min(pv, default=None), "policy_version_max": max(pv, default=None),
            "head_version_min": min(hv, default=None), "head_version_max": max(hv, default=None)}
