"""Cross-rank safety: every divergence between the ranks of a group is an error on every rank, within
the group's timeout where nothing can name it sooner ([Note: agreement], [Note: agreement once per
call signature], [Note: layer config], [Note: input checks], [Note: plan files]).

The timeout cases run on a gloo group of their own with a 3 s timeout (the pool's group keeps
working after them, so the pool is not rebuilt); each rank reports its error and how long its
failing call took.
"""
import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from overlap_layers import (OverlapAttention, OverlapConfig, OverlapMLP, OverlapMoE, OverlapTransformerBlock,
                            UlyssesAttention, load_plans, save_plans)
from overlap_layers.layers import TilePlan
from overlap_layers.planning.cross_checks import MAX_FIELDS, fingerprints
from pool import all_reduce_ranks, expect_value_error_on_every_rank

TIMEOUT_S = 3


# ------------------------------------------------------------------ timeouts: a rank that diverges alone
def _outcome(fn):
    """(exception type name, message, seconds) of ``fn()``, or ("ok", None, seconds)."""
    start = time.monotonic()
    try:
        fn()
        return "ok", None, time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - the test reads every rank's outcome
        return type(e).__name__, str(e), time.monotonic() - start


def _diverge(rank, ws, case):
    """On a new group with a ``TIMEOUT_S`` timeout, an OverlapMLP (no sequence parallelism) calls
    once on every rank, then rank 0 alone diverges in the second call: ``capture`` (its call
    signature changes: it gathers alone), ``forward`` (raises before its collectives) or
    ``backward`` (raises in backward). Per rank the second call's outcome and, for ``capture``,
    the outcome of one more call with a new shape on every rank once both failed."""
    from overlap_layers.planning import call_agreement
    group = dist.new_group(list(range(ws)), timeout=timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    layer = OverlapMLP(16, 8 * ws, group=group, sequence_parallel=False, num_tiles=2)
    x = torch.randn(2, 4, 16, requires_grad=True)
    layer(x).sum().backward()
    real_capturing, real_run = call_agreement.capturing_graph, layer._run

    def fault(*args):
        raise RuntimeError("injected fault")
    if rank == 0 and case == "capture":
        call_agreement.capturing_graph = lambda t: True
    if rank == 0 and case == "forward":
        layer._run = fault

    def second():
        y = layer(x)
        if rank == 0 and case == "backward":
            y.register_hook(fault)
        y.sum().backward()
    try:
        out = [_outcome(second)]
    finally:
        call_agreement.capturing_graph, layer._run = real_capturing, real_run
    if case == "capture":  # the agreement is out of step now: a later call raises at once, not at the timeout
        dist.barrier()  # on the pool's group, which still works
        out.append(_outcome(lambda: layer(torch.randn(4, 4, 16))))
    dist.destroy_process_group(group)
    return out


def _within_twice_the_timeout(outcomes):
    for r, (kind, msg, seconds) in enumerate(outcomes):
        assert kind != "ok" and seconds < 2 * TIMEOUT_S, (r, kind, msg, seconds)


def _timed_out(outcome) -> bool:
    """Whether ``outcome`` is gloo's timeout (its words vary: "Timed out waiting ...", "Application
    timeout caused pair closure")."""
    return outcome[0] == "RuntimeError" and "time" in outcome[1].lower()


def test_a_call_changed_on_one_rank_fails_every_rank_within_the_group_timeout(pool2):
    """A repeated call runs without a gather, so a rank whose call changed alone (here it is
    captured into a CUDA graph) gathers alone: it raises when the group's timeout runs out, naming
    the layer, the call and the rank that did not arrive, while its peer's collective fails at the
    same timeout. After that the agreement is out of step: the next call raises on both ranks
    within about a second (the rank whose gather failed at once), never reading a stale row."""
    res = pool2.run(_diverge, "capture")
    _within_twice_the_timeout([r[0] for r in res])
    kind, msg, _ = res[0][0]
    assert kind == "RuntimeError" and "agreement of OverlapMLP (layer 0 of its group on this rank), call 2: " \
        f"rank 1 of the group did not arrive within {TIMEOUT_S} s" in msg, msg
    assert _timed_out(res[1][0]), res[1][0]
    (kind0, msg0, s0), (kind1, msg1, s1) = res[0][1], res[1][1]
    assert kind0 == "RuntimeError" and "an earlier gather of this rank failed" in msg0 and s0 < 0.5, res[0][1]
    assert kind1 == "RuntimeError" and "rank 0 of the group failed in an earlier gather" in msg1 and s1 < 2.5, res[1][1]


@pytest.mark.parametrize("case", ["forward", "backward"])
def test_a_fault_on_one_rank_ends_the_others_calls_within_the_group_timeout(pool2, case):
    """An exception on one rank in the middle of a call (its forward, or its backward) leaves its
    peer in a collective of that call, which fails when the group's timeout runs out."""
    res = pool2.run(_diverge, case)
    _within_twice_the_timeout([r[0] for r in res])
    assert res[0][0][:2] == ("RuntimeError", "injected fault"), res[0][0]
    assert _timed_out(res[1][0]), res[1][0]


# ------------------------------------------------------------------ the layer's configuration
def _built_apart(rank, ws, kind, field, num_tiles):
    """A layer whose ``field`` differs on rank 1, called once (``num_tiles``: "auto" or a fixed K)."""
    torch.manual_seed(0)
    g, other = dist.group.WORLD, rank == 1
    if kind == "mlp":
        kw = {"activation": dict(activation="gelu" if other else "swiglu"), "bias": dict(bias=other),
              "sequence_parallel": dict(sequence_parallel=not other),
              "check_inputs": dict(config=OverlapConfig(check_inputs=other))}.get(field, {})
        layer = OverlapMLP(16, 8 * ws, group=g, num_tiles=num_tiles, **kw)
        seq = 4 if layer.sequence_parallel else 4 * ws
        return tuple(layer(torch.randn(2, seq, 16)).shape)
    if kind == "attention":
        kw = dict(num_heads=8 if other else 4) if field == "num_heads" else \
            dict(num_heads=4, rope_theta=500000.0 if other else 10000.0)
        layer = OverlapAttention(32, num_kv_heads=2, group=g, num_tiles=num_tiles, **kw)
        return tuple(layer(torch.randn(2, 4, 32)).shape)
    if kind == "ulysses":
        layer = UlyssesAttention(16, 4, group=g, num_tiles=num_tiles, qk_norm=other)
        return tuple(layer(torch.randn(2, 4, 16)).shape)
    if kind == "moe":
        layer = OverlapMoE(16, 8, 4, 1 if other else 2, group=g, num_tiles=num_tiles)
        return tuple(layer(torch.randn(2, 4, 16)).shape)
    block = OverlapTransformerBlock(32, 4, 64, num_kv_heads=2, group=g, num_tiles=num_tiles,
                                    norm_eps=1e-6 if other else 1e-5)
    return tuple(block(torch.randn(2, 4, 32)).shape)


@pytest.mark.parametrize("num_tiles", ["auto", 2])
@pytest.mark.parametrize("kind,field,match", [
    ("mlp", "activation", "activation differs: rank 0: 'swiglu', rank 1: 'gelu'"),
    ("mlp", "bias", "bias differs: rank 0: False, rank 1: True"),
    ("mlp", "sequence_parallel", "sequence_parallel differs: rank 0: True, rank 1: False"),
    ("mlp", "check_inputs", "config.check_inputs differs: rank 0: False, rank 1: True"),
    ("attention", "num_heads", "num_heads differs: rank 0: 4, rank 1: 8; head_dim differs: rank 0: 8, rank 1: 4"),
    ("attention", "rope_theta", "rope_theta differs: rank 0: 10000.0, rank 1: 500000.0"),
    ("ulysses", "qk_norm", "qk_norm differs: rank 0: False, rank 1: True"),
    ("moe", "top_k", "top_k differs: rank 0: 2, rank 1: 1"),
    ("block", "norm_eps", "block.attn_norm differs: rank 0: 'rmsnorm eps=1e-05', rank 1: 'rmsnorm eps=1e-06'"),
])
def test_layers_built_apart_raise_on_every_rank_naming_the_field(pool2, kind, field, match, num_tiles):
    """[Note: layer config]: compared at the first call, whether the plan is planned or fixed."""
    expect_value_error_on_every_rank(pool2, _built_apart, kind, field, num_tiles, match=match)


def _config_tables(rank, ws):
    g = dist.group.WORLD
    block = OverlapTransformerBlock(32, 4, 64, num_kv_heads=2, group=g)
    block(torch.randn(2, 4, 32))  # the block hands its norms to the attention's table
    layers = [OverlapMLP(16, 8 * ws, group=g), OverlapAttention(32, 4, group=g), UlyssesAttention(16, 4, group=g),
              OverlapMoE(16, 8, 4, 2, group=g), block.attention]
    return [[name for name, _ in m._config_table()] for m in layers]


def test_config_tables_fit_the_naming_gather(pool2):
    for tables in pool2.run(_config_tables):
        for names in tables:
            assert len(names) <= MAX_FIELDS and len(set(names)) == len(names), names
        assert "block.attn_norm" in tables[-1] and "config.check_inputs" in tables[0]


def test_the_group_goes_on_after_a_config_mismatch(pool2):
    expect_value_error_on_every_rank(pool2, _built_apart, "mlp", "bias", 2, match="bias differs")
    assert pool2.run(all_reduce_ranks) == [3, 3]
    assert pool2.run(_built_apart, "mlp", "none", 2) == [(2, 4, 16)] * 2


# ------------------------------------------------------------------ check_inputs
def test_fingerprints_tell_equal_tensors_from_others():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    same = fingerprints([x, x.clone(), None])
    assert same[:3] == same[3:6] and same[6:] == (0, 0, 0)
    rows = x.clone()
    rows[:, [0, 1]] = rows[:, [1, 0]]
    cols = x.clone()
    cols[..., [0, 1]] = cols[..., [1, 0]]
    bit = x.clone()
    bit[2, 4, 7] = torch.nextafter(bit[2, 4, 7], torch.tensor(10.0))
    prints = {fingerprints([t]) for t in (x, rows, cols, bit, x.double(), x.reshape(5, 3, 8))}
    assert len(prints) == 6
    ids = torch.arange(12).expand(2, -1)  # expanded, as the README passes position ids
    assert fingerprints([ids]) == fingerprints([ids.contiguous()]) != fingerprints([ids.flip(-1)])
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    assert fingerprints([mask]) != fingerprints([mask.T])
    nan = torch.full((2, 2), float("nan"))
    assert fingerprints([nan]) == fingerprints([nan.clone()])


def _checked(rank, ws, kind, bad, num_tiles=2):
    """Two calls of a layer with ``check_inputs=True``; in the second, rank 1's ``bad`` input differs
    (None: nothing differs). Returns the outputs' shapes."""
    torch.manual_seed(0)
    cfg, g = OverlapConfig(check_inputs=True), dist.group.WORLD
    if kind == "attention":
        layer = OverlapAttention(16, 4, group=g, sequence_parallel=True, num_tiles=num_tiles, config=cfg)
        x = torch.randn(2, 4, 16) + rank  # sequence parallel: the ranks' shards differ, as they must
        pos = torch.arange(4 * ws).expand(2, -1)
        out = [layer(x, position_ids=pos).shape]
        if bad == "position_ids" and rank == 1:
            pos = pos + 1
        out.append(layer(x, position_ids=pos).shape)
        return out
    layer = OverlapMLP(16, 8 * ws, group=g, sequence_parallel=kind == "mlp_sp", num_tiles=num_tiles, config=cfg)
    x = torch.randn(2, 4, 16) + (rank if kind == "mlp_sp" else 0)
    out = [layer(x).shape]
    if bad == "x" and rank == 1:
        x = x.clone()
        x[1, 2, 3] += 1e-3
    elif bad == "batch" and rank == 1:  # a new call signature on one rank: gathered at once with the check
        x = torch.cat([x, x])
    out.append(layer(x).shape)
    return out


@pytest.mark.parametrize("num_tiles", ["auto", 2])
@pytest.mark.parametrize("kind,bad,match", [
    ("mlp", "x", "check_inputs: x differs across ranks: ranks with equal values: 0 | 1"),
    ("attention", "position_ids", "check_inputs: position_ids differs across ranks: ranks with equal values: 0 | 1"),
    ("mlp", "batch", "batch differs across ranks: rank 0: 2, rank 1: 4"),
])
def test_check_inputs_raises_on_every_rank_at_a_repeated_call(pool2, kind, bad, match, num_tiles):
    """With check_inputs every call is compared, not only a new signature: a replicated batch or
    position ids that differ on one rank, and a signature changed on one rank alone (without the
    check: a timeout), raise ValueError on every rank at once."""
    expect_value_error_on_every_rank(pool2, _checked, kind, bad, num_tiles, match=match)


def test_check_inputs_passes_equal_inputs_and_sharded_batches(pool2):
    for kind in ("mlp", "mlp_sp", "attention"):
        assert pool2.run(_checked, kind, None) == [[torch.Size([2, 4, 16])] * 2] * 2


# ------------------------------------------------------------------ NaN and inf
def _nan_token(rank, ws, k):
    torch.manual_seed(0)
    w_in, w_out = torch.randn(2 * 8 * ws, 16) / 4, torch.randn(16, 8 * ws) / 4
    mlp = OverlapMLP.from_dense(w_in, w_out, group=dist.group.WORLD, sequence_parallel=False, num_tiles=k)
    x = torch.randn(2, 4, 16)
    x[1, 2, 5] = float("nan")
    x[0, 1, 3] = float("inf")
    gate, up = (x @ w_in.T).chunk(2, dim=-1)
    dense = (torch.nn.functional.silu(gate) * up) @ w_out.T
    return torch.equal(mlp(x).isnan(), dense.isnan()), bool(dense.isnan().any())


@pytest.mark.parametrize("k", [1, 2])
def test_nan_and_inf_propagate_as_in_the_dense_layer(pool2, k):
    assert pool2.run(_nan_token, k) == [(True, True)] * 2


# ------------------------------------------------------------------ plan files
class _Model(torch.nn.Module):
    """An attention and an MLP, sequence parallel, planned ("auto")."""

    def __init__(self, ws, config=None):
        super().__init__()
        torch.manual_seed(0)
        self.attn = OverlapAttention(16, 4, group=dist.group.WORLD, config=config)
        self.mlp = OverlapMLP(16, 8 * ws, group=dist.group.WORLD, config=config)

    def forward(self, x):
        return self.mlp(self.attn(x))


def _step(model, x, dy):
    """y and every gradient of one call (x's and the parameters')."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = model(x)
    (y * dy).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _reproduced(rank, ws, path):
    """Run 1 plans (the planner forced to K=2, verified against K=1 by timing, as on a GPU) until
    settled, takes a step and writes the plans; run 2, a new model of the same seed, loads them and
    may not plan: its first steps must equal run 1's bit for bit, and each other."""
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, 16, generator=g)
    first = _Model(ws)
    for layer in (first.attn, first.mlp):
        layer.planner.make_plan = lambda *key: TilePlan(2, reason="forced")
    for _ in range(40):
        _step(first, x, dy)
        if not (first.attn.verifying or first.mlp.verifying):
            break
    want, plans = _step(first, x, dy), (first.attn.plan, first.mlp.plan)
    if rank == 0:
        save_plans(first, path)
    dist.barrier()
    second = _Model(ws)
    for layer in (second.attn, second.mlp):
        layer.planner.make_plan = None  # loaded: never called
    load_plans(second, path)
    got = [_step(second, x, dy) for _ in range(3)]
    same = [all(torch.equal(a, b) for a, b in zip(want, run)) for run in got]
    return same, (second.attn.plan, second.mlp.plan) == plans, second.mlp.plan.reason, second.mlp.planner.describe()


