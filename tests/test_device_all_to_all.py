"""``runtime.device_all_to_all.copy_rows_by_table`` against the all-to-all it must equal (module
docstring), with every rank's buffers in one process: pulls from every source, then pushes, for
random count tables with one group per rank and with several (the MoE's local experts), counts
past the buffers (clipped, nothing written outside), bad arguments;
``DeviceCountAllToAll``'s own checks on a stand-in workspace.
On the CPU its torch path, or its kernel under Triton's interpreter; the symmetric-memory exchange
itself is checked on GPUs (tests/cuda_worker.py check_device_all_to_all)."""
import math

import pytest
import torch

from kernel_device import DEVICE as KERNEL_DEVICE
from overlap_layers.runtime.device_all_to_all import DeviceCountAllToAll, copy_rows_by_table, segments

DEVICE = KERNEL_DEVICE or torch.device("cpu")  # the kernel where Triton runs, else the torch path


def _table(ws, rows, groups, g):
    """Random ``[ws, ws, groups]`` counts whose rows sum to at most ``rows`` (zeros included)."""
    t = torch.zeros(ws, ws * groups, dtype=torch.int32)
    for s in range(ws):
        cuts = sorted(torch.randint(0, rows + 1, (ws * groups,), generator=g).tolist())
        t[s] = torch.tensor([cuts[0]] + [b - a for a, b in zip(cuts, cuts[1:])], dtype=torch.int32)
    return t.view(ws, ws, groups)


def _send_start(table, s, r, grp):
    """Where source s's rows for (r, grp) begin in its send rows: after its rows for the ranks
    s, s + 1, ... before r (cyclically) and for r's earlier groups."""
    ws = table.shape[0]
    before = [(s + j) % ws for j in range((r - s) % ws)]
    return int(sum(table[s, d].sum() for d in before)) + int(table[s, r, :grp].sum())


def _want_pull(table, sends, r, s):
    """The reference pull by rank r from source s, from the definitions: for each group, the rows
    s sends to (r, group)."""
    G = table.shape[2]
    return torch.cat([sends[s][_send_start(table, s, r, grp):][:int(table[s, r, grp])] for grp in range(G)])


@pytest.mark.parametrize("ws,groups,rows,width,dtype", [
    (2, 1, 5, 3, torch.float32), (4, 1, 13, 40, torch.bfloat16), (3, 1, 9, 7, torch.float64),
    (8, 1, 6, 24, torch.float16), (2, 1, 7, 1100, torch.float32), (2, 3, 11, 16, torch.float32),
    (4, 5, 23, 40, torch.bfloat16), (3, 2, 9, 1100, torch.float16)])
