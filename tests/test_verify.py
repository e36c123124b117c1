"""rejection_sample is lossless, and its acceptance matches the theory."""
import pytest
import torch
from scipy.stats import chisquare

from rollout.verify import (DRAFT, ONE_LEVEL_MAX, PLACEHOLDER, KeyedDraws, inverse_cdf, process_logits,
                            process_logits_with_entropy,
                            rejection_sample, sample)
from tests.helpers import entropy
from tests.lossless import lossy_rejection_sample


def _random_dist(V: int, gen: torch.Generator, sharpness: float = 2.0) -> torch.Tensor:
    return (torch.randn(V, generator=gen) * sharpness).softmax(-1)


def _first_token_histogram(fn, p, q, trials, gen, greedy=False, keyed=False):
    """keyed: draws keyed on (seed, row, position) as the engine makes them, one row per trial."""
    V = p.shape[-1]
    rng = KeyedDraws(int(torch.randint(0, 2**62, (), generator=gen)), torch.arange(trials),
                     torch.zeros(trials, dtype=torch.long)) if keyed else gen
    draft_probs = q.expand(trials, 1, V)
    drafts = q.argmax().expand(trials, 1).clone() if greedy else sample(draft_probs, rng, DRAFT)
    target = p.expand(trials, 2, V)
    out, _ = fn(drafts, None if greedy else draft_probs, target, rng)
    return torch.bincount(out[:, 0], minlength=V).double()


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("greedy", [False, True])
def test_first_token_distribution_equals_target(greedy, keyed):
    gen = torch.Generator().manual_seed(0)
    V = 8
    p, q = _random_dist(V, gen), _random_dist(V, gen)
    distances = []
    for trials in (2_000, 200_000):
        counts = _first_token_histogram(rejection_sample, p, q, trials, gen, greedy, keyed)
        distances.append(0.5 * (counts / trials - p.double()).abs().sum().item())
    assert distances[1] < distances[0] / 3, distances   # ~ 1/sqrt(n): 10x fewer samples -> ~10x farther
    assert distances[1] < 0.01
    assert chisquare(counts.numpy(), (p.double() * 200_000).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("greedy", [False, True])
def test_lossy_variant_fails_the_same_test(greedy, keyed):
    gen = torch.Generator().manual_seed(0)
    V = 8
    p = _random_dist(V, gen)
    q = p.roll(3)  # the draft's favourite is not the target's, so rejections are common
    trials = 200_000
    counts = _first_token_histogram(lossy_rejection_sample, p, q, trials, gen, greedy, keyed)
    assert 0.5 * (counts / trials - p.double()).abs().sum().item() > 0.02  # the correct sampler: < 0.01
    assert chisquare(counts.numpy(), (p.double() * trials).numpy()).pvalue < 1e-6


def test_per_position_acceptance_matches_theory():
    gen = torch.Generator().manual_seed(1)
    k, V, trials = 3, 12, 100_000
    p = torch.stack([_random_dist(V, gen, s) for s in (1.0, 2.0, 3.0, 1.5)])     # [k+1, V]
    q = torch.stack([_random_dist(V, gen, s) for s in (1.0, 2.0, 3.0)])          # [k, V]
    target = p.expand(trials, k + 1, V)
    # rejection mode: acceptance at j (given reached) = 1 - TV(p_j, q_j) = sum min(p, q)
    drafts = sample(q.expand(trials, k, V), gen)
    _, n = rejection_sample(drafts, q.expand(trials, k, V), target, gen)
    # greedy mode: acceptance = p_j(argmax q_j)
    greedy_drafts = q.argmax(-1).expand(trials, k).clone()
    _, n_greedy = rejection_sample(greedy_drafts, None, target, gen)
    checked = {"rejection": 0, "greedy": 0}
    for j in range(k):
        for mode, counts, theory in (("rejection", n, torch.minimum(p[j], q[j]).sum()),
                                     ("greedy", n_greedy, p[j, q[j].argmax()])):
            reached = (counts >= j).sum().item()
            if reached < 500:      # greedy drafts that p almost never takes: too few rows get this far
                continue
            rate = (counts > j).sum().item() / reached
            se = (theory * (1 - theory) / reached) ** 0.5
            assert abs(rate - theory.item()) < 5 * se + 1e-3, (mode, j, rate, theory.item())
            checked[mode] += 1
    assert checked == {"rejection": k, "greedy": 2}, checked


def test_output_layout_and_greedy_exactness():
    # temperature 0: one-hot p; drafts [3, 3, 5] against argmax path [3, 3, 4, 9]
    V = 10
    p = torch.zeros(1, 4, V)
    for j, t in enumerate([3, 3, 4, 9]):
        p[0, j, t] = 1.0
    out, n = rejection_sample(torch.tensor([[3, 3, 5]]), None, p)
    assert n.tolist() == [2]
    assert out.tolist() == [[3, 3, 4, PLACEHOLDER]]
    out, n = rejection_sample(torch.tensor([[3, 3, 4]]), None, p)
    assert n.tolist() == [3] and out.tolist() == [[3, 3, 4, 9]]   # bonus token


def test_k_zero_is_plain_sampling():
    p = torch.tensor([[[0.0, 1.0, 0.0]]])
    out, n = rejection_sample(torch.zeros(1, 0, dtype=torch.long), None, p)
    assert out.tolist() == [[1]] and n.tolist() == [0]


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="k\\+1"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 4, 5), torch.rand(2, 4, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 2, 6), torch.rand(2, 4, 5))
    with pytest.raises(ValueError, match="index"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), None, torch.rand(8, 5),
                         index=torch.zeros(2, 3, dtype=torch.long))


