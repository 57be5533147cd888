"""Measured timelines (OpRecorder through execute) in the simulator's format, and plot_timeline."""
import json
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from overlap_layers.plot import plot_timeline
from overlap_layers.runtime.executor import execute
from overlap_layers.planning.trace import OpRecorder
from overlap_layers.schedule import TileProgram, comm, compute, round_robin, wait
from overlap_layers.sim import Costs, Event, simulate
from overlap_layers.sim.simulator import timeline_from_events

from programs import mlp_like

BUCKETS = {"ag": ((0, 1), (2,))}


def tiny_program(w):
    """prep -> all_gather -> mm -> reduce_scatter, on real tensors."""
    def prep(env):
        env["x2"] = env["x"] * 2

    def mm(env):
        env["y"] = env["xg"] @ w

    return TileProgram("tiny", (compute("prep", prep), comm("ag", "all_gather", src="x2"),
                                wait("ag", dst="xg"), compute("mm", mm),
                                comm("rs", "reduce_scatter", src="y"), wait("rs", dst="out")))


def tiny_schedule(w=None):
    return round_robin(tiny_program(w), 3, buckets=BUCKETS)


def run_tiny(rank, ws):
    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=torch.float64)
    xs = [torch.randn(2, 8, dtype=torch.float64) + rank for _ in range(3)]
    sched = tiny_schedule(w)
    outs = []
    for rec in (None, OpRecorder("cpu")):
        envs = [{"x": x} for x in xs]
        execute(sched, envs, dist.group.WORLD, recorder=rec)
        outs.append(torch.cat([e["out"] for e in envs]))
    return torch.equal(outs[0], outs[1]), rec.timeline()


@pytest.fixture(scope="module")
def measured(pool2):
    return pool2.run(run_tiny)


def by_key(tl):
    return {(e.name, e.tile): e for e in tl.events}


def test_one_event_per_launch_and_bucket_tile(measured):
    sched = tiny_schedule()
    sim_keys = Counter((e.name, e.tile, e.stream) for e in simulate(sched, trivial_costs()).events)
    for same, tl in measured:
        assert same  # the recorder does not change the results
        n_launched = sum(1 for ln in sched.launches if ln.bucket != ())
        assert len(tl.events) == n_launched
        assert Counter((e.name, e.tile, e.stream) for e in tl.events) == sim_keys
        comm_events = sorted((e.name, str(e.tile)) for e in tl.events if e.stream == "comm")
        assert comm_events == [("ag", "(0, 1)"), ("ag", "2"), ("rs", "0"), ("rs", "1"), ("rs", "2")]
        assert [e.tile for e in tl.events if e.name in ("prep", "mm")] == [0, 1, 2, 0, 1, 2]
        assert all(e.stream == "compute0" for e in tl.events if e.stream != "comm")


def check_times(tl, host_ordered=True):
    """Invariants of a measured timeline of the tiny schedule (any stream count)."""
    ev = by_key(tl)
    assert all(e.end_ms >= e.start_ms >= 0 for e in tl.events)
    assert min(e.start_ms for e in tl.events) == 0.0
    assert tl.makespan_ms == max(e.end_ms for e in tl.events)
    for s in tl.stream_busy_ms:
        if s == "comm":
            continue
        row = sorted((e for e in tl.events if e.stream == s), key=lambda e: e.start_ms)
        assert row
        for a, b in zip(row, row[1:]):
            assert b.start_ms >= a.end_ms, (a, b)  # one stream (on CPU one thread): no overlap
        assert tl.stream_busy_ms[s] == pytest.approx(sum(e.end_ms - e.start_ms for e in row))
    # A collective starts after its issuing tile's preceding compute op (the bucket is issued
    # by its last member, tile 1) and ends at its first wait, before the consumer computes.
    assert ev[("ag", (0, 1))].start_ms >= ev[("prep", 1)].end_ms
    assert ev[("ag", 2)].start_ms >= ev[("prep", 2)].end_ms
    for t in range(3):
        assert ev[("rs", t)].start_ms >= ev[("mm", t)].end_ms
        assert ev[("wait_rs", t)].start_ms == ev[("wait_rs", t)].end_ms >= ev[("rs", t)].end_ms
        assert ev[("mm", t)].start_ms >= ev[("wait_ag", t)].end_ms
    assert ev[("ag", (0, 1))].end_ms <= ev[("wait_ag", 0)].start_ms <= ev[("mm", 0)].start_ms
    if host_ordered:  # tile 1's wait comes after tile 0's compute: the first wait ended the bucket
        assert ev[("ag", (0, 1))].end_ms < ev[("wait_ag", 1)].start_ms
    assert 0.0 <= tl.exposed_comm_ms <= tl.stream_busy_ms["comm"] <= tl.makespan_ms


