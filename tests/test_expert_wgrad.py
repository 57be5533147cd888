"""``grouped_wgrad`` (``kernels/expert_wgrad.py``: Triton on CUDA, or under Triton's interpreter on the
CPU; the torch path elsewhere) against a float64 loop over the groups: accumulating and not, empty
groups, group sizes off the kernel's blocks, a strided operand, and rows past the last end that
must not be read."""
import pytest
import torch

from kernel_device import DEVICE
from overlap_layers.kernels.expert_wgrad import WgradParts, grouped_wgrad, grouped_wgrad_parts


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


def _parts_case(dev, dtype, seed):
    """Three parts of rows (one with NaN rows past its segments, never read) and tables
    ``[S=3, G=4]``: every group's rows split over the parts, some segments empty."""
    g = torch.Generator().manual_seed(seed)
    M, N, rows = 40, 136, (150, 90, 7)
    wide = [torch.randn(r, M + 8, generator=g).to(dev, dtype) for r in rows]
    a = [w[:, 8:8 + M] for w in wide]  # row stride M + 8 in every part
    b = [torch.randn(r, N, generator=g).to(dev, dtype) for r in rows]
    a[1][80:] = float("nan")
    b[1][80:] = float("nan")
    part = [[0, 0, 1, 2], [1, 1, 0, 0], [2, 0, 2, 1]]
    lo = [[0, 20, 0, 0], [5, 40, 70, 141], [0, 141, 7, 80]]
    hi = [[20, 70, 5, 7], [40, 80, 141, 150], [0, 150, 7, 80]]
    as_dev = [torch.tensor(t, device=dev, dtype=torch.int32) for t in (part, lo, hi)]
    return a, b, (part, lo, hi), as_dev, M, N


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("accumulate", [True, False])
def test_grouped_wgrad_parts_matches_the_dense_sum(dtype, tol, accumulate):
    dev = DEVICE or torch.device("cpu")
    a, b, (part, lo, hi), tables, M, N = _parts_case(dev, dtype, 7)
    out = torch.randn(4, M, N, generator=torch.Generator().manual_seed(8)).to(dev, dtype)
    want = out.double().clone() if accumulate else torch.zeros_like(out, dtype=torch.float64)
    for s in range(3):
        for grp in range(4):
            p, i, j = part[s][grp], lo[s][grp], hi[s][grp]
            want[grp] += a[p][i:j].double().t() @ b[p][i:j].double()
    got = grouped_wgrad_parts(WgradParts(a, b), *tables, out, accumulate)
    assert got is out and torch.isfinite(got).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < tol, err


def test_grouped_wgrad_parts_refuses_bad_parts_and_tables():
    a, b = [torch.zeros(6, 4), torch.zeros(3, 4)], [torch.zeros(6, 5), torch.zeros(3, 5)]
    with pytest.raises(ValueError, match="WgradParts: a"):
        WgradParts(a, b[:1])
    with pytest.raises(ValueError, match="WgradParts: a"):
        WgradParts([a[0], torch.zeros(3, 8)[:, :4]], b)  # another row stride
    parts = WgradParts(a, b)
    t = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped_wgrad_parts: parts"):
        grouped_wgrad_parts(parts, t, t, t, torch.zeros(3, 5, 4))
    with pytest.raises(ValueError, match="of one shape"):
        grouped_wgrad_parts(parts, t, t, t[:1], torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match="16-byte aligned"):
        WgradParts([torch.zeros(6, 9)[:, 1:5], torch.zeros(3, 9)[:, :4]], b)