def test_process_logits_top_k_top_p_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert process_logits(logits, 0.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    top2 = process_logits(logits, 1.0, top_k=2)
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    # top_p just above p(0): keeps tokens 0 and 1 only
    top_p = process_logits(logits, 1.0, top_p=float(full[0]) + 1e-3)
    assert (top_p[0, 2:] == 0).all() and (top_p[0, :2] > 0).all()
    hot = process_logits(logits, 0.5)
    assert hot[0, 0] > full[0]


def _expected(p, counts):
    p = p.double()
    return (p / p.sum() * counts.sum()).numpy()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                       (1.0, 0, 0.8), (0.0, 0, 1.0)])
def test_entropy_from_logits_equals_the_elementwise_definition(temperature, top_k, top_p):
    """The engine's entropy (log Z - E_p[z], log Z from the most likely token) is H(processed p)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 500, generator=gen) * torch.tensor([0.1, 3.0, 30.0])[:, None, None]
    probs, ent = process_logits_with_entropy(logits, temperature, top_k, top_p)
    ref = process_logits(logits, temperature, top_k, top_p)
    assert torch.equal(probs, ref)
    torch.testing.assert_close(ent, entropy(ref), atol=2e-5, rtol=1e-5)
    assert torch.isfinite(ent).all()


def test_inverse_cdf_sampler_matches_the_distribution():
    """sample() draws by inverse CDF: same distribution tests as multinomial, zeros never drawn."""
    gen = torch.Generator().manual_seed(3)
    V, trials = 8, 200_000
    p = _random_dist(V, gen)
    p[2] = 0.0
    p = p / p.sum()
    counts = torch.bincount(sample(p.expand(trials, V), gen), minlength=V).double()
    assert counts[2] == 0
    keep = p > 0
    assert chisquare(counts[keep].numpy(), _expected(p[keep], counts[keep])).pvalue > 1e-3
    # batched rows with different distributions: shapes follow probs
    rows = torch.stack([p, p.roll(1)])
    out = sample(rows.expand(trials // 10, 2, V), gen)
    assert out.shape == (trials // 10, 2)
    assert abs((out[:, 1] == p.roll(1).argmax()).double().mean() - p.max().double()) < 0.02



def test_inverse_cdf_draws_the_same_tokens_through_one_and_two_levels():
    """Rows up to ONE_LEVEL_MAX wide take one cumulative sum, wider ones two levels: the same rows padded
    with zero-mass tokens past ONE_LEVEL_MAX draw the same tokens for the same uniforms (they can differ
    only where u * total falls within rounding of a boundary), and zero-mass tokens are never drawn."""
    gen = torch.Generator().manual_seed(7)
    rows, V = 4, 3000
    p = (torch.randn(rows, V, generator=gen) * 3).softmax(-1)
    p[:, ::7] = 0.0                                                               # tokens without mass
    u = torch.rand(5000, rows, generator=gen, dtype=torch.float64).clamp_min(1e-12)
    narrow = inverse_cdf(p.expand(5000, rows, V), u)
    wide_p = torch.cat([p, torch.zeros(rows, ONE_LEVEL_MAX + 1 - V)], -1)         # the same mass, two levels
    wide = inverse_cdf(wide_p.expand(5000, rows, wide_p.shape[-1]), u)
    assert (narrow == wide).double().mean() > 0.999
    assert (narrow % 7 != 0).all() and (wide % 7 != 0).all() and (wide < V).all()


def test_q_is_looked_up_in_the_draft_vocabulary_passed_not_an_earlier_one():
    """q's slot map is kept between calls: a different vocabulary of the same size (as a new drafter's
    buffer, which may reuse a freed one's memory) must give its own q values."""
    gen = torch.Generator().manual_seed(8)
    B, V, S = 16, 30, 6
    first, second = torch.arange(S), torch.arange(S) + 10                         # same size, other ids
    p = torch.full((B, 2, V), 1.0 / V)
    q = torch.full((B, 1, S), 1.0 / S)
    for vocab in (first, second, first):
        drafts = vocab[torch.randint(0, S, (B, 1), generator=gen)]
        _, n = rejection_sample(drafts, q, p, torch.Generator().manual_seed(1), draft_vocab=vocab)
        # p / q = 6 / 30 = 0.2 for a drafted token in vocab; a stale map would read q = 0 (always accept)
        _, n_dense = rejection_sample(drafts, torch.zeros(B, 1, V).index_copy_(2, vocab, q), p,
                                      torch.Generator().manual_seed(1))
        assert torch.equal(n, n_dense) and 0 < int(n.sum()) < B


