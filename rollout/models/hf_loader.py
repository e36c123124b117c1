"""The HF directory format (config.json + safetensors + tokenizer.json), read and written.

HF tensor names are this project's canonical weight names: every loader returns them and
the decoder's state_dict uses them, so `LoadedModel` and the expected-tensor table live here.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from rollout.models.config import ModelConfig


@dataclass
class LoadedModel:
    """Weights (HF names), architecture and tokenizer of one model, whatever file it came from."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    chat_template: str | None
    source: str


@dataclass(frozen=True)
class ArchSpec:
    """What an HF model_type implies beyond its config.json fields (transformers' defaults)."""

    hf_class: str
    attention_bias: bool          # default when config.json has no attention_bias key
    qk_norm: bool
    max_position_embeddings: int


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", attention_bias=False, qk_norm=False, max_position_embeddings=2048),
    # Qwen2 always has q/k/v biases (transformers and vLLM hard-code them).
    "qwen2": ArchSpec("Qwen2ForCausalLM", attention_bias=True, qk_norm=False, max_position_embeddings=32768),
    "qwen3": ArchSpec("Qwen3ForCausalLM", attention_bias=False, qk_norm=True, max_position_embeddings=32768),
}


def expected_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model with this config has, by HF name (lm_head only when untied)."""
    d, hd, ff, V = cfg.hidden_size, cfg.dim_per_head, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, d)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (ff, d)
        shapes[p + "mlp.up_proj.weight"] = (ff, d)
        shapes[p + "mlp.down_proj.weight"] = (d, ff)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, d)
    return shapes


def select_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The tensors the config needs, shape-checked; extras (e.g. a tied lm_head) are dropped."""
    shapes = expected_tensor_shapes(cfg)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{source}: missing tensors for the {cfg.architecture} config: {missing[:5]}{more}")
    wrong = [f"{n}: {tuple(tensors[n].shape)} != {s}" for n, s in shapes.items() if tuple(tensors[n].shape) != s]
    if wrong:
        raise ValueError(f"{source}: tensor shapes do not match config.json: {wrong[:5]}")
    selected = {n: tensors[n] for n in shapes}
    check_finite(selected, source)
    return selected


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights holding NaN or inf (a damaged file or a bad dequantisation), naming the tensor:
    they would load silently and decode garbage."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise ValueError(f"{source}: tensor {name} holds non-finite values ({n_nan} NaN, {n_inf} inf of "
                             f"{t.numel()}); the file is damaged or was written wrongly")


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def canonical_head_dim(head_dim: int | None, hidden_size: int, num_heads: int) -> int | None:
    """None when head_dim is the default hidden/heads, so configs from any source compare equal."""
    return None if head_dim in (None, hidden_size // num_heads) else int(head_dim)


def _token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _rope(d: dict) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling from either the classic keys or transformers v5 rope_parameters."""
    params = d.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def config_from_hf(d: dict, generation_config: dict | None = None, source: str = "config.json") -> ModelConfig:
    """Map a config.json dict (plus generation_config.json's EOS ids, appended) to ModelConfig."""
    model_type = d.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{source}: unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    spec = ARCHITECTURES[model_type]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in d:
            raise ValueError(f"{source}: config.json has no {key!r}")
    gen = generation_config or {}
    eos = _token_ids(d.get("eos_token_id")) + _token_ids(gen.get("eos_token_id"))
    bos = d.get("bos_token_id", gen.get("bos_token_id"))
    theta, scaling = _rope(d)
    return ModelConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=int(d["num_attention_heads"]),
        num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
        head_dim=canonical_head_dim(d.get("head_dim"), d["hidden_size"], d["num_attention_heads"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", spec.max_position_embeddings)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", spec.attention_bias)),
        qk_norm=spec.qk_norm,
        architecture=model_type,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json for transformers / vLLM (the inverse of config_from_hf)."""
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"cannot export architecture {cfg.architecture!r}")
    eos = list(cfg.eos_token_ids)
    d = {
        "architectures": [ARCHITECTURES[cfg.architecture].hf_class],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.architecture == "llama":
        d.update(mlp_bias=False, pretraining_tp=1)
    if cfg.architecture in ("qwen2", "qwen3"):
        d.update(use_sliding_window=False, sliding_window=None)
    return d


# ---------------------------------------------------------------------------------------------
# Reading a directory


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / f for f in dict.fromkeys(_read_json(index).get("weight_map", {}).values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent or not files:
            raise ValueError(f"{index}: shard files missing: {absent or 'weight_map is empty'}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights (pytorch_model.bin is not supported; "
                         "convert it to safetensors)")
    return files


def _chat_template(path: Path, tokenizer_config: dict) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is None and (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template


def load_hf_dir(path: str | os.PathLike, dtype: torch.dtype | None = None) -> LoadedModel:
    """A local HF-format Llama / Qwen2 / Qwen3 directory; tensors keep their stored dtype unless `dtype`."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json (not an HF model directory)")
    gen_path = path / "generation_config.json"
    cfg = config_from_hf(_read_json(path / "config.json"),
                         _read_json(gen_path) if gen_path.is_file() else None, source=str(path))
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        try:
            tensors.update(load_file(f))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types, without the file name
            raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    state_dict = select_tensors(cfg, tensors, str(path))
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    tok_path, tok_cfg_path = path / "tokenizer.json", path / "tokenizer_config.json"
    tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.is_file() else None
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    return LoadedModel(cfg, state_dict, tokenizer, _chat_template(path, tok_cfg), str(path.resolve()))


# ---------------------------------------------------------------------------------------------
# Writing a directory


def _token_str(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.id_to_token(token_id)


def _write_dir(loaded: LoadedModel, out: Path, dtype: torch.dtype) -> None:
    cfg = loaded.config
    tensors = select_tensors(cfg, loaded.state_dict, loaded.source)
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")
    eos = list(cfg.eos_token_ids)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if loaded.tokenizer is None:
        return
    loaded.tokenizer.save(str(out / "tokenizer.json"))
    eos_str = _token_str(loaded.tokenizer, eos[0] if eos else None)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token_str(loaded.tokenizer, cfg.bos_token_id),
        "eos_token": eos_str,
        "pad_token": eos_str,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": loaded.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def export_hf_dir(loaded: LoadedModel, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                  overwrite: bool = False) -> Path:
    """Write `loaded` as an HF directory (how GGUF models reach vLLM); atomic: temp dir, then rename."""
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_dir(loaded, tmp, dtype)
        if out.exists():  # overwrite: move the old one aside first; a directory cannot be os.replace'd
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "dir")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