def test_measured_times_are_consistent(measured):
    for _, tl in measured:
        check_times(tl)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL and CUDA events; the CPU "
                                                            "timeline runs in the tests above)")
def test_measured_timeline_on_cuda_streams():
    """One NCCL rank, two compute streams: CUDA events give the same rows and order."""
    from overlap_layers.runtime import StreamPool

    if dist.is_initialized():
        pytest.skip("needs a process without a process group (this one already has one)")
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    try:
        w = torch.randn(512, 512, device=dev)
        xs = [torch.randn(256, 512, device=dev) for _ in range(3)]
        sched = tiny_schedule(w)
        streams = StreamPool().get(dev, 2)
        for _ in range(2):  # the second run is the one timed (NCCL and cuBLAS warmed up)
            rec = OpRecorder(dev)
            envs = [{"x": x} for x in xs]
            execute(sched, envs, dist.group.WORLD, streams=streams, recorder=rec)
            tl = rec.timeline()
        want = torch.cat([x * 2 @ w for x in xs])
        assert torch.allclose(torch.cat([e["out"] for e in envs]), want, rtol=1e-4, atol=1e-3)
    finally:
        dist.destroy_process_group()
    predicted = simulate(sched, trivial_costs(num_streams=2))
    assert Counter((e.name, e.tile, e.stream) for e in tl.events) == \
        Counter((e.name, e.tile, e.stream) for e in predicted.events)
    assert list(tl.stream_busy_ms) == list(predicted.stream_busy_ms) == ["compute0", "compute1", "comm"]
    check_times(tl, host_ordered=False)


def trivial_costs(**kw):
    return Costs(compute_ms=lambda t, op: 1.0, comm_ms=lambda t, op: 1.0, **kw)


