"""vLLM's spec-decode counters (`llm.get_metrics()`) -> our SpecDecodingStats for one call."""
from __future__ import annotations

from rollout.types import SpecDecodingStats


def spec_counters(llm) -> dict[str, float | list[float]]:
    """Cumulative `vllm:spec_decode_*` counters of this LLM, summed over label sets."""
    out: dict[str, float | list[float]] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            key = m.name.removeprefix("vllm:spec_decode_")
            if hasattr(m, "values"):
                prev = out.get(key, [])
                out[key] = [a + b for a, b in zip(prev, m.values)] if prev else list(m.values)
            else:
                out[key] = out.get(key, 0) + m.value
    return out


def stats_delta(before: dict, after: dict, k: int, reached: list[int] | None = None) -> SpecDecodingStats:
    """Counters before and after a call -> that call's SpecDecodingStats. reached_j = accepted_{j-1} holds
    when every step drafts k tokens; methods that draft fewer pass `reached` (vLLM counts no reached_j)."""
    get = lambda d, key: d.get(key, 0)  # noqa: E731
    drafts = int(get(after, "num_drafts") - get(before, "num_drafts"))
    prev_pos = before.get("num_accepted_tokens_per_pos") or [0] * k
    acc_pos = [int(a - b) for a, b in zip(after.get("num_accepted_tokens_per_pos") or [0] * k, prev_pos)]
    accepted = int(get(after, "num_accepted_tokens") - get(before, "num_accepted_tokens"))
    return SpecDecodingStats(
        num_drafts=drafts,
        num_draft_tokens=int(get(after, "num_draft_tokens") - get(before, "num_draft_tokens")),
        num_accepted_tokens=accepted, num_emitted_tokens=accepted + drafts,
        accepted_per_pos=acc_pos, reached_per_pos=list(reached) if reached is not None else [drafts] + acc_pos[:-1])
