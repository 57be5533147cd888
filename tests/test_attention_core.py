"""Tier 1: the attention core's RoPE (``attention_core.apply_rope``, a hand-written backward) against
the Hugging Face formula ``x * cos + rotate_half(x) * sin`` under float64 autograd, forward and
gradients, with general tables (halves unequal), per-batch and shared tables, strided inputs and
tables that require gradients."""
import pytest
import torch

from overlap_layers.layers.attention_core import apply_rope


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def reference(x, cos, sin):
    """float64 autograd of the formula; ``cos, sin [b or 1, S, d]`` broadcast over the heads."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("table_batch", [1, 3])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("table_grad", [False, True])
def test_rope_matches_formula_forward_and_gradients(dtype, table_batch, strided, table_grad):
    g = torch.Generator().manual_seed(7 + table_batch + 2 * strided + 4 * table_grad)
    b, n, S, d = 3, 2, 5, 8
    if strided:  # q as the projection leaves it: [b, S, n, d] viewed as [b, n, S, d]
        x64 = torch.randn(b, S, n, d, generator=g, dtype=torch.float64).transpose(1, 2)
    else:
        x64 = torch.randn(b, n, S, d, generator=g, dtype=torch.float64)
    cos64 = torch.randn(table_batch, S, d, generator=g, dtype=torch.float64)  # halves differ on purpose
    sin64 = torch.randn(table_batch, S, d, generator=g, dtype=torch.float64)
    dy64 = torch.randn(b, n, S, d, generator=g, dtype=torch.float64)

    leaves64 = [t.clone().requires_grad_(True) for t in (x64, cos64, sin64)]
    want = reference(*leaves64)
    want.backward(dy64)

    x = x64.to(dtype).requires_grad_(True)
    cos, sin = (t.to(dtype).requires_grad_(table_grad) for t in (cos64, sin64))
    got = apply_rope(x, cos, sin)
    got.backward(dy64.to(dtype))

    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), leaves64[0].grad, rtol=tol, atol=tol)
    if table_grad:
        torch.testing.assert_close(cos.grad.double(), leaves64[1].grad, rtol=tol, atol=tol)
        torch.testing.assert_close(sin.grad.double(), leaves64[2].grad, rtol=tol, atol=tol)
    else:
        assert cos.grad is None and sin.grad is None
