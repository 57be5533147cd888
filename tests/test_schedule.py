"""Tier 1: tile programs, segments, round-robin order and bucketing (no process group)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from overlap_layers import OverlapConfig
from overlap_layers.planning.tiling import effective_num_tiles, tile_bounds
from overlap_layers.schedule import TileProgram, comm, compute, round_robin, segments, wait


from programs import mlp_like, noop as _noop  # noqa: E402


def test_segments_cut_at_waits():
    assert segments(mlp_like()) == ((0,), (1, 2, 3, 4), (5,))
    only_compute = TileProgram("c", (compute("a", _noop), compute("b", _noop)))
    assert segments(only_compute) == ((0, 1),)


def test_round_robin_k2_by_hand():
    order = round_robin(mlp_like(), 2).describe()
    assert order == ("ag[0]", "ag[1]",
                     "wait_ag[0]", "fc1[0]", "fc2[0]", "rs[0]",
                     "wait_ag[1]", "fc1[1]", "fc2[1]", "rs[1]",
                     "wait_rs[0]", "wait_rs[1]")


def test_join_launches_past_a_wait_within_the_round():
    """A wait on a joined handle opens no round: tile 0's ops after its reduce-scatter's wait
    launch before tile 1's reduce-scatter (the fused block's seam)."""
    assert segments(mlp_like(), join=("rs",)) == ((0,), (1, 2, 3, 4, 5))
    order = round_robin(mlp_like(), 2, join=("rs",)).describe()
    assert order == ("ag[0]", "ag[1]",
                     "wait_ag[0]", "fc1[0]", "fc2[0]", "rs[0]", "wait_rs[0]",
                     "wait_ag[1]", "fc1[1]", "fc2[1]", "rs[1]", "wait_rs[1]")
    with pytest.raises(ValueError, match="joined"):
        round_robin(mlp_like(), 2, join=("rs",), buckets={"rs": ((0, 1),)})


def test_cut_gives_an_op_a_round_of_its_own():
    """A compute op named in the program's ``cut`` opens a segment: every tile's ops before it launch
    first (the attention's backward: every tile's dx reduce-scatter before any tile's weight gradients)."""
    ops = (comm("ag", "all_gather", src="dy"), wait("ag", dst="dyg"), compute("dgrad", _noop),
           comm("rs", "reduce_scatter", src="dx"), compute("wgrad", _noop), wait("rs", dst="out"))
    prog = TileProgram("bwd", ops, cut=("wgrad",))
    assert segments(prog) == ((0,), (1, 2, 3), (4,), (5,))
    assert round_robin(prog, 2).describe() == (
        "ag[0]", "ag[1]", "wait_ag[0]", "dgrad[0]", "rs[0]", "wait_ag[1]", "dgrad[1]", "rs[1]",
        "wgrad[0]", "wgrad[1]", "wait_rs[0]", "wait_rs[1]")
    assert round_robin(TileProgram("bwd", ops), 2).describe()[5:9] == ("wgrad[0]", "wait_ag[1]", "dgrad[1]", "rs[1]")


def test_scoped_programs_share_one_environment():
    """Two scoped copies of a program run on one environment without touching each other's keys:
    compute ops see their prefix's keys, comm and wait ops name prefixed handles and keys."""
    from overlap_layers.schedule import Scope, scoped

    def double(env):
        env["y"] = 2 * env.pop("x")
    prog = TileProgram("p", (comm("ag", "all_gather", src="x"), wait("ag", dst="x"), compute("double", double)))
    a, b = scoped(prog, "a."), scoped(prog, "b.")
    assert (a[0].handle, a[0].src, a[1].handle, a[1].dst, a[2].name) == ("a.ag", "a.x", "a.ag", "a.x", "a.double")
    env = {"a.x": 1, "b.x": 10, "other": 0}
    a[2].fn(env)
    b[2].fn(env)
    assert env == {"a.y": 2, "b.y": 20, "other": 0}
    view = Scope(env, "a.")
    assert list(view) == ["y"] and len(view) == 1 and "y" in view and "other" not in view
    TileProgram("both", (*a, *b))  # handles stay distinct


def test_round_robin_k3_custom_order():
    order = round_robin(mlp_like(), 3, order=[2, 0, 1]).describe()
    assert order[:3] == ("ag[2]", "ag[0]", "ag[1]")
    assert order[3:7] == ("wait_ag[2]", "fc1[2]", "fc2[2]", "rs[2]")
    assert order[-3:] == ("wait_rs[2]", "wait_rs[0]", "wait_rs[1]")


def test_bucket_is_issued_at_last_member():
    sched = round_robin(mlp_like(), 3, buckets={"rs": ((0, 1), (2,)), "ag": ((0, 1, 2),)})
    order = sched.describe()
    assert order[:3] == ("-ag[0]", "-ag[1]", "ag[0,1,2]")
    assert order.index("-rs[0]") < order.index("rs[0,1]") < order.index("rs[2]")
    # Every wait still comes after its bucket.
    assert order.index("rs[0,1]") < order.index("wait_rs[0]")
    assert sched.bucket_of("rs", 1) == (0, 1)


@pytest.mark.parametrize("bad", [((0, 2), (1,)), ((0,),), ((1, 0), (2,)), ((0, 1), (1, 2))])
def test_invalid_buckets_raise(bad):
    with pytest.raises(ValueError, match="buckets"):
        round_robin(mlp_like(), 3, buckets={"rs": bad})


def test_unknown_bucket_handle_and_bad_k_raise():
    with pytest.raises(ValueError, match="handle"):
        round_robin(mlp_like(), 2, buckets={"nope": ((0, 1),)})
    with pytest.raises(ValueError, match="num_tiles"):
        round_robin(mlp_like(), 0)
    with pytest.raises(ValueError, match="order"):
        round_robin(mlp_like(), 2, order=[0, 0])


def test_program_checks_handles():
    with pytest.raises(AssertionError):
        TileProgram("bad", (wait("x", dst="y"),))
    with pytest.raises(AssertionError):
        TileProgram("bad", (comm("x", "all_reduce", src="a"),))
    with pytest.raises(ValueError, match="collective"):
        comm("x", "broadcast", src="a")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 9))
def test_tile_bounds_match_tensor_split(n, k):
    rows = torch.arange(n)
    want = [p for p in torch.tensor_split(rows, k) if p.numel()]
    got = [rows[a:b] for a, b in tile_bounds(n, k)]
    assert len(got) == effective_num_tiles(n, k) == min(n, k)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_config_validation():
    assert OverlapConfig().num_tiles == "auto"
    for bad in (dict(num_tiles=0), dict(num_tiles="two"), dict(num_tiles=True), dict(memory_budget=1.5),
                dict(memory_budget=-3), dict(margin=-0.1), dict(transport="mpi"), dict(cuda_graphs=1),
                dict(graph_calls="yes")):
        with pytest.raises(ValueError):
            OverlapConfig(**bad)
    with pytest.raises(Exception):
        OverlapConfig().num_tiles = 2  # frozen
