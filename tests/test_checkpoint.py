"""Head checkpoints: round trip, atomic writes, refusal of heads built for another policy."""
import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

import mtp_heads.checkpoint as ckpt
from mtp_heads.checkpoint import (HeadMeta, default_heads_path, draft_vocab_of, load_heads, read_meta, save_heads,
                                  set_draft_vocab, sidecar_path)
from mtp_heads.heads import init_heads
from rollout.models.config import ModelConfig
from rollout.models.decoder import random_model
from tests.conftest import tiny_config


def _meta(heads, **kw):
    return HeadMeta.for_heads(heads, loss="tv", steps=7, head_version=3, model_spec="tiny", **kw)


def test_round_trip_weights_meta_and_draft_vocab(tmp_path, tiny_policy, tiny_heads):
    set_draft_vocab(tiny_heads, torch.tensor([5, 3, 9, 3]))
    path = tmp_path / "h.safetensors"
    written = save_heads(path, tiny_heads, _meta(tiny_heads))
    heads, meta = load_heads(path, tiny_policy)
    assert meta == written and meta.created > 0
    assert (meta.loss, meta.steps, meta.head_version, meta.num_depths, meta.draft_vocab_size) == ("tv", 7, 3, 2, 3)
    assert meta.policy_fingerprint == tiny_policy.config.fingerprint()
    sd0, sd1 = tiny_heads.state_dict(), heads.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    assert draft_vocab_of(heads).tolist() == [3, 5, 9]              # sorted, unique
    assert torch.equal(heads.state_dict()["draft_vocab"], torch.tensor([3, 5, 9]))   # travels with the weights
    side = json.loads(sidecar_path(path).read_text())
    assert side["policy_fingerprint"] == meta.policy_fingerprint and side["steps"] == 7
    assert read_meta(path) == meta


def test_full_vocabulary_checkpoint_has_no_draft_vocab(tmp_path, tiny_policy, tiny_heads):
    path = tmp_path / "h.safetensors"
    save_heads(path, tiny_heads, _meta(tiny_heads))
    heads, meta = load_heads(path, tiny_policy)
    assert draft_vocab_of(heads) is None and meta.draft_vocab_size == 0


def test_failed_write_leaves_old_checkpoint_intact(tmp_path, tiny_policy, tiny_heads, monkeypatch):
    path = tmp_path / "h.safetensors"
    save_heads(path, tiny_heads, _meta(tiny_heads))
    before = path.read_bytes(), sidecar_path(path).read_bytes()
    changed = init_heads(tiny_policy, 2, seed=1)

    def broken(fd):                       # the bytes went to the temporary file, then the disk fills up
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError, match="disk full"):
        save_heads(path, changed, _meta(changed, ))
    assert (path.read_bytes(), sidecar_path(path).read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.json", "h.safetensors"]   # no temp files left
    heads, _ = load_heads(path, tiny_policy)
    assert torch.equal(heads.depths[0].eh_proj.weight, tiny_heads.depths[0].eh_proj.weight)


@pytest.mark.parametrize("override, what", [
    (dict(num_hidden_layers=3), "fingerprint"),
    (dict(hidden_size=48, intermediate_size=64), "fingerprint"),
    (dict(vocab_size=80), "fingerprint"),
])
def test_heads_for_another_policy_are_refused(tmp_path, tiny_heads, override, what):
    path = tmp_path / "h.safetensors"
    save_heads(path, tiny_heads, _meta(tiny_heads))
    other = random_model(tiny_config(**override), seed=1)
    with pytest.raises(ValueError, match=f"{what}.*this policy is .*mtp-rollout train-heads"):
        load_heads(path, other)


def test_hidden_and_vocab_checks_name_the_property(tiny_policy, tiny_heads):
    meta = _meta(tiny_heads)
    fp = tiny_policy.config.fingerprint()
    with pytest.raises(ValueError, match="hidden size 99, this policy has 32"):
        ckpt.check_meta(HeadMeta(fp, 99, 64, 2), tiny_policy, "x")
    with pytest.raises(ValueError, match="vocabulary size 70, this policy has 64"):
        ckpt.check_meta(HeadMeta(fp, 32, 70, 2), tiny_policy, "x")
    ckpt.check_meta(meta, tiny_policy, "x")


def test_meta_must_describe_the_heads(tmp_path, tiny_heads):
    bad = HeadMeta("0" * 16, 32, 64, 2)
    with pytest.raises(ValueError, match="does not describe these heads"):
        save_heads(tmp_path / "h.safetensors", tiny_heads, bad)


def test_missing_or_foreign_file(tmp_path, tiny_policy):
    with pytest.raises(ValueError, match="no head checkpoint.*train-heads"):
        load_heads(tmp_path / "nope.safetensors", tiny_policy)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(ValueError, match="without an MTP-head header"):
        load_heads(tmp_path / "f.safetensors", tiny_policy)


def test_draft_vocab_validation(tiny_heads):
    with pytest.raises(ValueError, match=r"draft_vocab must be .*in \[0, 64\)"):
        set_draft_vocab(tiny_heads, torch.tensor([1, 64]))
    set_draft_vocab(tiny_heads, torch.tensor([1, 2]))
    set_draft_vocab(tiny_heads, None)
    assert draft_vocab_of(tiny_heads) is None


def test_default_heads_path_uses_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path))
    p = default_heads_path("smollm2-135m", 3, "tv")
    assert p == tmp_path / "heads" / "smollm2-135m-D3-tv.safetensors"
    assert default_heads_path("/a b/model dir", 2, "ce").name == "a_b_model_dir-D2-ce.safetensors"