def test_plan_files_make_runs_bit_identical(pool2, tmp_path):
    path = tmp_path / "plans.json"
    for same, equal_plans, reason, described in pool2.run(_reproduced, str(path)):
        assert same == [True, True, True] and equal_plans
        assert reason == f"loaded by load_plans from {path}" and described.startswith("OverlapMLP 'mlp' (layer ")
    data = json.loads(path.read_text())
    assert data["overlap_layers_plans"] == 1 and set(data["modules"]) == {"attn", "mlp"}
    assert data["modules"]["mlp"]["plans"][0]["key"] == [8, {"dtype": "float32"}, True]


def _block_plans(rank, ws, path):
    """A block's fusion plan written and read back into a new block."""
    from overlap_layers.layers.block.fused import BlockPlan
    key = ((2, 4, 32), torch.float32, True, 11, 22)
    block = OverlapTransformerBlock(32, 4, 64, num_kv_heads=2, group=dist.group.WORLD)
    block._fusion.cache().preload(key, BlockPlan(True, 2))
    if rank == 0:
        save_plans(block, path)
    dist.barrier()
    again = OverlapTransformerBlock(32, 4, 64, num_kv_heads=2, group=dist.group.WORLD)
    load_plans(again, path)
    got = again._fusion.cache().settled(key)
    return (got.fused, got.num_tiles) == (True, 2)


