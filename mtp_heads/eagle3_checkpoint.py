"""EAGLE-3 drafter checkpoints in the layout vLLM's `eagle3` method loads (SpecForge writes the same).

A directory with
  config.json        a Llama config of the draft layer: architectures ["LlamaForCausalLMEagle3"],
                     num_hidden_layers 1, vocab_size (the target's), draft_vocab_size, and
                     eagle_config.eagle_aux_hidden_state_layer_ids (the target layers fused by fc);
  model.safetensors  fc.weight [d, n_aux d], midlayer.* (q/k/v_proj read 2d), norm.weight,
                     lm_head.weight [draft_vocab_size, d], and with a reduced draft vocabulary
                     d2t [draft_vocab_size] int64 (target id - draft id) and t2d [V] bool.
The embedding is the target's (an `embed_tokens.weight` in the file is the drafter's own).

Everything that can be checked against the policy (hidden size, vocabulary, aux layer ids, variants
we do not compute) is checked from config.json before a tensor is read; errors name the file.
`drafter_layout` tells our head checkpoints and EAGLE-3 directories apart.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from mtp_heads.checkpoint import META_KEY
from mtp_heads.eagle3 import Eagle3Drafter, check_aux_layer_ids
from rollout.fileio import atomic_write
from rollout.models.config import ModelConfig
from rollout.models.decoder import CausalLM
from rollout.models.hf_loader import check_finite

# what vLLM 0.32 maps to llama_eagle3.Eagle3LlamaForCausalLM (a Llama-family target)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
LAYOUTS = ("mtp-rollout heads: one <name>.safetensors written by `mtp-rollout train-heads` (header "
           f"{META_KEY!r})",
           f"EAGLE-3: a directory with {CONFIG_FILE} (architectures {list(EAGLE3_ARCHITECTURES)}) and "
           f"{WEIGHTS_FILE}")
# EAGLE-3 variants vLLM can load but this drafter does not compute: refused by name
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "parallel_drafting")


def config_dict(drafter: Eagle3Drafter, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of a drafter (the draft layer's Llama config plus the EAGLE-3 keys)."""
    c = drafter.config
    return {
        "architectures": [EAGLE3_ARCHITECTURES[0]], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.dim_per_head, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "vocab_size": c.vocab_size, "draft_vocab_size": drafter.draft_vocab_size,
        "target_hidden_size": c.hidden_size, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(drafter.aux_layer_ids),
                         "use_aux_hidden_state": True},
    }


def eagle3_files(config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, bytes]:
    """The directory's two files as bytes, weights first: {model.safetensors, config.json} of a drafter's
    config_dict and state dict (floating tensors cast to `dtype`)."""
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()}
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    return {WEIGHTS_FILE: save(tensors, metadata={"format": "pt"}),
            CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode("utf-8")}


