"""``grouped_wgrad`` (``layers/expert_wgrad.py``: Triton on CUDA, or under Triton's interpreter on the
CPU; the torch path elsewhere) against a float64 loop over the groups: accumulating and not, empty
groups, group sizes off the kernel's blocks, a strided operand, and rows past the last end that
must not be read."""
import pytest
import torch

from kernel_device import DEVICE
from overlap_layers.layers.expert_wgrad import grouped_wgrad


def _reference(a, b, ends, out, accumulate):
    want = out.double().clone() if accumulate else torch.zeros_like(out, dtype=torch.float64)
    start = 0
    for g, end in enumerate(ends):
        want[g] += a[start:end].double().t() @ b[start:end].double()
        start = end
    return want


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("sizes,M,N", [([70, 0, 131, 1], 40, 136), ([64, 64], 128, 128), ([0, 0], 8, 8), ([5], 200, 9)])
def test_grouped_wgrad_matches_the_loop(dtype, tol, accumulate, sizes, M, N):
    dev = DEVICE or torch.device("cpu")
    g = torch.Generator().manual_seed(len(sizes) * 1000 + M + N)
    R = sum(sizes)
    extra = 3  # rows past the last end: NaN, never read
    wide = torch.randn(R + extra, M + 5, generator=g).to(dev, dtype)
    a = wide[:, 2:2 + M]  # row stride M + 5: a strided operand
    b = torch.randn(R + extra, N, generator=g).to(dev, dtype)
    a[R:] = float("nan")
    b[R:] = float("nan")
    ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    out = torch.randn(len(sizes), M, N, generator=g).to(dev, dtype)
    want = _reference(a[:R], b[:R], ends.tolist(), out, accumulate)
    got = grouped_wgrad(a, b, ends, out, accumulate)
    assert got is out and torch.isfinite(got).all()
    err = ((got.double() - want).norm() / max(want.norm().item(), 1e-12)).item()
    assert err < tol, err


def test_grouped_wgrad_refuses_bad_shapes():
    a, b = torch.zeros(6, 4), torch.zeros(6, 5)
    ends = torch.tensor([2, 6])
    with pytest.raises(ValueError, match="grouped_wgrad: a"):
        grouped_wgrad(a, b, ends, torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match="integer ends"):
        grouped_wgrad(a, b, ends.float(), torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="contiguous out"):
        grouped_wgrad(a, b, ends, torch.zeros(2, 5, 4).transpose(1, 2))
