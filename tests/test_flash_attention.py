"""The tiled online-softmax attention equals SDPA, forward and backward: causal or not, GQA,
sequence lengths that are not a multiple of the tile, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmind.model.flash_attention import flash_attention


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def inputs(B: int, H: int, H_kv: int, T: int, S: int, D: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g).to(dtype).requires_grad_() for h, n in ((H, T), (H_kv, S), (H_kv, S))]


def sdpa(q, k, v, causal: bool):
    if causal and q.shape[2] != k.shape[2]:  # queries are the last T positions
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


SHAPES = [  # (B, H, H_kv, T, S, D, causal, block_q, block_k)
    (2, 4, 4, 37, 37, 16, True, 16, 8),      # MHA, T not a multiple of either tile
    (1, 8, 2, 50, 50, 32, True, 16, 16),     # GQA 4:1
    (2, 6, 1, 33, 33, 8, False, 8, 16),      # MQA, not causal
    (1, 4, 2, 5, 29, 16, True, 4, 8),        # a few new queries after earlier keys (decode-like)
    (1, 2, 2, 64, 64, 16, True, 64, 64),     # one tile
]


@pytest.mark.parametrize("B,H,H_kv,T,S,D,causal,block_q,block_k", SHAPES)
def test_fp32_forward_and_gradients_equal_sdpa(B, H, H_kv, T, S, D, causal, block_q, block_k) -> None:
    q, k, v = inputs(B, H, H_kv, T, S, D)
    grad = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    out = flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    out.backward(grad)
    ours = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = sdpa(q, k, v, causal)
    ref.backward(grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, [ref.detach()] + [t.grad for t in (q, k, v)]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_bf16_is_close_to_sdpa() -> None:
    q, k, v = inputs(1, 4, 2, 45, 45, 32, torch.bfloat16)
    out = flash_attention(q, k, v, block_q=16, block_k=16)
    assert out.dtype == torch.bfloat16
    ref = sdpa(q.float(), k.float(), v.float(), True)  # the exact answer for these bf16 inputs
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 and t.grad.isfinite().all() for t in (q, k, v))


def test_bad_shapes_name_the_problem() -> None:
    q, k, v = inputs(1, 3, 2, 8, 8, 8)
    with pytest.raises(ValueError, match="3 query heads cannot share 2"):
        flash_attention(q, k, v)
    q, k, v = inputs(1, 2, 2, 8, 4, 8)
    with pytest.raises(ValueError, match="needs at least as many keys"):
        flash_attention(q, k, v)