def save_eagle3(out_dir: str | os.PathLike, drafter: Eagle3Drafter, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json + model.safetensors (weights first, each atomically); returns the directory."""
    out = Path(out_dir)
    for name, data in eagle3_files(config_dict(drafter, dtype), drafter.state_dict(), dtype).items():
        atomic_write(out / name, data)
    return out


def drafter_layout(path: str | os.PathLike) -> str:
    """'heads' (our head checkpoint) or 'eagle3' (an EAGLE-3 directory); ValueError naming both layouts."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        try:
            with safe_open(str(p), framework="pt") as f:
                if META_KEY in (f.metadata() or {}):
                    return "heads"
        except Exception:  # noqa: BLE001 - an unreadable file is reported below as "neither"
            pass
    config = p / CONFIG_FILE if p.is_dir() else p
    if config.name == CONFIG_FILE and config.is_file():
        try:
            archs = json.loads(config.read_text()).get("architectures") or []
        except (ValueError, AttributeError):
            archs = []
        if any(a in EAGLE3_ARCHITECTURES for a in archs):
            return "eagle3"
    raise ValueError(f"{p} is in neither drafter layout; accepted: " + "; ".join(LAYOUTS))


def _config_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / CONFIG_FILE if p.is_dir() else p


def read_config(path: str | os.PathLike) -> dict:
    """config.json of an EAGLE-3 directory (or the file itself)."""
    config = _config_path(path)
    if not config.is_file():
        raise ValueError(f"no EAGLE-3 drafter at {path}: {config} does not exist")
    try:
        raw = json.loads(config.read_text())
    except ValueError as e:
        raise ValueError(f"{config}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or not any(a in EAGLE3_ARCHITECTURES for a in raw.get("architectures") or []):
        raise ValueError(f"{config}: architectures {raw.get('architectures') if isinstance(raw, dict) else None} "
                         f"is not an EAGLE-3 drafter (expected one of {list(EAGLE3_ARCHITECTURES)})")
    return raw


def aux_layer_ids_of(raw: dict, num_layers: int) -> tuple[int, ...]:
    """The config's aux layer ids; absent, vLLM's default for the target, (2, L // 2, L - 3)."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or raw.get("eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)


def check_config(raw: dict, cfg: ModelConfig, where: str | os.PathLike) -> tuple[ModelConfig, tuple[int, ...], int]:
    """Refuse a drafter that does not fit the policy (of config `cfg`), naming the file and the mismatch;
    returns the draft layer's config, the aux layer ids and the draft vocabulary size."""
    fix = "; this drafter was trained for another policy"

    def refuse(msg: str):
        raise ValueError(f"EAGLE-3 drafter {where}: {msg}")

    for key in ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads"):
        if not isinstance(raw.get(key), int):
            refuse(f"config key {key!r} missing or not an integer ({raw.get(key)!r})")
    if raw["hidden_size"] != cfg.hidden_size:
        refuse(f"hidden_size {raw['hidden_size']} != the policy's {cfg.hidden_size}{fix}")
    target_hidden = raw.get("target_hidden_size") or raw["hidden_size"]
    if target_hidden != cfg.hidden_size:
        refuse(f"target_hidden_size {target_hidden} != the policy's hidden_size {cfg.hidden_size}{fix}")
    if raw["vocab_size"] != cfg.vocab_size:
        refuse(f"vocab_size {raw['vocab_size']} != the policy's {cfg.vocab_size}{fix}")
    draft_vocab = raw.get("draft_vocab_size") or raw["vocab_size"]
    if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= cfg.vocab_size:
        refuse(f"draft_vocab_size {draft_vocab!r} not in [1, {cfg.vocab_size}]")
    try:
        ids = check_aux_layer_ids(aux_layer_ids_of(raw, cfg.num_hidden_layers), cfg.num_hidden_layers)
    except ValueError as e:
        refuse(str(e) + fix)
    if raw.get("num_hidden_layers", 1) != 1:
        refuse(f"num_hidden_layers {raw.get('num_hidden_layers')} (only one-layer EAGLE-3 drafters are supported)")
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        refuse("eagle_config.use_aux_hidden_state is false (a drafter without aux states is not supported)")
    flags = [f for f in _UNSUPPORTED_FLAGS if raw.get(f) or eagle.get(f)]
    if flags:
        refuse(f"variant {flags} is not supported (supported: the plain EAGLE-3 layer)")
    if raw.get("attention_bias"):
        refuse("attention_bias true is not supported")
    heads = raw["num_attention_heads"]
    layer = ModelConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=raw["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim"), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", 10000.0), rope_scaling=raw.get("rope_scaling"),
        max_position_embeddings=raw.get("max_position_embeddings", cfg.max_position_embeddings), architecture="llama")
    return layer, ids, draft_vocab


def check_eagle3_dir(path: str | os.PathLike, policy: CausalLM) -> dict:
    """config.json checked against the policy, without reading weights (a command's pre-flight)."""
    raw = read_config(path)
    check_config(raw, policy.config, _config_path(path))
    return raw


def load_eagle3(path: str | os.PathLike, policy: CausalLM) -> Eagle3Drafter:
    """The drafter at `path` (a directory or its config.json) for `policy`, on its device and dtype."""
    config = _config_path(path)
    raw = read_config(config)
    check_config(raw, policy.config, config)
    weights = config.parent / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"EAGLE-3 drafter {config.parent}: {WEIGHTS_FILE} is missing")
    with safe_open(str(weights), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    check_finite(tensors, f"EAGLE-3 drafter {weights}")
    return eagle3_from_tensors(raw, tensors, policy.config, weights).to_policy(policy).eval()


def eagle3_from_tensors(raw: dict, tensors: dict[str, torch.Tensor], policy_config: ModelConfig,
                        where: str | os.PathLike) -> Eagle3Drafter:
    """The drafter of config.json `raw` holding `tensors` (its state dict), float32 on the CPU; the config is
    checked against the policy and the tensors against the config, errors naming `where`."""
    layer, ids, draft_vocab = check_config(raw, policy_config, where)
    drafter = Eagle3Drafter(layer, ids, draft_vocab, own_embedding="embed_tokens.weight" in tensors)
    expected = drafter.state_dict()
    bad = [f"{k} {tuple(v.shape)} (expected {tuple(expected[k].shape)})" for k, v in tensors.items()
           if k in expected and v.shape != expected[k].shape]
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if bad or missing or unexpected:
        raise ValueError(f"EAGLE-3 drafter {where} does not match its config (aux layers {list(ids)}, draft "
                         f"vocabulary {draft_vocab}): wrong shapes {bad[:3]}, missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    if drafter.d2t is not None:
        targets = torch.arange(draft_vocab) + tensors["d2t"].cpu().long()
        if int(targets.min()) < 0 or int(targets.max()) >= policy_config.vocab_size:
            raise ValueError(f"EAGLE-3 drafter {where}: d2t maps draft ids outside the policy's vocabulary "
                             f"[0, {policy_config.vocab_size})")
    drafter.load_state_dict(dict(tensors))
    return drafter
