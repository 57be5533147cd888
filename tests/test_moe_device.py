"""Tier 2: the MoE's device path ([Note: MoE graph calls] in ``layers/moe/device.py``) on 2 and 4
gloo ranks against the independent dense reference ``tests/moe_reference.py``.

On the CPU there is no symmetric memory, so the layer's exchange is replaced by a stand-in with
``DeviceCountAllToAll``'s interface built from all-gathers (its rows moved by
``copy_rows_by_table``, which ``test_device_all_to_all.py`` checks against its definition), in
which every row the exchange does not write is NaN: a row read past the received ones, a result
pushed to the wrong place, or a dropped assignment not masked shows as NaN in y. The exchange
itself, the grouped GEMMs on CUDA and the captured replays are checked on GPUs
(``tests/cuda_worker.py`` check_moe_graph_calls)."""
import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from test_moe import build_from_dense, check, make_case, reference, rel_err, rounded

from overlap_layers import OverlapConfig, OverlapMoE
from overlap_layers.layers.moe.experts import grouped_gemm_ok
from overlap_layers.layers.moe.device_path import SLOT_STEPS, slot_rows
from overlap_layers.layers.moe.ranks import rows_bound
from overlap_layers.runtime import device_all_to_all
from overlap_layers.runtime.device_all_to_all import RegionLayout, copy_rows_by_table, own_diverts
from overlap_layers.kernels.send_rows import place_by_key

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm (absent from this torch)")


class GatheredExchange:
    """``DeviceCountAllToAll``'s interface over all-gathers (no side streams), on its layout
    (``RegionLayout``): ``ready`` gathers every rank's counts and send buffer, ``pull`` and
    ``pull_rest`` (and ``own_rows``) copy from them, and each ``push`` or ``push_rest`` (every rank pushes alike: to
    the source ``j`` ranks on, the same part) gathers every rank's results and keeps those for
    this rank's rows. ``back`` is ``send``, as in the exchange ([Note: results where their rows
    were]); ``place`` sets all of it to NaN before it places, and ``ready`` every row but the own
    rows (peers may overwrite them from then on), so a read there of a row ``place`` did not put
    (own rows it put elsewhere, an earlier call's) or of a peer row's input after ``ready`` shows;
    ``finish`` checks that every peer's parts were pushed once by each kind of push."""

    def __init__(self, rows, width, dtype, groups):
        self.ws, self.rank, self.rows, self.groups = dist.get_world_size(), dist.get_rank(), rows, groups
        self.layout = RegionLayout(self.ws, rows, groups, torch.device("cpu"))
        self.send = self.back = torch.full((self.layout.buffer_rows, width), float("nan"), dtype=dtype)
        self.calls = 0

    def _gather(self, t):
        out = [torch.empty_like(t) for _ in range(self.ws)]
        dist.all_gather(out, t.contiguous())
        return out

    def place(self, src, keys, top_k, counts, own=None):
        self.send.fill_(float("nan"))  # nothing of an earlier call stays readable here
        return place_by_key(src, keys, top_k, self.layout.key_places(counts, self.rank), self.send,
                            own_diverts(self.groups, own))

    def parts(self, source):
        return self.layout.parts_at((self.rank - source) % self.ws)

    def ready(self, counts):
        assert counts.dtype == torch.int32 and counts.shape == (self.ws, self.groups)
        self.table = torch.stack(self._gather(counts))  # [source, destination, group]
        self.sends = self._gather(self.send)
        self.send[int(counts[self.rank].sum()):].fill_(float("nan"))
        self.pushed, self.calls = [], self.calls + 1

    @property
    def recv_counts(self):
        return self.table[:, self.rank]

    def pull(self, source, out, part=None):
        out.fill_(float("nan"))
        start, cap = self.layout.region((self.rank - source) % self.ws, part)
        out[:cap] = self.sends[source][start:start + cap]
        return out

    def own_rows(self, first, out):
        out.fill_(float("nan"))
        copy_rows_by_table(self.layout.own_tail(self.table[self.rank], self.rank, first), self.sends, out, push=False)
        return out

    def pull_rest(self, source, out, part=None):
        copy_rows_by_table(self.layout.rest(self.layout.rests(self.table), self.rank, source, part), self.sends, out,
                           push=False)
        return out

    def _push(self, source, results, part, rest):
        j = (source - self.rank) % self.ws
        assert j != 0  # the own results stay where they are
        scratch = torch.empty_like(self.back)
        for d, res in enumerate(self._gather(results)):  # d pushed its results for rank d + j
            if (d + j) % self.ws == self.rank:
                if rest:
                    remotes = [self.back if s == self.rank else scratch for s in range(self.ws)]
                    copy_rows_by_table(self.layout.rest(self.layout.rests(self.table), d, self.rank, part), remotes,
                                       res, push=True)
                else:
                    start, cap = self.layout.region((d - self.rank) % self.ws, part)
                    self.back[start:start + cap] = res[:cap]
        self.pushed.append((j, part, rest))

    def push(self, source, results, part=None):
        self._push(source, results, part, False)

    def push_rest(self, source, results, part=None):
        self._push(source, results, part, True)

    def finish(self):
        want = [(j, part, rest) for j in range(1, self.ws) for part in self.layout.parts_at(self.ws - j)
                for rest in (False, True)]
        assert sorted(self.pushed, key=repr) == sorted(want, key=repr)
        return self.back


