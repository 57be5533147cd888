"""``layers/moe/combine.combine_rows`` against its definition written as a loop over tokens and
their k rows (float64 sums of the weight, cast to the rows' dtype, times each row): the torch path
on every install, the kernel where Triton runs (CUDA, or the CPU under the interpreter: also run by
``test_triton_interpreted.py``). Rows that must not be read hold NaN: own rows past ``n_own``,
``back`` rows before it, every row past ``kept``; the counts come as device tensors (the device
path) or host ints (eager calls), and ``own`` and ``back`` end where they may (at ``n_own``, at
``kept``) or hold rows past it."""
import pytest
import torch

from kernel_device import DEVICE as KERNEL_DEVICE
from overlap_layers.layers.moe import combine as moe_combine
from overlap_layers.layers.moe.combine import combine_rows

DEVICES = ["torch"] + (["kernel"] if KERNEL_DEVICE is not None else [])


def _want(own, back, pos, weights, n_own, kept, late=None, n_first=None):
    """``(y, rows)``: the weighted sums in float64, and each assignment's row (0 where not read)."""
    T, k = weights.shape
    n_first = n_own if late is None else n_first
    y = torch.zeros(T, own.shape[1], dtype=torch.float64)
    rows = torch.zeros(T * k, own.shape[1], dtype=own.dtype)
    for t in range(T):
        for j in range(k):
            p = int(pos[t * k + j])
            if p < 0 or (kept is not None and p >= kept):
                continue
            row = own[p] if p < n_first else late[p - n_first] if p < n_own else back[p]
            y[t] += weights[t, j].to(own.dtype).double() * row.double()
            rows[t * k + j] = row
    return y, rows


@pytest.mark.parametrize("path", DEVICES)
@pytest.mark.parametrize("counts", ["device", "host"])
@pytest.mark.parametrize("T,k,H,n_own,kept,dtype", [(5, 2, 8, 3, None, torch.float32),
                                                    (7, 3, 40, 0, 15, torch.float32),
                                                    (6, 2, 1100, 12, 9, torch.bfloat16),
                                                    (4, 1, 16, 4, None, torch.bfloat16),
                                                    (0, 2, 8, 0, None, torch.float32),
                                                    (6, 3, 24, 5, 14, torch.float64)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("rows_out", [False, True])
def test_combine_equals_its_definition(path, counts, T, k, H, n_own, kept, dtype, split, rows_out, monkeypatch):
    """With ``split``, the own rows from ``n_own // 2`` on come from ``late`` (the device path's
    own rows run last), and every third position is -1 (an assignment not sent); with
    ``rows_out``, each assignment's row comes back too, exactly."""
    dev = KERNEL_DEVICE if path == "kernel" else torch.device("cpu")
    if path == "torch":
        monkeypatch.setattr(moe_combine, "runs_triton", lambda t: False)
    g = torch.Generator().manual_seed(T * 100 + H)
    n = T * k
    rows = torch.randn(n + 3, H, generator=g).to(dtype)
    own, back = rows.clone(), rows.clone() * 2
    n_first = n_own // 2 if split else n_own
    late = torch.full((n + 3, H), float("nan"), dtype=dtype)
    late[:n_own - n_first] = rows[n_first:n_own] * 3
    own[n_first:] = float("nan")
    back[:n_own] = float("nan")
    if kept is not None:
        own[kept:] = back[kept:] = float("nan")
    pos = torch.randperm(n, generator=g)
    if split:
        pos[::3] = -1
    weights = torch.rand(T, k, generator=g)
    want, want_rows = _want(own, back, pos, weights, n_own, kept, late if split else None, n_first)
    if counts == "host":  # as an eager call holds them: the rows end at the counts
        own, back = own[:n_first], back[:n if kept is None else kept]
        n_arg, kept_arg, first_arg = n_own, kept, n_first
    else:
        n_arg, kept_arg = torch.tensor(n_own, device=dev), None if kept is None else torch.tensor(kept, device=dev)
        first_arg = torch.tensor(n_first, device=dev)
    extra = dict(late=late.to(dev), n_first=first_arg) if split else {}
    if rows_out:
        extra["rows_out"] = torch.full((T * k, H), float("nan"), dtype=dtype, device=dev)
    got = combine_rows(own.to(dev), back.to(dev), pos.to(dev), weights.to(dev), n_arg, kept_arg, **extra)
    assert got.shape == (T, H) and got.dtype == dtype
    if rows_out:
        assert torch.equal(extra["rows_out"].cpu(), want_rows)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)  # float64: summed in float64
    assert torch.allclose(got.double().cpu(), want, rtol=tol, atol=tol)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="valid: rows of one width and dtype, T\\*k positions, n_first with late"):
        combine_rows(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float64), torch.arange(4),
                     torch.ones(2, 2), torch.tensor(1))
    with pytest.raises(ValueError, match="n_first with late"):
        combine_rows(torch.zeros(4, 8), torch.zeros(4, 8), torch.arange(4), torch.ones(2, 2), 1,
                     late=torch.zeros(4, 8))


@pytest.mark.parametrize("path", DEVICES)
@pytest.mark.parametrize("T,k,H,dtype,tol", [(5, 2, 8, torch.float32, 1e-6), (7, 3, 40, torch.float32, 1e-6),
                                             (6, 8, 1100, torch.bfloat16, 1e-2), (4, 1, 16, torch.bfloat16, 1e-2),
                                             (0, 2, 8, torch.float32, 0), (6, 3, 24, torch.float64, 1e-12)])
