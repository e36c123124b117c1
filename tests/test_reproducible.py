"""What a seed reproduces (docs/reliability.md, "What is reproducible"): random draws keyed on (seed, row,
position), so that a row's tokens do not depend on its batch-mates, and point-mass drafts (history, greedy
heads) verified by drawing each position's token from p, so that they never change the tokens."""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from rollout.engine.config import EngineConfig
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from rollout.verify import ACCEPT, DRAFT, TARGET, KeyedDraws, rejection_sample, sample
from tests.conftest import random_heads
from tests.lossless import MIXED_PROMPTS
from tests.test_per_row_drafting import eager_chooser
from tests.test_torch_engine import ATTENTION, attention_config

ROOT = Path(__file__).resolve().parents[1]
OTHERS = [[30, 31], [2, 2, 2, 2, 2, 2], [17], [9, 8, 7, 6]]       # batch-mates that differ from MIXED_PROMPTS


def _tokens(out):
    return [c.tokens for c in out.completions]


def _with_stop(policy, prompts, sp):
    """sp with a stop token that some rows emit early: rows finish at different times (compaction)."""
    first = TorchEngine(policy).generate(prompts, replace(sp, ignore_eos=True))
    return replace(sp, ignore_eos=True, stop_token_ids=(first.completions[0].tokens[5],))


