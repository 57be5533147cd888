"""Tier 2: the collectives behind the handle type, bucket packing, profiler ranges and mesh=."""
import json
import os
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

from overlap_layers import OverlapMLP
from overlap_layers.runtime import all_gather, all_reduce, all_to_all, reduce_scatter
from pool import torchrun


def rank_rows(rank, n, width=3, salt=0):
    return torch.arange(n * width, dtype=torch.float64).view(n, width) + 1000 * rank + 100 * salt


def collectives_case(rank, ws):
    out = {}
    # all_gather of a bucket of two non-adjacent members: each result is rank-major.
    a, b = rank_rows(rank, 2, salt=1), rank_rows(rank, 3, salt=2)
    h = all_gather([a, b], dist.group.WORLD)
    out["ag"] = (h.result(0), h.result(1))
    # reduce_scatter of two members into adjacent views of one output.
    x1, x2 = rank_rows(rank, 2 * ws, salt=3), rank_rows(rank, ws, salt=4)
    dst = torch.zeros(3, 3, dtype=torch.float64)
    h = reduce_scatter([x1, x2], [dst[:2], dst[2:]], dist.group.WORLD)
    out["rs"] = (h.result(0).clone(), h.result(1).clone(), dst.clone())
    # all_reduce of members that are not back to back (packed path) is still in place.
    p, q = rank_rows(rank, 2, salt=5), rank_rows(rank, 1, salt=6)
    h = all_reduce([p, q], dist.group.WORLD)
    h.result(0), h.result(1)
    out["ar"] = (p, q)
    # all_to_all with uneven splits, including zero rows to some ranks.
    in_splits = [(rank + j) % 3 for j in range(ws)]
    out_splits = [(j + rank) % 3 for j in range(ws)]
    x = rank_rows(rank, sum(in_splits), salt=7)
    out["a2a"] = all_to_all(x, in_splits, out_splits, dist.group.WORLD).result(0)
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_collectives_against_hand_reference(pools, ws):
    results = pools(ws).run(collectives_case)
    for rank, res in enumerate(results):
        ag0, ag1 = res["ag"]
        assert torch.equal(ag0, torch.cat([rank_rows(r, 2, salt=1) for r in range(ws)]))
        assert torch.equal(ag1, torch.cat([rank_rows(r, 3, salt=2) for r in range(ws)]))
        rs0, rs1, dst = res["rs"]
        want0 = sum(rank_rows(r, 2 * ws, salt=3) for r in range(ws))[2 * rank:2 * rank + 2]
        want1 = sum(rank_rows(r, ws, salt=4) for r in range(ws))[rank:rank + 1]
        assert torch.equal(rs0, want0) and torch.equal(rs1, want1)
        assert torch.equal(dst, torch.cat([want0, want1]))
        p, q = res["ar"]
        assert torch.equal(p, sum(rank_rows(r, 2, salt=5) for r in range(ws)))
        assert torch.equal(q, sum(rank_rows(r, 1, salt=6) for r in range(ws)))
        # Rank j sends rows [sum(in_splits_j[:rank]) ...] of its x to this rank.
        pieces = []
        for j in range(ws):
            splits_j = [(j + d) % 3 for d in range(ws)]
            start = sum(splits_j[:rank])
            pieces.append(rank_rows(j, sum(splits_j), salt=7)[start:start + splits_j[rank]])
        assert torch.equal(res["a2a"], torch.cat(pieces))


def bad_a2a(rank, ws):
    all_to_all(torch.zeros(3, 2), [1, 1], [3] * ws + [0], dist.group.WORLD)


def test_all_to_all_bad_splits_raise(pool2):
    from pool import RankFailure
    with pytest.raises(RankFailure) as info:
        pool2.run(bad_a2a)
    assert all(e and e[0] == "ValueError" for e in info.value.errors())


