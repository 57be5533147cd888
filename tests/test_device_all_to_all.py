"""``runtime.device_all_to_all``: ``RegionLayout`` with ``copy_rows_by_table`` and
``send_rows.place_by_key`` against the all-to-all they must equal (module docstrings), with every
rank's buffers in one process: every rank places its send rows from their keys (shuffled, some
dropped, one or several assignments per row), pulls each peer's parts (region and overflow), then
pushes results back, for random count tables with one group per rank and with several (the MoE's
local experts), tables that fit the regions and tables that overflow them, counts past the buffers
(clipped, nothing written outside), bad arguments; ``DeviceCountAllToAll``'s own checks on a
stand-in workspace. On the CPU the kernels' torch paths, or the kernels under Triton's
interpreter; the symmetric-memory exchange itself is checked on GPUs (tests/cuda_worker.py
check_device_all_to_all)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernel_device import DEVICE as KERNEL_DEVICE
from overlap_layers.runtime import device_all_to_all
from overlap_layers.runtime.device_all_to_all import DeviceCountAllToAll, RegionLayout, copy_rows_by_table, own_diverts
from overlap_layers.kernels.send_rows import place_by_key

DEVICE = KERNEL_DEVICE or torch.device("cpu")  # the kernel where Triton runs, else the torch path


def _table(ws, rows, groups, g, kind):
    """``[ws, ws, groups]`` counts whose rows sum to at most ``rows``: "random" (zeros and parts
    past their regions likely), "even" (every (destination, group) the same: fits the regions),
    "skewed" (each source sends nearly all its rows to the next rank's first group: past its
    regions)."""
    t = torch.zeros(ws, ws * groups, dtype=torch.int32)
    for s in range(ws):
        if kind == "even":
            t[s] = rows // (ws * groups)
        elif kind == "skewed":
            t.view(ws, ws, groups)[s, (s + 1) % ws, 0] = rows - 1
        else:
            cuts = sorted(torch.randint(0, rows + 1, (ws * groups,), generator=g).tolist())
            t[s] = torch.tensor([cuts[0]] + [b - a for a, b in zip(cuts, cuts[1:])], dtype=torch.int32)
    return t.view(ws, ws, groups)


def _keys(table, s, n, g):
    """``[n]`` int64 keys (send-order indices) of source s's rows, in a random order, with
    ``table[s]``'s counts (by destination rank and group), the rest dropped (keys E and above)."""
    ws, G = table.shape[0], table.shape[2]
    in_send_order = torch.cat([table[s, (s + j) % ws] for j in range(ws)]).to(torch.int64)
    keys = torch.repeat_interleave(torch.arange(ws * G), in_send_order)
    keys = torch.cat([keys, ws * G + torch.randint(0, 3, (n - keys.numel(),), generator=g)])
    return keys[torch.randperm(n, generator=g)]


def _sent(table, s, d, part):
    """Which of source s's rows in send order go to d in ``part``, from the definitions: after its
    rows for the ranks s, s + 1, ... before d (cyclically), those of the part's groups."""
    ws, G = table.shape[0], table.shape[2]
    a, b = (0, G) if part is None else part
    start = sum(int(table[s, (s + j) % ws].sum()) for j in range((d - s) % ws)) + int(table[s, d, :a].sum())
    return list(range(start, start + int(table[s, d, a:b].sum())))


@pytest.fixture(params=[1, 2])
def last_parts(request, monkeypatch):
    """The last peer's rows in one part or two (``LAST_PARTS``)."""
    monkeypatch.setattr(device_all_to_all, "LAST_PARTS", request.param)
    return request.param


@pytest.mark.parametrize("ws,groups,rows,width,dtype", [
    (2, 1, 5, 3, torch.float32), (4, 1, 13, 40, torch.bfloat16), (3, 1, 9, 7, torch.float64),
    (8, 1, 6, 24, torch.float16), (2, 1, 7, 1100, torch.float32), (2, 3, 11, 16, torch.float32),
    (4, 5, 23, 40, torch.bfloat16), (3, 2, 9, 1100, torch.float16), (2, 4, 64, 8, torch.float32)])
