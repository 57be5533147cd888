"""``runtime.device_all_to_all.copy_rows_by_table`` against the all-to-all it must equal (module
docstring), with every rank's buffers in one process: dispatch (pull) then combine (push) for
random count tables with one group per rank and with several (the MoE's local experts), counts
past the buffers (clipped, nothing written outside), bad arguments;
``DeviceCountAllToAll``'s own checks on a stand-in workspace.
On the CPU its torch path, or its kernel under Triton's interpreter; the symmetric-memory exchange
itself is checked on GPUs (tests/cuda_worker.py check_device_all_to_all)."""
import math

import pytest
import torch

from kernel_device import DEVICE as KERNEL_DEVICE
from overlap_layers.runtime.device_all_to_all import DeviceCountAllToAll, copy_rows_by_table

DEVICE = KERNEL_DEVICE or torch.device("cpu")  # the kernel where Triton runs, else the torch path


def _table(ws, rows, groups, g):
    """Random ``[ws, ws, groups]`` counts whose rows sum to at most ``rows`` (zeros included)."""
    t = torch.zeros(ws, ws * groups, dtype=torch.int32)
    for s in range(ws):
        cuts = sorted(torch.randint(0, rows + 1, (ws * groups,), generator=g).tolist())
        t[s] = torch.tensor([cuts[0]] + [b - a for a, b in zip(cuts, cuts[1:])], dtype=torch.int32)
    return t.view(ws, ws, groups)


def _want_recv(table, sends, r):
    """The reference dispatch for rank r, from the definitions: for each group, each source's
    rows for (r, group), which start after the source's rows for every earlier (rank, group)."""
    ws, _, G = table.shape
    parts = []
    for grp in range(G):
        for s, send in enumerate(sends):
            start = int(table[s, :r].sum()) + int(table[s, r, :grp].sum())
            parts.append(send[start:start + int(table[s, r, grp])])
    return torch.cat(parts)


@pytest.mark.parametrize("ws,groups,rows,width,dtype", [
    (2, 1, 5, 3, torch.float32), (4, 1, 13, 40, torch.bfloat16), (3, 1, 9, 7, torch.float64),
    (8, 1, 6, 24, torch.float16), (2, 1, 7, 1100, torch.float32), (2, 3, 11, 16, torch.float32),
    (4, 5, 23, 40, torch.bfloat16), (3, 2, 9, 1100, torch.float16)])