def profiled(rank, ws):
    layer = OverlapMLP(8, 8, group=dist.group.WORLD, num_tiles=2)
    x = torch.randn(1, 4, 8, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x).sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("overlap::")})


def test_profiler_ranges_name_op_and_tile(pool2):
    names = pool2.run(profiled)[0]
    for want in ("overlap::mlp::ag[0]", "overlap::mlp::ag[1]", "overlap::mlp::fc1[1]", "overlap::mlp::rs[0]",
                 "overlap::mlp_bwd::ag_dy[1]", "overlap::mlp_bwd::wgrad1[0]", "overlap::mlp_bwd::rs_dx[1]"):
        assert want in names, names


def mesh_vs_group(rank, ws, two_d):
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    w_in, w_out, x = torch.randn(16, 8), torch.randn(8, 8), torch.randn(2, 4, 8)
    if two_d:
        mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
        layer = OverlapMLP.from_dense(w_in, w_out, mesh=mesh, axis="tp", num_tiles=2)
        tp = mesh.get_group("tp")
    else:
        mesh = init_device_mesh("cpu", (ws,))
        layer = OverlapMLP.from_dense(w_in, w_out, mesh=mesh, num_tiles=2)
        tp = dist.group.WORLD
    ref = OverlapMLP.from_dense(w_in, w_out, group=tp, num_tiles=1)
    tp_rank, tp_ws = dist.get_rank(tp), dist.get_world_size(tp)
    xl = x.chunk(tp_ws, 1)[tp_rank]
    return layer.world_size, torch.allclose(layer(xl), ref(xl), atol=1e-6)


@pytest.mark.parametrize("ws,two_d", [(2, False), (4, True)])
def test_mesh_matches_group(pools, ws, two_d):
    for size, same in pools(ws).run(mesh_vs_group, two_d):
        assert same and size == (2 if two_d else ws)


def mesh_without_axis(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    OverlapMLP(8, 8, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))


def test_2d_mesh_needs_axis(pool4):
    from pool import RankFailure
    with pytest.raises(RankFailure) as info:
        pool4.run(mesh_without_axis)
    assert all(e and e[0] == "ValueError" and "axis" in e[1] for e in info.value.errors())


def gathered_lifetime(rank, ws):
    """The gathered input dies when the tile's program drops it, not when the executor moves on."""
    import time
    import weakref
    from overlap_layers.runtime import execute
    from overlap_layers.schedule import TileProgram, comm, compute, round_robin, wait
    alive = []

    def use(env):
        xg = env.pop("xg")
        env["ref"] = weakref.ref(xg)
        env["y"] = xg.sum(0, keepdim=True).repeat(ws, 1)

    def check(env):
        # gloo's worker thread may drop its own reference to a finished work a moment later;
        # the executor's reference (the bug this guards) would last until the next collective.
        ref = env.pop("ref")
        for _ in range(200):
            if ref() is None:
                break
            time.sleep(0.005)
        alive.append(ref() is not None)

    prog = TileProgram("t", (comm("ag", "all_gather", src="x"), wait("ag", dst="xg"), compute("use", use),
                             compute("check", check), comm("rs", "reduce_scatter", src="y"), wait("rs", dst="out")))
    envs = [{"x": torch.randn(2, 3)} for _ in range(2)]
    execute(round_robin(prog, 2), envs, dist.group.WORLD)
    return alive


def test_executor_keeps_no_collective_buffer_alive(pool2):
    assert pool2.run(gathered_lifetime) == [[False, False]] * 2


