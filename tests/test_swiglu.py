"""The Triton SwiGLU (``kernels/swiglu.py``; CUDA, or Triton's interpreter on the CPU) against the
float64 formulas: forward, backward (which returns ``h`` too) and through autograd, in float32 and
bfloat16, with odd sizes (a partial last block)."""
import pytest
import torch

from kernel_device import DEVICE, SKIP_REASON, needs_triton
from overlap_layers.kernels import swiglu as swiglu_module
from overlap_layers.kernels.swiglu import fused_available, swiglu, swiglu_backward
from overlap_layers.layers.common.activations import swiglu_recorded


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_swiglu_matches_the_formulas(dtype, tol):
    g = torch.Generator().manual_seed(3)
    pre = torch.randn(37, 2 * 129, generator=g).to(DEVICE, dtype)
    dh = torch.randn(37, 129, generator=g).to(DEVICE, dtype)
    assert fused_available(pre)
    ga, u = pre.double().chunk(2, -1)
    s = torch.sigmoid(ga)
    want_h = ga * s * u
    want_dpre = torch.cat([dh.double() * u * s * (1 + ga * (1 - s)), dh.double() * ga * s], -1)
    dpre, h = swiglu_backward(pre, dh)
    leaf = pre.clone().requires_grad_()
    swiglu_recorded(leaf).backward(dh)
    for got, want in ((swiglu(pre), want_h), (h, want_h), (dpre, want_dpre), (leaf.grad, want_dpre)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < tol, err


@needs_triton
@pytest.mark.parametrize("rows", [0, 5, 37, 80])
@pytest.mark.parametrize("programs", [None, 2])
def test_fused_swiglu_of_the_first_rows(rows, programs, monkeypatch):
    """With a device row count, the first ``min(rows, M)`` rows equal the formula and the kernel
    writes nothing past them (the output's memory, filled with a marker before, keeps it); with
    ``programs`` 2, each of two programs loops over several of the five blocks."""
    if programs is not None:
        monkeypatch.setattr(swiglu_module, "_STRIDED", programs)
    g = torch.Generator().manual_seed(4)
    pre = torch.randn(37, 2 * 129, generator=g).to(DEVICE)
    ga, u = pre.double().chunk(2, -1)
    want = ga * torch.sigmoid(ga) * u
    count = torch.tensor([rows], dtype=torch.int32, device=DEVICE)
    marker = torch.full((37 * 129,), 7.0, device=DEVICE)
    n = min(rows, 37)
    del marker  # the caching allocator (CUDA) hands the same block to the output; on the CPU, check the rows only
    h = swiglu(pre, count)
    assert torch.allclose(h[:n].double(), want[:n], rtol=1e-6, atol=1e-6)
    if DEVICE.type == "cuda" and n < 37:
        assert (h[n:] == 7.0).all()


@needs_triton
@pytest.mark.parametrize("rows", [0, 5, 37, 80])
@pytest.mark.parametrize("programs", [None, 2])
def test_fused_swiglu_backward_of_the_first_rows(rows, programs, monkeypatch):
    """The backward with a device row count (the MoE device path's, [Note: MoE training graphs]):
    the first ``min(rows, M)`` rows of ``dpre`` and ``h`` equal the formulas and the kernel writes
    nothing past them (both outputs, filled with a marker before, keep it); with ``programs`` 2,
    each of two programs loops over several of the five blocks."""
    if programs is not None:
        monkeypatch.setattr(swiglu_module, "_STRIDED", programs)
    g = torch.Generator().manual_seed(6)
    pre = torch.randn(37, 2 * 129, generator=g).to(DEVICE)
    dh = torch.randn(37, 129, generator=g).to(DEVICE)
    ga, u = pre.double().chunk(2, -1)
    s = torch.sigmoid(ga)
    want_h = ga * s * u
    want_dpre = torch.cat([dh.double() * u * s * (1 + ga * (1 - s)), dh.double() * ga * s], -1)
    count = torch.tensor([rows], dtype=torch.int32, device=DEVICE)
    out, h_out = torch.full_like(pre, 7.0), torch.full_like(dh, 7.0)
    dpre, h = swiglu_backward(pre, dh, out=out, h_out=h_out, rows=count)
    n = min(rows, 37)
    for got, want in ((h, want_h), (dpre, want_dpre)):
        assert torch.allclose(got[:n].double(), want[:n], rtol=1e-6, atol=1e-6)
        assert (got[n:] == 7.0).all()


@pytest.mark.parametrize("fused", [True, False])
def test_swiglu_backward_into_pre_itself(fused):
    """``out=pre``: the pre-activation's memory takes ``dpre`` and ``h_out`` takes ``h`` (the
    rank-chunk MLP's backward, [Note: weight gradients over every row]); both equal the formulas,
    computed from a copy of ``pre``. Unfused: the eager formulas (a non-contiguous ``dh``), on the
    CPU."""
    if fused and DEVICE is None:
        pytest.skip(SKIP_REASON)
    device = DEVICE if fused else torch.device("cpu")
    g = torch.Generator().manual_seed(5)
    pre = torch.randn(37, 2 * 129, generator=g, dtype=torch.float64).to(device, torch.float32)
    dh = torch.randn(129, 37, generator=g).to(device).t()  # non-contiguous: the eager path
    if fused:
        dh = dh.contiguous()
    ga, u = pre.double().chunk(2, -1)
    s = torch.sigmoid(ga)
    want_h = ga * s * u
    want_dpre = torch.cat([dh.double() * u * s * (1 + ga * (1 - s)), dh.double() * ga * s], -1)
    h_out = torch.empty(2, 37, 129, device=device)[1]
    dpre, h = swiglu_backward(pre, dh, out=pre, h_out=h_out)
    assert dpre.data_ptr() == pre.data_ptr() and h.data_ptr() == h_out.data_ptr()
    for got, want in ((h, want_h), (pre, want_dpre)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-6, err


@needs_triton
def test_float64_keeps_the_exact_formulas():
    """float64 rows take the eager formulas (the kernel computes in float32): forward and backward
    equal the float64 formulas to float64 precision."""
    g = torch.Generator().manual_seed(5)
    pre = torch.randn(9, 2 * 33, generator=g, dtype=torch.float64).to(DEVICE)
    dh = torch.randn(9, 33, generator=g, dtype=torch.float64).to(DEVICE)
    assert not fused_available(pre)
    ga, u = pre.chunk(2, -1)
    s = torch.sigmoid(ga)
    want_dpre = torch.cat([dh * u * s * (1 + ga * (1 - s)), dh * ga * s], -1)
    dpre, h = swiglu_backward(pre, dh)
    for got, want in ((swiglu(pre), ga * s * u), (h, ga * s * u), (dpre, want_dpre)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