def test_pulls_then_pushes_equal_the_all_to_all(ws, groups, rows, width, dtype):
    """Every rank pulls from every source, then pushes 3 x + 1 of what it pulled back: each
    rank's back holds 3 x + 1 of its send rows, in send order, and nothing past them."""
    g = torch.Generator().manual_seed(ws * 100 + width + groups)
    for trial in range(3):
        table = _table(ws, rows, groups, g) if trial else \
            torch.full((ws, ws, groups), rows // (ws * groups), dtype=torch.int32)
        flat = table.view(ws, ws) if groups == 1 and trial == 2 else table  # the two-dimensional table of one group
        sends = [torch.randn(rows, width, generator=g).to(DEVICE, dtype) for _ in range(ws)]
        pulled = {}
        for r in range(ws):
            for s in range(ws):
                out = torch.full((rows, width), float("nan"), device=DEVICE, dtype=dtype)
                copy_rows_by_table(segments(flat.to(DEVICE), r, s), sends, out, push=False)
                want = _want_pull(table, sends, r, s)
                assert torch.equal(out[:want.shape[0]], want), (trial, r, s)
                assert out[want.shape[0]:].isnan().all()  # nothing past the pulled rows
                pulled[r, s] = out
        backs = [torch.full((rows, width), float("nan"), device=DEVICE, dtype=dtype) for _ in range(ws)]
        for (d, s), out in pulled.items():  # destination d pushes its results for source s's rows
            copy_rows_by_table(segments(flat.to(DEVICE), d, s), backs, out * 3 + 1, push=True)
        for r in range(ws):
            n = int(table[r].sum())
            assert torch.equal(backs[r][:n], sends[r][:n] * 3 + 1), (trial, r)
            assert backs[r][n:].isnan().all()


@pytest.mark.parametrize("ws,groups,cut", [(2, 3, 1), (4, 5, 2), (3, 4, 3), (2, 2, 1)])
def test_a_source_pulled_and_pushed_in_two_ranges_of_groups(ws, groups, cut):
    """``segments(..., groups=(first, end))``: each range's rows land from row 0 of its own
    buffer, and pushing both ranges' results fills ``back`` as one push would."""
    rows, width = 17, 24
    g = torch.Generator().manual_seed(ws * 10 + groups)
    table = _table(ws, rows, groups, g)
    sends = [torch.randn(rows, width, generator=g).to(DEVICE) for _ in range(ws)]
    backs = [torch.full((rows, width), float("nan"), device=DEVICE) for _ in range(ws)]
    for r in range(ws):
        for s in range(ws):
            whole = _want_pull(table, sends, r, s)
            split = int(table[s, r, :cut].sum())
            for (a, b), want in (((0, cut), whole[:split]), ((cut, groups), whole[split:])):
                segs = segments(table.to(DEVICE), r, s, (a, b))
                out = torch.full((rows, width), float("nan"), device=DEVICE)
                copy_rows_by_table(segs, sends, out, push=False)
                assert torch.equal(out[:want.shape[0]], want), (r, s, a)
                assert out[want.shape[0]:].isnan().all()
                copy_rows_by_table(segs, backs, out * 3 + 1, push=True)
    for r in range(ws):
        n = int(table[r].sum())
        assert torch.equal(backs[r][:n], sends[r][:n] * 3 + 1), r
        assert backs[r][n:].isnan().all()
    with pytest.raises(ValueError, match="valid: None or \\(first, end\\) with 0 <= first < end <= 2"):
        segments(torch.zeros(2, 2, 2, dtype=torch.int32), 0, 1, (1, 1))


def test_counts_past_the_buffers_copy_what_fits_and_write_nothing_outside():
    """Positions come from the table as it is; of each source's rows only those inside both
    buffers are copied."""
    ws, rows, W = 3, 4, 5
    # source 0 sends 2 rows to itself, then 3 + 6 rows to rank 1's groups 0 and 1: 11 > 4 rows
    table = torch.tensor([[[2, 0], [3, 6], [0, 0]], [[0, 0], [1, 0], [3, 0]], [[4, 0], [0, 0], [0, 0]]],
                         dtype=torch.int32)
    sends = [torch.arange(rows * W, dtype=torch.float32, device=DEVICE).view(rows, W) + 100 * s for s in range(ws)]
    guarded = torch.full((3 + 4 + 3, W), -1.0, device=DEVICE)  # 4 pulled rows between guard rows
    out = guarded[3:7]
    copy_rows_by_table(segments(table.to(DEVICE), 1, 0), sends, out, push=False)
    # rank 1 pulls from 0 its group-0 rows [2, 5) into rows [0, 3): rows 2, 3 exist, so two are
    # copied; its group-1 rows [5, 11) into rows [3, 9): none exists
    assert torch.equal(out[:2], sends[0][2:4])
    assert (out[2:] == -1).all() and (guarded[:3] == -1).all() and (guarded[7:] == -1).all()


def test_bad_arguments_are_value_errors():
    segs = segments(torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), 0, 1)
    a, b = torch.zeros(3, 4, device=DEVICE), torch.zeros(3, 5, device=DEVICE)
    with pytest.raises(ValueError, match=r"valid: segments \[4, n\]"):
        copy_rows_by_table(segs[:3], [a, a], torch.zeros(6, 4, device=DEVICE), push=False)
    with pytest.raises(ValueError, match="as wide as the local"):
        copy_rows_by_table(segs, [a, a], torch.zeros(6, 5, device=DEVICE), push=False)
    with pytest.raises(ValueError, match="one shape"):
        copy_rows_by_table(segs, [a, b], torch.zeros(6, 4, device=DEVICE), push=False)


