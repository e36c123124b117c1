"""Small reference functions the tests check the library against (the library itself does not need them)."""
import numpy as np
import torch


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats: probs [..., V] -> [...]."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)


def bf16_bits_to_float(bits: np.ndarray) -> torch.Tensor:
    """uint16 bfloat16 bits [..., d] (as mtp_heads.data.teacher_force.to_bf16_bits stores them) -> float32."""
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bfloat16).float()