def test_chrome_trace_matches_simulated_format(measured):
    predicted = simulate(tiny_schedule(), trivial_costs()).to_chrome_trace()
    for _, tl in measured:
        got = json.loads(json.dumps(tl.to_chrome_trace()))
        assert set(got) == set(predicted)
        assert list(tl.stream_busy_ms) == ["compute0", "comm"]

        def threads(tr):
            return [e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M"]

        def shapes(tr):
            return Counter((e["ph"], tuple(sorted(e))) for e in tr["traceEvents"])

        def names(tr):
            return Counter((e["name"], e["cat"]) for e in tr["traceEvents"] if e["ph"] == "X")

        assert threads(got) == threads(predicted)
        assert shapes(got) == shapes(predicted)
        assert names(got) == names(predicted)
        assert ("ag[0,1]", "comm") in names(got)


def test_timeline_from_events_unions_overlapping_comm():
    # comm 0-2 and 1-3 overlap (in flight together): the row is busy 3 ms, not 4;
    # compute 1-2 covers 1 ms of it, so 2 ms are exposed.
    tl = timeline_from_events([Event("ag", 0, "comm", 0.0, 2.0), Event("ag", 1, "comm", 1.0, 3.0),
                               Event("mm", 0, "compute1", 1.0, 2.0), Event("w", 0, "compute0", 2.5, 2.5)])
    assert list(tl.stream_busy_ms) == ["compute0", "compute1", "comm"]
    assert tl.stream_busy_ms == pytest.approx({"compute0": 0.0, "compute1": 1.0, "comm": 3.0})
    assert tl.exposed_comm_ms == pytest.approx(2.0)
    assert tl.makespan_ms == 3.0 and tl.peak_bytes == 0


def test_recorder_cpu_clock_and_unended_op():
    rec = OpRecorder("cpu")
    a = rec.begin("fc1", 0, "compute0", None)
    time.sleep(0.002)
    rec.end(a, None)
    rec.mark("wait_ag", 0, "compute0", None)
    b = rec.begin("ag", (0, 1), "comm", None)
    tl = None
    with pytest.raises(ValueError, match=r"ag\[\(0, 1\)\]"):
        tl = rec.timeline()
    rec.end(b, None)
    tl = rec.timeline()
    fc1, w, ag = tl.events
    assert fc1.start_ms == 0.0 and fc1.end_ms >= 2.0
    assert w.start_ms == w.end_ms >= fc1.end_ms and ag.start_ms >= w.end_ms
    assert ag.tile == (0, 1) and list(tl.stream_busy_ms) == ["compute0", "comm"]


def test_plot_simulated_trace(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib (pip install \"overlap_layers[plot]\")")
    tl = simulate(round_robin(mlp_like(), 3, buckets={"ag": ((0, 1), (2,))}),
                  Costs(compute_ms={"fc1": 1.0, "fc2": 0.5}, comm_ms={"ag": 0.4, "rs": 0.4},
                        num_streams=2))
    trace = tmp_path / "pred.json"
    trace.write_text(json.dumps(tl.to_chrome_trace()))
    png = tmp_path / "pred.png"
    plot_timeline(trace, png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_several_pids_and_overlapping_events(tmp_path, measured):
    pytest.importorskip("matplotlib", reason="needs matplotlib (pip install \"overlap_layers[plot]\")")
    events = []
    for rank, (_, tl) in enumerate(measured):  # two ranks' measured timelines in one file
        for e in tl.to_chrome_trace()["traceEvents"]:
            events.append(dict(e, pid=rank))
    trace = tmp_path / "measured.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    png = tmp_path / "measured.png"
    plot_timeline(str(trace), str(png))
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("text,what", [
    ("{not json", "not JSON"),
    ('{"events": []}', "traceEvents"),
    ('{"traceEvents": [{"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": "soon", "dur": 1}]}', "numeric ts"),
    ('{"traceEvents": [3]}', "not an object"),
    ('{"traceEvents": []}', "neither"),
])
def test_plot_rejects_malformed_trace(tmp_path, text, what):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(ValueError, match=what) as info:
        plot_timeline(bad, tmp_path / "bad.png")
    assert str(bad) in str(info.value) and "to_chrome_trace" in str(info.value)
    assert not (tmp_path / "bad.png").exists()


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    import sys
    trace = tmp_path / "pred.json"
    trace.write_text(json.dumps(simulate(tiny_schedule(), trivial_costs()).to_chrome_trace()))
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import of it raises ImportError
    with pytest.raises(ImportError, match="pip install matplotlib") as info:
        plot_timeline(trace, tmp_path / "pred.png")
    assert isinstance(info.value.__cause__, ImportError)


# ------------------------------------------------------------ the layer's export_trace
def layer_traces(rank, ws, tmp, plan_k, training):
    from overlap_layers import OverlapMLP
    from overlap_layers.layers.mlp.layer import MLPPlan
    layer = OverlapMLP(16, 32, group=dist.group.WORLD)
    layer.pin_plan(MLPPlan(plan_k, buckets_fwd=(("rs", ((0, 1), (2,))),) if plan_k == 3 else ()))
    x = torch.randn(2, 6, 16, requires_grad=training)
    try:
        layer.export_trace(f"{tmp}/none{rank}.json")
        raised = False
    except ValueError:
        raised = True
    with torch.set_grad_enabled(training):
        layer(x).sum().backward() if training else layer(x)
        layer.export_trace(f"{tmp}/pred{rank}.json")
        layer.export_trace(f"{tmp}/meas{rank}.json", measured=True)
        y = layer(x)
        if training:
            y.sum().backward()
    return raised


def _events(path):
    data = json.load(open(path))
    procs = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"}
    return Counter((procs[e["pid"]], e["name"]) for e in data["traceEvents"] if e["ph"] == "X")


@pytest.mark.parametrize("plan_k,training", [(3, True), (2, False)])
def test_layer_export_trace_predicted_and_measured_match(pool2, tmp_path, plan_k, training):
    assert pool2.run(layer_traces, str(tmp_path), plan_k, training) == [True, True]
    for rank in (0, 1):
        pred, meas = _events(tmp_path / f"pred{rank}.json"), _events(tmp_path / f"meas{rank}.json")
        assert pred == meas  # the same ops, one for one, in the same processes
        procs = {p for p, _ in pred}
        assert procs == ({"forward", "backward"} if training else {"forward"})
        assert pred[("forward", "fc1[0]")] == 1 and pred[("forward", f"fc2[{plan_k - 1}]")] == 1
        if plan_k == 3:
            assert pred[("forward", "rs[0,1]")] == 1 and pred[("backward", "ag_dy[2]")] == 1
    pytest.importorskip("matplotlib", reason="needs matplotlib (pip install \"overlap_layers[plot]\")")
    plot_timeline(tmp_path / "meas0.json", tmp_path / "meas0.png")
    assert (tmp_path / "meas0.png").stat().st_size > 1000


def rank_traces(rank, ws, tmp):
    from overlap_layers import OverlapMLP
    from overlap_layers.layers.mlp.layer import MLPPlan
    layer = OverlapMLP(16, 32, group=dist.group.WORLD)
    layer.pin_plan(MLPPlan(1, decomposition="rank"))
    x = torch.randn(2, 6, 16, requires_grad=True)
    layer(x).sum().backward()
    layer.export_trace(f"{tmp}/pred{rank}.json")
    layer.export_trace(f"{tmp}/meas{rank}.json", measured=True)
    layer(x).sum().backward()


def test_rank_chunk_plan_export_trace_predicted_and_measured_match(pool2, tmp_path):
    """The rank-chunk plan's timeline (its cost recurrence) and its measured trace hold the same
    ops: the peer's chunk, its pull and push, the sum, forward and backward, the own rows
    (halves forward, whole backward) and the weight gradients over every row (backward)."""
    pool2.run(rank_traces, str(tmp_path))
    want = Counter({("forward", f"fwd[{tag}]"): 1 for tag in ("own[:h]", "1", "own[h:]")})
    want.update({("backward", f"bwd[{tag}]"): 1 for tag in ("own", "1")})
    want[("backward", "wgrad[all]")] = 1
    want.update({(d, name): 1 for d in ("forward", "backward") for name in ("pull[1]", "push[1]", "sum[0]")})
    for rank in (0, 1):
        assert _events(tmp_path / f"pred{rank}.json") == want
        assert _events(tmp_path / f"meas{rank}.json") == want


def attention_rank_traces(rank, ws, tmp, k):
    from overlap_layers import OverlapAttention
    from overlap_layers.layers.mlp.layer import MLPPlan
    torch.manual_seed(0)
    layer = OverlapAttention(16, 4, 2, group=dist.group.WORLD)
    layer.pin_plan(MLPPlan(k, decomposition="rank"))
    x = torch.randn(2, 6, 16, requires_grad=True)
    layer(x).sum().backward()
    layer.export_trace(f"{tmp}/pred{rank}.json")
    layer.export_trace(f"{tmp}/meas{rank}.json", measured=True)
    layer(x).sum().backward()


@pytest.mark.parametrize("k", [1, 2])
def test_attention_rank_chunk_trace_halves_its_last_push(pool2, tmp_path, k):
    """The attention's rank-chunk timeline and its measured trace hold the same ops, and both
    run the last tile's last peer piece, and its push, in halves ([Note: halved last push]),
    forward and backward; the other tiles' pieces whole."""
    pool2.run(attention_rank_traces, str(tmp_path), k)
    last = "1" if k == 1 else "1.1"
    for rank in (0, 1):
        pred, meas = _events(tmp_path / f"pred{rank}.json"), _events(tmp_path / f"meas{rank}.json")
        assert pred == meas
        for pas, piece in (("forward", "proj"), ("backward", "dgrad_qkv")):
            for half in ("[:h]", "[h:]"):
                assert pred[(pas, f"{piece}[{last}{half}]")] == 1 and pred[(pas, f"push[{last}{half}]")] == 1
            assert pred[(pas, f"push[{last}]")] == 0
            if k == 2:
                assert pred[(pas, "push[0.1]")] == 1 and pred[(pas, f"{piece}[0.1]")] == 1
