"""TV loss fused with the shared LM head, chunked over rows so [N, V] never exists.

The naive path materialises student and target logits for all N rows plus several
softmax/difference tensors of the same size and keeps them for backward (N=8192,
V=49152 float32: 1.6 GB each). Here the forward pass walks over row chunks,
computes both chunks' logits, the per-row TV and, right away, the gradient wrt the
student hidden state, then drops the chunk. Only that gradient ([N, d]) is kept for
backward, which just scales it by grad_output.

Gradient. With z = W h / T, q = softmax(z), g_v = dTV/dq_v = 0.5 * phi'(q_v - p_v)
(phi = smoothed |x|, phi' = sign(x) when eps = 0):
    dTV/dz_u = q_u * (g_u - sum_v q_v g_v),   dTV/dh = (dTV/dz) W / T.
For "tv_e2e", loss = D - mean_n sum_j prod_{i<=j} a_{n,i} with a = 1 - TV, so
dloss/dTV_{n,i} = w_{n,i} / N with w_i = prod_{l<i} a_l * S_i, S_D = 1,
S_i = 1 + a_{i+1} S_{i+1}: per-row weights on each depth's TV gradient, no division.
No gradient flows to lm_head_weight (shared, frozen) or to target_hidden (teacher).
"""
from __future__ import annotations

import torch

from mtp_heads.losses import TV_EPS

# Rows per chunk; chosen with experiments/bench_tv_loss.py (measurements: docs/performance.md).
DEFAULT_CHUNK_SIZE = 1024   # N=8192, d=576, V=49152: 4.4% of naive memory, 0.77x its time


def _softmax_(z: torch.Tensor, temperature: float) -> torch.Tensor:  # [c, V] logits -> probs, in place
    if temperature != 1.0:
        z.div_(temperature)
    z.sub_(z.amax(dim=-1, keepdim=True)).exp_()
    return z.div_(z.sum(dim=-1, keepdim=True))


def _chunk_tv(hs: torch.Tensor,   # [c, d] student hidden, compute dtype
              ht: torch.Tensor,   # [c, d] target hidden, compute dtype
              w: torch.Tensor,    # [V, d] compute dtype
              temperature: float,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # tv [c], dTV_row/dh [c, d]
    """Per-row TV and its gradient wrt each row's own student hidden state."""
    q = _softmax_(torch.mm(hs, w.t()), temperature)
    diff = _softmax_(torch.mm(ht, w.t()), temperature)            # p
    diff.neg_().add_(q)                                            # q - p
    if eps == 0:
        tv = 0.5 * torch.linalg.vector_norm(diff, ord=1, dim=-1)
        g = diff.sign_()
    else:
        r = diff.square().add_(eps * eps).sqrt_()   # one extra [c, V] buffer
        tv = 0.5 * r.sub_(eps).sum(dim=-1)          # subtract per token: no cancellation
        g = diff.div_(r.add_(eps))
        del r
    # dTV/dz = 0.5 * q * (g - <q, g>) ; then / T for z = W h / T.
    q_dot_g = torch.bmm(q.unsqueeze(1), g.unsqueeze(2)).view(-1, 1)   # [c, 1]; vecdot would hold q*g
    g.sub_(q_dot_g).mul_(q).mul_(0.5 / temperature)
    return tv, torch.mm(g, w)


def _rows_tv_and_grad(student: torch.Tensor,   # [M, d]
                      target: torch.Tensor,    # [M, d]
                      weight: torch.Tensor,    # [V, d]
                      temperature: float, eps: float,
                      chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # [M], [M, d]
    dtype = torch.float64 if torch.float64 in (student.dtype, weight.dtype) else torch.float32
    w = weight.detach().to(dtype)
    m = student.shape[0]
    tv = torch.empty(m, dtype=dtype, device=student.device)
    grad = torch.empty(m, student.shape[1], dtype=dtype, device=student.device)
    for start in range(0, m, chunk_size):
        rows = slice(start, min(start + chunk_size, m))
        tv[rows], grad[rows] = _chunk_tv(student[rows].detach().to(dtype),
                                         target[rows].detach().to(dtype),
                                         w, temperature, eps)
    return tv, grad


def _e2e_weights(tv: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, D] d(sum_j prod a)/da
    a = 1.0 - tv
    prefix = torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), a[:, :-1]], dim=1), dim=1)
    suffix = torch.ones_like(a)                       # S_i
    for i in range(a.shape[1] - 2, -1, -1):
        suffix[:, i] = 1.0 + a[:, i + 1] * suffix[:, i + 1]
    return prefix * suffix