def test_weigh_rows_and_its_gradients_equal_the_float64_sums(path, T, k, H, dtype, tol, monkeypatch):
    dev = KERNEL_DEVICE if path == "kernel" else torch.device("cpu")
    if path == "torch":
        monkeypatch.setattr(moe_combine, "runs_triton", lambda t: False)
    g = torch.Generator().manual_seed(T * 100 + k * 10 + H)
    rows = torch.randn(T, k, H, generator=g, dtype=torch.float64)
    weights = torch.rand(T, k, generator=g, dtype=torch.float64)
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    r, w = (t.to(dev, dtype).requires_grad_() for t in (rows, weights))
    y = moe_combine.weigh_rows(r, w)
    y.backward(dy.to(dev, dtype))
    r64, w64 = rows.to(dtype).double(), weights.to(dtype).double()  # the inputs as the layer holds them
    g64 = dy.to(dtype).double()
    want = {"y": (w64[:, :, None] * r64).sum(1), "d rows": w64[:, :, None] * g64[:, None, :],
            "d weights": (r64 * g64[:, None, :]).sum(2)}
    for name, got in (("y", y), ("d rows", r.grad), ("d weights", w.grad)):
        assert got.dtype == dtype and got.shape == want[name].shape, name
        err = (got.double().cpu() - want[name]).norm() / max(want[name].norm().item(), 1e-30)
        assert err <= tol, (name, err.item())


def test_weigh_rows_refuses_mismatched_weights():
    with pytest.raises(ValueError, match="weigh_rows: rows"):
        moe_combine.weigh_rows(torch.zeros(3, 2, 4), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="one dtype"):
        moe_combine.weigh_rows(torch.zeros(3, 2, 4), torch.zeros(3, 2, dtype=torch.float64))


@pytest.mark.parametrize("path", DEVICES)
@pytest.mark.parametrize("divert", [False, True])
@pytest.mark.parametrize("T,k,H,dtype,tol", [(7, 3, 40, torch.float32, 1e-6), (6, 8, 1100, torch.bfloat16, 1e-2),
                                             (6, 3, 24, torch.float64, 1e-12), (0, 2, 8, torch.float32, 0)])
def test_weigh_backward_into_places_the_row_gradients(path, divert, T, k, H, dtype, tol, monkeypatch):
    # every assignment's gradient row at its place; places -1 and past dst are not written; with a
    # divert, those of places 3 .. 3 + T - 1 at out[place - 3] instead, out's first T - 2 rows only
    dev = KERNEL_DEVICE if path == "kernel" else torch.device("cpu")
    if path == "torch":
        monkeypatch.setattr(moe_combine, "runs_triton", lambda t: False)
    g = torch.Generator().manual_seed(T * 10 + k)
    rows = torch.randn(T, k, H, generator=g, dtype=torch.float64).to(dtype)
    weights = torch.rand(T, k, generator=g, dtype=torch.float64).to(dtype)
    dy = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    n_dst = T * k + 2
    pos = torch.randperm(n_dst, generator=g)[:T * k]
    pos[::4] = -1
    if T:
        pos[1] = n_dst + 5  # outside dst
    dst = torch.full((n_dst, H), 7.0, dtype=dtype, device=dev)
    lo, hi, n_out = 3, 3 + T, max(T - 2, 0)
    out = torch.full((n_out, H), 5.0, dtype=dtype, device=dev)
    d_w = moe_combine.weigh_backward_into(rows.to(dev), weights.to(dev), dy.to(dev), pos.to(dev), dst,
                                          (torch.tensor([lo, hi], device=dev), out) if divert else None)
    want_dw = (rows.double() * dy.double()[:, None]).sum(-1)
    err = (d_w.double().cpu() - want_dw).norm() / max(want_dw.norm().item(), 1e-30)
    assert d_w.dtype == dtype and err <= tol, err.item()
    want, want_out = torch.full((n_dst, H), 7.0, dtype=torch.float64), torch.full((n_out, H), 5.0, dtype=torch.float64)
    for a, p in enumerate(pos.tolist()):
        row = weights[a // k, a % k].double() * dy[a // k].double()
        if divert and lo <= p < hi:
            if p - lo < n_out:
                want_out[p - lo] = row
        elif 0 <= p < n_dst:
            want[p] = row
    for got, exp in ((dst, want), (out, want_out)):
        err = (got.double().cpu() - exp).norm() / max(exp.norm().item(), 1e-30)
        assert err <= tol, err.item()
    assert not divert or not T or (want_out != 5.0).any()  # the divert took rows


def test_weigh_backward_into_refuses_mismatched_shapes():
    rows, w, dy = torch.zeros(3, 2, 4), torch.zeros(3, 2), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="weigh_backward_into: rows"):
        moe_combine.weigh_backward_into(rows, w, dy[:, :3], torch.zeros(6, dtype=torch.long), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="one dtype"):
        moe_combine.weigh_backward_into(rows, w, dy, torch.zeros(6, dtype=torch.long), torch.zeros(8, 4).double())
    for bounds, out in ((torch.tensor([1, 2, 3]), torch.zeros(4, 4)), (torch.tensor([1.0, 2.0]), torch.zeros(4, 4)),
                        (torch.tensor([1, 2]), torch.zeros(4, 3)), (torch.tensor([1, 2]), torch.zeros(4, 8)[:, ::2])):
        with pytest.raises(ValueError, match="a divert's contiguous \\[\\*, H\\] after its two integer bounds"):
            moe_combine.weigh_backward_into(rows, w, dy, torch.zeros(6, dtype=torch.long), torch.zeros(8, 4),
                                            (bounds, out))
