"""Drafts copied from rollout history (rollout.engine.history): both suffix index backends agree,
and RolloutHistory drafts from siblings, earlier calls, the prompt and other prompts within its
bounds."""
import random

import pytest

from rollout.engine import history
from rollout.engine.history import (ArcticSuffixIndex, HistoryDraft, PythonSuffixIndex,
                                    RolloutHistory, arctic_available, new_index, resolve_backend)

needs_arctic = pytest.mark.skipif(not arctic_available(), reason="arctic-inference not installed")
BACKENDS = ["python", pytest.param("arctic", marks=needs_arctic)]


def _unique(start: int, n: int) -> list[int]:
    """n tokens no other test sequence uses (ids from `start`)."""
    return list(range(start, start + n))


def _fill(h: RolloutHistory, row: int, tokens: list[int], chunk: int = 3):
    for i in range(0, len(tokens), chunk):
        h.append(row, tokens[i:i + chunk])


def _assert_well_formed(d: HistoryDraft, max_tokens: int):
    assert len(d.tokens) == len(d.probs) <= max(max_tokens, 0)
    assert all(0.0 < p <= 1.0 for p in d.probs)
    assert all(a >= b for a, b in zip(d.probs, d.probs[1:]))
    assert all(0.0 < c <= 1.0 + 1e-6 for c in d.cond)
    assert d.score == pytest.approx(sum(d.probs), rel=1e-5)


@needs_arctic
@pytest.mark.parametrize("depth,vocab", [(4, 3), (8, 4), (24, 5), (24, 40)])
def test_backends_give_the_same_drafts_on_random_streams_with_repeats(depth, vocab):
    """Extends (random tokens or copies of earlier spans), removals and queries of every kind, in
    the same order on both backends: same tokens, probs (1e-6), match length and score."""
    rng = random.Random(depth * 100 + vocab)
    a, p = ArcticSuffixIndex(depth), PythonSuffixIndex(depth)
    seqs: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(1500):
        r = rng.random()
        if r < 0.45 or not seqs:
            sid = rng.choice(list(seqs)) if seqs and rng.random() < 0.7 else next_id
            next_id += sid == next_id
            if seqs and rng.random() < 0.5:
                src = seqs[rng.choice(list(seqs))]
                i = rng.randrange(len(src))
                toks = src[i:i + rng.randint(1, 12)]
            else:
                toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            a.extend(sid, toks)
            p.extend(sid, toks)
            seqs.setdefault(sid, []).extend(toks)
        elif r < 0.55:
            sid = rng.choice(list(seqs))
            a.remove(sid)
            p.remove(sid)
            del seqs[sid]
        else:
            if seqs and rng.random() < 0.7:
                sid = rng.choice(list(seqs))
                src = seqs[sid]
                i = rng.randrange(len(src) + 1)
                ctx = src[max(0, i - rng.randint(0, depth + 3)):i]
                hint = sid if i == len(src) else None
            else:
                ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, depth + 3))]
                hint = None
            args = (ctx, rng.randint(0, 12), rng.choice([0.0, 0.05, 0.1, 0.3, 0.5, 1.0]),
                    rng.choice([1.0, 0.5, 2.0]), rng.choice([0.0, 1.0, 2.5]))
            da, dp = a.speculate(*args), p.speculate(*args, seq_id=hint)
            assert (dp.tokens, dp.match_len, dp.score) == (da.tokens, da.match_len, da.score), args
            assert dp.probs == pytest.approx(da.probs, abs=1e-6)
    assert a.num_seqs() == p.num_seqs() == len(seqs)
    assert p.num_tokens() == a.num_tokens() == sum(map(len, seqs.values()))
    for sid in list(seqs):
        p.remove(sid)
    assert p.num_nodes() == 0 and p.num_seqs() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_basics(backend):
    idx = new_index(8, backend)
    assert idx.backend == backend
    idx.extend(0, [1, 2, 3, 1, 2, 4])
    d = idx.speculate([9, 1, 2], 8, 0.1)
    assert d.tokens == [3, 1] and d.probs == [0.5, 0.5] and d.match_len == 2
    assert idx.speculate([7, 8, 9], 8, 0.1) == HistoryDraft()      # unseen: empty, no match
    assert idx.speculate([1, 2], 0, 0.1).tokens == []
    assert idx.num_seqs() == 1 and idx.num_tokens() == 6 and idx.memory_bytes() > 0
    with pytest.raises(KeyError):
        idx.remove(5)
    idx.remove(0)
    assert idx.num_seqs() == 0 and idx.speculate([9, 1, 2], 8, 0.1).tokens == []