@contextlib.contextmanager
def last_peer_parts(n):
    """The exchange's last peer in ``n`` parts (``device_all_to_all.LAST_PARTS``; None: as it is)
    within the block."""
    kept = device_all_to_all.LAST_PARTS
    device_all_to_all.LAST_PARTS = kept if n is None else n
    try:
        yield
    finally:
        device_all_to_all.LAST_PARTS = kept


def run_device(rank, ws, case, opts, dtype, need=None, parts=None):
    """The layer's device path on this rank's tokens, with the stand-in exchange (``need``: the
    count its slots must hold, None: the bound; the last peer in ``parts`` parts), and the peak
    count the call reported."""
    with last_peer_parts(parts):
        return _run_device(rank, case, opts, dtype, need)


def _run_device(rank, case, opts, dtype, need):
    layer = build_from_dense(case, dtype, opts)
    max_tokens = max(b * s for b, s in case["sizes"])
    made = []

    def exchange(rows, dt, device):
        assert rows == rows_bound(max_tokens, layer.top_k) and dt == dtype
        made.append(GatheredExchange(rows, layer.hidden_size, dt, layer.num_local_experts))
        return made[-1]

    layer._device_path.exchange = exchange
    x = case["xs"][rank].to(dtype)
    slot = None if need is None else layer._device_path.slot(rows_bound(max_tokens, layer.top_k), need)
    with torch.no_grad():
        y = layer._device_path.run(x, max_tokens, slot)
    assert grouped_gemm_ok(x.reshape(-1, x.shape[-1]), layer.w_in, layer.w_out)
    # the layer's slot rows from the exchange's regions as its layout has them
    assert slot is None or slot == slot_rows(made[0].rows, made[0].layout.largest_region, need)
    return dict(y=y, calls=made[0].calls, slot=slot,
                peak=None if layer._device_path.peak is None else int(layer._device_path.peak[0]))