class _Handle:
    """The signal pad of the stand-in: signals recorded, waits return at once."""

    def __init__(self):
        self.signals = []

    def put_signal(self, peer, channel):
        self.signals.append((peer, channel))

    def wait_signal(self, peer, channel):
        pass


class _Workspace:
    """A one-process stand-in for the group's symmetric workspace: a byte buffer per rank."""

    def __init__(self, ws, rank):
        self.ws, self.rank, self.handle, self.nbytes = ws, rank, _Handle(), 0
        self.bufs = {}
        self.pull_stream = self.push_stream = None

    def reserve(self, nbytes):
        if nbytes > self.nbytes:
            self.bufs = {q: torch.zeros(nbytes, dtype=torch.uint8) for q in range(self.ws)}
            self.nbytes, self.handle = nbytes, _Handle()

    def view(self, rank, shape, dtype, offset):
        n = math.prod(shape) * dtype.itemsize
        return self.bufs[rank][offset:offset + n].view(dtype).view(shape)


def test_ready_writes_this_ranks_counts_into_every_ranks_table_then_signals():
    """``ready``: row ``rank`` of every rank's table holds this rank's counts (the kernel where
    Triton runs, else copies), the other rows untouched, then a TABLE signal to each peer."""
    ws, rank, G = 3, 1, 4
    w = _Workspace(ws, rank)
    ex = DeviceCountAllToAll(w, 8, 16, torch.float32, groups=G)
    for q in range(ws):
        w.view(q, (ws, ws, G), torch.int32, 0).fill_(-1)
    counts = torch.arange(ws * G, dtype=torch.int32).view(ws, G) + 5
    ex.ready(counts)
    for q in range(ws):
        table = w.view(q, (ws, ws, G), torch.int32, 0)
        assert torch.equal(table[rank], counts), q
        assert (table[[s for s in range(ws) if s != rank]] == -1).all()
    assert w.handle.signals == [(2, 0), (0, 0)]
    assert torch.equal(ex.recv_counts, w.view(rank, (ws, ws, G), torch.int32, 0)[:, rank])


def test_exchange_checks_its_arguments_and_its_workspace():
    """Bad counts, ``out``, ``results`` or sources are ValueErrors saying what is valid; an
    exchange made before the workspace grew raises instead of writing into a freed buffer."""
    w = _Workspace(2, 0)
    ex = DeviceCountAllToAll(w, 5, 3, torch.float32)
    assert w.nbytes >= 4 * 4 + 2 * 5 * 3 * 4 and ex.send.shape == ex.back.shape == (5, 3)
    counts = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"valid: \[2, 1\] torch.int32"):
        ex.ready(counts.long())
    with pytest.raises(ValueError, match=r"valid: \[2, 3\] torch.int32"):
        DeviceCountAllToAll(w, 5, 3, torch.float32, groups=3).ready(counts)
    with pytest.raises(ValueError, match=r"valid: \[>= 5, 3\] torch.float32"):
        ex.pull(1, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="valid: a rank of the group, 0 .. 1"):
        ex.pull(2, torch.zeros(5, 3))
    with pytest.raises(ValueError, match="valid: laid out as pull's out"):
        ex.push(1, torch.zeros(5, 3, dtype=torch.float64))
    w.reserve(w.nbytes + 1)  # another exchange grew the workspace
    with pytest.raises(RuntimeError, match="make a new one"):
        ex.ready(counts)
