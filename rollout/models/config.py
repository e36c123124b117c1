"""Architecture description shared by every loader, the decoder and the MTP heads."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """A Llama / Qwen2 / Qwen3-family decoder, in HF config.json terms."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None              # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None         # HF rope_scaling dict ("linear", "llama3", "dynamic" ignored)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False             # Qwen2: bias on q/k/v projections
    qk_norm: bool = False                    # Qwen3: RMSNorm on q and k per head
    architecture: str = "llama"              # llama | qwen2 | qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f for f in cls.__dataclass_fields__}
        d = {k: v for k, v in d.items() if k in known}
        if "eos_token_ids" in d:
            d["eos_token_ids"] = tuple(d["eos_token_ids"] or ())
        return cls(**d)

    def fingerprint(self) -> str:
        """Identifies the architecture (not the weights): heads are built against it."""
        blob = json.dumps(
            {k: self.to_dict()[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "architecture")},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
