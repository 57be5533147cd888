"""The heads step's Triton kernel (``kernels/heads.py``, reached through
``attention_core.heads_into`` / ``heads_backward_into``; on CUDA, or on the CPU under Triton's
interpreter) against the RoPE formula in float64
autograd: rank-major rows to heads (q, k RoPE'd, v copied) and the gradients back, whole tiles
and one rank's chunk written into the tile's buffers, shared and per-sequence tables or none, head
dims whose half is and is not a power of two, and a v whose strides differ from k's (one launch
serves q, k and v, each with its own strides)."""
import pytest
import torch

from kernel_device import DEVICE, needs_triton
from overlap_layers.layers.attention import core as attention_core
from overlap_layers.kernels import heads as heads_kernel
from overlap_layers.layers.attention.core import heads_backward_into, heads_into
from overlap_layers.kernels import triton_gate

pytestmark = needs_triton


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def reference_heads(rows, cos, sin, nq, nkv, d):
    """(q, k, v) ``[b, n, g, s, d]`` of rows ``[g, b, s, C]`` with tables ``[b or 1, g, s, d]``
    (None: no RoPE)."""
    def group(lo, n):
        return rows[..., lo * d:(lo + n) * d].unflatten(-1, (n, d)).permute(1, 3, 0, 2, 4)
    q, k, v = group(0, nq), group(nq, nkv), group(nq + nkv, nkv)
    if cos is None:
        return q, k, v
    c, s_ = cos[:, None], sin[:, None]
    return q * c + rotate_half(q) * s_, k * c + rotate_half(k) * s_, v


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("d", [128, 80])
@pytest.mark.parametrize("table_batch", [1, 2])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("variant", ["plain", "no_rope", "v_strided"])
def test_heads_kernel_matches_formula(dtype, tol, d, table_batch, chunk, variant, monkeypatch):
    ran = []  # the kernel, not the torch path, must run each direction

    def kernel(*args):
        ran.append(heads_kernel.move_heads(*args))
        return ran[-1]
    monkeypatch.setattr(attention_core, "move_heads", kernel)
    g_, dev = torch.Generator().manual_seed(d + table_batch), DEVICE
    g, b, s, nq, nkv = 4, 2, 24, 4, 2
    C = (nq + 2 * nkv) * d
    def randn(*shape):  # values the kernel's dtype holds exactly: only its rounding of the result differs
        return torch.randn(*shape, generator=g_, dtype=torch.float64).to(dtype).double()
    rows64 = randn(g, b, s, C)
    cos64, sin64 = (randn(table_batch, g * s, d) for _ in range(2))
    grads64 = [randn(b, n, g, s, d) for n in (nq, nkv, nkv)]
    leaf = rows64.clone().requires_grad_()
    tables64 = tuple(t.unflatten(1, (g, s)) for t in (cos64, sin64)) if variant != "no_rope" else (None, None)
    want = reference_heads(leaf, *tables64, nq, nkv, d)
    want_grad = torch.autograd.grad(want, leaf, grads64)[0]

    sl = slice(None) if chunk is None else slice(chunk, chunk + 1)
    rows = rows64.to(dev, dtype)
    bufs = [torch.full((b, n, g * s, d), float("nan"), device=dev, dtype=dtype) for n in (nq, nkv, nkv)]
    if variant == "v_strided":  # v's storage [b, g*s, nkv, d]: other strides than k's
        bufs[2] = torch.full((b, g * s, nkv, d), float("nan"), device=dev, dtype=dtype).transpose(1, 2)
    views = [t.unflatten(2, (g, s))[:, :, sl] for t in bufs]
    tables = tuple(t.to(dev, dtype) for t in (cos64, sin64)) if variant != "no_rope" else None
    if chunk is not None and tables is not None:  # one rank's rows and their positions, as the rank-chunk forward passes them
        tables = tuple(t[:, chunk * s:(chunk + 1) * s] for t in tables)
    heads_into(rows[sl], *views, tables, nq, nkv, d)
    for got, ref in zip(views, want):
        torch.testing.assert_close(got.double().cpu(), ref.detach()[:, :, sl], rtol=tol, atol=tol)

    dq, dk, dv = (t.to(dev, dtype)[:, :, sl] for t in grads64)
    if variant == "v_strided":
        dv = grads64[2].to(dev, dtype).permute(0, 2, 3, 1, 4).contiguous().permute(0, 3, 1, 2, 4)[:, :, sl]
    drows = torch.full_like(rows[sl], float("nan"))
    heads_backward_into(drows, dq, dk, dv, tables, nq, nkv, d)
    torch.testing.assert_close(drows.double().cpu(), want_grad[sl], rtol=tol, atol=tol)
    assert ran == [True, True]


def test_heads_kernel_declines_what_it_cannot_run():
    """Head dims split unevenly, heads of mixed dtypes and float64 rows (the kernel computes in
    float32) go to the torch path, and so do CPU tensors unless Triton interprets."""
    odd = torch.zeros(1, 1, 2, 9, device=DEVICE)
    assert not heads_kernel.move_heads(odd, [torch.zeros(1, 1, 1, 2, 3, device=DEVICE)] * 3, None, 1, 1, 3, False)
    rows = torch.zeros(1, 1, 2, 6, device=DEVICE)
    mixed = [torch.zeros(1, 1, 1, 2, 2, device=DEVICE, dtype=t) for t in (torch.float32, torch.float32, torch.float64)]
    assert not heads_kernel.move_heads(rows, mixed, None, 1, 1, 2, backward=False)
    wide = [torch.zeros(1, 1, 1, 2, 2, device=DEVICE, dtype=torch.float64) for _ in range(3)]
    assert not heads_kernel.move_heads(rows.double(), wide, None, 1, 1, 2, backward=False)
    if not triton_gate.INTERPRETED:
        heads = [torch.zeros(1, 1, 1, 2, 2) for _ in range(3)]
        assert not heads_kernel.move_heads(rows.cpu(), heads, None, 1, 1, 2, backward=False)