def test_a_rejection_that_leaves_no_residual_mass_draws_its_token_from_p():
    """max(0, p - q) can have no mass only when q is not a distribution over p's support (here q > p
    everywhere p has mass); the row's token then comes from p, never from an empty row (token 0)."""
    gen = torch.Generator().manual_seed(9)
    B, V = 4000, 6
    p = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.9, 0.9, 0.0, 0.0])                              # unnormalised, above p
    drafts = torch.full((B, 1), 2)
    out, n = rejection_sample(drafts, q.expand(B, 1, V), p.expand(B, 2, V), gen)
    rejected = n == 0
    assert 0.3 < rejected.double().mean() < 0.6                                   # accepted w.p. p/q = 5/9
    assert set(out[rejected, 0].tolist()) == {2, 3}

def test_rows_with_fewer_drafts_sample_their_last_token_from_p():
    """num_drafts[b] = 0 (the engine's fallback for a non-finite q): one token from p[:, 0], even
    when q is NaN; num_drafts = 1 of k = 2: never more than one accepted, bonus from p[:, 1]."""
    gen = torch.Generator().manual_seed(4)
    V, trials = 6, 100_000
    p = torch.stack([_random_dist(V, gen) for _ in range(3)])               # [k+1, V]
    q = torch.full((trials, 2, V), float("nan"))
    drafts = torch.zeros(trials, 2, dtype=torch.long)
    out, n = rejection_sample(drafts, q, p.expand(trials, 3, V), gen, torch.zeros(trials, dtype=torch.long))
    assert (n == 0).all() and (out[:, 1:] == PLACEHOLDER).all()
    counts = torch.bincount(out[:, 0], minlength=V).double()
    assert chisquare(counts.numpy(), _expected(p[0], counts)).pvalue > 1e-3
    q = p[:2].expand(trials, 2, V).clone()
    drafts = sample(q, gen)
    out, n = rejection_sample(drafts, q, p.expand(trials, 3, V), gen, torch.ones(trials, dtype=torch.long))
    assert n.max() == 1 and (out[:, 2] == PLACEHOLDER).all()
    bonus = out[n == 1, 1]
    counts = torch.bincount(bonus, minlength=V).double()
    assert chisquare(counts.numpy(), _expected(p[1], counts)).pvalue > 1e-3


