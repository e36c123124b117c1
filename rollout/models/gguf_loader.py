"""GGUF files of the llama architecture -> LoadedModel (dequantised float tensors, HF names)."""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from rollout.models.config import ModelConfig
from rollout.models.hf_loader import LoadedModel, canonical_head_dim, select_tensors
from rollout.models.tokenizer import bpe_tokenizer

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF llama tensor name; None if it has no HF counterpart here."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


# ---------------------------------------------------------------------------------------------
# The Q/K row permutation.
#
# HF Llama applies RoPE with rotate_half: within a head of size hd, dimension i is rotated
# together with i + hd/2. llama.cpp's rope rotates adjacent pairs (2j, 2j+1). So
# convert_hf_to_gguf reorders the output rows of q_proj / k_proj (and their biases) per head:
# view the head's rows as [2, hd/2] (half, j), swap to [hd/2, 2] (j, half), flatten. The GGUF
# row 2j+h is then HF row h*hd/2 + j: each rotation pair becomes adjacent. The inverse views
# the GGUF rows as [hd/2, 2] and swaps back to [2, hd/2]. k uses the number of KV heads.


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF -> GGUF row order of q_proj / k_proj: w [n_heads*hd, ...] (what convert_hf_to_gguf does)."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GGUF -> HF row order of q_proj / k_proj: w [n_heads*hd, ...]; inverse of llama_cpp_permute."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Metadata


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain-ndarray view of its memmap (still zero-copy).

    np.memmap's per-slice bookkeeping made parsing SmolLM2's 98k vocabulary strings and
    dequantising its tensors 2-3x slower; GGUFReader slices `self.data` for every value.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = np.asarray(value)


class _Meta:
    """Typed access to GGUF key/values with errors that name the file and the key."""

    _MISSING = object()

    def __init__(self, reader: GGUFReader, source: str):
        self.reader, self.source = reader, source

    def get(self, key: str, default=_MISSING):
        field = self.reader.fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise ValueError(f"{self.source}: GGUF metadata has no {key!r}")
            return default
        return field.contents()

    def f32(self, key: str, default: float) -> float:
        """GGUF floats are float32: take the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
        value = self.get(key, None)
        return default if value is None else float(str(np.float32(value)))


def _rope_scaling(meta: _Meta, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.f32(f"{arch}.rope.scaling.factor", 1.0)}
    raise ValueError(f"{meta.source}: unsupported GGUF rope scaling {kind!r} (supported: linear)")


def config_from_gguf(meta: _Meta, tensor_names: set[str]) -> ModelConfig:
    """llama.* metadata -> ModelConfig; the LM head is tied when the file has no output.weight."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{meta.source}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{meta.source}: per-dimension rope_freqs (Llama 3.1 rope scaling) is not supported")
    d = int(meta.get(f"{arch}.embedding_length"))
    n_heads = int(meta.get(f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", d // n_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{meta.source}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens", None)
    vocab = meta.get(f"{arch}.vocab_size", None) or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError(f"{meta.source}: GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=d,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.get(f"{arch}.block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=canonical_head_dim(head_dim, d, n_heads),
        rms_norm_eps=meta.f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.f32(f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(meta, arch),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=False,
        architecture="llama",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def tokenizer_from_gguf(meta: _Meta, config: ModelConfig):
    """The GGUF's byte-level BPE tokenizer, or None (with a warning) for other tokenizer models."""
    model = meta.get("tokenizer.ggml.model", None)
    if model is None:
        return None
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if model != "gpt2":
        warnings.warn(f"{meta.source}: tokenizer model {model!r} is not supported (only gpt2 BPE); no tokenizer")
        return None
    try:
        return bpe_tokenizer(meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges"),
                             meta.get("tokenizer.ggml.token_type", None), pre=pre,
                             bos_token_id=config.bos_token_id,
                             add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    except ValueError as e:
        warnings.warn(f"{meta.source}: {e}; no tokenizer")
        return None


# ---------------------------------------------------------------------------------------------
# Tensors


def _tensor(t) -> torch.Tensor:
    """One GGUF tensor, dequantised to float32 in torch (row-major) shape."""
    try:
        a = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"tensor {t.name}: GGML type {t.tensor_type.name} cannot be dequantised") from None
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
    a = np.asarray(a, dtype=np.float32).reshape(shape)
    return torch.from_numpy(a.copy() if not a.flags.writeable else a)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A llama-architecture GGUF (any gguf-py-dequantisable type: F32/F16/BF16/Q4_0/Q4_1/Q8_0, ...)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    try:
        reader = _PlainArrayReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    meta = _Meta(reader, str(path))
    names = {t.name for t in reader.tensors}
    cfg = config_from_gguf(meta, names)
    unknown = sorted(n for n in names if hf_name(n) is None)
    if unknown:
        raise ValueError(f"{path}: GGUF tensors with no HF llama counterpart: {unknown[:5]}")
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = _tensor(t)
        name = hf_name(t.name)
        if ".q_proj." in name:
            w = llama_cpp_unpermute(w, cfg.num_attention_heads)
        elif ".k_proj." in name:
            w = llama_cpp_unpermute(w, cfg.num_key_value_heads)
        tensors[name] = w.to(dtype)
    state_dict = select_tensors(cfg, tensors, str(path))
    return LoadedModel(cfg, state_dict, tokenizer_from_gguf(meta, cfg),
                       meta.get("tokenizer.chat_template", None), str(path.resolve()))
