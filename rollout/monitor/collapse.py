"""The acceptance-collapse alert: the heads' acceptance falls towards 0 within one step, and why.

The failure RL users hit is a policy weight sync that leaves the drafter stale or drops it
(vLLM PR 46725 "Runtime Draft Weight Update"; acceptance "dropped to 0%", "pinned at exactly
0"). A windowed mean notices that only after several steps; this rule compares one step with the
median of the recent healthy steps, so it fires at the step of the collapse. The cause is read
from the versions every record carries, between the last healthy step and this one:

    policy moved, drafter did not  -> stale_drafter   (the drafter was not refreshed after the sync)
    drafter moved                  -> bad_refresh     (the new drafter weights are wrong)
    neither moved                  -> inputs_changed  (the prompts or sampling changed: entropy reported)

Only steps whose heads drafted at least `min_draft_tokens` count, as the step judged and in the
baseline; steps already flagged stay out of the baseline, so the alert holds until acceptance
recovers, and through steps that drafted too little to tell.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from rollout.monitor.records import as_float

NAME = "acceptance_collapse"
MIN_BASELINE_STEPS = 3          # healthy drafted steps the median needs before one step is judged against it


def heads_acceptance(rec: dict) -> tuple[float, int]:
    """(acceptance rate, draft tokens) of the heads' drafts in one step record; a record without a
    `drafting` block (written before per-source drafting was logged) gives the whole batch's."""
    heads = (rec.get("drafting") or {}).get("heads")
    if heads is not None:
        return as_float(heads["acceptance_rate"]), int(heads["draft_tokens"])
    return as_float(rec["acceptance_rate"]), int(rec["num_draft_tokens"])


def _flagged(rec: dict) -> dict | None:
    return next((a for a in rec.get("alerts", []) if a["name"] == NAME), None)


def collapse_alert(rec: dict, previous: Sequence[dict], *, window: int, fraction: float, floor: float,
                   min_draft_tokens: int) -> dict | None:
    """The alert for step record `rec` (its `alerts` not yet set) given the run's earlier step records,
    oldest first; None when acceptance did not collapse or there is no baseline to tell."""
    acc, drafted = heads_acceptance(rec)
    if drafted < min_draft_tokens or not math.isfinite(acc):
        # too few drafts to judge: an alert in force stays in force (the chooser may draft little after a collapse)
        return _flagged(previous[-1]) if previous else None
    healthy = _healthy(previous, window, min_draft_tokens)
    if len(healthy) < MIN_BASELINE_STEPS:
        return None
    baseline = statistics.median(heads_acceptance(r)[0] for r in healthy)
    threshold = min(fraction * baseline, floor)
    if acc >= threshold:
        return None
    entropy = (_median_finite(as_float(r["entropy_drafted"]) for r in healthy), as_float(rec["entropy_drafted"]))
    cause, message = diagnose(rec, healthy[-1], baseline, acc, entropy)
    return {"name": NAME, "cause": cause, "value": acc, "baseline": baseline, "threshold": threshold,
            "reference_step": healthy[-1]["step"],
            "policy_version": [healthy[-1]["policy_version_max"], rec["policy_version_max"]],
            "head_version": [healthy[-1]["head_version_max"], rec["head_version_max"]],
            "entropy": list(entropy), "message": message}


def _healthy(previous: Sequence[dict], window: int, min_draft_tokens: int) -> list[dict]:
    """The last `window` earlier steps, oldest first, that drafted enough and were not flagged."""
    out = []
    for r in reversed(previous):
        acc, drafted = heads_acceptance(r)
        if drafted >= min_draft_tokens and math.isfinite(acc) and _flagged(r) is None:
            out.append(r)
            if len(out) == window:
                break
    return out[::-1]


def diagnose(rec: dict, ref: dict, baseline: float, acc: float,
             entropy: tuple[float, float]) -> tuple[str, str]:
    """(cause, message) of a collapse at `rec` from the versions at the last healthy step `ref`."""
    p0, p1 = ref["policy_version_max"], rec["policy_version_max"]
    h0, h1 = ref["head_version_max"], rec["head_version_max"]
    fell = f"heads' acceptance fell from {baseline:.2f} to {acc:.2f} at step {rec['step']}"
    if None in (p0, p1, h0, h1):
        return "unknown", f"{fell}; the completions carry no policy/drafter versions to tell why"
    if h1 != h0:
        policy = f"policy {p0} -> {p1}" if p1 != p0 else f"policy unchanged at version {p1}"
        return "bad_refresh", (f"{fell} right after the drafter moved from version {h0} to {h1} ({policy}): "
                               "the new drafter weights are wrong (a bad refresh: weights for another policy, "
                               "a wrong checkpoint or a broken transfer)")
    if p1 != p0:
        return "stale_drafter", (f"{fell} while the policy moved {_versions(p1 - p0)} ({p0} -> {p1}) and the drafter "
                                 f"stayed at version {h1}: the drafter was not refreshed after the policy sync "
                                 "(stale or missing drafter weights)")
    e0, e1 = entropy
    change = (f"entropy at drafted positions {e0:.2f} -> {e1:.2f} nats, {e1 - e0:+.2f}"
              if math.isfinite(e0) and math.isfinite(e1) else "the engine recorded no entropy at drafted positions")
    return "inputs_changed", (f"{fell} with the policy (version {p1}) and the drafter (version {h1}) unchanged: "
                              f"the inputs changed ({change}; new prompts or sampling settings)")


def _median_finite(xs) -> float:
    finite = [x for x in xs if math.isfinite(x)]
    return statistics.median(finite) if finite else float("nan")


def _versions(n: int) -> str:
    return f"{n} version{'s' if abs(n) != 1 else ''}"


def check_config(fraction: Any, floor: Any, min_draft_tokens: Any) -> None:
    """The collapse thresholds of MonitorConfig, refused naming the key."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
        raise ValueError(f"collapse_fraction must be a number in (0, 1), got {fraction!r}")
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 < floor <= 1.0:
        raise ValueError(f"collapse_floor must be a number in (0, 1], got {floor!r}")
    if isinstance(min_draft_tokens, bool) or not isinstance(min_draft_tokens, int) or min_draft_tokens < 1:
        raise ValueError(f"collapse_min_draft_tokens must be an integer >= 1, got {min_draft_tokens!r}")
