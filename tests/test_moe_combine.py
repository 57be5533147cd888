"""``layers/moe_combine.combine_rows`` against its definition written as a loop over tokens and
their k rows (float64 sums of the weight, cast to the rows' dtype, times each row): the torch path
on every install, the kernel where Triton runs (CUDA, or the CPU under the interpreter: also run by
``test_triton_interpreted.py``). Rows that must not be read hold NaN: own rows past ``n_own``,
``back`` rows before it, every row past ``kept``; the counts come as device tensors (the device
path) or host ints (eager calls), and ``own`` and ``back`` end where they may (at ``n_own``, at
``kept``) or hold rows past it."""
import pytest
import torch

from kernel_device import DEVICE as KERNEL_DEVICE
from overlap_layers.layers import moe_combine
from overlap_layers.layers.moe_combine import combine_rows

DEVICES = ["torch"] + (["kernel"] if KERNEL_DEVICE is not None else [])


def _want(own, back, pos, weights, n_own, kept):
    T, k = weights.shape
    y = torch.zeros(T, own.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            p = int(pos[t * k + j])
            if kept is not None and p >= kept:
                continue
            row = own[p] if p < n_own else back[p]
            y[t] += weights[t, j].to(own.dtype).double() * row.double()
    return y


@pytest.mark.parametrize("path", DEVICES)
@pytest.mark.parametrize("counts", ["device", "host"])
@pytest.mark.parametrize("T,k,H,n_own,kept,dtype", [(5, 2, 8, 3, None, torch.float32),
                                                    (7, 3, 40, 0, 15, torch.float32),
                                                    (6, 2, 1100, 12, 9, torch.bfloat16),
                                                    (4, 1, 16, 4, None, torch.bfloat16),
                                                    (0, 2, 8, 0, None, torch.float32)])
def test_combine_equals_its_definition(path, counts, T, k, H, n_own, kept, dtype, monkeypatch):
    dev = KERNEL_DEVICE if path == "kernel" else torch.device("cpu")
    if path == "torch":
        monkeypatch.setattr(moe_combine, "runs_triton", lambda t: False)
    g = torch.Generator().manual_seed(T * 100 + H)
    n = T * k
    rows = torch.randn(n + 3, H, generator=g).to(dtype)
    own, back = rows.clone(), rows.clone() * 2
    own[n_own:] = float("nan")
    back[:n_own] = float("nan")
    if kept is not None:
        own[kept:] = back[kept:] = float("nan")
    pos = torch.randperm(n, generator=g)
    weights = torch.rand(T, k, generator=g)
    want = _want(own, back, pos, weights, n_own, kept)
    if counts == "host":  # as an eager call holds them: the rows end at the counts
        own, back = own[:n_own], back[:n if kept is None else kept]
        n_arg, kept_arg = n_own, kept
    else:
        n_arg, kept_arg = torch.tensor(n_own, device=dev), None if kept is None else torch.tensor(kept, device=dev)
    got = combine_rows(own.to(dev), back.to(dev), pos.to(dev), weights.to(dev), n_arg, kept_arg)
    assert got.shape == (T, H) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.double().cpu(), want, rtol=tol, atol=tol)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="valid: rows of one width and dtype, T\\*k positions"):
        combine_rows(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float64), torch.arange(4),
                     torch.ones(2, 2), torch.tensor(1))