def test_workspaces_are_shared_per_group_object_not_per_group_name(monkeypatch):
    """Group names repeat after ``destroy_process_group`` and a new ``init_process_group``: a
    group of the new world must not find the workspace (the symmetric buffers) of an old group
    that old layers still hold, though both are named "0"."""
    from overlap_layers.runtime import symmetric as exchange

    class Workspace:  # the real one needs CUDA; like it, this holds its group
        def __init__(self, group, device):
            self.group, self.device, self.nbytes = group, device, 0

    class Group:
        group_name = "0"

    monkeypatch.setattr(exchange, "SymmetricWorkspace", Workspace)
    monkeypatch.setattr(exchange, "_WORKSPACES", weakref.WeakValueDictionary())
    old, new = Group(), Group()
    dev = torch.device("cuda", 1)
    held = exchange.shared_workspace(old, dev)
    held.nbytes = 4096
    assert exchange.shared_workspace(old, dev) is held
    fresh = exchange.shared_workspace(new, dev)
    assert fresh is not held and fresh.group is new and fresh.device == dev
    assert (exchange.held_workspace_bytes(old, dev), exchange.held_workspace_bytes(new, dev)) == (4096, 0)
    assert exchange.shared_workspace(old, torch.device("cuda", 0)) is not held  # one per device


def test_workspace_bytes_aligns_each_source_and_counts_every_slot():
    from overlap_layers.runtime.exchange import peers, workspace_bytes
    # one source of 3x5 bf16 = 30 B -> 256 B; 2 slots of 30 B
    assert workspace_bytes(2, [(3, 5)], (3, 5), 2) == 256 + 2 * 30
    # two sources of 8x16 bf16 = 256 B each (already aligned); 4 slots of 256 B
    assert workspace_bytes(4, [(8, 16), (8, 16)], (8, 16), 2) == 2 * 256 + 4 * 256
    # step j receives from rank + j and sends to rank - j: every pair meets at the same step
    ws = 4
    for r in range(ws):
        for j, q, s in peers(r, ws):
            assert (j, r) in {(jj, ss) for jj, _, ss in peers(q, ws)}


def agreement_rows(rank, ws):
    """Gathers through the shared-memory mailbox and through gloo, several calls in a row (both
    parities reused), int and float rows and a row of three rounds."""
    import os
    from overlap_layers.runtime.group import Agreement
    from overlap_layers.runtime.mailbox import WORDS
    fast, slow = Agreement(dist.group.WORLD), Agreement(dist.group.WORLD, shared_memory=False)

    def ints(r, i):
        return tuple(r * 1000 + 10 * i + j for j in range(3 + i))

    def floats(r, i):
        return tuple(r + 0.25 * j - 1e-300 * i for j in range(2 + i))

    def long(r, i):
        return tuple(range(r + i, r + i + 2 * WORDS + 5))

    bad = []
    for i in range(5):
        for row, dtype in ((ints, torch.int64), (floats, torch.float64), (long, torch.int64)):
            want = [row(r, i) for r in range(ws)]
            for a in (fast, slow):
                got = a.gather(row(rank, i), dtype)
                if got != want:
                    bad.append((i, row.__name__, a.mailbox is not None))
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"overlap_layers_agree_{os.getpid()}_")]
    return fast.mailbox is not None, slow.mailbox is None, bad, left


@pytest.mark.parametrize("ws", [2, 4])
def test_agreement_mailbox_gathers_what_gloo_gathers(pools, ws):
    for used, unused, bad, left in pools(ws).run(agreement_rows):
        assert used and unused and bad == [] and left == []


def agreement_stress(rank, ws, calls):
    """Many gathers in a row with ranks drifting apart (random pauses): every row of every call
    must be that call's, so no rank ever reads a slot of another call."""
    import random
    import time
    from overlap_layers.runtime.group import Agreement
    a, rng, bad = Agreement(dist.group.WORLD), random.Random(rank), 0
    for i in range(calls):
        if rng.random() < 0.1:
            time.sleep(rng.random() * 1e-3)
        got = a.gather((i, rank, i * ws + rank))
        bad += got != [(i, r, i * ws + r) for r in range(ws)]
    return a.mailbox is not None, bad


def test_agreement_mailbox_keeps_calls_apart_under_drift(pool4):
    for used, bad in pool4.run(agreement_stress, 400):
        assert used and bad == 0


