"""CallGraphs' bookkeeping ([Note: graph calls]) with stand-in captures: which calls capture,
replay or run eagerly, on one rank and with another rank's capture outcome gathered. The CUDA tier
checks real replays against eager twins (tests/cuda_worker.py check_graph_calls)."""
import pytest
import torch

from overlap_layers.planning import call_graphs
from overlap_layers.runtime import graph_capture
from overlap_layers.planning.call_graphs import CallGraphs


class _Agreement:
    """A group's gather as the other ranks answer it: ``others`` rows after this rank's own."""

    def __init__(self, others=()):
        self.others, self.gathered = list(others), []

    def gather(self, row):
        self.gathered.append(tuple(row))
        return [tuple(row), *self.others]


class _Replay:
    """A captured call standing in for a CUDA graph: counts its replays."""

    def __init__(self, fn, nbytes=100):
        self.fn, self.nbytes, self.replays, self.pending = fn, nbytes, 0, False

    def call(self, inputs, params):
        self.replays += 1
        return self.fn(*inputs)


def _run(graphs, key, inputs, fn, where, params=None):
    """One call as the layer makes it: its agreement's parameter check, then the run."""
    graphs.params_kept(where)
    return graphs.run(key, inputs, fn, params)


@pytest.fixture
def captured(monkeypatch):
    """Every capture succeeds (a :class:`_Replay`), or fails where ``fail`` says; returns the log."""
    log = {"captures": [], "fail": False, "stages": []}

    def capture(inputs, fn, params, owner, stage=None, deferred=()):
        log["stages"].append(stage)
        if log["fail"]:
            return None, "RuntimeError: stand-in"
        graph = _Replay(fn)
        log["captures"].append(graph)
        return graph, ""
    monkeypatch.setattr(CallGraphs, "_capture", staticmethod(capture))
    return log


def test_a_capture_is_given_the_stage(captured):
    """The layer's ``stage`` reaches the capture (asked there, not at every call)."""
    graphs, x = CallGraphs(_Agreement()), torch.ones(2)
    stage = lambda t: None  # noqa: E731
    graphs.params_kept((1,))
    for _ in range(2):
        graphs.run("a", (x,), lambda t: t + 1, None, stage)
    assert captured["stages"] == [stage]


def test_shared_pool_is_one_per_owner_and_device(monkeypatch):
    """[Note: shared no-grad pool]: the layers of one group (one owner) get one pool per device
    while a graph captured into it lives, and a new one once none does (the allocator asserts on
    a capture into a pool whose graphs are all gone); another owner or device gets its own; the
    entry goes with its owner."""
    import gc
    made = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: made.append(len(made)) or (0, len(made)))

    class Owner:
        pass
    a, b = Owner(), Owner()
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    handle = lambda owner, dev: graph_capture.shared_pool(owner, dev).handle  # noqa: E731

    class Graph:
        pass
    graph = Graph()
    graph_capture.shared_pool(a, d0).graphs.add(graph)
    assert handle(a, d0) == handle(a, d0) == (0, 1)
    assert len({handle(a, d1), handle(b, d0), (0, 1)}) == 3 and len(made) == 3
    del graph
    assert handle(a, d0) == (0, 4) and handle(a, d0) == (0, 5), "a pool without live graphs is made anew"
    graph_capture.shared_pool(a, d0).graphs.add(keep := Graph())
    assert handle(a, d0) == handle(a, d0) == (0, 6) and keep is not None
    owners = len(graph_capture._NO_GRAD_POOLS)
    del a
    gc.collect()
    assert len(graph_capture._NO_GRAD_POOLS) == owners - 1 and b in graph_capture._NO_GRAD_POOLS


def test_a_signature_captures_once_then_replays(captured):
    graphs, x = CallGraphs(_Agreement()), torch.ones(2)
    outs = [_run(graphs, "a", (x,), lambda t: t * 2, (1,)) for _ in range(3)]
    assert all(torch.equal(o, x * 2) for o in outs)
    # every call, the capturing one too, went through the graph (the eager path replays nothing)
    assert len(captured["captures"]) == 1 and captured["captures"][0].replays == 3
    assert len(graphs) == 1 and graphs.last_nbytes == 100


