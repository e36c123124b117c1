"""Small reference functions the tests check the library against (the library itself does not need them)."""
import numpy as np
import torch


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats: probs [..., V] -> [...]."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)


def bf16_bits_to_float(bits: np.ndarray) -> torch.Tensor:
    """uint16 bfloat16 bits [..., d] (as mtp_heads.data.teacher_force.to_bf16_bits stores them) -> float32."""
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bfloat16).float()


def wrong_in_two_threads(is_right, repeats: int = 200) -> list[int]:
    """Two threads call is_right(0) and is_right(1) `repeats` times each, at once -> how often each got False."""
    import threading
    wrong = [0, 0]

    def run(i: int) -> None:
        for _ in range(repeats):
            wrong[i] += not is_right(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wrong