CASES = [  # (ws, E, top_k, shapes, routing, capacity factor, shared ffn, activation)
    (2, 4, 2, "even", "random", None, None, "swiglu"),
    (2, 6, 1, "uneven", "random", None, 4, "gelu"),
    (4, 8, 2, "uneven", "random", None, None, "swiglu"),
    (4, 8, 3, "zero_batch", "random", None, 4, "relu"),
    (4, 4, 1, "zero_seq", "skewed", None, None, "swiglu"),
    (2, 4, 2, "even", "skewed", 0.5, None, "swiglu"),
    (4, 8, 2, "uneven", "random", 0.75, 4, "swiglu"),
    (2, 16, 3, "uneven", "random", None, None, "swiglu"),  # the last peer's 8 groups in one part, or two of 4
    (4, 16, 2, "even", "random", 0.75, None, "swiglu"),
]


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("ws,E,top_k,shapes,routing,cf,Fs,activation", CASES)
def test_device_path_matches_dense_reference(pools, ws, E, top_k, shapes, routing, cf, Fs, activation, parts):
    """y on every rank equals the reference on its tokens (capacity drops and the shared expert
    included), through one exchange per call, the last peer's rows in one part or two; no NaN
    from the stand-in's unwritten rows reaches y."""
    dtype = torch.float32
    case = make_case(17 + ws + E, ws=ws, E=E, top_k=top_k, shapes=shapes, routing=routing, F=8, Fs=Fs,
                     activation=activation)
    opts = dict(activation=activation, capacity_factor=cf)
    results = pools(ws).run(run_device, case, opts, dtype, None, parts)
    ref = reference(rounded(case, dtype), opts)
    for rank, (res, want) in enumerate(zip(results, ref)):
        assert res["calls"] == 1
        assert res["y"].shape == want["y"].shape and res["y"].dtype == dtype
        assert not res["y"].isnan().any(), rank
        if want["y"].numel():
            assert rel_err(res["y"], want["y"]) < 5e-5, (rank, rel_err(res["y"], want["y"]))


def run_device_training(rank, ws, case, opts, dtype, backwards=1, need=None, parts=None, frozen=()):
    """One training call of the layer's device path with the stand-in exchange (slots for
    ``need`` and the last peer's ``parts``, as :func:`run_device`): y, dx and every parameter's
    gradient of sum(y * dy), as ``test_moe.run_layer`` returns them (accumulated over
    ``backwards`` backward passes, all but the last with ``retain_graph``); the parameters
    ``frozen`` require no grad."""
    with last_peer_parts(parts):
        return _run_device_training(rank, case, opts, dtype, backwards, need, frozen)


class _OfferLog:
    """A ``CallGraphs`` outside a capture, as the backward sees it: records the shapes of the
    gradients offered to :meth:`~overlap_layers.planning.call_graphs.CallGraphs.defer` and takes none."""

    def __init__(self):
        self.offered = []

    def defer(self, compute, like):
        self.offered.append([tuple(t.shape) for t in like])
        return None


def _run_device_training(rank, case, opts, dtype, backwards, need, frozen=()):
    layer = build_from_dense(case, dtype, opts)
    for name in frozen:
        getattr(layer, name).requires_grad_(False)
    layer.planner.call_graphs = log = _OfferLog()
    max_tokens = max(b * s for b, s in case["sizes"])
    made = []

    def exchange(rows, dt, device):
        made.append(GatheredExchange(rows, layer.hidden_size, dt, layer.num_local_experts))
        return made[-1]

    layer._device_path.exchange = exchange
    x = case["xs"][rank].to(dtype).requires_grad_()
    y = layer._device_path.run(x, max_tokens,
                          None if need is None else layer._device_path.slot(rows_bound(max_tokens, layer.top_k), need))
    loss = (y * case["dys"][rank].to(dtype)).sum()
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return dict(y=y.detach(), dx=x.grad, dtype=y.dtype, aux=None, calls=made[0].calls,
                nan=any(t.isnan().any().item() for t in (y, x.grad, *(p.grad for p in layer.parameters()))
                        if t is not None),
                grads={n: p.grad for n, p in layer.named_parameters()}, offered=log.offered)


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("ws,E,top_k,shapes,routing,cf,Fs,activation", CASES)
def test_device_path_training_matches_dense_reference(pools, ws, E, top_k, shapes, routing, cf, Fs, activation,
                                                      parts):
    """[Note: MoE training graphs]: y, dx and the gradients of w_in, w_out, the router and the
    shared expert equal the dense reference's, through two exchanges per call (forward and
    backward), the last peer's rows in one part or two; no NaN from the stand-in's unwritten rows
    reaches any of them."""
    dtype = torch.float32
    case = make_case(29 + ws + E, ws=ws, E=E, top_k=top_k, shapes=shapes, routing=routing, F=8, Fs=Fs,
                     activation=activation)
    opts = dict(activation=activation, capacity_factor=cf)
    results = pools(ws).run(run_device_training, case, opts, dtype, 1, None, parts)
    assert [(r["calls"], r["nan"]) for r in results] == [(2, False)] * ws
    check(results, case, opts, dtype)