class _FusedLinearTV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_hidden, target_hidden, lm_head_weight, temperature, eps,
                chunk_size):
        # student_hidden [N, d] -> mean TV; [N, D, d] -> D - mean expected accepted length
        e2e = student_hidden.dim() == 3
        flat_s = student_hidden.reshape(-1, student_hidden.shape[-1])
        flat_t = target_hidden.reshape(-1, target_hidden.shape[-1])
        tv, grad = _rows_tv_and_grad(flat_s, flat_t, lm_head_weight, temperature, eps,
                                     chunk_size)
        n = student_hidden.shape[0]
        if e2e:
            tv = tv.view(n, -1)                                        # [N, D]
            accepted = torch.cumprod(1.0 - tv, dim=1).sum(dim=1)       # [N]
            loss = tv.shape[1] - accepted.mean()
            grad = grad.view(n, tv.shape[1], -1).mul_((_e2e_weights(tv) / n).unsqueeze(-1))
        else:
            loss = tv.mean()
            grad = grad.div_(n)
        ctx.save_for_backward(grad)            # compute dtype ([N, d] or [N, D, d]: small)
        ctx.input_dtype = student_hidden.dtype
        return loss                             # float32 (float64 for float64 inputs)

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        grad_student = (grad * grad_output.to(grad.dtype)).to(ctx.input_dtype)
        return grad_student, None, None, None, None, None


def _check(student_hidden, target_hidden, lm_head_weight, ndim, temperature, chunk_size, eps):
    if student_hidden.dim() != ndim:
        raise ValueError(f"student_hidden must have {ndim} dims, got {tuple(student_hidden.shape)}")
    if target_hidden.shape != student_hidden.shape:
        raise ValueError(f"target_hidden shape {tuple(target_hidden.shape)} != "
                         f"student_hidden shape {tuple(student_hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != student_hidden.shape[-1]:
        raise ValueError(f"lm_head_weight must be [V, {student_hidden.shape[-1]}], "
                         f"got {tuple(lm_head_weight.shape)}")
    if lm_head_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("lm_head_weight is treated as frozen (no gradient is computed for it); "
                         "pass lm_head_weight.detach()")
    if student_hidden.numel() == 0:
        raise ValueError(f"no rows: student_hidden has shape {tuple(student_hidden.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def fused_linear_tv_loss(student_hidden: torch.Tensor,   # [N, d] requires grad
                         target_hidden: torch.Tensor,    # [N, d] no grad; p = softmax(W h / T)
                         lm_head_weight: torch.Tensor,   # [V, d] shared, frozen
                         temperature: float = 1.0,
                         chunk_size: int = DEFAULT_CHUNK_SIZE,
                         *, eps: float = TV_EPS) -> torch.Tensor:  # scalar mean TV
    """== draft_loss("tv", h_s W^T, target_logits=h_t W^T, eps=eps) without [N, V]."""
    _check(student_hidden, target_hidden, lm_head_weight, 2, temperature, chunk_size, eps)
    return _FusedLinearTV.apply(student_hidden, target_hidden, lm_head_weight, temperature,
                                eps, chunk_size)


def fused_linear_tv_e2e_loss(student_hidden: torch.Tensor,   # [N, D, d] requires grad
                             target_hidden: torch.Tensor,    # [N, D, d] no grad
                             lm_head_weight: torch.Tensor,   # [V, d] shared, frozen
                             temperature: float = 1.0,
                             chunk_size: int = DEFAULT_CHUNK_SIZE,
                             *, eps: float = TV_EPS) -> torch.Tensor:  # scalar D - mean E
    """== draft_loss("tv_e2e", ...) on the D depths' logits; chunk_size counts (row, depth) pairs."""
    _check(student_hidden, target_hidden, lm_head_weight, 3, temperature, chunk_size, eps)
    return _FusedLinearTV.apply(student_hidden, target_hidden, lm_head_weight, temperature,
                                eps, chunk_size)