def uneven_agreement_rows(rank, ws):
    from overlap_layers.runtime.group import Agreement
    a = Agreement(dist.group.WORLD)
    a.gather((1,))
    return a.gather(tuple(range(rank + 1)))


def test_agreement_mailbox_rows_of_different_lengths_raise_on_every_rank(pool2):
    from pool import expect_value_error_on_every_rank
    expect_value_error_on_every_rank(pool2, uneven_agreement_rows, match="rows of different lengths")


def _layers_of_one_group(rank, ws, mismatched):
    """An MLP and an attention layer on WORLD, then on a new group of the same ranks; with
    ``mismatched`` rank 0 calls the MLP while the others call the attention."""
    from overlap_layers import OverlapAttention
    torch.manual_seed(0)
    world = dist.group.WORLD
    mlp, attn = OverlapMLP(16, 8 * ws, group=world), OverlapAttention(16, 2 * ws, ws, group=world, head_dim=4)
    other = dist.new_group(list(range(ws)))
    twin = OverlapMLP(16, 8 * ws, group=other)
    x = torch.randn(2, 4, 16)
    if mismatched:
        return (mlp if rank == 0 else attn)(x)
    first = mlp.planner.agreement
    del mlp
    again = OverlapMLP(16, 8 * ws, group=world)  # made after the first MLP was freed: the same share
    y = attn(again(x))
    return (first is attn.planner.agreement is again.planner.agreement, twin.planner.agreement is not first,
            first.mailbox is not None, tuple(y.shape), tuple(twin(x).shape))


def test_layers_of_a_group_share_one_agreement(pool2):
    assert pool2.run(_layers_of_one_group, False) == [(True, True, True, (2, 4, 16), (2, 4, 16))] * 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (reads thread names from /proc)")
def test_destroying_the_group_frees_it_and_stops_gloo(tmp_path):
    """After ``run_ranks`` destroys the group, the layers' shared Agreement does not hold it:
    the group is freed and gloo's worker threads are gone before interpreter exit (held until
    then, a worker that releases a finished collective's tensors there can abort the process)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = torchrun(2, ["tests/teardown_worker.py", tmp_path], env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                    cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert rows == [dict(rank=r, group_freed=True, gloo_threads=[]) for r in range(2)]


def test_ranks_calling_different_layers_raise_on_every_rank_and_the_group_goes_on(pool2):
    from pool import expect_value_error_on_every_rank
    expect_value_error_on_every_rank(pool2, _layers_of_one_group, True,
                                     match=("rows of different lengths", "differs across ranks"))
    assert pool2.run(_layers_of_one_group, False)[0][3] == (2, 4, 16)


def agreement_one_rank_without_mailbox(rank, ws):
    from overlap_layers.runtime import mailbox
    from overlap_layers.runtime.group import Agreement
    capable = mailbox._capable
    if rank == ws - 1:
        mailbox._capable = lambda: False
    try:
        a = Agreement(dist.group.WORLD)
        return a.gather((rank, 7)), a.mailbox is None
    finally:
        mailbox._capable = capable


def test_agreement_falls_back_to_gloo_on_every_rank_if_one_cannot_map(pool4):
    for rows, gloo in pool4.run(agreement_one_rank_without_mailbox):
        assert rows == [(r, 7) for r in range(4)] and gloo


def _lone_mailbox(pids, timeout_s):
    import mmap
    from overlap_layers.runtime.mailbox import HostMailbox, WORDS
    return HostMailbox(mmap.mmap(-1, 2 * 2 * (WORDS + 2) * 8), 2, 0, pids, timeout_s)


def test_mailbox_wait_raises_when_the_awaited_rank_exited():
    import subprocess
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(RuntimeError, match=f"pid {gone.pid}\\) exited"):
        _lone_mailbox([os.getpid(), gone.pid], 60.0).gather([1])


def test_mailbox_wait_times_out():
    import os
    with pytest.raises(RuntimeError, match="did not arrive within"):
        _lone_mailbox([os.getpid(), os.getpid()], 0.5).gather([1])


# ------------------------------------------------------------------ the rank all-to-all (send/recv)
def _a2a_table(ws, seed):
    """counts[s][d]: rows rank s sends to d, zeros included (the same table on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (ws, ws), generator=g).tolist()