# ------------------------------------------------------------------ keyed draws
def test_keyed_draws_depend_on_seed_row_position_and_stream_only():
    rows, start = torch.tensor([3, 0, 7, -1]), torch.tensor([5, 9, 2, 4])
    u = KeyedDraws(11, rows, start).uniform(TARGET, 6)                                   # [4, 6]
    assert u.dtype == torch.float64 and ((u > 0) & (u < 1)).all()
    alone = KeyedDraws(11, rows[2:3], start[2:3]).uniform(TARGET, 6)                    # another batch, slot 0
    assert torch.equal(alone[0], u[2])
    assert torch.equal(KeyedDraws(11, rows, start + 2).uniform(TARGET, 4), u[:, 2:])    # column j = position
    for other in (KeyedDraws(12, rows, start).uniform(TARGET, 6), KeyedDraws(11, rows, start).uniform(DRAFT, 6),
                  KeyedDraws(11, rows, start).uniform(ACCEPT, 6), KeyedDraws(11, rows + 1, start).uniform(TARGET, 6)):
        assert not torch.isclose(other, u).any()
    big = KeyedDraws(2**62 - 1, torch.arange(100_000), torch.zeros(100_000, dtype=torch.long)).uniform(TARGET, 2)
    counts = torch.histc(big.float(), bins=20, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-3                                     # uniform
    assert abs(torch.corrcoef(big.T.float())[0, 1]) < 0.02                              # columns independent


def test_keyed_sampling_draws_from_p_and_never_a_token_without_mass():
    gen = torch.Generator().manual_seed(0)
    V, n = 700, 200_000                                       # V > one inverse-CDF block, not a multiple of it
    logits = torch.randn(V, generator=gen) * 2
    logits[::7] = float("-inf")
    p = logits.softmax(-1)
    top = p.topk(12).indices
    p_top = torch.zeros(V).scatter_(0, top, p[top])          # a few tokens carry the mass: a sharp test
    keys = KeyedDraws(5, torch.arange(n), torch.zeros(n, dtype=torch.long))
    for dist in (p, p_top):
        counts = torch.bincount(sample(dist.expand(n, V), keys), minlength=V).double()
        assert counts[dist == 0].sum() == 0
        keep = dist * n >= 5
        expected = dist[keep].double() / dist[keep].double().sum() * counts[keep].sum()
        assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3


def test_point_mass_verification_emits_the_tokens_plain_sampling_draws_at_each_position():
    """rejection_sample with point-mass drafts, keyed: whatever the drafts (right, wrong, ragged per row),
    the emitted tokens are the ones sample() draws position by position with the same keys."""
    gen = torch.Generator().manual_seed(1)
    B, k, V = 64, 4, 6
    p = (torch.randn(B, k + 1, V, generator=gen) * 1.5).softmax(-1)
    keys = KeyedDraws(9, torch.arange(B) * 3, torch.randint(3, 40, (B,), generator=gen))
    plain = torch.stack([sample(p[:, j], keys.at(j)) for j in range(k + 1)], 1)           # [B, k+1]
    # drafts: the plain tokens for a random number of positions, then random tokens
    right = torch.randint(0, k + 1, (B, 1), generator=gen)
    drafts = torch.where(torch.arange(k)[None] < right, plain[:, :k], torch.randint(0, V, (B, k), generator=gen))
    num_drafts = torch.randint(0, k + 1, (B,), generator=gen)
    for draft_probs, point_mass in ((None, None), (torch.rand(B, k, V, generator=gen), torch.ones(B, dtype=torch.bool))):
        out, n = rejection_sample(drafts, draft_probs, p, keys, num_drafts, point_mass=point_mass)
        for b in range(B):
            assert out[b, :n[b] + 1].tolist() == plain[b, :n[b] + 1].tolist()
        assert (n < num_drafts).any() and (n == num_drafts).any() and (n > 0).any()


# ------------------------------------------------------------------ the engine: batch-mates
@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_plain_sampling_gives_a_row_the_same_tokens_whatever_its_batch_mates(attention):
    """T = 1, float32, one seed: prompt i at index i gets the same tokens alone (batch 1, for i = 0), with other
    batch-mates, and with or without compaction of finished rows (batch buckets)."""
    policy = random_model(attention_config(attention, vocab_size=32), seed=1)
    sp = _with_stop(policy, MIXED_PROMPTS, SamplingParams(max_new_tokens=30, temperature=1.0, seed=7))
    batch = TorchEngine(policy).generate(MIXED_PROMPTS, sp)
    assert len({len(t) for t in _tokens(batch)}) > 1                       # rows finished at different times
    alone = TorchEngine(policy).generate(MIXED_PROMPTS[:1], sp)
    assert _tokens(alone)[0] == _tokens(batch)[0]
    torch.testing.assert_close(alone.completions[0].logprobs, batch.completions[0].logprobs, atol=1e-5, rtol=0)
    for i in range(1, len(MIXED_PROMPTS)):
        mixed = OTHERS[:i] + [MIXED_PROMPTS[i]] + OTHERS[i + 1:]
        assert _tokens(TorchEngine(policy).generate(mixed, sp))[i] == _tokens(batch)[i]
    unbucketed = TorchEngine(policy, config=EngineConfig(batch_buckets=(8,))).generate(MIXED_PROMPTS, sp)
    assert _tokens(unbucketed) == _tokens(batch)


def test_fixed_length_rejection_drafts_give_a_row_the_same_tokens_whatever_its_batch_mates():
    """Sampled head drafts draw from their own keyed stream too: with fixed draft lengths (no decisions from
    measured times), a row's tokens do not depend on its batch-mates either."""
    policy = random_model(attention_config("sdpa", vocab_size=32), seed=2)
    heads = random_heads(policy, 2, seed=3)
    sp = _with_stop(policy, MIXED_PROMPTS, SamplingParams(max_new_tokens=24, temperature=1.0, seed=4))
    sp = replace(sp, num_draft_tokens=3, draft_mode="rejection")
    engine = TorchEngine(policy, heads, config=EngineConfig(draft_lengths="fixed"))
    batch = engine.generate(MIXED_PROMPTS, sp)
    assert _tokens(engine.generate(MIXED_PROMPTS, sp)) == _tokens(batch)
    assert _tokens(engine.generate(MIXED_PROMPTS[:1], sp))[0] == _tokens(batch)[0]
    mixed = OTHERS[:2] + MIXED_PROMPTS[2:3] + OTHERS[3:]
    assert _tokens(engine.generate(mixed, sp))[2] == _tokens(batch)[2]


# ------------------------------------------------------------------ the engine: point-mass drafts
@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("draft_mode, sources", [("greedy", ("heads", "history")), ("rejection", ("history",))])
def test_point_mass_drafts_at_temperature_one_give_the_tokens_of_plain_decoding(attention, draft_mode, sources,
                                                                                 monkeypatch):
    """Greedy head drafts and history drafts, ragged per row, rows finishing at different times, a second call
    drafting from the first call's rollouts: at T = 1 the same tokens as plain decoding with the same seed."""
    eager_chooser(monkeypatch)
    policy = random_model(attention_config(attention, vocab_size=32), seed=1)
    prompts = MIXED_PROMPTS + MIXED_PROMPTS[:2]
    base = _with_stop(policy, prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=3))
    plain = TorchEngine(policy).generate(prompts, base)
    assert len({len(t) for t in _tokens(plain)}) > 1
    engine = TorchEngine(policy, random_heads(policy, 2, seed=2), config=EngineConfig(draft_sources=sources))
    sp = replace(base, num_draft_tokens=4, draft_mode=draft_mode)
    outs = [engine.generate(prompts, sp) for _ in range(2)]
    for out in outs:
        assert _tokens(out) == _tokens(plain)
    rounds = [(s, n, a) for out in outs for c in out.completions
              for s, n, a in zip(c.round_sources, c.round_draft_tokens, c.round_accepted)]
    assert {s for s, _, _ in rounds} == set(sources)
    assert len({n for _, n, _ in rounds}) > 1                                   # ragged drafts
    assert any(a > 0 for s, _, a in rounds if s == "history")                   # drafts were accepted ...
    assert any(a < n for _, n, a in rounds)                                     # ... and rejected


