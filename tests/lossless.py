"""Shared pieces of the losslessness tests: a deliberately lossy verifier (the control every
distribution test must reject) and a chi-square comparison of sampled continuations."""
import torch
from scipy.stats import chi2_contingency

from rollout.verify import rejection_sample, sample

# prompts of different lengths, so rows of one batch sit at different positions
MIXED_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [3], [20, 21, 22, 23, 24]]


def lossy_rejection_sample(draft_tokens, draft_probs, target_probs, generator=None, num_drafts=None, index=None,
                           point_mass=None, draft_vocab=None):
    """The classic mistake: after a rejection, resample from p instead of norm(max(0, p - q))."""
    out, n = rejection_sample(draft_tokens, draft_probs, target_probs, generator, num_drafts, index=index,
                              point_mass=point_mass, draft_vocab=draft_vocab)
    B, k = draft_tokens.shape
    rows = torch.arange(B)
    if index is None:
        index = rows[:, None] * (k + 1) + torch.arange(k + 1)[None]
        target_probs = target_probs.reshape(B * (k + 1), -1)
    rejected = n < (k if num_drafts is None else num_drafts)
    # a fresh draw from p (keyed draws would give the position's own token: a point mass's correct answer)
    fresh = generator if isinstance(generator, torch.Generator) else torch.Generator(device=target_probs.device).manual_seed(n.sum().item())
    from_p = sample(target_probs[index[rows, n]], fresh)
    out[rows, n] = torch.where(rejected, from_p, out[rows, n])
    return out, n


def continuation_counts(engine, sp, n_rows):
    """n_rows completions of one short prompt, their first CONTINUATION tokens as hashable tuples."""
    out = engine.generate([[4, 2]] * n_rows, sp)
    return first_tokens(out)


CONTINUATION = 3    # tokens compared: 5^3 outcomes of a 5-token vocabulary, ~32 rows each at n = 4000


def first_tokens(batch) -> list[tuple[int, ...]]:
    """Each completion's first CONTINUATION tokens. The chooser's tests with k = 2 decode one token more
    than they compare: the chooser has a row verify no draft it could not emit before max_new_tokens, so
    at 3 tokens the first round would verify one draft, not two."""
    return [tuple(c.tokens[:CONTINUATION]) for c in batch.completions]


def chi2_pvalue(a, b):
    """p-value that two lists of outcomes come from one distribution (categories with >= 10 counts)."""
    cats = sorted(set(a) | set(b))
    table = [[a.count(x) for x in cats], [b.count(x) for x in cats]]
    keep = [i for i in range(len(cats)) if table[0][i] + table[1][i] >= 10]
    return chi2_contingency([[row[i] for i in keep] for row in table]).pvalue