def _a2a_row(s, d, i, width=3):
    """Row i of those rank s sends to rank d: it names its source, destination and index."""
    return torch.tensor([1000.0 * s + 100.0 * d + i] * width, dtype=torch.float64)


def rank_all_to_all_case(rank, ws, seed):
    """Every step's pull, then each pulled row pushed back times 2 plus its destination;
    returns what the exchange gave."""
    from overlap_layers.runtime.rank_all_to_all import PointToPointAllToAll
    counts = _a2a_table(ws, seed)
    rows = sum(counts[rank]) + 2  # made for more rows than sent: the last ones are not sent
    ex = PointToPointAllToAll(dist.group.WORLD, rows, 3, torch.float64, "cpu")
    steps = [(rank + j) % ws for j in range(ws)]  # the send rows in step order: own first
    sent = [_a2a_row(rank, d, i) for d in steps for i in range(counts[rank][d])]
    ex.send.copy_(torch.stack(sent + [torch.full((3,), -1.0, dtype=torch.float64)] * 2))
    ex.start(counts)
    own = ex.own().clone()
    pulled = {}
    for j in range(1, ws):
        pulled[j] = ex.pull(j).clone()
        ex.push(j, pulled[j] * 2 + rank)
    return dict(own=own, pulled=pulled, back=ex.finish().clone())


@pytest.mark.parametrize("ws,seed", [(2, 0), (4, 1), (4, 2)])
def test_rank_all_to_all_against_hand_reference(pools, ws, seed):
    """PointToPointAllToAll (the send/recv transport of layers/moe/ranks.py): pull(j) holds the rows
    rank r+j sent to r, in its order, and finish() each destination's results for r's rows, in
    send order after the own rows (step order: own rows first, then r+1, r+2, ...), from the table
    alone."""
    counts = _a2a_table(ws, seed)
    results = pools(ws).run(rank_all_to_all_case, seed)

    def rows(s, d):
        return [_a2a_row(s, d, i) for i in range(counts[s][d])]

    def stack(rs):
        return torch.stack(rs) if rs else torch.empty(0, 3, dtype=torch.float64)

    for r, res in enumerate(results):
        assert torch.equal(res["own"], stack(rows(r, r)))
        for j, got in res["pulled"].items():
            assert torch.equal(got, stack(rows((r + j) % ws, r))), (r, j)
        want = [row * 2 + d for d in [(r + j) % ws for j in range(1, ws)] for row in rows(r, d)]
        assert torch.equal(res["back"][counts[r][r]:], stack(want)), r  # the own rows' range: unspecified


def rank_all_to_all_out_of_order(rank, ws):
    from overlap_layers.runtime.rank_all_to_all import PointToPointAllToAll
    ex = PointToPointAllToAll(dist.group.WORLD, 0, 3, torch.float64, "cpu")
    ex.start([[0] * ws for _ in range(ws)])
    ex.pull(1), ex.pull(2)
    ex.push(2, torch.empty(0, 3, dtype=torch.float64))


def test_rank_all_to_all_pushes_must_go_in_step_order(pool4):
    """A push out of step order would pair one rank's sends with another step's receives: it
    fails on the rank that issues it (an assertion, before any transfer)."""
    from pool import RankFailure
    with pytest.raises(RankFailure) as info:
        pool4.run(rank_all_to_all_out_of_order, timeout=60)
    assert all(e is not None and e[0] == "AssertionError" for e in info.value.errors())


class _FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass

    def wait_event(self, ev):
        pass

    def __repr__(self):
        return self.name


