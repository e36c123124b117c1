"""Device tensors of a finished generate() call -> RolloutBatch (one host transfer at the end)."""
from __future__ import annotations

import numpy as np

from rollout.engine.predictor import HEADS, SOURCES
from rollout.engine.round import RoundResult
from rollout.engine.state import Results
from rollout.types import Completion, RolloutBatch, SamplingParams


def build(prompts: list[list[int]], res: Results, records: list[RoundResult], sp: SamplingParams,
          policy_version: int, head_version: int) -> RolloutBatch:
    seq, logprob, tok_ent = res.seq.cpu().numpy(), res.logprob.cpu().numpy(), res.token_entropy.cpu().numpy()
    tok_max = res.token_max_prob.cpu().numpy()
    committed, prompt_len, stopped = res.committed.tolist(), res.prompt_len.tolist(), res.stopped.tolist()
    completions = []
    for b, prompt in enumerate(prompts):
        lo, hi = prompt_len[b], committed[b]
        comp = Completion(
            prompt=list(map(int, prompt)), tokens=seq[b, lo:hi].tolist(),
            logprobs=logprob[b, lo:hi].tolist(), entropies=tok_ent[b, lo:hi].tolist(),
            max_probs=tok_max[b, lo:hi].tolist(),
            num_draft_tokens=sp.num_draft_tokens, finish_reason="stop" if stopped[b] else "length",
            policy_version=policy_version, head_version=head_version,
        )
        if sp.return_hidden_states:
            # hidden_states[i] is the policy state that predicted tokens[i] (position lo-1+i)
            comp.hidden_states = res.hidden[b, lo - 1:hi - 1].float().cpu().numpy()
        completions.append(comp)
    for r in records:  # rounds in which some row drafted, in order
        row_ids, active = r.row_ids.cpu().numpy(), r.active.cpu().numpy()
        n, m = r.num_accepted.cpu().numpy(), r.num_drafts.cpu().numpy()
        ent = r.draft_entropy.float().cpu().numpy()
        nonfinite = (r.nonfinite.cpu().numpy() & (r.plan.source == HEADS)) if r.nonfinite is not None else None
        for slot in np.flatnonzero(active & (row_ids >= 0)):
            comp = completions[row_ids[slot]]
            if nonfinite is not None and nonfinite[slot]:   # q was not finite: one plain token, no drafts verified
                comp.nonfinite_draft_rounds += 1
                continue
            if m[slot] == 0:                                 # this row drafted nothing this round
                continue
            comp.round_accepted.append(int(n[slot]))
            comp.round_draft_tokens.append(int(m[slot]))
            comp.draft_entropies.append(ent[slot, :m[slot]].tolist())
            comp.round_sources.append(SOURCES[int(r.plan.source[slot])])
            comp.round_predicted.append([round(float(a), 4) for a in r.plan.predicted[slot]])
    return RolloutBatch(completions)