@pytest.mark.parametrize("kind", ["random", "even", "skewed"])
def test_place_pull_push_equal_the_all_to_all(ws, groups, rows, width, dtype, kind, last_parts):
    """Every rank places its send rows (``key_places``, ``place_by_key``) in a NaN buffer, pulls each
    peer's parts (region, then overflow) and pushes 3 x + 1 of them back: each pulled part holds
    exactly the rows its source sends in it, by group; each rank's ``back`` holds 3 x + 1 at the
    place of each row it sent a peer, and NaN at its own rows' places."""
    g = torch.Generator().manual_seed(ws * 100 + width + groups)
    lay = RegionLayout(ws, rows, groups, DEVICE)
    for trial in range(2):
        table = _table(ws, rows, groups, g, kind)
        dev_table = table.to(DEVICE)
        rows_of, sends, places = [], [], []
        for s in range(ws):
            send = torch.full((lay.buffer_rows, width), float("nan"), device=DEVICE, dtype=dtype)
            counts = dev_table[s] if groups > 1 or trial == 0 else dev_table[s].view(ws)  # [ws] with one group
            keys = _keys(table, s, rows, g)
            src = torch.randn(rows, width, generator=g).to(DEVICE, dtype)
            pos = place_by_key(src, keys.to(DEVICE), 1, lay.key_places(counts, s), send)
            in_order = torch.sort(keys, stable=True).indices  # the rows in send order, the dropped last
            rows_of.append(src[in_order.to(DEVICE)])
            at = pos[in_order.to(DEVICE)]
            n = int(table[s].sum())
            assert (at[n:] == -1).all() and torch.equal(at[:int(table[s, s].sum())].cpu(),
                                                        torch.arange(int(table[s, s].sum())))  # own rows first
            assert len(set(at[:n].tolist())) == n and all(0 <= p < lay.buffer_rows for p in at[:n].tolist())
            sends.append(send)
            places.append(at)
        backs = [torch.full((lay.buffer_rows, width), float("nan"), device=DEVICE, dtype=dtype) for _ in range(ws)]
        over = 0
        for r in range(ws):
            for s in range(ws):
                if s == r:
                    continue
                for part in lay.parts_at((r - s) % ws):
                    out = torch.full((rows, width), float("nan"), device=DEVICE, dtype=dtype)
                    start, cap = lay.region((r - s) % ws, part)
                    out[:cap] = sends[s][start:start + cap]
                    segs = lay.rest(lay.rests(dev_table), r, s, part)
                    copy_rows_by_table(segs, sends, out, push=False)
                    want = rows_of[s][_sent(table, s, r, part)]
                    assert torch.equal(out[:want.shape[0]], want), (trial, r, s, part)
                    assert int(segs[3]) == max(0, want.shape[0] - cap)
                    over += int(segs[3])
                    res = out * 3 + 1
                    backs[s][start:start + cap] = res[:cap]
                    copy_rows_by_table(segs, backs, res, push=True)
        for s in range(ws):
            own = int(table[s, s].sum())
            n = int(table[s].sum())
            assert torch.equal(backs[s][places[s][own:n]], rows_of[s][own:n] * 3 + 1), (trial, s)
            assert backs[s][:own].isnan().all()
        if kind != "random":
            assert (over == 0) == (kind == "even"), over  # the even tables fit, the skewed ones overflow