# ------------------------------------------------------------------ a seeded run
def _records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


# what a run's records hold that a seed does not fix: times, and how drafting went
TIMES = ("time", "wall_time_s", "tokens_per_s", "plain_estimate_s", "speedup_estimate", "rollout_s",
         "rollout_wait_s", "train_s", "rollout_plain_estimate_s")
DRAFTING = ("acceptance", "draft", "accepted", "slope", "bins_step", "drafting", "nonfinite", "speedup",
            "plain_estimate", "alerts", "calibration", "history", "speculation_")


def _close(a, b) -> bool:
    """Equal, but floats to float32 round-off: a drafted position's entropy and log-probability come
    from the verification forward, which computes several positions at once (another reduction order
    than plain decoding's one-token forward; measured ~1e-8 relative on an AMD EPYC). Counts, tokens
    and rewards, integers or exact floats, must still be equal: a 1e-6 tolerance on them would not
    hide a different token."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    return a == b


def _without(record, words):
    if isinstance(record, dict):
        return {k: _without(v, words) for k, v in record.items() if not any(w in k for w in words)}
    return record


@pytest.mark.slow
@pytest.mark.ray
def test_a_seeded_run_repeats_and_point_mass_drafting_does_not_change_it(tmp_path):
    """The smoke job (heads fixed: refresh=never), seed fixed: (a) run twice with fixed draft lengths, its monitor
    and RL records are identical but for times; (b) with greedy head drafts and history chosen per row from
    measured round times, every record of the policy's side (tokens, rewards, and to float32 round-off the
    entropies and training statistics) is that of plain decoding."""
    from experiments.async_rl import main
    from rollout.ray_guard import local_ray

    common = [str(ROOT / "configs/smoke.yaml"), "progress=false", "steps=4", "accelerator.cotrainer.refresh=[never]"]
    runs = {"fixed_a": ["accelerator.workers.draft_lengths=fixed"], "fixed_b": ["accelerator.workers.draft_lengths=fixed"],
            "plain": ["sampling.num_draft_tokens=0"], "greedy": ["sampling.draft_mode=greedy"]}
    threads = torch.get_num_threads()
    with local_ray(num_cpus=2, log_to_driver=False):
        for name, extra in runs.items():
            assert main([*common, f"out_dir={tmp_path / name}", *extra]) == 0
    torch.set_num_threads(threads)

    def steps(name, file, words):
        return [_without(r, words) for r in _records(tmp_path / name, file) if "event" not in r]

    for file in ("monitor.jsonl", "rl.jsonl"):
        a, b = steps("fixed_a", file, TIMES), steps("fixed_b", file, TIMES)
        assert len(a) == 4 and a == b
        plain, greedy = steps("plain", file, TIMES + DRAFTING), steps("greedy", file, TIMES + DRAFTING)
        assert len(plain) == 4 and _close(plain, greedy), (plain, greedy)
    greedy_mon = _records(tmp_path / "greedy", "monitor.jsonl")
    assert sum(r.get("num_drafts", 0) for r in greedy_mon) > 0                        # it did draft
    assert all(math.isfinite(r["train"]["entropy"]) for r in _records(tmp_path / "plain", "rl.jsonl"))