@pytest.mark.parametrize("frozen", [("w_out",), ("w_in",), ("w_in", "w_out")])
def test_device_path_training_with_frozen_expert_weights(pool2, frozen):
    """Experts' weights that require no grad get none, nor are they offered to be deferred (autograd
    would drop the placeholder, and the capture fail), and every other gradient is what the call
    with all of them trainable gives (checked against the dense reference above)."""
    case = make_case(41, ws=2, E=4, top_k=2, shapes="uneven", routing="random", F=8, activation="swiglu")
    opts = dict(activation="swiglu", capacity_factor=None)
    every = pool2.run(run_device_training, case, opts, torch.float32)
    some = pool2.run(run_device_training, case, opts, torch.float32, 1, None, None, frozen)
    shapes = {"w_in": (4 // 2, 2 * 8, 8), "w_out": (4 // 2, 8, 8)}  # local experts' [El, 2F, H], [El, H, F]
    for a, b in zip(every, some):
        assert a["offered"] == [[shapes["w_in"], shapes["w_out"]]]
        assert b["offered"] == ([[shapes[n] for n in ("w_in", "w_out") if n not in frozen]] if len(frozen) < 2 else [])
        assert torch.equal(a["y"], b["y"]) and torch.equal(a["dx"], b["dx"])
        for name, g in b["grads"].items():
            assert (g is None) if name in frozen else torch.equal(g, a["grads"][name]), name


def test_device_path_second_backward_with_retain_graph_doubles(pool2):
    """[Note: first-order backward]: a second backward through a call after ``retain_graph=True``
    adds the same gradients again (the first left the saved pre-activations as they were)."""
    ws, E, top_k, shapes, routing, cf, Fs, activation = CASES[0]
    case = make_case(29 + ws + E, ws=ws, E=E, top_k=top_k, shapes=shapes, routing=routing, F=8, Fs=Fs,
                     activation=activation)
    opts = dict(activation=activation, capacity_factor=cf)
    once = pool2.run(run_device_training, case, opts, torch.float32)
    twice = pool2.run(run_device_training, case, opts, torch.float32, 2)
    for a, b in zip(once, twice):
        assert torch.allclose(b["dx"], 2 * a["dx"], rtol=1e-5, atol=1e-6)
        for name, g in a["grads"].items():
            assert torch.allclose(b["grads"][name], 2 * g, rtol=1e-5, atol=1e-6), name


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 1 << 22), data=st.data())
def test_slot_rows_hold_the_peak_and_its_headroom_within_the_bound(rows, data):
    """[Note: MoE slot rows]: at least the largest region and the peak with 1/8 more, at most the
    bound, and less than one step above what they need."""
    least, peak = data.draw(st.integers(0, rows)), data.draw(st.integers(0, 2 * rows))
    s = slot_rows(rows, least, peak)
    step = max(1, rows // SLOT_STEPS)
    assert least <= s <= rows
    assert s >= min(rows, peak + peak // 8)
    assert s == least or s == rows or (s % step == 0 and s < peak + peak // 8 + step)


def test_slot_rows_bad_arguments_are_value_errors():
    for args in ((8, 9, 0), (8, -1, 0), (8, 4, -1)):
        with pytest.raises(ValueError, match="valid: 0 <= least <= rows, peak >= 0"):
            slot_rows(*args)


def rows_between_ranks(case, ws):
    """``[source, destination]``: the rows each rank sends each rank (every token's top_k experts,
    no capacity), from the case's router in float64."""
    E = case["router_weight"].shape[0]
    out = torch.zeros(ws, ws, dtype=torch.int64)
    for s, x in enumerate(case["xs"]):
        top = (x.reshape(-1, x.shape[-1]) @ case["router_weight"].t()).topk(case["top_k"], -1).indices
        out[s] = torch.bincount((top // (E // ws)).flatten(), minlength=ws)
    return out


@pytest.mark.parametrize("ws,E,top_k,shapes,routing", [(4, 8, 2, "uneven", "skewed"), (2, 4, 3, "even", "skewed"),
                                                      (4, 8, 2, "even", "random")])
def test_slots_for_the_peak_give_the_reference_and_smaller_ones_report_it(pools, ws, E, top_k, shapes, routing):
    """[Note: MoE slot rows]: with the fewest slot rows (the exchange's largest region) every rank
    reports the largest count of rows one rank sends another (which exceeds them); with slots for
    that count, fewer rows than the bound, y and the training call's gradients equal the dense
    reference's and no unwritten row reaches them."""
    dtype = torch.float32
    case = make_case(41 + ws + E, ws=ws, E=E, top_k=top_k, shapes=shapes, routing=routing, F=8)
    opts = dict(activation="swiglu", capacity_factor=None)
    peak = int(rows_between_ranks(rounded(case, dtype), ws).max())
    small = pools(ws).run(run_device, case, opts, dtype, 0)
    assert [r["peak"] for r in small] == [peak] * ws
    rows = rows_bound(max(b * s for b, s in case["sizes"]), top_k)
    assert small[0]["slot"] < peak, (small[0]["slot"], peak)  # tokens this few: some rank sends past even shares
    fitted = pools(ws).run(run_device, case, opts, dtype, peak)
    assert peak <= fitted[0]["slot"] < rows, (peak, fitted[0]["slot"], rows)
    for rank, (res, want) in enumerate(zip(fitted, reference(rounded(case, dtype), opts))):
        assert res["peak"] == peak and not res["y"].isnan().any(), rank
        if want["y"].numel():
            assert rel_err(res["y"], want["y"]) < 5e-5, (rank, rel_err(res["y"], want["y"]))
    results = pools(ws).run(run_device_training, case, opts, dtype, 1, peak)
    assert [r["nan"] for r in results] == [False] * ws
    check(results, case, opts, dtype)


def graphed_runs(rank, ws):
    """Whether ``_graphed_run`` is None, for aux loss coefficients 0 and 0.1, each without and
    with autograd."""
    out = []
    for coef in (0.0, 0.1):
        layer = OverlapMoE(8, 8, 4, 2, group=dist.group.WORLD, aux_loss_coef=coef,
                           config=OverlapConfig(graph_calls=True))
        with torch.no_grad():
            layer(torch.randn(1, 3, 8))  # an eager call: its agreement sets the copy-engine floor
        out += [layer._graphed_run(None, (1, 3, 8), torch.float32, save) is None for save in (False, True)]
    return out


def test_device_path_is_taken_only_where_it_applies(pool2):
    """``_graphed_run`` (what ``config.graph_calls`` captures) is None for an aux loss and on the
    CPU (no symmetric memory), with autograd or without, so those calls stay eager."""
    assert pool2.run(graphed_runs) == [[True] * 4] * 2


def race_finish_points(rank, ws):
    """Where a racing layer ends its timing: the calls' log (forward returned, backward returned,
    the gradient hooks left on the parameters) with each ``finish`` of a stand-in race that times
    every call."""
    layer = OverlapMoE(8, 8, 4, 2, group=dist.group.WORLD, config=OverlapConfig(graph_calls=True))
    log = []

    class Race:
        timing = True

        @staticmethod
        def finish(nbytes, budget):
            log.append("finish")

    layer._device_path.race = Race()
    for _ in range(2):
        y = layer(torch.randn(1, 3, 8, requires_grad=True))
        log.append("forward")
        y.sum().backward()
        log.append("backward")
        log.append(sum(len(p._post_accumulate_grad_hooks or {}) for p in layer.parameters()))  # none left
    layer(torch.randn(1, 3, 8, requires_grad=True))
    log.append("forward without backward")
    with torch.no_grad():
        layer(torch.randn(1, 3, 8))
    log.append("no_grad")
    log.append(sum(len(p._post_accumulate_grad_hooks or {}) for p in layer.parameters()))
    return log


def test_race_times_a_training_call_to_the_end_of_its_backward(pool2):
    """[Note: MoE graph calls: the race]: a training call's timing ends in its backward, once (the
    hook on the parameters does not stay for later backward passes); one whose backward never
    comes ends at the next call, before that call's own; a call without autograd's ends with the
    forward."""
    want = ["forward", "finish", "backward", 0] * 2 + ["forward without backward", "finish", "finish", "no_grad", 0]
    assert pool2.run(race_finish_points) == [want, want]


def workspace_held_after(rank, ws, choice):
    """Whether a layer still holds its eager calls' workspace (a stand-in) after a call at whose
    end a stand-in race returns ``choice``."""
    layer = OverlapMoE(8, 8, 4, 2, group=dist.group.WORLD, config=OverlapConfig(graph_calls=True))
    held = object()

    class Race:
        timing = True

        @staticmethod
        def finish(nbytes, budget):
            layer._workspace = held  # as the race's eager calls left it
            return choice

    layer._device_path.race = Race()
    with torch.no_grad():
        layer(torch.randn(1, 3, 8))
    return layer._workspace is held


@pytest.mark.parametrize("choice,held", [(True, False), (False, True), (None, True)])
def test_race_won_by_the_device_path_lets_go_of_the_eager_workspace(pool2, choice, held):
    """[Note: MoE graph calls: the race]: the call at which the device path wins drops the layer's
    hold on its eager calls' symmetric workspace; one at which it loses, or nothing was decided,
    keeps it."""
    assert pool2.run(workspace_held_after, choice) == [held, held]


def race_choices(rank, ws, eager_ms, device_ms, graph_bytes=(1, 1), budget=None):
    """What a DevicePathRace says at each of 9 calls of one signature, with a scripted clock
    whose calls take ``eager_ms[rank]`` then ``device_ms[rank]`` (each 3 calls), each call's graph
    keeping ``graph_bytes[rank]`` under a memory budget of ``budget`` bytes."""
    from overlap_layers.layers.moe.device_path import DevicePathRace
    from overlap_layers.runtime.group import shared_agreement
    times = iter(eager_ms[rank] + device_ms[rank])

    class Clock:  # the call's time at stop, read as it is
        start = staticmethod(lambda: None)
        stop = staticmethod(lambda _: next(times))
        read = staticmethod(lambda ms: ms)

    race = DevicePathRace(shared_agreement(dist.group.WORLD), Clock)
    out = []
    for _ in range(9):
        out.append((race.choose(("sig",)), race.finish(graph_bytes[rank], lambda: budget)))
    return out


@pytest.mark.parametrize("device_ms,wins", [([[50, 4, 4], [50, 9, 8]], False),
                                            ([[50, 4, 4], [50, 4.5, 4.9]], True)])
def test_race_picks_the_faster_path_alike_on_every_rank(pool2, device_ms, wins):
    """[Note: MoE graph calls: the race]: 3 eager calls, 3 device calls, then the choice on every
    rank from the slowest rank's best time of each, the first call of each not counted (eager
    best: max(5, 5) = 5 ms; device best: 8 or 4.9 on rank 1, 4 on rank 0)."""
    eager_ms = [[9, 5, 6], [9, 5, 5]]
    want = [(False, None)] * 3 + [(True, None)] * 2 + [(True, wins)] + [(wins, None)] * 3
    assert pool2.run(race_choices, eager_ms, device_ms) == [want, want]


@pytest.mark.parametrize("graph_bytes,budget,wins", [((100, 300), 300, True), ((100, 301), 300, False),
                                                     ((100, 301), None, True), ((0, 0), None, False),
                                                     ((100, 0), None, False)])
def test_race_keeps_the_device_path_within_the_memory_budget(pool2, graph_bytes, budget, wins):
    """The faster device path (4.9 against 5 ms) wins only if the largest rank's graph fits the
    memory budget (none: no limit), and only if its deciding call replayed a graph on every rank
    (0 bytes: it ran eagerly, its capture having failed); the choice is the same on every rank."""
    eager_ms, device_ms = [[9, 5, 6], [9, 5, 5]], [[50, 4, 4], [50, 4.5, 4.9]]
    want = [(False, None)] * 3 + [(True, None)] * 2 + [(True, wins)] + [(wins, None)] * 3
    assert pool2.run(race_choices, eager_ms, device_ms, graph_bytes, budget) == [want, want]