def test_backend_choice(monkeypatch):
    assert resolve_backend("python") == "python"
    assert resolve_backend("auto") == ("arctic" if arctic_available() else "python")
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("rust")
    monkeypatch.setattr(history, "arctic_available", lambda: False)
    assert resolve_backend("auto") == "python"
    assert RolloutHistory().stats()["backend"] == "python"
    with pytest.raises(ImportError, match="arctic-inference"):
        resolve_backend("arctic")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sibling_is_drafted_for_another_row_while_both_generate(backend):
    h = RolloutHistory(backend=backend)
    prompt, resp = _unique(1000, 30), _unique(2000, 40)
    rows = h.begin_call([prompt, _unique(5000, 10), prompt], policy_version=0)
    assert rows == [0, 1, 2]
    _fill(h, 0, resp[:20])
    _fill(h, 2, resp[:6])
    d = h.propose(2, 8)
    assert d.tokens == resp[6:14] and d.probs == [0.5] * 8   # the sibling passes, row 2 ends here
    assert d.match_len > 6                                   # the match spans the prompt's tail
    _fill(h, 0, resp[20:])
    _fill(h, 2, resp[6:30])
    assert h.propose(2, 4).tokens == resp[30:34]
    assert h.propose(1, 8).tokens == []                      # other prompt, nothing to copy
    h.end_call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_earlier_calls_response_is_drafted_in_a_later_call(backend):
    h = RolloutHistory(backend=backend)
    prompt, resp = _unique(1000, 30), _unique(2000, 40)
    h.begin_call([prompt], policy_version=0)
    _fill(h, 0, resp)
    h.end_call()
    (row,) = h.begin_call([prompt], policy_version=1)
    assert h.propose(row, 8).tokens == resp[:8]              # the opening, before any token
    _fill(h, row, resp[:3])
    d = h.propose(row, 8)
    assert d.tokens == resp[3:11] and d.probs == [0.5] * 8
    h.end_call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_prompt_itself_is_drafted(backend):
    h = RolloutHistory(backend=backend)
    quote = _unique(3000, 20)
    prompt = _unique(1000, 10) + quote + _unique(1100, 10)
    (row,) = h.begin_call([prompt], policy_version=0)
    _fill(h, row, _unique(4000, 3) + quote[:6])
    d = h.propose(row, 8)
    assert d.tokens == quote[6:12] and d.match_len == 6      # m * spec_factor tokens for m = 6
    _fill(h, row, quote[6:12])
    assert h.propose(row, 8).tokens == quote[12:20]