@pytest.mark.parametrize("keyed", [False, True])
def test_q_over_a_draft_vocabulary_verifies_as_q_scattered_over_the_whole_vocabulary(keyed):
    """draft_probs over a draft vocabulary S (draft_vocab, unsorted ids) gives the same tokens and acceptances
    as the same q written into [B, k', V] with zeros outside S: rows with q, point-mass rows, ragged
    num_drafts, positions past q's (k' < k), and bonus tokens, on the same draws."""
    gen = torch.Generator().manual_seed(3)
    B, k, k_q, V = 64, 3, 2, 40
    vocab = torch.randperm(V, generator=gen)[:12]                                  # S: 12 ids, unsorted
    q_s = (torch.randn(B, k_q, vocab.numel(), generator=gen) * 1.5).softmax(-1)   # [B, k', S]
    q_full = torch.zeros(B, k_q, V).index_copy_(2, vocab, q_s)                     # [B, k', V]
    # p close to q on S (many acceptances), some mass outside S
    p = 0.8 * torch.zeros(B, k + 1, V).index_copy_(2, vocab, (torch.randn(B, k + 1, vocab.numel(), generator=gen)
                                                              * 1.5).softmax(-1)) + 0.2 * torch.rand(B, k + 1, V,
                                                                                                  generator=gen).softmax(-1)
    drafts = vocab[torch.multinomial(q_s.reshape(-1, vocab.numel()), 1, generator=gen).view(B, k_q)]
    drafts = torch.cat([drafts, torch.randint(0, V, (B, k - k_q), generator=gen)], 1)   # past q: point masses
    num_drafts = torch.randint(0, k + 1, (B,), generator=gen)
    point_mass = torch.rand(B, generator=gen) < 0.25
    results = []
    for probs, ids in ((q_full, None), (q_s, vocab)):
        rng = (KeyedDraws(11, torch.arange(B), torch.zeros(B, dtype=torch.long)) if keyed
               else torch.Generator().manual_seed(5))
        results.append(rejection_sample(drafts, probs, p, rng, num_drafts, point_mass=point_mass, draft_vocab=ids))
    (dense_out, dense_n), (sparse_out, sparse_n) = results
    assert torch.equal(dense_n, sparse_n) and torch.equal(dense_out, sparse_out)
    assert 0 < int(dense_n.sum()) < int(num_drafts.sum())                # some drafts accepted, some rejected
    assert ((dense_n < num_drafts) & ~point_mass).any() and (dense_n == num_drafts).any()   # recovered and bonus
    with pytest.raises(ValueError, match="draft vocabulary"):
        rejection_sample(drafts, q_full, p, gen, draft_vocab=vocab)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9)])
def test_the_raw_log_normalizer_is_logsumexp_of_the_raw_logits(temperature, top_k, top_p):
    """Read off p_max at T = 1 without top-k / top-p, a pass over the vocabulary elsewhere: either way the
    log-probability a rollout records is log softmax of the raw logits."""
    from rollout.verify import process_logits_with_stats, raw_log_normalizer
    logits = torch.randn(6, 4000, generator=torch.Generator().manual_seed(0)) * 4
    _, _, p_max = process_logits_with_stats(logits, temperature, top_k, top_p)
    got = raw_log_normalizer(logits, temperature, top_k, top_p, p_max)
    assert torch.allclose(got, logits.logsumexp(-1), rtol=0, atol=1e-5)
    assert not torch.allclose(got, logits.amax(-1), rtol=0, atol=1e-2)      # not the max alone


def test_keyed_draws_on_cpu_are_the_torch_hash_bit_for_bit():
    """The CPU path hashes in numpy; its uniforms must be the integers and floats of the torch form
    (written out here), for 64-bit seeds, large positions and several streams."""
    from rollout.verify import _MASK32, _mix32

    def torch_form(seed, rows, start, stream, width):
        base = _mix32(_mix32(_mix32((seed >> 32) & _MASK32) ^ (seed & _MASK32)) ^ stream)
        h = _mix32((rows & _MASK32) ^ base)[:, None]
        h = _mix32(h ^ ((start[:, None] + torch.arange(width)) & _MASK32))
        low = _mix32(h ^ 0x5BD1E995)
        return ((h >> 6).double() * 2.0 ** 26 + (low >> 6).double() + 0.5) * 2.0 ** -52

    rows, start = torch.tensor([0, 5, 2**40 + 3]), torch.tensor([0, 117, 2**33 + 9])
    for seed in (0, 11, 2**62 + 12345):
        for stream in (0, 1, 2):
            got = KeyedDraws(seed, rows, start).uniform(stream, 5)
            assert got.dtype == torch.float64 and got.shape == (3, 5)
            assert torch.equal(got, torch_form(seed, rows, start, stream, 5))
            assert bool(((got > 0) & (got < 1)).all())
