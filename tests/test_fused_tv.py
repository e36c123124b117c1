"""Fused chunked TV vs the naive path (logits for all rows, then draft_loss), forward and gradient."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtp_heads.fused_tv import (DEFAULT_CHUNK_SIZE, fused_linear_tv_e2e_loss,
                                fused_linear_tv_loss)
from mtp_heads.losses import TV_EPS, draft_loss


def _inputs(n, d, v, depth=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = (n, d) if depth is None else (n, depth, d)
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) * d ** -0.5 * 2).to(dtype)
    hs = torch.randn(rows, generator=g, dtype=torch.float64).to(dtype)
    ht = (hs.double() + torch.randn(rows, generator=g, dtype=torch.float64)).to(dtype)
    return hs, ht, weight


def _naive(kind, hs, ht, weight, temperature, eps):
    return draft_loss(kind, hs @ weight.t(), target_logits=ht @ weight.t(),
                      temperature=temperature, eps=eps)


def _grad(fn, hs):
    hs = hs.clone().requires_grad_(True)
    loss = fn(hs)
    (g,) = torch.autograd.grad(loss, hs)
    return loss.detach(), g


@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_gradcheck_float64(eps):
    hs, ht, w = _inputs(5, 4, 7, seed=1)
    hs.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda h: fused_linear_tv_loss(h, ht, w, 0.8, chunk_size=2, eps=eps), (hs,))
    hs3, ht3, w3 = _inputs(4, 4, 9, depth=3, seed=2)
    hs3.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda h: fused_linear_tv_e2e_loss(h, ht3, w3, 1.3, chunk_size=5, eps=eps), (hs3,))


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("temperature,eps", [(1.0, TV_EPS), (0.7, 0.0), (1.0, 1e-3)])
def test_odd_shapes_match_naive(chunk_size, temperature, eps):
    hs, ht, w = _inputs(37, 24, 1031, seed=3)
    got, g_got = _grad(lambda h: fused_linear_tv_loss(h, ht, w, temperature, chunk_size, eps=eps), hs)
    want, g_want = _grad(lambda h: _naive("tv", h, ht, w, temperature, eps), hs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-14)
    assert 0.05 < got < 0.95


@pytest.mark.parametrize("chunk_size", [1, 7, 200])
def test_e2e_matches_naive(chunk_size):
    hs, ht, w = _inputs(13, 16, 301, depth=3, seed=4)
    got, g_got = _grad(lambda h: fused_linear_tv_e2e_loss(h, ht, w, 0.9, chunk_size), hs)
    want, g_want = _grad(lambda h: _naive("tv_e2e", h, ht, w, 0.9, TV_EPS), hs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-14)


def test_ties_give_zero_loss_and_gradient():
    hs, _, w = _inputs(11, 8, 97, seed=5)
    for fn in (fused_linear_tv_loss, lambda h, t, w, T, c: _naive("tv", h, t, w, T, 0.0)):
        loss, g = _grad(lambda h: fn(h, hs.clone(), w, 1.0, 4), hs)
        assert loss == 0 and g.abs().max() == 0
    hs3, _, w3 = _inputs(6, 8, 97, depth=2, seed=6)
    loss, g = _grad(lambda h: fused_linear_tv_e2e_loss(h, hs3.clone(), w3, 1.0, 4), hs3)
    assert loss == 0 and g.abs().max() == 0


def test_grad_output_scales_gradient():
    hs, ht, w = _inputs(9, 8, 50, seed=7)
    _, g1 = _grad(lambda h: fused_linear_tv_loss(h, ht, w, chunk_size=4), hs)
    _, g3 = _grad(lambda h: 3.0 * fused_linear_tv_loss(h, ht, w, chunk_size=4), hs)
    torch.testing.assert_close(g3, 3.0 * g1)


def test_float32_and_bfloat16_inputs():
    hs, ht, w = _inputs(29, 32, 517, seed=8)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        h, t, ww = hs.to(dtype), ht.to(dtype), w.to(dtype)
        got, g_got = _grad(lambda x: fused_linear_tv_loss(x, t, ww, chunk_size=8), h)
        # reference: the same (rounded) inputs in float64
        want, g_want = _grad(lambda x: _naive("tv", x, t.double(), ww.double(), 1.0, TV_EPS),
                             h.double())
        assert got.dtype == torch.float32 and g_got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        grad_tol = 1e-5 if dtype == torch.float32 else 1e-2 * g_want.abs().max().item()
        torch.testing.assert_close(g_got.double(), g_want, rtol=0.02, atol=grad_tol)


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.big_allocs = 0     # fresh (non-view, non-in-place) outputs of >= 8 * 300 elements

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = not func._schema.is_mutable and not any(
            a.alias_info for a in func._schema.returns if a.alias_info is not None)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
                self.big_allocs += fresh and t.numel() >= 8 * 300
        return out


def test_never_materialises_all_rows_logits():
    n, d, v, chunk = 64, 16, 300, 8
    hs, ht, w = _inputs(n, d, v, seed=9)
    hs.requires_grad_(True)
    with _MaxNumel() as seen:
        fused_linear_tv_loss(hs, ht, w, chunk_size=chunk).backward()
    assert seen.max_numel <= max(chunk * v, v * d) < n * v
    assert seen.big_allocs <= 2 * (n // chunk)       # two [chunk, V] buffers per chunk, no more
    with _MaxNumel() as naive:
        _naive("tv", hs, ht, w, 1.0, TV_EPS).backward()
    assert naive.max_numel >= n * v


def test_default_chunk_size_and_eps():
    hs, ht, w = _inputs(10, 8, 60, seed=10)
    assert fused_linear_tv_loss(hs, ht, w) == fused_linear_tv_loss(
        hs, ht, w, 1.0, DEFAULT_CHUNK_SIZE, eps=TV_EPS)


def test_bad_inputs_raise():
    hs, ht, w = _inputs(4, 8, 20, seed=11)
    with pytest.raises(ValueError, match="frozen"):
        fused_linear_tv_loss(hs, ht, w.clone().requires_grad_(True))
    with pytest.raises(ValueError, match="target_hidden shape"):
        fused_linear_tv_loss(hs, ht[:3], w)
    with pytest.raises(ValueError, match="lm_head_weight"):
        fused_linear_tv_loss(hs, ht, w[:, :5])
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_tv_loss(hs, ht, w, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_tv_loss(hs, ht, w, temperature=-1.0)
    with pytest.raises(ValueError, match="2 dims"):
        fused_linear_tv_loss(hs[None], ht[None], w)
    with pytest.raises(ValueError, match="3 dims"):
        fused_linear_tv_e2e_loss(hs, ht, w)
    with pytest.raises(ValueError, match="no rows"):
        fused_linear_tv_loss(hs[:0], ht[:0], w)