@pytest.mark.parametrize("backend", BACKENDS)
def test_another_prompts_response_is_drafted_through_the_global_window(backend):
    for window, expect in ((256, True), (0, False)):
        h = RolloutHistory(backend=backend, window_responses=window)
        resp = _unique(2000, 40)
        h.begin_call([_unique(1000, 30)], policy_version=0)
        _fill(h, 0, resp)
        h.end_call()
        (row,) = h.begin_call([_unique(6000, 30)], policy_version=0)
        _fill(h, row, resp[:10])
        d = h.propose(row, 8)
        assert d.tokens == (resp[10:18] if expect else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_responses_older_than_max_version_lag_are_removed(backend):
    prompt = _unique(1000, 30)
    resps = [_unique(10_000 * (v + 1), 30) for v in range(4)]
    for lag in (2, None):
        h = RolloutHistory(backend=backend, max_version_lag=lag)
        for v in range(3):
            h.begin_call([prompt], policy_version=v)
            _fill(h, 0, resps[v])
            h.end_call()
        (row,) = h.begin_call([prompt], policy_version=3)    # keeps versions >= 3 - lag
        assert h.stats()["responses"] == (3 if lag is None else 2) + 1
        _fill(h, row, resps[0][:10])
        assert h.propose(row, 4).tokens == ([] if lag == 2 else resps[0][10:14])
        h.end_call()
        h.begin_call([prompt], policy_version=3)
        h.append(0, resps[1][:10])
        assert h.propose(0, 4).tokens == resps[1][10:14]     # version 1 is still within the lag


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_bounds_hold_and_stats_report_them(backend):
    h = RolloutHistory(backend=backend, depth=8, max_prompts=3, max_responses_per_prompt=2,
                       window_responses=4, window_tokens=300, max_held_tokens=None)
    prompts = [_unique(1000 * (i + 1), 12) for i in range(6)]
    sizes = []
    for call in range(6):
        batch = [prompts[call]] * 3 + [prompts[0]]           # prompt 0 is used every call
        h.begin_call(batch, policy_version=call)
        for row in range(len(batch)):
            _fill(h, row, _unique(100_000 + 1000 * (4 * call + row), 50))
        h.end_call()
        s = h.stats()
        sizes.append(s["memory_bytes"])
        walked = sum(e.index.memory_bytes() for e in h._entries.values()) + h._global.memory_bytes()
        assert s["memory_bytes"] == walked              # the cached sizes follow appends and removals
        assert s["backend"] == backend
        assert s["prompts"] <= 3 and s["responses"] <= 3 * 2
        assert s["window_responses"] <= 4 and s["window_tokens"] <= 300
        assert s["tokens"] == sum(len(k) for k in h._entries) + 57 * s["responses"]  # 7 lead + 50
    assert tuple(prompts[0]) in h._entries and tuple(prompts[1]) not in h._entries  # LRU kept 0
    assert max(sizes[2:]) < 2 * min(sizes[2:])               # steady, not growing
    (row,) = h.begin_call([prompts[5]], policy_version=9)
    _fill(h, row, _unique(100_000 + 1000 * 21, 10))          # a kept response of prompt 5
    assert h.propose(row, 4).tokens == _unique(100_000 + 1000 * 21 + 10, 4)

    small = RolloutHistory(backend=backend, depth=8, max_held_tokens=200, window_responses=0)
    for i in range(5):
        small.begin_call([prompts[i]], policy_version=0)
        _fill(small, 0, _unique(200_000 + 1000 * i, 60))
        small.end_call()
        assert small.stats()["tokens"] <= 200
    assert small.stats()["prompts"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_propose_respects_max_tokens_and_is_empty_for_an_unseen_context(backend):
    rng = random.Random(7)
    h = RolloutHistory(backend=backend, depth=12, min_prob=0.05)
    prompts = [[rng.randrange(6) for _ in range(15)] for _ in range(3)]
    rows = h.begin_call([prompts[i % 3] for i in range(9)], policy_version=0)
    drafted = 0
    for _ in range(40):
        for row in rows:
            h.append(row, [rng.randrange(6) for _ in range(rng.randint(1, 3))])
            for k in (0, 1, 3, 8):
                d = h.propose(row, k)
                _assert_well_formed(d, k)
                drafted += len(d.tokens)
    assert drafted > 0
    (row,) = h.begin_call([[100, 101, 102]], policy_version=1)
    h.append(row, [103, 104])
    assert h.propose(row, 8) == HistoryDraft()
    h.end_call()
    assert h.stats()["responses"] == 9 + 1
    h.begin_call([[100, 101, 102]], policy_version=1)
    h.end_call()                                             # an empty response is not kept
    assert h.stats()["responses"] == 9 + 1