class _FakeEvent:
    def record(self, stream=None):
        pass


def _fake_cuda(monkeypatch):
    """torch.cuda's stream calls on the CPU: a current stream that ``set_stream`` changes, and the
    log of every ``set_stream``."""
    state = {"current": _FakeStream("main"), "sets": []}
    main = state["current"]

    def set_stream(s):
        state["sets"].append(s.name)
        state["current"] = s
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: state["current"])
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return state, main


def test_executor_sets_each_ops_stream_only_when_it_changes(monkeypatch):
    """[Note: executor streams] on a fake torch.cuda: every op runs with its tile's stream
    current; ``set_stream`` only where the stream changes (the round-robin alternates tiles, a
    tile's consecutive ops share one); the caller's stream current again at the end, and after an
    op that raised."""
    from overlap_layers.runtime.executor import execute
    from overlap_layers.schedule import TileProgram, compute, round_robin
    state, main = _fake_cuda(monkeypatch)
    seen = []

    def op(name):
        def fn(env):
            seen.append((env["tile"], name, state["current"].name))
        return fn
    prog = TileProgram("t", (compute("a", op("a")), compute("b", op("b"))))
    sched = round_robin(prog, 3)
    streams = [_FakeStream("s0"), _FakeStream("s1")]
    execute(sched, [{"tile": t} for t in range(3)], None, streams=streams)
    assert len(seen) == 6 and all(cur == f"s{t % 2}" for t, _, cur in seen)
    changes, last = [], "main"  # the stream of each op whose stream differs from the op before
    for _, _, cur in seen:
        if cur != last:
            changes.append(cur)
            last = cur
    assert state["sets"] == changes + ["main"] and len(changes) < len(seen)  # some neighbours share one
    assert state["current"] is main

    def boom(env):
        raise RuntimeError("boom")
    state["sets"].clear()
    with pytest.raises(RuntimeError, match="boom"):
        execute(round_robin(TileProgram("t", (compute("a", op("a")), compute("boom", boom))), 2),
                [{"tile": t} for t in range(2)], None, streams=streams)
    assert state["current"] is main and state["sets"][-1] == "main"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA streams and the caching allocator)")
def test_a_bucket_member_is_not_reused_before_the_issuing_stream_packed_it():
    """A bucketed collective packs its members on the issuing stream, while each member was made
    on its tile's stream and is dropped by the executor right after the issue: the member's memory
    must not go to its own stream's next tensor before the packing copy ran (a race that gives a
    wrong first tile). The issuing stream is held busy; a tensor of the member's size made
    on the member's stream after the drop must get other memory, and the packed rows must be the
    members' rows."""
    from overlap_layers.runtime.collectives import _packed

    dev = torch.device("cuda", 0)
    mine, issuing = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    # the memory may go to c once the packing ran: the check holds only while the issuing stream
    # is still asleep when c is made (a loaded host can take longer than the sleep: sleep longer)
    for cycles in (50_000_000, 400_000_000, 3_200_000_000):
        with torch.cuda.stream(mine):
            a = torch.full((1024, 256), 1.0, device=dev)
            b = torch.full((1024, 256), 2.0, device=dev)
        issuing.wait_stream(mine)
        with torch.cuda.stream(issuing):
            torch.cuda._sleep(cycles)  # keeps the packing copy queued while the members are dropped
            packed = _packed([a, b], [a, b])
        where = a.data_ptr()
        del a
        with torch.cuda.stream(mine):
            c = torch.full((1024, 256), 3.0, device=dev)
        asleep = not issuing.query()
        torch.cuda.synchronize(dev)
        if asleep:
            assert c.data_ptr() != where
            assert torch.equal(packed[:1024], torch.ones(1024, 256, device=dev))
            assert torch.equal(packed[1024:], torch.full((1024, 256), 2.0, device=dev))
            return
        del b, c, packed
    pytest.fail("the issuing stream woke before the next tensor was made at every sleep: the race was never tested")