def test_parts_and_regions(monkeypatch):
    """The rows for the next rank (a destination's last peer) come in ``LAST_PARTS`` ranges of
    the groups (as even as they allow; as many as there are groups, if fewer), the others in one
    part; each region holds its part's even share of the rows and an eighth, after the ``rows``
    of the own rows and overflow, the regions end to end."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(device_all_to_all, "LAST_PARTS", 4)
    lay = RegionLayout(4, 64, 6, cpu)
    assert lay.parts_at(1) == [(0, 1), (1, 3), (3, 4), (4, 6)] and lay.parts_at(2) == lay.parts_at(3) == [None]
    assert RegionLayout(2, 64, 1, cpu).parts_at(1) == [None]
    assert RegionLayout(2, 64, 3, cpu).parts_at(1) == [(0, 1), (1, 2), (2, 3)]
    # 64 rows over 4 ranks of 6 groups: a group's share 64 / 24, times 1.125, rounded up
    assert [lay.region(1, p) for p in lay.parts_at(1)] == [(64, 3), (67, 6), (73, 3), (76, 6)]
    assert lay.region(2, None) == (82, 18) and lay.region(3, None) == (100, 18)
    assert lay.buffer_rows == 118
    with pytest.raises(ValueError, match=r"valid: \[\(0, 1\), \(1, 3\), \(3, 4\), \(4, 6\)\]"):
        lay.region(1, None)
    monkeypatch.setattr(device_all_to_all, "LAST_PARTS", 2)
    assert RegionLayout(4, 64, 6, cpu).parts_at(1) == [(0, 3), (3, 6)]


def test_counts_past_the_buffers_copy_what_fits_and_write_nothing_outside():
    """Positions come from the table as it is; of a part's overflow rows only those inside both
    buffers are copied."""
    ws, rows, W = 2, 4, 5
    lay = RegionLayout(ws, rows, 1, DEVICE)  # region of 3 rows (ceil(4 / 2 * 1.125))
    table = torch.tensor([[[1], [9]], [[0], [0]]], dtype=torch.int32, device=DEVICE)  # 9 rows for rank 1
    segs = lay.rest(lay.rests(table), 1, 0, None)
    assert segs.view(-1).tolist() == [0, 1, 3, 6]  # from row 1 (after the own row), to row 3, 6 rows
    sends = [torch.arange(lay.buffer_rows * W, dtype=torch.float32, device=DEVICE).view(-1, W) + 100 * s
             for s in range(ws)]
    guarded = torch.full((3 + 6 + 3, W), -1.0, device=DEVICE)  # 6 pulled rows between guard rows
    out = guarded[3:9]
    copy_rows_by_table(segs, sends, out, push=False)
    # rows [1, 7) of source 0 into rows [3, 9) of out: rows 1, 2, 3 of out... only out rows 3, 4, 5 exist
    assert torch.equal(out[3:6], sends[0][1:4])
    assert (out[:3] == -1).all() and (guarded[:3] == -1).all() and (guarded[9:] == -1).all()


def _defined_places(lay, keys, ws, groups):
    """Each assignment's place from the layout's definition (module docstring), walking the kept
    rows in send order (by key, then assignment): the own rows from row 0, each part's first
    ``cap`` rows in its region, every part's rows past it after the own rows, in send order."""
    n, E = len(keys), ws * groups
    in_order = sorted((a for a in range(n) if keys[a] < E), key=lambda a: (keys[a], a))
    own = [a for a in in_order if keys[a] < groups]
    want = [-1] * n
    for i, a in enumerate(own):
        want[a] = i
    after = len(own)
    for j in range(1, ws):
        for part in lay.parts_at(j):
            lo, hi = (0, groups) if part is None else part
            start, cap = lay.region(j, part)
            for i, a in enumerate(x for x in in_order if j * groups + lo <= keys[x] < j * groups + hi):
                if i < cap:
                    want[a] = start + i
                else:
                    want[a], after = after, after + 1
    return want


@pytest.mark.parametrize("ws,groups,tokens,top_k,width,dtype,key_dtype", [
    (2, 4, 9, 3, 5, torch.float32, torch.int16), (3, 2, 20, 2, 1100, torch.bfloat16, torch.int64),
    (4, 1, 7, 1, 16, torch.float16, torch.int32), (2, 64, 40, 8, 24, torch.float32, torch.int16),
    (4, 3, 0, 2, 8, torch.float32, torch.int16)])