def test_two_layer_heads_round_trip(tmp_path, tiny_policy):
    heads = init_heads(tiny_policy, 1, seed=3, num_layers=2)
    path = tmp_path / "h2.safetensors"
    save_heads(path, heads, HeadMeta.for_heads(heads, loss="tv"))
    loaded, meta = load_heads(path, tiny_policy)
    assert meta.num_layers == 2 and loaded.num_layers == 2
    for (name, a), b in zip(heads.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_shipped_heads_use_the_current_tensor_names_and_format():
    from mtp_heads.shipped import shipped_heads_path
    path = shipped_heads_path("smollm2-135m")
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3)              # SmolLM2-135M's architecture
    assert cfg.fingerprint() == read_meta(path).policy_fingerprint
    # load_heads reads only the policy's config and the dtype/device of its embedding
    policy = SimpleNamespace(config=cfg, model=SimpleNamespace(embed_tokens=SimpleNamespace(
        weight=torch.empty(0, dtype=torch.bfloat16))))
    heads, meta = load_heads(path, policy)
    assert meta.format_version == ckpt.FORMAT_VERSION
    fresh = ckpt.MTPHeads(cfg, meta.num_depths, meta.num_layers)
    assert set(heads.state_dict()) - {"draft_vocab"} == set(fresh.state_dict())
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(fresh.state_dict()) | {"draft_vocab"}



def test_the_shipped_eagle3_drafter_fits_smollm2_and_is_named_shipped_eagle3():
    """heads=shipped-eagle3 names the packaged EAGLE-3 drafter; its config and every tensor fit SmolLM2-135M
    (checked against the architecture, without the model's weights), finite, in bf16 with its draft maps."""
    from mtp_heads.eagle3_checkpoint import WEIGHTS_FILE, drafter_layout, eagle3_from_tensors, read_config
    from mtp_heads.shipped import drafter_location, shipped_eagle3_path
    path = shipped_eagle3_path("smollm2-135m")
    assert drafter_location("shipped-eagle3", "smollm2-135m") == str(path)
    assert drafter_location("shipped", "smollm2-135m") == "shipped"
    assert drafter_layout(path) == "eagle3"
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3)              # SmolLM2-135M's architecture
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert all(torch.isfinite(t.float()).all() for t in tensors.values() if t.is_floating_point())
    assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.bfloat16}
    drafter = eagle3_from_tensors(read_config(path), tensors, cfg, path)
    assert drafter.aux_layer_ids == (2, 15, 27) and drafter.draft_vocab_size == 4096
    with pytest.raises(ValueError, match="heads=shipped-eagle3: the package ships no EAGLE-3 drafter for model 'other'"):
        drafter_location("shipped-eagle3", "other")

def _rewrite_header(path, **changes):
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = json.loads(f.metadata()[ckpt.META_KEY])
    header.update(changes)
    header = {k: v for k, v in header.items() if v is not None}
    path.write_bytes(save(tensors, metadata={ckpt.META_KEY: json.dumps(header)}))


def test_an_unsupported_or_missing_format_version_is_refused_naming_it(tmp_path, tiny_policy, tiny_heads):
    path = tmp_path / "h.safetensors"
    save_heads(path, tiny_heads, _meta(tiny_heads))
    assert read_meta(path).format_version == ckpt.FORMAT_VERSION == 2
    _rewrite_header(path, format_version=99)
    with pytest.raises(ValueError, match=r"h\.safetensors: head checkpoint format_version 99 is not supported "
                                         r"\(.*reads format_version 2\)"):
        load_heads(path, tiny_policy)
    _rewrite_header(path, format_version=None)
    with pytest.raises(ValueError, match=r"h\.safetensors: head checkpoint format_version None is not supported"):
        read_meta(path)


def test_grown_heads_draft_exactly_what_the_one_layer_heads_drafted(tiny_policy):
    from mtp_heads.heads import grow_layers
    one = init_heads(tiny_policy, 1, seed=5)
    two = grow_layers(one, tiny_policy, 2)
    assert two.num_layers == 2 and one.num_layers == 1
    tokens = torch.randint(2, tiny_policy.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = tiny_policy.hidden_states(tokens)
        a, b = one.teacher_forced(tiny_policy, hidden, tokens)[0], two.teacher_forced(tiny_policy, hidden, tokens)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the added layer is trainable capacity, not a frozen identity: its zeroed output projections get gradients
    two.requires_grad_(True)
    two.teacher_forced(tiny_policy, hidden, tokens)[0].square().sum().backward()
    assert float(two.depths[0].blocks[1].mlp.down_proj.weight.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="cannot shrink"):
        grow_layers(two, tiny_policy, 1)