def test_dispatch_then_combine_equal_the_all_to_all(ws, groups, rows, width, dtype):
    g = torch.Generator().manual_seed(ws * 100 + width + groups)
    for trial in range(3):
        table = _table(ws, rows, groups, g) if trial else \
            torch.full((ws, ws, groups), rows // (ws * groups), dtype=torch.int32)
        if groups == 1 and trial == 2:
            table = table.view(ws, ws)  # the two-dimensional table of one group
        sends = [torch.randn(rows, width, generator=g).to(DEVICE, dtype) for _ in range(ws)]
        recvs = [torch.full((ws * rows, width), float("nan"), device=DEVICE, dtype=dtype) for _ in range(ws)]
        for r in range(ws):
            copy_rows_by_table(table.to(DEVICE), sends, recvs[r], r, push=False)
            want = _want_recv(table.view(ws, ws, groups), sends, r)
            assert torch.equal(recvs[r][:want.shape[0]], want), (trial, r)
            assert recvs[r][want.shape[0]:].isnan().all()  # nothing past the received rows
        backs = [torch.full((rows, width), float("nan"), device=DEVICE, dtype=dtype) for _ in range(ws)]
        for d in range(ws):  # every destination pushes its results (here 3 x + 1 of its received rows)
            copy_rows_by_table(table.to(DEVICE), backs, recvs[d] * 3 + 1, d, push=True)
        for r in range(ws):
            n = int(table[r].sum())
            assert torch.equal(backs[r][:n], sends[r][:n] * 3 + 1), (trial, r)
            assert backs[r][n:].isnan().all()


def test_counts_past_the_buffers_copy_what_fits_and_write_nothing_outside():
    """Positions come from the table as it is; of each source's rows only those inside both
    buffers are copied."""
    ws, rows, W = 3, 4, 5
    table = torch.tensor([[2, 9, 0], [0, 1, 3], [4, 0, 0]], dtype=torch.int32)  # row 0 sends 11 > 4 rows
    sends = [torch.arange(rows * W, dtype=torch.float32, device=DEVICE).view(rows, W) + 100 * s for s in range(ws)]
    guarded = torch.full((3 + 4 + 3, W), -1.0, device=DEVICE)  # recv of 4 rows between guard rows
    recv = guarded[3:7]
    copy_rows_by_table(table.to(DEVICE), sends, recv, 1, push=False)
    # rank 1 receives from 0 its rows [2, 11) into recv rows [0, 9): rows 2, 3 exist, and recv has
    # 4 rows, so two are copied; from 1 one row into recv row 9, past recv: none
    assert torch.equal(recv[:2], sends[0][2:4])
    assert (recv[2:] == -1).all() and (guarded[:3] == -1).all() and (guarded[7:] == -1).all()


def test_bad_arguments_are_value_errors():
    t = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    a, b = torch.zeros(3, 4, device=DEVICE), torch.zeros(3, 5, device=DEVICE)
    with pytest.raises(ValueError, match="2 remotes of one shape"):
        copy_rows_by_table(t, [a], torch.zeros(6, 4, device=DEVICE), 0, push=False)
    with pytest.raises(ValueError, match="as wide as the local"):
        copy_rows_by_table(t, [a, a], torch.zeros(6, 5, device=DEVICE), 0, push=False)
    with pytest.raises(ValueError, match="one shape"):
        copy_rows_by_table(t, [a, b], torch.zeros(6, 4, device=DEVICE), 0, push=False)


class _Workspace:
    """A one-process stand-in for the group's symmetric workspace: a byte buffer per rank."""

    def __init__(self, ws, rank):
        self.ws, self.rank, self.handle, self.nbytes = ws, rank, object(), 0
        self.bufs = {}

    def reserve(self, nbytes):
        if nbytes > self.nbytes:
            self.bufs = {q: torch.zeros(nbytes, dtype=torch.uint8) for q in range(self.ws)}
            self.nbytes, self.handle = nbytes, object()

    def view(self, rank, shape, dtype, offset):
        n = math.prod(shape) * dtype.itemsize
        return self.bufs[rank][offset:offset + n].view(dtype).view(shape)


def test_exchange_checks_its_arguments_and_its_workspace():
    """Bad ``recv`` or ``results`` are ValueErrors saying what is valid; an exchange made before
    the workspace grew raises instead of writing into a freed buffer."""
    w = _Workspace(2, 0)
    ex = DeviceCountAllToAll(w, 5, 3, torch.float32)
    assert w.nbytes >= 4 * 4 + 2 * 5 * 3 * 4 and ex.send.shape == ex.back.shape == (5, 3)
    counts = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"valid: \[>= 10, 3\] torch.float32"):
        ex.dispatch(counts, torch.zeros(9, 3))
    with pytest.raises(ValueError, match="valid: after dispatch"):
        ex.combine(torch.zeros(10, 3))
    with pytest.raises(ValueError, match=r"valid: \[2, 1\] torch.int32"):
        ex.dispatch(counts.long(), torch.zeros(10, 3))
    with pytest.raises(ValueError, match=r"valid: \[2, 3\] torch.int32"):
        DeviceCountAllToAll(w, 5, 3, torch.float32, groups=3).dispatch(counts, torch.zeros(10, 3))
    w.reserve(w.nbytes + 1)  # another exchange grew the workspace
    with pytest.raises(RuntimeError, match="make a new one"):
        ex.dispatch(counts, torch.zeros(10, 3))