def test_place_by_key_matches_its_definition(ws, groups, tokens, top_k, width, dtype, key_dtype):
    """``place_by_key`` with the layout's ``key_places``: each kept assignment's row at the place
    the layout's definition gives it, that place in ``pos``, -1 for the dropped ones (keys E and
    above), no other row written; for skewed keys (parts past their regions) and random ones."""
    g = torch.Generator().manual_seed(ws * 10 + groups + tokens)
    E, n = ws * groups, tokens * top_k
    lay = RegionLayout(ws, n + 3, groups, DEVICE)
    for source, skewed in [(0, False), (ws - 1, True), (ws // 2, False)]:
        keys = torch.randint(0, E + 2, (n,), generator=g)
        if skewed:
            keys[torch.rand(n, generator=g) < 0.6] = groups % E  # the next rank's first group
        kept = keys[keys < E]
        counts = torch.zeros(ws, groups, dtype=torch.int32)
        for e in kept.tolist():
            counts[(source + e // groups) % ws, e % groups] += 1
        src = torch.randn(tokens, width, generator=g).to(DEVICE, dtype)
        dst = torch.full((lay.buffer_rows, width), float("nan"), device=DEVICE, dtype=dtype)
        pos = place_by_key(src, keys.to(DEVICE, key_dtype), top_k, lay.key_places(counts.to(DEVICE), source), dst)
        want = _defined_places(lay, keys.tolist(), ws, groups)
        assert pos.tolist() == want, (source, skewed)
        expect = torch.full_like(dst, float("nan"))
        for a, p in enumerate(want):
            if p >= 0:
                expect[p] = src[a // top_k]
        assert torch.equal(dst.nan_to_num(-7), expect.nan_to_num(-7)), (source, skewed)
    with pytest.raises(ValueError, match="valid: rows of one width and dtype, top_k >= 1 keys per src row"):
        place_by_key(torch.zeros(3, 4, device=DEVICE), torch.zeros(5, dtype=torch.int64, device=DEVICE), 2,
                     lay.key_places(counts.to(DEVICE), 0), dst[:, :4])


@pytest.mark.parametrize("ws,groups,split,room", [(2, 4, 2, None), (3, 2, 1, None), (4, 1, 1, None),
                                                   (2, 4, 3, 5), (3, 5, 5, None), (3, 5, 5, 4)])
def test_place_by_key_diverts_the_own_rows(ws, groups, split, room):
    """Diverts ``(0, split, out1)`` and ``(split, groups, out2)`` (the own rows' two halves; one
    divert where ``split`` is every group): each own row in its half's buffer at its defined
    place less the kept own rows of the keys before that half's, every other row at its defined
    place in ``dst``, ``pos`` as without diverts, nothing else written; with ``room`` rows per
    buffer, those past them not written. Bad diverts are ValueErrors saying what is valid."""
    g = torch.Generator().manual_seed(ws * 100 + groups * 10 + split)
    E, tokens, top_k, W = ws * groups, 30, 2, 6
    lay = RegionLayout(ws, tokens * top_k, groups, DEVICE)
    keys = torch.randint(0, E + 1, (tokens * top_k,), generator=g)
    keys[torch.rand(tokens * top_k, generator=g) < 0.3] = 0  # some own rows past a small buffer
    source = 1
    counts = torch.zeros(ws, groups, dtype=torch.int32)
    for e in keys[keys < E].tolist():
        counts[(source + e // groups) % ws, e % groups] += 1
    src = torch.randn(tokens, W, generator=g).to(DEVICE)
    rows = room or tokens * top_k
    dst = torch.full((lay.buffer_rows, W), float("nan"), device=DEVICE)
    outs = [torch.full((rows, W), float("nan"), device=DEVICE) for _ in range(2)]
    spans = [(0, split), (split, groups)] if split < groups else [(0, groups)]
    pos = place_by_key(src, keys.to(DEVICE), top_k, lay.key_places(counts.to(DEVICE), source), dst,
                       [(lo, hi, out) for (lo, hi), out in zip(spans, outs)])
    want = _defined_places(lay, keys.tolist(), ws, groups)
    assert pos.tolist() == want
    expect = [torch.full_like(dst, float("nan"))] + [torch.full_like(o, float("nan")) for o in outs]
    for a, p in enumerate(want):
        if p < 0:
            continue
        half = next((h for h, (lo, hi) in enumerate(spans) if lo <= keys[a] < hi), None)
        if half is None:
            expect[0][p] = src[a // top_k]
            continue
        at = p - int((keys[keys < spans[half][0]]).numel())  # the kept own rows of the keys before the half's
        if at < rows:
            expect[1 + half][at] = src[a // top_k]
    for got, exp in zip([dst] + outs, expect):
        assert torch.equal(got.nan_to_num(-7), exp.nan_to_num(-7))
    assert room is None or not outs[0].isnan().any()  # some rows did not fit: that buffer is full
    places = lay.key_places(counts.to(DEVICE), source)
    for bad in ([(0, 1, outs[0]), (0, 2, outs[1])], [(0, 1, outs[0])] * 3, [(1, 0, outs[0])],
                [(0, 1, outs[0][:, :2].contiguous())], [(0, 1, outs[0][:, ::2])]):
        with pytest.raises(ValueError, match="valid: at most 2 disjoint key ranges"):
            place_by_key(src, keys.to(DEVICE), top_k, places, dst, bad)


def test_own_diverts_split_the_own_keys_in_two():
    """``own_diverts``: the own keys (send-order 0 .. groups-1) before ``split`` to the first
    buffer, the rest to the late one (none where ``split`` is every group); no ``own``, none; a split
    outside 1 .. groups, or a late buffer given or missing against it, a ValueError."""
    a, b = torch.zeros(2, 3), torch.zeros(2, 3)
    assert own_diverts(4, None) == []
    assert [(lo, hi, o is a) for lo, hi, o in own_diverts(4, (4, a, None))] == [(0, 4, True)]
    assert [(lo, hi, o is b) for lo, hi, o in own_diverts(4, (1, a, b))] == [(0, 1, False), (1, 4, True)]
    for bad in ((0, a, b), (5, a, b), (2, a, None), (4, a, b)):
        with pytest.raises(ValueError, match="valid: 0 < split <= 4, a late buffer exactly where split < 4"):
            own_diverts(4, bad)


@settings(max_examples=25, deadline=None)
@given(ws=st.integers(2, 4), groups=st.integers(1, 5), tokens=st.integers(0, 24), top_k=st.integers(1, 4),
       skew=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_place_by_key_property(ws, groups, tokens, top_k, skew, seed):
    """Any layout and keys (a share ``skew`` of them on one key, some dropped): every kept
    assignment at its defined place with its row, the dropped at -1."""
    g = torch.Generator().manual_seed(seed)
    E, n = ws * groups, tokens * top_k
    lay = RegionLayout(ws, n + 1, groups, DEVICE)
    source = seed % ws
    keys = torch.randint(0, E + 1, (n,), generator=g)
    keys[torch.rand(n, generator=g) < skew] = seed % E
    counts = torch.zeros(ws, groups, dtype=torch.int32)
    for e in keys[keys < E].tolist():
        counts[(source + e // groups) % ws, e % groups] += 1
    src = torch.randn(tokens, 3, generator=g).to(DEVICE)
    dst = torch.full((lay.buffer_rows, 3), float("nan"), device=DEVICE)
    pos = place_by_key(src, keys.to(DEVICE), top_k, lay.key_places(counts.to(DEVICE), source), dst)
    want = _defined_places(lay, keys.tolist(), ws, groups)
    assert pos.tolist() == want
    kept = [a for a, p in enumerate(want) if p >= 0]
    assert torch.equal(dst[[want[a] for a in kept]], src[[a // top_k for a in kept]])
    assert int(dst.isnan().all(1).sum()) == lay.buffer_rows - len(kept)


def test_bad_arguments_are_value_errors():
    segs = torch.zeros(4, 1, dtype=torch.int64, device=DEVICE)
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

    def __init__(self, ws, rank, bufs=None):
        self.ws, self.rank, self.handle, self.nbytes, self.device = ws, rank, _Handle(), 0, torch.device("cpu")
        self.bufs = {} if bufs is None else bufs  # shared by the ranks' stand-ins: one "group"
        self.pull_stream = self.push_stream = None

    def reserve(self, nbytes):
        if nbytes > self.nbytes:
            if not self.bufs or self.bufs[0].numel() < nbytes:
                self.bufs.update({q: torch.zeros(nbytes, dtype=torch.uint8) for q in range(self.ws)})
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
    assert ex.send.shape == (8, 3) and ex.back is ex.send  # 5 rows, a region of 3; results where their rows were
    assert w.nbytes == 256 + 8 * 3 * 4  # the table (16 bytes, on a 256-byte boundary), then one buffer of rows
    counts = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"valid: \[2, 1\] torch.int32"):
        ex.ready(counts.long())
    with pytest.raises(ValueError, match=r"valid: \[2, 3\] torch.int32"):
        DeviceCountAllToAll(w, 5, 3, torch.float32, groups=3).ready(counts)
    assert ex.layout.largest_region == 3
    with pytest.raises(ValueError, match=r"valid: \[>= 3, 3\] torch.float32 \(the largest region"):
        ex.pull(1, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="valid: a peer rank of the group, 0 .. 1 but 0"):
        ex.pull(2, torch.zeros(5, 3))
    with pytest.raises(ValueError, match="valid: a peer rank of the group"):
        ex.pull_rest(0, torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"push: results \(5, 3\) torch.float64; valid"):
        ex.push(1, torch.zeros(5, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"valid: \[None\]"):
        ex.push(1, torch.zeros(5, 3), (0, 1))
    w.reserve(w.nbytes + 1)  # another exchange grew the workspace
    with pytest.raises(RuntimeError, match="make a new one"):
        ex.ready(counts)


def test_exchange_over_one_process_workspace_equals_the_all_to_all(last_parts):
    """``DeviceCountAllToAll`` of every rank over one shared stand-in buffer (3 ranks, 4 groups,
    counts past some regions): places, ``ready``, then each rank pulls every peer's parts and
    pushes 3 x + 1 back; each rank's ``back`` holds 3 x + 1 at its peer rows' places and its own
    rows, untouched, at theirs, nothing else written ([Note: results where their rows were]), and
    ``own_rows`` gives its own rows of the last groups from row 0."""
    ws, G, rows, W = 3, 4, 24, 6
    bufs = {}
    exs = [DeviceCountAllToAll(_Workspace(ws, r, bufs), rows, W, torch.float32, groups=G) for r in range(ws)]
    g = torch.Generator().manual_seed(3)
    table = _table(ws, rows, G, g, "random")
    rows_of, places = [], []  # each rank's rows and their places in send order
    for r, ex in enumerate(exs):
        ex.send.fill_(float("nan"))
        keys, src = _keys(table, r, rows, g), torch.randn(rows, W, generator=g)
        in_order = torch.sort(keys, stable=True).indices
        rows_of.append(src[in_order])
        places.append(ex.place(src, keys, 1, table[r])[in_order])
    for r, ex in enumerate(exs):
        ex.ready(table[r])
    over = 0
    for r, ex in enumerate(exs):
        assert torch.equal(ex.recv_counts, table[:, r])
        for s in range(ws):
            for part in ex.parts(s) if s != r else []:
                out = ex.pull_rest(s, ex.pull(s, torch.full((rows, W), float("nan")), part), part)
                want = rows_of[s][_sent(table, s, r, part)]
                assert torch.equal(out[:want.shape[0]], want), (r, s, part)
                over += int(ex._rest(s, part)[3])
                ex.push(s, out * 3 + 1, part)
                ex.push_rest(s, out * 3 + 1, part)
    assert over > 0  # some parts came past their regions
    for r, ex in enumerate(exs):  # the own rows of the groups from 2 on, from row 0
        got = ex.own_rows(2, torch.full((rows, W), float("nan")))
        own_from = int(table[r, r, :2].sum())
        want = rows_of[r][own_from:int(table[r, r].sum())]
        assert torch.equal(got[:want.shape[0]], want) and got[want.shape[0]:].isnan().all(), r
    with pytest.raises(ValueError, match="valid: a group 1 .. 3"):
        exs[0].own_rows(0, torch.zeros(rows, W))
    for r, ex in enumerate(exs):
        own, n = int(table[r, r].sum()), int(table[r].sum())
        back = ex.finish()
        assert torch.equal(back[places[r][own:n]], rows_of[r][own:n] * 3 + 1), r
        assert torch.equal(back[places[r][:own]], rows_of[r][:own]), r
        placed = torch.zeros(back.shape[0], dtype=torch.bool)
        placed[places[r][:n]] = True
        assert back[~placed].isnan().all(), r


@settings(max_examples=25, deadline=None)
@given(E=st.integers(1, 70), tokens=st.integers(0, 40), top_k=st.integers(1, 4), skew=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**16), key_dtype=st.sampled_from([torch.int16, torch.int64]))
def test_place_in_key_order_property(E, tokens, top_k, skew, seed, key_dtype):
    """``place_in_key_order`` (the eager MoE's send rows): each kept assignment's place is its
    index in the stable order of the kept assignments by key (the earlier keys' rows, then the
    earlier assignments of its own key), its row there, the dropped (keys E and above) at -1 and
    nothing else written; more keys than a kernel block, so blocks' counts carry over."""
    from overlap_layers.kernels.send_rows import place_in_key_order
    g = torch.Generator().manual_seed(seed)
    n = tokens * top_k
    keys = torch.randint(0, E + 2, (n,), generator=g)
    keys[torch.rand(n, generator=g) < skew] = seed % E
    in_order = sorted((a for a in range(n) if keys[a] < E), key=lambda a: (int(keys[a]), a))
    want = [-1] * n
    for i, a in enumerate(in_order):
        want[a] = i
    src = torch.randn(tokens, 5, generator=g).to(DEVICE)
    dst = torch.full((n + 2, 5), float("nan"), device=DEVICE)
    pos = place_in_key_order(src, keys.to(DEVICE, key_dtype), top_k, E, dst)
    assert pos.tolist() == want
    assert torch.equal(dst[:len(in_order)], src[[a // top_k for a in in_order]])
    assert dst[len(in_order):].isnan().all()
    with pytest.raises(ValueError, match="E >= 1 keys"):
        place_in_key_order(src, keys.to(DEVICE), top_k, 0, dst)
