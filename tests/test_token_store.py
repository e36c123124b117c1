"""The token store: exact round trip, corrupt-shard detection and rebuild, resume, rollout hook."""
import json

import numpy as np
import pytest
import torch

from mtp_heads.data.builder import Example, add_rollouts, build_shards
from mtp_heads.data.sharegpt import loss_mask_of
from mtp_heads.data.teacher_force import length_batches, teacher_force, to_bf16_bits
from mtp_heads.data.token_store import CorruptShardError, StoreWriter, TokenStore
from tests.helpers import bf16_bits_to_float

META = {"model": "tiny", "hidden_size": 32, "dtype": "bfloat16"}


def items(n: int, seed: int = 0) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """n synthetic conversations: (key, tokens [T], assistant [T]) of varied length."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        T = int(rng.integers(5, 40))
        assistant = np.zeros(T, bool)
        assistant[int(rng.integers(1, T - 1)):] = True
        out.append((f"conv{i}", rng.integers(2, 64, T).astype(np.int32), assistant))
    return out


def make(chunk, shard_index):
    return [Example(k, t, a) for k, t, a in chunk]


def build(root, policy, n_items=10, target=10**9, log=print, make_examples=make, **kw):
    return build_shards(StoreWriter(root, META), policy, source="sharegpt", split="train", items=items(n_items),
                        make_examples=make_examples, items_per_shard=3, target_tokens=target,
                        max_batch_tokens=64, log=log, **kw)


def shard_checksums(root):
    return {n: {f: v["sha256"] for f, v in e["files"].items()}
            for n, e in json.loads((root / "manifest.json").read_text())["shards"].items()}


def test_round_trip_is_exact(tmp_path, tiny_policy):
    report = build(tmp_path, tiny_policy)
    assert report.shards_built == 4 and report.tokens == sum(len(t) for _, t, _ in items(10))
    store = TokenStore(tmp_path)
    train = store.split("train")
    assert len(train) == 10 and store.num_tokens("train") == report.tokens and store.split("heldout").__len__() == 0
    assert store.meta == META and list(train.lengths()) == [len(t) for _, t, _ in items(10)]
    expected_hidden = teacher_force(tiny_policy, [t for _, t, _ in items(10)], 64)
    for i, (key, tokens, assistant) in enumerate(items(10)):
        seq = train[i]
        assert seq.key == key and seq.source == "sharegpt"
        assert seq.tokens.dtype == torch.int64 and torch.equal(seq.tokens, torch.from_numpy(tokens).long())
        assert torch.equal(seq.loss_mask, torch.from_numpy(loss_mask_of(assistant)))
        assert seq.hidden.dtype == torch.bfloat16 and seq.hidden.shape == (len(tokens), 32)
        assert np.array_equal(seq.hidden.view(torch.int16).numpy().view(np.uint16), expected_hidden[i])
        # the stored state is the policy's final-norm hidden state (bf16-rounded), which gives its logits
        ref = tiny_policy.hidden_states(torch.from_numpy(tokens).long()[None])[0]
        torch.testing.assert_close(seq.hidden.float(), ref, atol=2e-2, rtol=1e-2)
    assert store.num_loss_tokens("train") == sum(int(loss_mask_of(a).sum()) for _, _, a in items(10))
    assert [s.key for s in train] == [k for k, _, _ in items(10)]
    assert store.summary()["train"]["sharegpt"]["sequences"] == 10


def test_padding_and_batching_do_not_change_the_states(tiny_policy):
    seqs = [t for _, t, _ in items(7, seed=1)]
    one_by_one = teacher_force(tiny_policy, seqs, max_batch_tokens=1)
    batched = teacher_force(tiny_policy, seqs, max_batch_tokens=10**6)
    for a, b in zip(one_by_one, batched):
        torch.testing.assert_close(bf16_bits_to_float(a), bf16_bits_to_float(b), atol=1e-2, rtol=1e-2)
    assert sorted(i for b in length_batches([5, 9, 3, 9], 18) for i in b) == [0, 1, 2, 3]
    assert all(len(b) * max([5, 9, 3, 9][i] for i in b) <= 18 for b in length_batches([5, 9, 3, 9], 18))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_shard_is_detected_named_and_rebuilt(tmp_path, tiny_policy, damage):
    build(tmp_path, tiny_policy)
    good = shard_checksums(tmp_path)
    victim = tmp_path / "shards" / "sharegpt-train-00002" / "hidden.npy"
    raw = bytearray(victim.read_bytes())
    if damage == "flip":
        raw[-7] ^= 0xFF
        victim.write_bytes(bytes(raw))
    elif damage == "truncate":
        victim.write_bytes(bytes(raw[:len(raw) // 2]))
    else:
        victim.unlink()
    with pytest.raises(CorruptShardError, match="sharegpt-train-00002") as err:
        TokenStore(tmp_path)
    assert err.value.shards == ["sharegpt-train-00002"]
    with pytest.warns(UserWarning, match="sharegpt-train-00002"):
        partial = TokenStore(tmp_path, on_corrupt="skip")
    assert len(partial.split("train")) == 7
    messages = []
    report = build(tmp_path, tiny_policy, log=messages.append)
    assert report.shards_rebuilt == 1 and report.shards_kept == 3 and report.shards_built == 1
    assert any("sharegpt-train-00002" in m and "rebuild" in m for m in messages)
    assert shard_checksums(tmp_path) == good
    assert len(TokenStore(tmp_path).split("train")) == 10


def test_resume_after_interruption_gives_the_same_store(tmp_path, tiny_policy):
    build(tmp_path / "once", tiny_policy)

    def dies_on_shard_2(chunk, i):
        if i == 2:
            raise KeyboardInterrupt
        return make(chunk, i)

    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "twice", tiny_policy, make_examples=dies_on_shard_2)
    assert sorted(shard_checksums(tmp_path / "twice")) == ["sharegpt-train-00000", "sharegpt-train-00001"]
    assert len(TokenStore(tmp_path / "twice").split("train")) == 6          # readable meanwhile
    report = build(tmp_path / "twice", tiny_policy)
    assert report.shards_kept == 2 and report.shards_built == 2
    assert shard_checksums(tmp_path / "twice") == shard_checksums(tmp_path / "once")


def test_growing_the_target_appends_shards(tmp_path, tiny_policy):
    first = build(tmp_path, tiny_policy, target=1)
    assert first.shards_built == 1
    second = build(tmp_path, tiny_policy)
    assert second.shards_kept == 1 and second.shards_built == 3
    with pytest.raises(ValueError, match="other settings"):
        StoreWriter(tmp_path, {**META, "hidden_size": 64})
    with pytest.raises(ValueError, match="built with"):
        build(tmp_path, tiny_policy, params={"kind": "other"})


def test_rollout_hook_appends_rollouts_in_the_store_format(tmp_path, tiny_policy):
    writer = StoreWriter(tmp_path, META)
    rollouts = []
    for i in range(30):
        tokens = torch.randint(2, 64, (12,))
        hidden = tiny_policy.hidden_states(tokens[None])[0]              # [T, d] as the engine returns
        rollouts.append((tokens.tolist(), hidden, 5, f"prompt {i}"))
    names = add_rollouts(writer, rollouts, heldout_fraction=0.2)
    names += add_rollouts(StoreWriter.existing(tmp_path), rollouts[:3], heldout_fraction=0.2)
    assert len(set(names)) == len(names) and "rollout-train-00001" in names
    store = TokenStore(tmp_path)
    seqs = list(store.split("train", sources=["rollout"])) + list(store.split("heldout"))
    assert len(seqs) == 33 and {s.source for s in seqs} == {"rollout"}
    assert not {s.key for s in store.split("train")} & {s.key for s in store.split("heldout")}
    by_key = {r[3]: r for r in rollouts}
    for s in seqs:
        tokens, hidden, P, _ = by_key[s.key]
        assert s.tokens.tolist() == tokens
        assert s.loss_mask.tolist() == [False] * (P - 1) + [True] * (12 - P) + [False]
        assert np.array_equal(s.hidden.view(torch.int16).numpy().view(np.uint16), to_bf16_bits(hidden))
    assert len(store.split("train", sources=["sharegpt"])) == 0