def test_lru_keeps_size_signatures(captured):
    graphs = CallGraphs(_Agreement(), size=2)
    for key in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" comes
        _run(graphs, key, (torch.ones(1),), lambda t: t, (1,))
    assert len(graphs) == 2 and len(captured["captures"]) == 3
    _run(graphs, "b", (torch.ones(1),), lambda t: t, (1,))  # evicted: captured again
    assert len(captured["captures"]) == 4


@pytest.mark.parametrize("fails_here", [True, False])
def test_a_failed_capture_anywhere_leaves_the_signature_eager_everywhere(captured, fails_here):
    """This rank's capture fails, or another rank's (its gathered row says 0): the call and every
    later call of the signature run eagerly here, with one warning, and one gather in all."""
    captured["fail"] = fails_here
    agreement = _Agreement(others=[(1,), (int(fails_here),)] if fails_here else [(1,), (0,)])
    graphs = CallGraphs(agreement)
    with pytest.warns(UserWarning, match="capturing a call failed on some rank"):
        y = _run(graphs, "a", (torch.ones(2),), lambda t: t + 1, (1,))
    assert torch.equal(y, torch.full((2,), 2.0))
    y = _run(graphs, "a", (torch.ones(2),), lambda t: t + 2, (1,))
    assert torch.equal(y, torch.full((2,), 3.0)) and len(graphs) == 0 and graphs.last_nbytes == 0
    assert agreement.gathered == [(int(not fails_here),)]
    if not fails_here:
        assert captured["captures"][0].replays == 0  # captured here, but never replayed


def test_a_pending_backward_runs_the_next_forward_eagerly(captured):
    graphs = CallGraphs(_Agreement())
    _run(graphs, "a", (torch.ones(1),), lambda t: t, (1,), params=[])
    graph = captured["captures"][0]
    graph.pending = True  # a replayed forward awaits its backward
    y = _run(graphs, "a", (torch.ones(1),), lambda t: t * 5, (1,), params=[])
    assert torch.equal(y, torch.full((1,), 5.0)) and graph.replays == 1 and graphs.last_nbytes == 0
    graph.pending = False
    _run(graphs, "a", (torch.ones(1),), lambda t: t, (1,), params=[])
    assert graph.replays == 2


def test_params_kept_and_clear(captured):
    graphs = CallGraphs(_Agreement())
    assert graphs.params_kept((7, 8)) == 1  # no graph yet
    _run(graphs, "a", (torch.ones(1),), lambda t: t, (7, 8))
    assert graphs.params_kept((7, 8)) == 1 and graphs.params_kept((7, 9)) == 0
    graphs.clear()
    assert len(graphs) == 0 and graphs.params_kept((7, 9)) == 1


def test_the_static_inputs_copy_what_the_graph_reads():
    """Replays read static copies: a _Graph copies each call's inputs into them (None stays None)
    and returns a copy of its output, which the next replay does not change."""
    static = graph_capture._static([torch.zeros(3), None], grad=False)

    class FakeGraph:
        def replay(self):
            out.copy_(static[0] * 2)
    out = torch.empty(3)
    graph = graph_capture._Graph(FakeGraph(), static, out, 0)
    first = graph.call([torch.arange(3.0), None], ())
    second = graph.call([torch.ones(3), None], ())
    assert torch.equal(first, torch.tensor([0.0, 2.0, 4.0])) and torch.equal(second, torch.full((3,), 2.0))


def test_parameters_moving_every_call_stop_the_captures(captured):
    """Parameters that move at every call (agreed through ``moved``) would recapture every call:
    after MAX_MOVES moves with no replay between them the layer runs eagerly, with a warning; a
    replay between moves (an occasional reload) resets the count."""
    graphs = CallGraphs(_Agreement())
    run = lambda: _run(graphs, "a", (torch.ones(1),), lambda t: t + 1, (1,))  # noqa: E731
    for _ in range(call_graphs.MAX_MOVES - 1):
        run()
        graphs.moved()
    run()
    run()  # a replay: the count starts again
    for _ in range(call_graphs.MAX_MOVES - 1):
        graphs.moved()
        run()
    assert graphs.capturing and len(captured["captures"]) == 2 * call_graphs.MAX_MOVES - 1
    with pytest.warns(UserWarning, match="moved to new memory"):
        graphs.moved()
    assert not graphs.capturing
    assert torch.equal(run(), torch.full((1,), 2.0)) and len(graphs) == 0
    assert len(captured["captures"]) == 2 * call_graphs.MAX_MOVES - 1  # no capture since


