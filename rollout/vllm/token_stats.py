"""Per-token statistics computed inside vLLM's worker: the entropy of the processed target
distribution at every emitted and drafted position, its largest probability at every emitted
position, and (on request) the target hidden states.

Why a hook here: vLLM returns at most the top-20 log-probs, so the entropy of the distribution a
token was sampled from cannot be rebuilt outside; before this hook the engine ran a second,
teacher-forced forward of the torch policy over every completion. The model runner's
`sample_tokens` step holds everything in one place: the raw logits of every row it samples or
verifies (`execute_model_state`: one row per request for plain decoding; with drafts, n_i target
rows then one bonus row per request i), the target's final-norm hidden states of those rows, and
the per-request temperature / top-k / top-p. `install` wraps that method on the worker's runner
(an instance attribute, nothing global) to compute, before vLLM samples (its sampler scales the
logits in place),

    H_row = -sum_v p(v) log p(v),   p = softmax(top_k_top_p(logits / T))   (0 for greedy rows)
    max_row = max_v p(v)                                                   (1 for greedy rows)

with vLLM's own top-k/top-p function, and after it, to keep the rows of the tokens it emitted:
row t of a step emitted that step's token t, so a step that emitted m tokens keeps rows 0..m-1,
and a step with n_i > 0 drafts also records rows 0..n_i-1 (H(p) at each draft position, reached or
not, as the torch engine does). Requests whose sampled token vLLM discards (a partial prefill chunk)
record nothing. Penalties, bad words and logits processors are not applied (the engine sets none).
The worker keeps records per request until the engine takes them (`take`) after generate().
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import numpy as np
import torch

_ATTR = "_mtp_rollout_token_stats"
_GREEDY_EPS = 1e-5   # vLLM's _SAMPLING_EPS: rows below this temperature are sampled greedily


@dataclass
class RequestStats:
    """What one request accumulated over its steps (worker side)."""

    entropies: list[float] = field(default_factory=list)        # per emitted token
    max_probs: list[float] = field(default_factory=list)        # per emitted token: max_v p(v)
    rounds: list[list[float]] = field(default_factory=list)     # per step with drafts: H at draft positions
    hidden: list[np.ndarray] = field(default_factory=list)      # per step: [m, d] float32 (capture_hidden)


def processed_stats(logits: torch.Tensor, temperature: torch.Tensor | None, top_k: torch.Tensor | None,
                    top_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy in nats and largest probability of vLLM's sampling distribution per row (a greedy
    row's distribution is one-hot: 0 and 1).

    logits [R, V]; temperature / top_k / top_p [R] or None (None temperature = all greedy)
    -> (entropy [R], max_prob [R]) float32.
    """
    if temperature is None:
        return (logits.new_zeros(logits.shape[0], dtype=torch.float32),
                logits.new_ones(logits.shape[0], dtype=torch.float32))
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    greedy = temperature < _GREEDY_EPS
    x = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature).float()[:, None]
    if top_k is not None or top_p is not None:
        x = apply_top_k_top_p(x, top_k, top_p)
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    h = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)                  # [R]
    p_max = p.amax(-1)                                                               # [R]
    return torch.where(greedy, torch.zeros_like(h), h), torch.where(greedy, torch.ones_like(p_max), p_max)


class _Recorder:
    """Lives on the model runner; `sample_tokens` is wrapped to call before() and after()."""

    def __init__(self, runner):
        self.runner = runner
        self.capture_hidden = False
        self.by_request: dict[str, RequestStats] = {}

    def before(self):
        """Entropy and max-probability of every logits row of this step, before vLLM's sampler scales
        them in place."""
        state = self.runner.execute_model_state
        if state is None:
            return None
        logits, spec, sample_hidden = state[1], state[2], state[5]
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        md = batch.sampling_metadata
        drafts = [0] * num_reqs if spec is None else list(spec.num_draft_tokens)
        if num_reqs == 0 or logits is None or logits.shape[0] != num_reqs + sum(drafts):
            return None                                  # a dummy/padded step: no request emits from it
        rows = torch.tensor([n + 1 for n in drafts], device=logits.device)                # [num_reqs]

        def per_row(x):
            return None if x is None else x[:num_reqs].repeat_interleave(rows)
        temperature = None if md.all_greedy else per_row(md.temperature)
        ent, p_max = processed_stats(logits, temperature, per_row(md.top_k), per_row(md.top_p))  # [R] each
        hidden = sample_hidden.float().cpu().numpy() if self.capture_hidden else None           # [R, d]
        ent_max = torch.stack([ent, p_max]).cpu()                                                # [2, R], one copy
        return list(batch.req_ids[:num_reqs]), drafts, ent_max[0].tolist(), ent_max[1].tolist(), hidden

    def after(self, pending, output) -> None:
        """Keep the rows of the tokens each request emitted in this step."""
        if pending is None:
            return
        req_ids, drafts, ent, p_max, hidden = pending
        sampled = getattr(output, "sampled_token_ids", None)
        if sampled is None or not hasattr(output, "req_id_to_index"):
            raise RuntimeError("mtp-rollout token stats need synchronous scheduling (async_scheduling=False)")
        start = 0
        for req_id, n in zip(req_ids, drafts):
            i = output.req_id_to_index.get(req_id)
            m = len(sampled[i]) if i is not None and i < len(sampled) else 0
            if m:
                rec = self.by_request.setdefault(req_id, RequestStats())
                rec.entropies.extend(ent[start:start + m])
                rec.max_probs.extend(p_max[start:start + m])
                if n:
                    rec.rounds.append(ent[start:start + n])
                if hidden is not None:
                    rec.hidden.append(hidden[start:start + m])
            start += n + 1


# ------------------------------------------------------------------ worker RPCs (llm.collective_rpc)
def install(worker) -> bool:
    """Wrap this worker's runner.sample_tokens once; returns True when newly installed."""
    runner = worker.model_runner
    if getattr(runner, _ATTR, None) is not None:
        return False
    if not all(hasattr(runner, a) for a in ("execute_model_state", "input_batch", "sample_tokens")):
        raise RuntimeError(f"{type(runner).__name__} is not vLLM's v1 GPUModelRunner layout that the entropy hook "
                           "reads (execute_model_state, input_batch); unset VLLM_USE_V2_MODEL_RUNNER")
    recorder = _Recorder(runner)
    original = runner.sample_tokens

    def sample_tokens(self, grammar_output):
        pending = recorder.before()
        output = original(grammar_output)
        recorder.after(pending, output)
        return output

    setattr(runner, _ATTR, recorder)
    runner.sample_tokens = types.MethodType(sample_tokens, runner)
    return True


def set_capture_hidden(worker, flag: bool) -> None:
    getattr(worker.model_runner, _ATTR).capture_hidden = bool(flag)


def take(worker) -> dict[str, RequestStats]:
    """Every record so far (by vLLM's internal request id), cleared on the worker."""
    recorder = getattr(worker.model_runner, _ATTR)
    out, recorder.by_request = recorder.by_request, {}
    return out


def match_requests(records: dict[str, RequestStats], request_ids: list[str]) -> list[RequestStats]:
    """Records in the order of the LLM's outputs. vLLM appends '-<8 random chars>' to each external
    request id internally (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION); both forms are accepted."""
    by_external = {}
    for key, rec in records.items():
        by_external[key if key in request_ids else key.rsplit("-", 1)[0]] = rec
    return [by_external.get(r, RequestStats()) for r in request_ids]
