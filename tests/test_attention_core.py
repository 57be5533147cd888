"""Tier 1: the attention core's RoPE (``attention_core.apply_rope``, a hand-written backward) against
the Hugging Face formula ``x * cos + rotate_half(x) * sin`` under float64 autograd, forward and
gradients, with general tables (halves unequal), per-batch and shared tables, strided inputs and
tables that require gradients."""
import pytest
import torch

from overlap_layers.layers.attention.core import apply_rope


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
    _check(got, x, cos, sin, want, leaves64, dtype, table_grad)
    if not table_grad:  # the hand-written backward itself (small tensors take the formula's autograd)
        from overlap_layers.layers.attention.core import _Rope
        x.grad = None
        got = _Rope.apply(x, cos[:, None], sin[:, None])
        got.backward(dy64.to(dtype))
        _check(got, x, cos, sin, want, leaves64, dtype, table_grad)


def _check(got, x, cos, sin, want, leaves64, dtype, table_grad):

    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), leaves64[0].grad, rtol=tol, atol=tol)
    if table_grad:
        torch.testing.assert_close(cos.grad.double(), leaves64[1].grad, rtol=tol, atol=tol)
        torch.testing.assert_close(sin.grad.double(), leaves64[2].grad, rtol=tol, atol=tol)
    else:
        assert cos.grad is None and sin.grad is None


def test_sdpa_gradient_reaches_the_output_in_its_own_strides():
    """``attention_core._GradLikeOutput`` (applied to SDPA's output on CUDA): a gradient that
    arrives ``[b, S, n, d]``-strided for a ``[b, n, S, d]`` output is handed on in the output's
    strides, with the same values (cuDNN's backward gave wrong gradients otherwise)."""
    from overlap_layers.layers.attention.core import _GradLikeOutput
    leaf = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    o = leaf * 2.0
    seen = []
    o.register_hook(lambda g: seen.append(g))
    y = _GradLikeOutput.apply(o)
    dy = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    (y.transpose(1, 2) * dy).sum().backward()  # the gradient of y arrives as dy.transpose(1, 2)
    assert seen[0].stride() == o.stride() and torch.equal(seen[0], dy.transpose(1, 2))
    torch.testing.assert_close(leaf.grad, 2.0 * dy.transpose(1, 2), rtol=0, atol=0)