class _Linear:
    """Stand-in forward and backward graphs of ``y = x @ w``: their replays compute on the static
    tensors as the captured kernels would."""

    def __init__(self, static_x):
        self.x = static_x
        self.y, self.dy = torch.empty(2, 3), torch.empty(2, 3)
        self.dx, self.dw = torch.empty(2, 4), torch.empty(4, 3)

    def graphs(self, w):
        me = self

        class Fwd:
            def replay(self):
                me.y.copy_(me.x @ w)

        class Bwd:
            def replay(self):
                me.dx.copy_(me.dy @ w.t())
                me.dw.copy_(me.x.t() @ me.dy)
        return Fwd(), Bwd()


def _training_graph(w):
    static = graph_capture._static([torch.zeros(2, 4, requires_grad=True)], grad=True)
    lin = _Linear(static[0])
    fwd, bwd = lin.graphs(w)
    return call_graphs._TrainingGraph(fwd, bwd, static, lin.y, lin.dy, [lin.dx, lin.dw], 0)


def test_a_replayed_training_call_gives_the_eager_gradients():
    """_Replayed wires the stand-in graphs into autograd: the output, x's and w's gradients equal
    those of ``x @ w``; the entry is pending between forward and backward; a second backward
    (``retain_graph``) raises, whose captured backward may have consumed what it read."""
    w = torch.randn(4, 3, requires_grad=True)
    entry = _training_graph(w.detach())
    x, dy = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3)
    y = entry.call([x], [w])
    assert entry.pending and torch.allclose(y, x.detach() @ w.detach())
    y.backward(dy, retain_graph=True)
    assert not entry.pending
    assert torch.allclose(x.grad, dy @ w.detach().t()) and torch.allclose(w.grad, x.detach().t() @ dy)
    with pytest.raises(RuntimeError, match="second backward through a replayed call"):
        y.backward(dy)


def test_a_backward_after_a_later_forward_replay_raises():
    """The saved activations live in the graph: a second backward (retain_graph) through a call
    whose signature replayed another forward since must raise, not return that forward's gradients
    (as every second backward through a replayed call does)."""
    w = torch.randn(4, 3, requires_grad=True)
    entry = _training_graph(w.detach())
    dy = torch.randn(2, 3)
    y1 = entry.call([torch.randn(2, 4, requires_grad=True)], [w])
    y1.backward(dy, retain_graph=True)
    entry.call([torch.randn(2, 4, requires_grad=True)], [w])
    with pytest.raises(RuntimeError, match="or a later forward overwritten them"):
        y1.backward(dy)


def test_deferred_gradients_run_after_each_backward_replay():
    """[Note: deferred gradients]: w's gradient left out of the stand-in backward graph comes from
    the closure, run once per backward replay after it (reading the static tensors the replays
    wrote), into memory of its own: each call's gradients equal those of ``x @ w``."""
    w = torch.randn(4, 3, requires_grad=True)
    static = graph_capture._static([torch.zeros(2, 4, requires_grad=True)], grad=True)
    lin = _Linear(static[0])
    fwd, bwd = lin.graphs(w.detach())
    runs = []

    def compute():  # reads the static output gradient the backward replay was given
        runs.append(1)
        return (static[0].detach().t() @ lin.dy,)
    entry = call_graphs._TrainingGraph(fwd, bwd, static, lin.y, lin.dy, [lin.dx, None], 0, [(compute, [1])])
    grads = []
    for _ in range(2):
        x, dy = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3)
        w.grad = None
        entry.call([x], [w]).backward(dy)
        assert torch.allclose(x.grad, dy @ w.detach().t()) and torch.allclose(w.grad, x.detach().t() @ dy)
        grads.append(w.grad)
    assert len(runs) == 2 and grads[0].data_ptr() != grads[1].data_ptr()


