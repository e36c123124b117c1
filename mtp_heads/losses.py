"""Draft-head losses: how far the head's distribution q is from the policy's p.

Rejection-sampling verification accepts a drafted token with expected probability
1 - TV(p, q), so "tv" trains exactly what decoding pays for; "ce", "fkl" and "rkl"
are the usual baselines and "tv_e2e" trains the expected accepted length of a chain
of D drafts. Each kind is one function in ``LOSSES``; ``draft_loss`` validates the
inputs and dispatches.

Conventions (all kinds):
    p = softmax(target_logits / T), never differentiated (the policy is the teacher);
    q = softmax(student_logits / T);
    maths in float32 at least (float64 stays float64), result is a scalar mean over rows.

TV smoothing. TV's gradient wrt q is 0.5 * sign(q - p): it does not shrink as q -> p.
``eps`` > 0 replaces |x| per token by phi(x) = sqrt(x^2 + eps^2) - eps, whose gradient
x / sqrt(x^2 + eps^2) fades once |q_v - p_v| << eps (phi <= |x|, |x| - phi <= eps, so
the smoothed value underestimates TV by at most V * eps / 2). The default is exact TV,
``TV_EPS = 0`` (subgradient 0 where q_v == p_v, as torch's abs), because in the toy
study (``python -m experiments.bench_tv_loss --smoothing``) neither
fix helped: with Adam, eps <= 1e-5 and a 0.1*KL(p||q) term changed nothing and
eps >= 1e-4 raised the held-out TV floor (0.0022 -> 0.0027 / 0.0031); only with SGD at
a too-high step size did eps = 1e-3 lower it (0.033 -> 0.028), while it did slightly
worse on the misspecified problem. The floor comes from step size times minibatch noise: decay
the learning rate instead; ``eps`` stays as a keyword for such experiments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

# Default smoothing of |q_v - p_v| in "tv"/"tv_e2e" and the fused kernel: 0 = exact TV.
# Chosen from the toy study: see the module docstring.
TV_EPS: float = 0.0

IGNORE_INDEX = -100


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.to(_compute_dtype(logits))
    return logits if temperature == 1.0 else logits / temperature


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(_scaled(logits, temperature), dim=-1)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(_scaled(logits, temperature), dim=-1)


def smooth_abs(x: torch.Tensor, eps: float) -> torch.Tensor:
    """sqrt(x^2 + eps^2) - eps; exactly |x| when eps == 0."""
    if eps == 0:
        return x.abs()
    return torch.sqrt(x * x + eps * eps) - eps


def topk_union_mask(p: torch.Tensor,   # [..., V]
                    q: torch.Tensor,   # [..., V]
                    k: int) -> torch.Tensor:  # [..., V] bool
    """True on the union of p's and q's top-k tokens of each row."""
    mask = torch.zeros(p.shape, dtype=torch.bool, device=p.device)
    mask.scatter_(-1, p.topk(k, dim=-1).indices, True)
    mask.scatter_(-1, q.detach().topk(k, dim=-1).indices, True)
    return mask


def tv_rows(student_logits: torch.Tensor,   # [..., V]
            target_logits: torch.Tensor,    # [..., V]
            temperature: float = 1.0,
            top_k: int | None = None,
            eps: float = TV_EPS) -> torch.Tensor:  # [...] per-row (smoothed) TV
    """0.5 * sum_v phi(q_v - p_v) per row.

    With ``top_k`` only the union of p's and q's top-k tokens is summed (the Bebop
    top-K approximation); the mass outside is ignored, not renormalised, so the value
    underestimates TV, and tokens outside get gradient only through q's normaliser.
    """
    p = _probs(target_logits.detach(), temperature)
    q = _probs(student_logits, temperature)
    per_token = smooth_abs(q - p, eps)
    if top_k is not None and top_k < p.shape[-1]:
        per_token = per_token * topk_union_mask(p, q, top_k)
    return 0.5 * per_token.sum(dim=-1)


# --- one function per kind: (student_logits, target_logits, labels, T, top_k, eps) -> scalar


def _ce(student_logits, target_logits, labels, temperature, top_k, eps):
    logq = _log_probs(student_logits, temperature).flatten(0, -2)   # [rows, V]
    labels = labels.flatten()                                         # [rows]
    valid = labels != IGNORE_INDEX
    if not bool(valid.any()):          # all ignored: zero loss that still has a graph
        return logq.sum() * 0.0
    return F.nll_loss(logq, labels, ignore_index=IGNORE_INDEX)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(a||b); tokens with a == 0 contribute 0 (not 0 * -inf)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(dim=-1).mean()


def _fkl(student_logits, target_logits, labels, temperature, top_k, eps):
    """KL(p||q) = H(p, q) - H(p)."""
    return _kl(_log_probs(target_logits.detach(), temperature), _log_probs(student_logits, temperature))


def _rkl(student_logits, target_logits, labels, temperature, top_k, eps):
    """KL(q||p)."""
    return _kl(_log_probs(student_logits, temperature), _log_probs(target_logits.detach(), temperature))


def _tv(student_logits, target_logits, labels, temperature, top_k, eps):
    return tv_rows(student_logits, target_logits, temperature, top_k, eps).mean()


def expected_accepted_length(tv: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N]
    """sum_j prod_{i<=j} (1 - TV_i): drafts accepted before the first rejection."""
    return torch.cumprod(1.0 - tv, dim=-1).sum(dim=-1)


def _tv_e2e(student_logits, target_logits, labels, temperature, top_k, eps):
    # Returns D - mean_rows E[accepted]: >= 0, 0 iff every depth matches, and
    # minimising it maximises the expected accepted length.
    tv = tv_rows(student_logits, target_logits, temperature, top_k, eps)   # [N, D]
    return tv.shape[-1] - expected_accepted_length(tv).mean()


@dataclass(frozen=True)
class LossKind:
    fn: Callable[..., torch.Tensor]
    needs_target: bool
    needs_labels: bool
    ndim: int | None  # required student_logits.dim(); None = any >= 2


LOSSES: dict[str, LossKind] = {
    "ce": LossKind(_ce, needs_target=False, needs_labels=True, ndim=None),
    "fkl": LossKind(_fkl, needs_target=True, needs_labels=False, ndim=None),
    "rkl": LossKind(_rkl, needs_target=True, needs_labels=False, ndim=None),
    "tv": LossKind(_tv, needs_target=True, needs_labels=False, ndim=None),
    "tv_e2e": LossKind(_tv_e2e, needs_target=True, needs_labels=False, ndim=3),
}


def draft_loss(kind: str,
               student_logits: torch.Tensor,                 # [N, V]; [N, D, V] for tv_e2e
               *,
               target_logits: torch.Tensor | None = None,    # same shape as student_logits
               labels: torch.Tensor | None = None,           # [N] int64, -100 = ignore ("ce")
               temperature: float = 1.0,
               top_k: int | None = None,
               eps: float = TV_EPS) -> torch.Tensor:          # scalar, mean over rows
    """Loss of the draft head's logits against the policy (see module docstring).

    "ce": -log q(labels), labels sampled from p. "fkl": KL(p||q). "rkl": KL(q||p).
    "tv": 0.5 * sum|p - q| (smoothed by ``eps``). "tv_e2e": D - mean_rows
    sum_j prod_{i<=j} (1 - TV_i) over the D depths. ``top_k`` restricts the TV kinds
    to the union of p's and q's top-k tokens; ``eps`` only affects the TV kinds.
    """
    spec = LOSSES.get(kind)
    if spec is None:
        raise ValueError(f"unknown draft loss kind {kind!r}; expected one of {sorted(LOSSES)}")
    if student_logits.dim() < 2:
        raise ValueError(f"student_logits must be [..., V], got shape {tuple(student_logits.shape)}")
    if spec.ndim is not None and student_logits.dim() != spec.ndim:
        raise ValueError(f"{kind!r} needs student_logits of {spec.ndim} dims ([N, D, V]), "
                         f"got shape {tuple(student_logits.shape)}")
    if spec.needs_target:
        if target_logits is None:
            raise ValueError(f"{kind!r} needs target_logits")
        if target_logits.shape != student_logits.shape:
            raise ValueError(f"target_logits shape {tuple(target_logits.shape)} != "
                             f"student_logits shape {tuple(student_logits.shape)}")
    if spec.needs_labels:
        if labels is None:
            raise ValueError(f"{kind!r} needs labels")
        if labels.shape != student_logits.shape[:-1]:
            raise ValueError(f"labels shape {tuple(labels.shape)} != student_logits rows "
                             f"{tuple(student_logits.shape[:-1])}")
        if labels.dtype != torch.int64:
            raise ValueError(f"labels must be int64, got {labels.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return spec.fn(student_logits, target_logits, labels, temperature, top_k, eps)