def test_push_order_halves_only_the_last_push():
    """[Note: halved last push]: with ``split_last`` the last block's last step is pushed as two
    halves split at ``(b - a) // 2``, first half first; any other order, or that push whole, is an
    assertion (it would pair one rank's sends with another push's receives). A last block of one
    row is pushed whole."""
    from overlap_layers.runtime.exchange import PushOrder as _PushOrder
    o = _PushOrder([(0, 4), (4, 9)], 3, split_last=True)
    assert o.halves == ((0, 2), (2, 5))
    assert [o.next(1, 0, None), o.next(2, 0, None), o.next(1, 1, None), o.next(2, 1, 0)] == \
        [(0, 4), (0, 4), (4, 9), (4, 6)]
    assert not o.done
    assert o.next(2, 1, 1) == (6, 9) and o.done
    with pytest.raises(AssertionError):
        o.next(2, 1, 1)
    whole = _PushOrder([(0, 4), (4, 9)], 3, split_last=True)
    for j, i in ((1, 0), (2, 0), (1, 1)):
        whole.next(j, i, None)
    with pytest.raises(AssertionError):
        whole.next(2, 1, None)
    second_first = _PushOrder([(0, 5)], 2, split_last=True)
    with pytest.raises(AssertionError):
        second_first.next(1, 0, 1)
    one_row = _PushOrder([(0, 1)], 2, split_last=True)
    assert one_row.halves is None and one_row.next(1, 0, None) == (0, 1) and one_row.done
    plain = _PushOrder([(0, 5)], 2, split_last=False)
    assert plain.halves is None and plain.next(1, 0, None) == (0, 5) and plain.done


def halved_exchange(rank, ws, blocks, T):
    """A send/recv exchange of two blocks with a halved last push: returns its halves, the
    pulled chunks and ``finish()``."""
    from overlap_layers.runtime.p2p_exchange import PointToPointExchange
    H = 3

    def partial(src, dst):  # rank src's partial for rank dst's rows
        return torch.arange(T * H, dtype=torch.float64).view(T, H) * (src + 1) + 100 * dst

    x = torch.arange(T * H, dtype=torch.float64).view(T, H) + 1000 * rank
    ex = PointToPointExchange(dist.group.WORLD, [x], (T, H), blocks=blocks, split_last=True)
    ex.own_partial.copy_(partial(rank, rank))
    pulled = {}
    for i, (a, b) in enumerate(blocks):
        for j in range(1, ws):
            q = (rank + j) % ws
            pulled[j, i] = ex.pull(j, i)[0].clone()
            p = partial(rank, q)[a:b]
            if ex.halves is not None and (j, i) == (ws - 1, len(blocks) - 1):
                for h, (lo, hi) in enumerate(ex.halves):
                    ex.push(j, p[lo:hi], i, h)
            else:
                ex.push(j, p, i)
    return ex.halves, pulled, ex.finish(), sum(partial(s, rank) for s in range(ws))


def test_send_recv_exchange_with_a_halved_last_push_equals_the_reduce_scatter(pool4):
    """Blocks ``[0, 2)`` and ``[2, 7)``: the last push in halves of 2 and 3 rows; every rank's
    ``finish()`` is the sum of every rank's partial for its rows, and the pulls are the peers'
    sources."""
    T, H = 7, 3
    res = pool4.run(halved_exchange, [(0, 2), (2, 7)], T)
    for r, (halves, pulled, got, want) in enumerate(res):
        assert halves == ((0, 2), (2, 5))
        assert torch.equal(got, want), r
        for (j, i), chunk in pulled.items():
            a, b = [(0, 2), (2, 7)][i]
            q = (r + j) % 4
            assert torch.equal(chunk, (torch.arange(T * H, dtype=torch.float64).view(T, H) + 1000 * q)[a:b])