def test_deferred_slots_find_each_placeholder_or_raise():
    """The capture's gradients name where each placeholder came back (those places emptied for the
    closure's results); one that another op took raises instead of leaving its zeros."""
    m1, m2, other = torch.zeros(()).expand(2, 3), torch.zeros(()).expand(3), torch.ones(2)
    compute = object()
    grads = [other, m2, None, m1]
    assert call_graphs._deferred_slots(grads, [(compute, (m1, m2))]) == [(compute, [3, 1])]
    assert grads == [other, None, None, None]
    with pytest.raises(RuntimeError, match="placeholder went through another op"):
        call_graphs._deferred_slots([m1.clone()], [(compute, (m1,))])


def test_defer_hands_out_placeholders_only_inside_a_capture(monkeypatch):
    """Outside a capture of this object's (or on a stream not capturing) ``defer`` gives None and
    the caller computes; inside, broadcast zeros of the gradients' shapes, recorded with the
    closure."""
    graphs, w = CallGraphs(_Agreement()), torch.randn(4, 3)
    compute = lambda: (w,)  # noqa: E731
    assert graphs.defer(compute, (w,)) is None
    graphs._deferring = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert graphs.defer(compute, (w,)) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    (mark,) = graphs.defer(compute, (w,))
    assert mark.shape == w.shape and mark.dtype == w.dtype and mark.stride() == (0, 0) and not mark.any()
    assert graphs._deferring == [(compute, (mark,))]


def test_a_replayed_training_call_is_first_order():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    y = _training_graph(w.detach()).call([x], [w])
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def staged_roles(rank, ws):
    """Per (layer, plan), the roles whose static tensor :meth:`_graph_stage` puts in the
    workspace, and whether that is the exchange's first source's place (offset 0)."""
    import torch.distributed as dist

    from overlap_layers import OverlapAttention, OverlapMLP, OverlapMoE
    from overlap_layers.layers.mlp.layer import MLPPlan
    from test_device_all_to_all import _Workspace  # a stand-in of the symmetric workspace
    g = dist.group.WORLD

    def workspace(nbytes):
        w = _Workspace(ws, rank)
        w.reserve(nbytes)
        return w
    layers = {"mlp": OverlapMLP(16, 32, group=g), "attention": OverlapAttention(16, 2 * ws, group=g),
              "moe": OverlapMoE(16, 8, 2 * ws, 2, group=g)}
    plans = {"ce": MLPPlan(1, decomposition="rank", transport="copy_engine"),
             "ce regather": MLPPlan(1, regather=True, decomposition="rank", transport="copy_engine"),
             "ce K=2": MLPPlan(2, decomposition="rank", transport="copy_engine"),
             "nccl": MLPPlan(1, decomposition="rank"), "batch": MLPPlan(2)}
    out = {}
    for name, layer in layers.items():
        layer._workspace = workspace(1 << 16)
        t = torch.randn(4, 16, dtype=layer._weight.dtype)
        for label, plan in plans.items():
            if name != "attention" and plan.decomposition == "rank" and plan.num_tiles > 1:
                continue  # rank chunks inside batch tiles are the attention's
            got = {role: layer._graph_stage(plan, t, role) for role in ("input", "training_input", "output_grad")}
            out[name, label] = sorted(r for r, p in got.items() if p is not None)
            assert all(p.data_ptr() == layer._workspace.bufs[rank].data_ptr() and p.shape == t.shape
                       for p in got.values() if p is not None)
        layer._workspace = workspace(64)  # smaller than the tensor: nothing staged
        assert layer._graph_stage(plans["ce"], t, "input") is None
    return out


def test_which_static_tensors_live_in_the_exchange_place(pool2):
    """[Note: staged input]: copy-engine rank chunks of the MLP and attention stage a no-grad
    input and a training call's output gradient; a training input only where the backward reads
    the kept own rows (no re-gather; the attention with one tile); NCCL and batch-tile plans and
    the MoE stage nothing."""
    every, grad_only = ["input", "output_grad", "training_input"], ["input", "output_grad"]
    want = {("mlp", "ce"): every, ("mlp", "ce regather"): grad_only, ("attention", "ce"): every, ("attention", "ce regather"): grad_only,
            ("attention", "ce K=2"): grad_only}
    for got in pool2.run(staged_roles):
        for key, roles in got.items():
            assert roles == want.get(key, []), key
