"""EAGLE-3 drafter: the reference drafting function, its checkpoint layout, and bad checkpoints."""
import json

import pytest
import torch

from mtp_heads.checkpoint import HeadMeta, save_heads
from mtp_heads.eagle3 import aux_hidden_states, default_aux_layer_ids, draft_greedy, init_eagle3
from mtp_heads.eagle3_checkpoint import (CONFIG_FILE, WEIGHTS_FILE, check_eagle3_dir, drafter_layout, load_eagle3,
                                         save_eagle3)
from mtp_heads.heads import init_heads
from tests.conftest import tiny_model

AUX = (1, 2, 4)


@pytest.fixture(scope="module")
def policy():
    return tiny_model(seed=0, num_hidden_layers=4, vocab_size=96)


@pytest.fixture(scope="module")
def drafter(policy):
    return init_eagle3(policy, AUX, draft_vocab=torch.arange(0, 96, 2), seed=1)   # even token ids only


def _residual_stream(policy, tokens):
    """Layer by layer, by hand: [embeddings, after layer 1, ..., after layer L] each [B, T, d]."""
    x = policy.model.embed_tokens(tokens)
    positions = torch.arange(tokens.shape[1])[None]
    rope = policy.model.rotary(positions)
    out = [x]
    for i, layer in enumerate(policy.model.layers):
        x = layer(x, rope, positions, None, i)
        out.append(x)
    return out


@torch.no_grad()
def _draft_without_cache(policy, drafter, sequence, k):
    """The same drafts recomputed from scratch each step over the whole sequence (no KV cache): the
    drafter's input at committed positions is (x_{i+1}, fc(aux_i)), at draft positions its own
    pre-norm output and its previous draft."""
    seq = torch.tensor([sequence])
    stream = _residual_stream(policy, seq[:, :-1])
    hidden = drafter.fc(torch.cat([stream[i] for i in drafter.aux_layer_ids], -1))       # [1, n-1, d]
    tokens = seq[:, 1:]
    drafts = []
    for _ in range(k):
        T = tokens.shape[1]
        post, pre = drafter.step(policy, tokens, hidden, torch.arange(T)[None], None)
        d = drafter.greedy_tokens(post[:, -1:])
        drafts.append(int(d))
        tokens = torch.cat([tokens, d], 1)
        hidden = torch.cat([hidden, pre[:, -1:]], 1)
    return drafts


def test_aux_states_are_the_residual_stream_after_each_listed_layer(policy):
    tokens = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    stream = _residual_stream(policy, tokens)
    got = aux_hidden_states(policy, tokens, AUX)
    torch.testing.assert_close(got, torch.cat([stream[i] for i in AUX], -1), rtol=0, atol=0)
    assert aux_hidden_states(policy, tokens, (0,)).equal(policy.model.embed_tokens(tokens))


def test_reference_drafts_match_a_cache_free_recomputation(policy, drafter):
    g = torch.Generator().manual_seed(2)
    for n in (2, 5, 11):
        seq = torch.randint(0, 96, (n,), generator=g).tolist()
        drafts = draft_greedy(policy, drafter, seq, 4)
        assert drafts == _draft_without_cache(policy, drafter, seq, 4)
        assert all(t % 2 == 0 for t in drafts)           # reduced vocabulary: even ids only, through d2t


def test_draft_logits_are_minus_inf_outside_the_draft_vocabulary(policy, drafter):
    post = torch.randn(3, policy.config.hidden_size)
    logits = drafter.draft_logits(post)
    assert logits.shape == (3, 96)
    assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()
    assert drafter.greedy_tokens(post).equal(logits.argmax(-1))


def test_checkpoint_round_trip_in_vllm_layout(policy, drafter, tmp_path):
    out = save_eagle3(tmp_path / "eagle3", drafter)
    cfg = json.loads((out / CONFIG_FILE).read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX) and cfg["draft_vocab_size"] == 48
    from safetensors import safe_open
    with safe_open(str(out / WEIGHTS_FILE), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (32, 3 * 32)
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape == (32, 2 * 32)
        assert f.get_tensor("lm_head.weight").shape == (48, 32)
        assert f.get_tensor("t2d").dtype == torch.bool and f.get_tensor("d2t").dtype == torch.int64
    assert {"d2t", "t2d", "norm.weight", "midlayer.hidden_norm.weight"} <= names
    assert not any(n.startswith("embed_tokens") for n in names)         # the target's embedding is shared
    assert drafter_layout(out) == "eagle3" and drafter_layout(out / CONFIG_FILE) == "eagle3"
    loaded = load_eagle3(out, policy)
    for k, v in drafter.state_dict().items():
        assert loaded.state_dict()[k].equal(v), k
    seq = [5, 7, 9, 11, 3]
    assert draft_greedy(policy, loaded, seq, 3) == draft_greedy(policy, drafter, seq, 3)


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(30) == (2, 15, 27)            # vLLM's default for SmolLM2-135M
    assert len(default_aux_layer_ids(4)) == 3 and max(default_aux_layer_ids(4)) <= 4


# ------------------------------------------------------------------------------ bad input
def _edit_config(path, **changes):
    cfg = json.loads((path / CONFIG_FILE).read_text())
    for k, v in changes.items():
        if k == "aux":
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = v
        else:
            cfg[k] = v
    (path / CONFIG_FILE).write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=64), "hidden_size 64 != the policy's 32"),
    (dict(vocab_size=128), "vocab_size 128 != the policy's 96"),
    (dict(aux=[1, 2, 9]), "out of range for a 4-layer policy"),
    (dict(aux=[3, 1, 2]), "distinct and ascending"),
    (dict(norm_before_fc=True), "norm_before_fc"),
])
def test_a_drafter_that_does_not_fit_the_policy_is_refused_naming_file_and_mismatch(policy, drafter, tmp_path,
                                                                                    change, message):
    out = save_eagle3(tmp_path / "d", drafter)
    (out / WEIGHTS_FILE).write_bytes(b"not read: the config is refused first")
    _edit_config(out, **change)
    for check in (check_eagle3_dir, load_eagle3):
        with pytest.raises(ValueError) as e:
            check(out, policy)
        assert message in str(e.value) and str(out / CONFIG_FILE) in str(e.value)


def test_weights_that_do_not_match_the_config_are_refused(policy, drafter, tmp_path):
    out = save_eagle3(tmp_path / "d", drafter)
    _edit_config(out, aux=[1, 2])                 # fc still reads three layers
    with pytest.raises(ValueError, match=r"model.safetensors does not match its config .*fc.weight"):
        load_eagle3(out, policy)


def test_neither_layout_names_the_accepted_ones(policy, tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"junk")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / CONFIG_FILE).write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for bad in (tmp_path / "x.safetensors", tmp_path / "plain", tmp_path / "missing"):
        with pytest.raises(ValueError, match="neither drafter layout; accepted: mtp-rollout heads.*EAGLE-3"):
            drafter_layout(bad)
    heads_path = tmp_path / "heads.safetensors"
    heads = init_heads(policy, 1)
    save_heads(heads_path, heads, HeadMeta.for_heads(heads))
    assert drafter_layout(heads_path) == "heads"