def test_plan_files_hold_the_blocks_fusion_plans(pool2, tmp_path):
    assert pool2.run(_block_plans, str(tmp_path / "block.json")) == [True, True]


def _load_apart(rank, ws, tmp, case):
    """Every rank loads a plan file that is wrong (``case``) on rank 1 or everywhere."""
    model = _Model(ws)
    path = f"{tmp}/plans{rank}.json"
    modules = {"attn": {"class": "OverlapAttention", "plans": []},
               "mlp": {"class": "OverlapMLP", "plans": [{"key": [8, {"dtype": "float32"}, True], "plan": dict(
                   num_tiles=2 + (case == "other" and rank == 1), buckets_fwd=[], buckets_bwd=[], regather=False,
                   num_streams=2, transport="nccl", decomposition="batch", carveout=[])}]}}
    if case == "unknown":
        modules["mlp.inner"] = modules["mlp"]
    if case != "missing" or rank == 0:
        with open(path, "w") as f:
            json.dump({"overlap_layers_plans": 1, "modules": modules}, f)
    load_plans(model, path)


@pytest.mark.parametrize("case,match", [
    ("other", "the ranks loaded different plans for module 'mlp'"),
    ("missing", ("No such file", "rank(s) [1] could not load the file")),
    ("unknown", "no planned module of the model is named ['mlp.inner']"),
])
def test_load_plans_refuses_files_that_differ_or_do_not_fit_on_every_rank(pool2, tmp_path, case, match):
    expect_value_error_on_every_rank(pool2, _load_apart, str(tmp_path), case, match=match)
