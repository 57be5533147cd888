"""Tier 2: OverlapMoE (expert parallel) on 2 and 4 gloo ranks against the independent dense
reference ``tests/moe_reference.py``.

Every rank holds its own tokens (token counts may differ per rank, zero included). The reference
is run once per rank on that rank's tokens with all experts (float64, torch autograd). What each
rank must hold, written out here from the spec rather than taken from the layer:
  y, x.grad                     the reference on this rank's tokens
  router_weight.grad, shared_*  the reference gradient from this rank's tokens only
  w_in.grad, w_out.grad         the reference gradients summed over every rank's run, sliced to
                                the rank's experts r*E/ws .. (r+1)*E/ws - 1
  aux_loss                      the reference aux loss on this rank's tokens
"""
import math

import pytest
import torch
import torch.distributed as dist

from moe_reference import dense_moe, route
from pool import assert_dense_round_trip, all_reduce_ranks, expect_value_error_on_every_rank

from overlap_layers import OverlapConfig, OverlapMoE
from overlap_layers.layers.moe.experts import grouped_gemm_ok, grouped_setups, routed_ends
from overlap_layers.planning.plan import TilePlan
from overlap_layers.sim import analytic_model

TOL = {torch.float64: 1e-10, torch.float32: 5e-5}
# The capacity order ([Note: capacity order] in moe_reference.py): by the top-k router probability
# before renormalisation (with top-1 and renormalisation every final weight is 1, so ordering by it
# would keep tokens by index alone).
CAPACITY_KEY = "prob"
PARAMS = ("router_weight", "w_in", "w_out", "shared_w_in", "shared_w_out")


# ------------------------------------------------------------------ cases
SHAPES = {
    # per-rank (batch, seq)
    "even": lambda ws: [(2, 4)] * ws,
    "uneven": lambda ws: [(1 + r, 3) for r in range(ws)],
    "zero_batch": lambda ws: [(0, 4) if r == 1 else (1 + r, 4) for r in range(ws)],   # rank 1: batch 0
    "zero_seq": lambda ws: [(2, 0) if r == 0 else (1 + r, 3) for r in range(ws)],     # rank 0: seq 0
}


def make_case(seed, *, ws, E, top_k, shapes="even", H=8, F=6, Fs=None, activation="swiglu", routing="random"):
    """Dense weights and per-rank x / dy. ``routing="skewed"``: every token of rank 0 goes first to
    expert E-1 (on the last rank), every token of the other ranks first to expert 1 (on rank 0); with
    top_k=1 every other expert is empty."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    n_in = 2 if activation == "swiglu" else 1
    sizes = SHAPES[shapes](ws)
    case = dict(top_k=top_k, activation=activation, sizes=sizes,
                xs=[r(b, s, H) for b, s in sizes], dys=[r(b, s, H) for b, s in sizes],
                router_weight=r(E, H) / math.sqrt(H) * 2.0,
                w_in=r(E, n_in * F, H) / math.sqrt(H), w_out=r(E, H, F) / math.sqrt(F),
                shared_w_in=None, shared_w_out=None)
    if Fs:
        case.update(shared_w_in=r(n_in * Fs, H) / math.sqrt(H), shared_w_out=r(H, Fs) / math.sqrt(Fs))
    if routing == "skewed":
        for rank, x in enumerate(case["xs"]):
            x[..., 0] = 1.0 if rank == 0 else -1.0
            x[..., 1] = 1.0
        rw = case["router_weight"] * 0.15
        rw[E - 1, 0] += 20.0
        rw[1, 1] += 10.0
        case["router_weight"] = rw
    return case


def rounded(case, dtype):
    """The case with every tensor rounded to ``dtype`` and back to float64: the float32 layer and
    the float64 reference then see the same numbers."""
    out = dict(case)
    for k in PARAMS:
        if case[k] is not None:
            out[k] = case[k].to(dtype).double()
    out["xs"] = [x.to(dtype).double() for x in case["xs"]]
    out["dys"] = [d.to(dtype).double() for d in case["dys"]]
    return out


def moe_opts(opts):
    """The keywords of dense_moe among the layer options."""
    return {k: opts[k] for k in ("normalize_topk", "capacity_factor", "aux_loss_coef", "activation") if k in opts}


def reference(case, opts, capacity_key=CAPACITY_KEY, aux_only=False):
    """Per rank: y, aux, and the gradients of sum(y * dy) + aux (aux only if aux_loss_coef > 0;
    ``aux_only``: of aux alone)."""
    out = []
    for x0, dy in zip(case["xs"], case["dys"]):
        leaves = {k: (case[k].clone().requires_grad_() if case[k] is not None else None) for k in PARAMS}
        x = x0.clone().requires_grad_()
        y, aux = dense_moe(x, leaves["router_weight"], leaves["w_in"], leaves["w_out"], top_k=case["top_k"],
                           shared_w_in=leaves["shared_w_in"], shared_w_out=leaves["shared_w_out"],
                           capacity_key=capacity_key, **moe_opts(opts))
        loss = (y * dy).sum()
        if aux_only:
            loss = aux
        elif opts.get("aux_loss_coef", 0.0) > 0:
            loss = loss + aux
        loss.backward()
        grads = {k: (v.grad if v is not None else None) for k, v in leaves.items()}
        out.append(dict(y=y.detach(), aux=aux.detach(), dx=x.grad, grads=grads))
    return out


# ------------------------------------------------------------------ worker side
def build_from_dense(case, dtype, opts):
    cast = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
    return OverlapMoE.from_dense(cast(case["router_weight"]), cast(case["w_in"]), cast(case["w_out"]),
                                 top_k=case["top_k"], shared_w_in=cast(case["shared_w_in"]),
                                 shared_w_out=cast(case["shared_w_out"]), group=dist.group.WORLD, **opts)


def run_layer(rank, ws, case, opts, dtype, aux_only=False, pin=None):
    layer = build_from_dense(case, dtype, opts)
    if pin is not None:
        layer.pin_plan(pin)
    params = {n: p.detach().clone() for n, p in layer.named_parameters()}
    x = case["xs"][rank].to(dtype).requires_grad_()
    y = layer(x)
    aux = getattr(layer, "aux_loss", None)
    if aux_only:
        aux.backward()
    else:
        loss = (y * case["dys"][rank].to(dtype)).sum()
        if opts.get("aux_loss_coef", 0.0) > 0:
            loss = loss + aux
        loss.backward()
    plan = getattr(layer, "plan", None)
    return dict(y=y.detach(), dx=x.grad, dtype=y.dtype, params=params, aux=None if aux is None else aux.detach(),
                grads={n: p.grad for n, p in layer.named_parameters()}, k=getattr(plan, "num_tiles", None),
                decomposition=getattr(plan, "decomposition", None))


# ------------------------------------------------------------------ checks in the test process
def rel_err(got, want):
    """Relative error in norm; a gradient that is zero in exact arithmetic (top-1 with
    normalize_topk: the router gets none through w = p/p) is compared against a floor of 1e-2
    instead of its rounding noise (every tensor here is of order 1)."""
    return ((got.double() - want).norm() / max(want.norm().item(), 1e-2)).item()


def compare(results, case, opts, dtype, ref, aux_only=False):
    """A list of failure strings (empty when the layer matches ``ref``)."""
    ws, E = len(results), case["router_weight"].shape[0]
    El = E // ws
    tol = TOL[dtype]
    fails = []

    def close(name, got, want, tol=tol):
        if got is None:
            fails.append(f"{name} is None (want shape {tuple(want.shape)})")
            return
        if tuple(got.shape) != tuple(want.shape):
            fails.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        err = rel_err(got, want)
        if not err < tol:
            fails.append(f"{name}: relative error {err:.3g} > {tol}")

    if not aux_only:
        sum_w_in = sum(r["grads"]["w_in"] for r in ref)
        sum_w_out = sum(r["grads"]["w_out"] for r in ref)
    for rank, res in enumerate(results):
        want = ref[rank]
        if not aux_only:
            if res["dtype"] != dtype:
                fails.append(f"y[{rank}].dtype {res['dtype']} != {dtype}")
            close(f"y[{rank}]", res["y"], want["y"])
            close(f"dx[{rank}]", res["dx"], want["dx"])
            close(f"w_in.grad[{rank}]", res["grads"]["w_in"], sum_w_in[rank * El:(rank + 1) * El])
            close(f"w_out.grad[{rank}]", res["grads"]["w_out"], sum_w_out[rank * El:(rank + 1) * El])
            for n in ("shared_w_in", "shared_w_out"):
                if case[n] is not None:
                    close(f"{n}.grad[{rank}] (this rank's tokens)", res["grads"][n], want["grads"][n])
        close(f"router_weight.grad[{rank}] (this rank's tokens)", res["grads"]["router_weight"],
              want["grads"]["router_weight"])
        if opts.get("aux_loss_coef", 0.0) > 0:
            if res["aux"] is None:
                fails.append(f"aux_loss[{rank}] is None")
            elif res["aux"].numel() != 1:
                fails.append(f"aux_loss[{rank}] has shape {tuple(res['aux'].shape)}; want a scalar")
            else:
                a, b = res["aux"].double().reshape(()), want["aux"]
                if not abs(a - b).item() <= tol * max(abs(b).item(), 1e-3):
                    fails.append(f"aux_loss[{rank}] = {a.item():.12g}, want {b.item():.12g}")
    return fails


def check(results, case, opts, dtype, aux_only=False):
    ref_case = rounded(case, dtype)
    fails = compare(results, ref_case, opts, dtype, reference(ref_case, opts, aux_only=aux_only), aux_only)
    if not fails:
        return
    msg = f"{opts}, {dtype}, sizes {case['sizes']}, top_k {case['top_k']}:\n  " + "\n  ".join(fails)
    if opts.get("capacity_factor") is not None:  # [Note: capacity order] in moe_reference.py
        other = "prob" if CAPACITY_KEY == "weight" else "weight"
        if not compare(results, ref_case, opts, dtype, reference(ref_case, opts, capacity_key=other, aux_only=aux_only),
                       aux_only):
            msg += (f"\n  -> the layer matches the reference with capacity_key={other!r} instead "
                    f"(CAPACITY_KEY={CAPACITY_KEY!r}); everything else agrees")
    pytest.fail(msg)


# ------------------------------------------------------------------ numerics: the sampled grid
GRID = [
    # ws, K, top_k, normalize, activation, dtype, shapes, routing, capacity, aux, shared Fs, E
    (2, 1, 2, True, "swiglu", torch.float64, "even", "random", None, 0.0, None, 4),
    (2, 2, 1, True, "swiglu", torch.float64, "uneven", "random", None, 0.0, 4, 4),
    (2, 3, 2, False, "gelu", torch.float64, "uneven", "random", None, 0.01, None, 8),
    (2, 4, 3, True, "swiglu", torch.float32, "even", "random", None, 0.0, 4, 8),
    (2, 2, 2, True, "swiglu", torch.float64, "uneven", "skewed", None, 0.0, None, 4),
    (2, 1, 1, True, "swiglu", torch.float64, "even", "skewed", None, 0.0, None, 8),       # 6 of 8 experts empty
    (2, 3, 1, False, "relu", torch.float64, "zero_batch", "random", None, 0.0, None, 4),
    (2, 2, 2, True, "swiglu", torch.float64, "zero_seq", "random", None, 0.0, 4, 4),
    (2, 4, 2, True, "swiglu", torch.float64, "uneven", "random", 0.5, 0.0, None, 4),
    (2, 3, 3, False, "swiglu", torch.float32, "uneven", "random", 0.5, 0.05, 4, 4),
    (4, 1, 2, True, "swiglu", torch.float64, "uneven", "random", None, 0.0, None, 8),
    (4, 2, 3, False, "swiglu", torch.float64, "zero_batch", "skewed", None, 0.0, None, 8),
    (4, 3, 2, True, "gelu", torch.float32, "uneven", "random", 0.5, 0.1, 4, 8),
    (4, 4, 1, True, "swiglu", torch.float64, "zero_seq", "skewed", None, 0.02, 4, 4),
    (4, 2, 1, False, "swiglu", torch.float64, "uneven", "random", 0.5, 0.0, None, 4),
    # one rank, one tile: the plain call ([Note: MoE plain call]); float32 runs grouped GEMMs on the
    # CPU, float64 the loop per expert
    (1, 1, 2, True, "swiglu", torch.float64, "uneven", "random", None, 0.0, None, 4),
    (1, 1, 3, True, "swiglu", torch.float32, "even", "random", None, 0.0, 4, 8),
    (1, 1, 2, False, "gelu", torch.float32, "uneven", "skewed", None, 0.01, None, 8),     # experts left empty
    (1, 1, 2, True, "swiglu", torch.float32, "uneven", "random", 0.5, 0.0, None, 4),
    (1, 1, 3, False, "swiglu", torch.float64, "uneven", "random", 0.5, 0.05, 4, 4),
    (1, 1, 1, True, "relu", torch.float64, "zero_batch", "random", None, 0.0, None, 4),
]


@pytest.mark.parametrize("ws,k,top_k,normalize,activation,dtype,shapes,routing,cf,aux,Fs,E", GRID)
def test_matches_dense_reference(pools, ws, k, top_k, normalize, activation, dtype, shapes, routing, cf, aux, Fs,
                                 E):
    case = make_case(ws * 1000 + k * 100 + top_k * 10 + E, ws=ws, E=E, top_k=top_k, shapes=shapes, Fs=Fs,
                     activation=activation, routing=routing)
    opts = dict(num_tiles=k, normalize_topk=normalize, activation=activation, capacity_factor=cf, aux_loss_coef=aux)
    check(pools(ws).run(run_layer, case, opts, dtype), case, opts, dtype)


@pytest.mark.parametrize("ws,k,top_k,normalize,activation,dtype,shapes,routing,cf,aux,Fs,E", GRID)
def test_rank_chunks_match_dense_reference(pools, ws, k, top_k, normalize, activation, dtype, shapes, routing, cf,
                                           aux, Fs, E):
    """The exchange split by source rank (layers/moe/ranks.py; over send/recv on gloo): the grid's cases
    with the rank-chunk plan pinned (float32 cases run the grouped GEMMs where this torch has
    them on CPU, float64 the per-expert loop)."""
    case = make_case(ws * 1000 + k * 100 + top_k * 10 + E + 7, ws=ws, E=E, top_k=top_k, shapes=shapes, Fs=Fs,
                     activation=activation, routing=routing)
    opts = dict(normalize_topk=normalize, activation=activation, capacity_factor=cf, aux_loss_coef=aux)
    results = pools(ws).run(run_layer, case, opts, dtype, False, TilePlan(1, decomposition="rank"))
    assert all(r["decomposition"] == "rank" for r in results), [r["decomposition"] for r in results]
    check(results, case, opts, dtype)


@pytest.mark.parametrize("ws,E,top_k,shapes,routing,cf", [(2, 4, 2, "uneven", "random", None),
                                                       (4, 8, 3, "zero_batch", "skewed", None),
                                                       (4, 8, 2, "uneven", "random", 0.5),
                                                       (2, 20, 3, "uneven", "random", None),
                                                       (2, 20, 2, "zero_seq", "skewed", 0.5)])
def test_rank_chunks_grouped_gemms_match_dense_reference(pools, ws, E, top_k, shapes, routing, cf):
    """The rank-chunk plan on the grouped-GEMM path (float32, every row stride a multiple of 16
    bytes: ``torch._grouped_mm`` on CPU), empty experts and dropped assignments included; with
    10 local experts the weight gradients are grouped GEMMs added per piece, with 2 an
    accumulating GEMM per expert ([Note: MoE weight-gradient accumulation])."""
    if not grouped_gemm_ok(torch.empty(0, 8), torch.empty(1, 16, 8), torch.empty(1, 8, 8)):
        pytest.skip("needs torch._grouped_mm on the CPU (this torch has none)")
    case = make_case(ws * 31 + top_k + E, ws=ws, E=E, top_k=top_k, shapes=shapes, F=8, routing=routing)
    opts = dict(capacity_factor=cf)
    results = pools(ws).run(run_layer, case, opts, torch.float32, False, TilePlan(1, decomposition="rank"))
    assert all(r["decomposition"] == "rank" for r in results)
    check(results, case, opts, torch.float32)


def test_skewed_case_is_skewed():
    """The skewed routing really sends all of rank 0's tokens to expert E-1, every other rank's to
    expert 1, and leaves experts empty (a check of the test data, no ranks)."""
    case = make_case(5, ws=4, E=8, top_k=1, shapes="uneven", routing="skewed")
    for rank, x in enumerate(case["xs"]):
        r = route(x.reshape(-1, 8), case["router_weight"], 1)
        assert set(r["experts"].flatten().tolist()) == ({7} if rank == 0 else {1})


def test_reference_against_per_token_loop():
    """The reference (dropless) equals a token-by-token loop with Python sorting (no ranks)."""
    case = make_case(3, ws=2, E=4, top_k=3, shapes="uneven", Fs=4)
    x = case["xs"][1].reshape(-1, 8)
    for normalize in (True, False):
        y, _ = dense_moe(x[None], case["router_weight"], case["w_in"], case["w_out"], top_k=3,
                         normalize_topk=normalize, shared_w_in=case["shared_w_in"], shared_w_out=case["shared_w_out"])
        for t in range(x.shape[0]):
            p = torch.softmax(case["router_weight"] @ x[t], 0).tolist()
            chosen = sorted(range(4), key=lambda e: (-p[e], e))[:3]
            s = sum(p[e] for e in chosen) if normalize else 1.0
            want = sum(p[e] / s * act_ffn(x[t], case["w_in"][e], case["w_out"][e]) for e in chosen)
            want = want + act_ffn(x[t], case["shared_w_in"], case["shared_w_out"])
            assert torch.allclose(y[0, t], want, rtol=1e-12, atol=1e-12)


def act_ffn(x, w_in, w_out):
    h = w_in @ x
    f = w_out.shape[1]
    return w_out @ (torch.nn.functional.silu(h[:f]) * h[f:])


def test_reference_capacity_by_hand():
    """E=2, k=1, 4 tokens all routed to expert 0, capacity ceil(0.5*4*1/2) = 1: with
    normalize_topk every weight is 1 and the tie keeps token 0; without, the most probable token."""
    rw = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    x = torch.tensor([[0.5, 0.0], [2.0, 0.0], [1.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    r = route(x, rw, 1, normalize_topk=True, capacity_factor=0.5)
    assert r["capacity"] == 1 and r["kept"].flatten().tolist() == [True, False, False, False]
    r = route(x, rw, 1, normalize_topk=False, capacity_factor=0.5)
    assert r["kept"].flatten().tolist() == [False, True, False, False]  # tokens 1 and 3 tie: the lower index
    r = route(x, rw, 1, normalize_topk=True, capacity_factor=0.5, capacity_key="prob")
    assert r["kept"].flatten().tolist() == [False, True, False, False]
    r = route(x, rw, 1, capacity_factor=1.0)
    assert r["capacity"] == 2 and r["kept"].flatten().tolist() == [True, True, False, False]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_any_num_tiles_same_result(pool2, k):
    """Routing and capacity are decided on the whole local batch before tiling: every K matches."""
    case = make_case(77, ws=2, E=4, top_k=2, shapes="uneven", Fs=4)
    opts = dict(num_tiles=k, capacity_factor=0.5, aux_loss_coef=0.01)
    check(pool2.run(run_layer, case, opts, torch.float64), case, opts, torch.float64)


def test_auto_num_tiles(pool2):
    """num_tiles="auto" (the planner picks K): same numbers as the reference."""
    case = make_case(61, ws=2, E=4, top_k=2, shapes="uneven", Fs=4)
    opts = dict(num_tiles="auto", aux_loss_coef=0.01)
    res = pool2.run(run_layer, case, opts, torch.float64)
    assert all(isinstance(r["k"], int) and r["k"] >= 1 for r in res), [r["k"] for r in res]
    check(res, case, opts, torch.float64)


def _planned_send_recv(rank, ws, case, opts, dtype):
    """Which rank-chunk transports each layer offers the planner here (gloo: no copy engine),
    then a MoE call whose planner picked rank chunks over send/recv: its rank-chunk candidates
    predicted 100x faster, so the choice does not depend on this machine's speed."""
    from dataclasses import replace
    from overlap_layers import OverlapAttention, OverlapMLP
    offered = {"moe": build_from_dense(case, dtype, opts)._rank_transports(),
               "moe nccl": build_from_dense(case, dtype, {**opts, "config": OverlapConfig(transport="nccl")}
                                            )._rank_transports(),
               "mlp": OverlapMLP(8, 16, group=dist.group.WORLD)._rank_transports(),
               "attention": OverlapAttention(8, 2, group=dist.group.WORLD)._rank_transports()}
    orig = OverlapMoE._rank_candidates

    def faster(self, cm, batch, *, training):
        return [replace(c, predicted_ms=c.predicted_ms / 100) for c in orig(self, cm, batch, training=training)]
    OverlapMoE._rank_candidates = faster
    try:
        out = run_layer(rank, ws, case, {**opts, "config": OverlapConfig(verify_first_calls=False)}, dtype)
    finally:
        OverlapMoE._rank_candidates = orig
    return dict(out, offered=offered)


def test_planner_runs_rank_chunks_over_send_recv(pool2):
    """Without the copy engine the MoE's planner weighs rank chunks over send/recv (its all-to-all
    is send/recv in NCCL); the MLP and attention offer none (their ring collectives are faster).
    A planned send/recv plan equals the dense reference, forward and gradients."""
    case = make_case(29, ws=2, E=4, top_k=2, shapes="uneven")
    opts = dict(num_tiles="auto")
    res = pool2.run(_planned_send_recv, case, opts, torch.float64)
    for r in res:
        assert r["offered"] == {"moe": ("nccl",), "moe nccl": ("nccl",), "mlp": (), "attention": ()}
        assert (r["decomposition"], r["k"]) == ("rank", 1)
    check(res, case, opts, torch.float64)


# ------------------------------------------------------------------ capacity
def _capacity_case(seed, ws, top_k, normalize):
    """A case where capacity 0.5 drops assignments on every rank and where the two capacity orders
    ([Note: capacity order]) keep different assignments on some rank."""
    case = make_case(seed, ws=ws, E=4, top_k=top_k, shapes="uneven")
    drops, differ = True, False
    for x in case["xs"]:
        kw = dict(normalize_topk=normalize, capacity_factor=0.5)
        a = route(x.reshape(-1, 8), case["router_weight"], top_k, **kw)
        b = route(x.reshape(-1, 8), case["router_weight"], top_k, capacity_key="prob", **kw)  # vs "weight"
        drops &= bool((~a["kept"]).any())
        differ |= not torch.equal(a["kept"], b["kept"])
    return case, drops, differ


@pytest.mark.parametrize("ws,top_k,normalize,k", [(2, 2, True, 2), (2, 1, True, 3), (4, 2, False, 1),
                                                  (4, 3, True, 4)])
def test_capacity_drops(pools, ws, top_k, normalize, k):
    """capacity_factor=0.5: each expert keeps at most ceil(0.5 * T_local * k / E) assignments from
    each source rank, by decreasing combine weight then lower token index; dropped ones give 0."""
    case, drops, differ = _capacity_case(100 + ws * 10 + top_k, ws, top_k, normalize)
    assert drops, "test data: capacity must drop something on every rank"
    if normalize:
        assert differ, "test data: the two capacity orders must disagree somewhere"
    opts = dict(num_tiles=k, capacity_factor=0.5, normalize_topk=normalize)
    check(pools(ws).run(run_layer, case, opts, torch.float64), case, opts, torch.float64)


def test_capacity_large_factor_is_dropless(pool2):
    case = make_case(9, ws=2, E=4, top_k=2, shapes="uneven")
    opts = dict(num_tiles=2, capacity_factor=4.0)
    res = pool2.run(run_layer, case, opts, torch.float64)
    check(res, case, opts, torch.float64)
    check(res, case, dict(opts, capacity_factor=None), torch.float64)


def test_capacity_skewed_every_token_to_one_expert(pools):
    """All of rank 0's tokens compete for one expert: most are dropped (rank 0 keeps ceil(c*T*k/E))."""
    case = make_case(13, ws=4, E=4, top_k=1, shapes="uneven", routing="skewed")
    opts = dict(num_tiles=2, capacity_factor=1.0)
    check(pools(4).run(run_layer, case, opts, torch.float64), case, opts, torch.float64)


# ------------------------------------------------------------------ aux loss
@pytest.mark.parametrize("top_k,normalize,cf", [(2, True, None), (1, False, 0.5)])
def test_aux_loss_value_and_router_grad(pool2, top_k, normalize, cf):
    """aux_loss = coef * E * sum_e f_e P_e on this rank's tokens; backward of aux_loss alone reaches
    the router through P_e only (f_e counts assignments before capacity drops)."""
    case = make_case(21 + top_k, ws=2, E=4, top_k=top_k, shapes="uneven")
    opts = dict(num_tiles=2, aux_loss_coef=0.3, normalize_topk=normalize, capacity_factor=cf)
    res = pool2.run(run_layer, case, opts, torch.float64, True)
    check(res, case, opts, torch.float64, aux_only=True)
    for r in res:
        for n in ("w_in", "w_out"):
            g = r["grads"][n]
            assert g is None or not g.any(), f"aux loss alone must not reach {n}"


def _zero_aux(rank, ws, case):
    """With aux_loss_coef 0: the aux loss after a grad call (its backward alone), and after a
    no_grad call; a rank with no tokens included."""
    layer = build_from_dense(case, torch.float64, dict(num_tiles=1))
    x = case["xs"][rank].double().requires_grad_()
    layer(x)
    aux = layer.aux_loss
    attached = aux.requires_grad
    aux.backward()
    grad = layer.router_weight.grad
    with torch.no_grad():
        layer(x)
    plain = layer.aux_loss
    return dict(value=aux.item(), attached=attached, grad_zero=grad is not None and not grad.any(),
                again=layer.aux_loss is plain, plain=(plain.item(), plain.requires_grad, plain.dtype))


def test_zero_aux_loss_backward_works_on_every_rank(pool2):
    """aux_loss_coef 0: aux_loss is a 0 attached to the router after a call with grad (backward
    works, on a rank without tokens too, and leaves a zero router gradient), a plain float64 0 after
    a no_grad call, and reading it twice gives the same tensor."""
    case = make_case(23, ws=2, E=4, top_k=2, shapes="zero_seq")
    for r in pool2.run(_zero_aux, case):
        assert r["value"] == 0.0 and r["attached"] and r["grad_zero"] and r["again"]
        assert r["plain"] == (0.0, False, torch.float64)


# ------------------------------------------------------------------ shared expert, activations
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_shared_expert(pool2, activation):
    case = make_case(31, ws=2, E=4, top_k=2, shapes="uneven", Fs=10, activation=activation)
    opts = dict(num_tiles=2, activation=activation)
    res = pool2.run(run_layer, case, opts, torch.float64)
    check(res, case, opts, torch.float64)
    for r in res:
        assert tuple(r["params"]["shared_w_in"].shape) == ((20 if activation == "swiglu" else 10), 8)
        assert tuple(r["params"]["shared_w_out"].shape) == (8, 10)


# ------------------------------------------------------------------ parameters, round trip
def _round_trip(rank, ws, case, opts):
    layer = build_from_dense(case, torch.float64, opts)
    dense = layer.to_dense()
    again = OverlapMoE.from_dense(dense["router_weight"], dense["w_in"], dense["w_out"], top_k=case["top_k"],
                                  shared_w_in=dense["shared_w_in"], shared_w_out=dense["shared_w_out"],
                                  group=dist.group.WORLD, **opts)
    same = {n: torch.equal(p, q) for (n, p), (_, q) in zip(layer.named_parameters(), again.named_parameters())}
    return dense, {n: p.detach().clone() for n, p in layer.named_parameters()}, same


@pytest.mark.parametrize("ws,E,Fs,activation", [(2, 4, None, "swiglu"), (2, 8, 6, "gelu"), (4, 8, 4, "swiglu"),
                                                (4, 4, None, "relu")])
def test_from_dense_to_dense_round_trip(pools, ws, E, Fs, activation):
    case = make_case(41 + E, ws=ws, E=E, top_k=2, Fs=Fs, activation=activation)
    El, n_in = E // ws, (2 if activation == "swiglu" else 1)
    for rank, (dense, params, same) in enumerate(pools(ws).run(_round_trip, case, dict(activation=activation))):
        assert_dense_round_trip(dense, same, case, PARAMS)
        want = dict(router_weight=case["router_weight"], w_in=case["w_in"][rank * El:(rank + 1) * El],
                    w_out=case["w_out"][rank * El:(rank + 1) * El], shared_w_in=case["shared_w_in"],
                    shared_w_out=case["shared_w_out"])
        assert set(params) == {n for n in PARAMS if case[n] is not None}, sorted(params)
        for n, p in params.items():
            assert torch.equal(p, want[n]), f"local {n} on rank {rank}: shape {tuple(p.shape)}"
        assert tuple(params["w_in"].shape) == (El, n_in * 6, 8)


def _constructor_shapes(rank, ws):
    torch.manual_seed(0)  # the same seed on every rank: the replicated weights must then agree
    layer = OverlapMoE(8, 6, 8, 2, group=dist.group.WORLD, shared_expert_ffn=4)
    d = layer.to_dense()
    return ({n: tuple(p.shape) for n, p in layer.named_parameters()},
            {n: (tuple(t.shape) if t is not None else None) for n, t in d.items()},
            layer.router_weight.detach().clone())


def test_constructor_shapes(pool2):
    res = pool2.run(_constructor_shapes)
    for local, dense, _ in res:
        assert local == dict(router_weight=(8, 8), w_in=(4, 12, 8), w_out=(4, 8, 6), shared_w_in=(8, 8),
                             shared_w_out=(8, 4)), local
        assert dense == dict(router_weight=(8, 8), w_in=(8, 12, 8), w_out=(8, 8, 6), shared_w_in=(8, 8),
                             shared_w_out=(8, 4)), dense
    assert torch.equal(res[0][2], res[1][2]), "the replicated router differs across ranks"


def _grouped_setups(rank, ws):
    """Each grouped GEMM the layer times for its planner, run once: ``(key, (m, n), relative
    error)`` against a float64 product per expert, the rows grouped by ``routed_ends``, with the
    layer's weights as the cost model's gemms order them (gate/up and down transposed, then their
    data gradients)."""
    torch.manual_seed(0)
    layer = OverlapMoE(8, 4, 8, 2, group=dist.group.WORLD)
    cm = layer._cost_model((16, torch.float32), analytic_model("cpu"))
    setups = grouped_setups(cm, layer.w_in, layer.w_out, torch.float32)
    w_in, w_out = layer.w_in.detach().double(), layer.w_out.detach().double()
    weights = (w_in.transpose(-2, -1), w_out.transpose(-2, -1), w_out, w_in)
    out = []
    for key, (m, n, k, i) in sorted(cm.grouped_ops().items()):
        torch.manual_seed(1)
        y = setups[key]()()
        torch.manual_seed(1)
        x = torch.randn(m, k).double()  # the setup's rows, drawn first
        bounds = [0] + routed_ends(m, w_in.shape[0]).tolist()
        want = torch.cat([x[a:b] @ weights[i][e] for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        out.append((key, tuple(y.shape), (m, n), ((y.double() - want).norm() / want.norm()).item()))
    return out


def test_routed_ends_are_random_counts_of_every_row():
    """Offsets of every row over every group, the same on each draw, not all equal."""
    ends = routed_ends(1000, 8)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    assert ends.dtype == torch.int32 and int(ends[-1]) == 1000 and bool((counts >= 0).all())
    assert torch.equal(ends, routed_ends(1000, 8)) and len(set(counts.tolist())) > 1


def test_grouped_gemm_timings_run_the_priced_gemms(pool2):
    """[Note: grouped GEMMs cost more than dense ones]: the setups the layer times at its first
    call compute, for every key the cost model prices, that grouped GEMM on the layer's weights."""
    for res in pool2.run(_grouped_setups):
        assert len(res) >= 8, res  # tiles and rank pieces, four GEMMs each
        for key, shape, want_shape, err in res:
            assert shape == want_shape and err < 1e-5, (key, shape, want_shape, err)


def _grouped_setups_dtensor(rank, ws):
    """The layer's own setups with DTensor parameters (``mesh=``, as ``swap`` builds it): each runs
    on the local experts (a DTensor would not mix with the plain rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    layer = OverlapMoE(8, 4, 8, 2, mesh=init_device_mesh("cpu", (ws,)))
    cm = layer._cost_model((16, torch.float32), analytic_model("cpu"))
    shapes = {key: (m, n) for key, (m, n, k, i) in cm.grouped_ops().items()}
    return [(tuple(setup()().shape), shapes[key]) for key, setup in layer._op_setups(cm, torch.float32).items()
            if key in shapes]


def test_grouped_gemm_timings_with_dtensor_parameters(pool2):
    for res in pool2.run(_grouped_setups_dtensor):
        assert len(res) >= 8 and all(got == want for got, want in res), res


# ------------------------------------------------------------------ bad input
def _build_kw(rank, ws, kw):
    args = dict(hidden_size=8, ffn_hidden_size=6, num_experts=4, top_k=2, group=dist.group.WORLD)
    args.update(kw)
    OverlapMoE(**args)


@pytest.mark.parametrize("ws,kw,match", [
    (2, dict(num_experts=3), "num_experts"),
    (4, dict(num_experts=6), "num_experts"),
    (2, dict(top_k=5), "top_k"),
    (2, dict(top_k=0), "top_k"),
    (2, dict(activation="tanh"), "activation"),
    (2, dict(num_tiles=0), "num_tiles"),
    (2, dict(group=None), "exactly one of group"),
    (2, dict(aux_loss_coef=float("nan")), "aux_loss_coef=nan"),
    (2, dict(capacity_factor=float("inf")), "capacity_factor=inf"),
    (2, dict(dtype=torch.bool), "dtype=torch.bool"),
])
def test_bad_constructor_arguments(pools, ws, kw, match):
    expect_value_error_on_every_rank(pools(ws), _build_kw, kw, match=match)


def _from_dense_bad(rank, ws, which):
    E, H, F = 4, 8, 6
    t = dict(router_weight=torch.randn(E, H), w_in=torch.randn(E, 2 * F, H), w_out=torch.randn(E, H, F),
             shared_w_in=None, shared_w_out=None)
    kw = {}
    if which == "router_weight":
        t["router_weight"] = torch.randn(E, H + 1)
    elif which == "w_in":
        t["w_in"] = torch.randn(E, 2 * F + 1, H)
    elif which == "w_in_experts":
        t["w_in"] = torch.randn(E + 2, 2 * F, H)
    elif which == "w_out":
        t["w_out"] = torch.randn(E, H + 1, F)
    elif which == "w_out_ffn":  # w_in and w_out disagree on ffn: either may be named
        t["w_out"] = torch.randn(E, H, F + 1)
    elif which == "w_in_gelu":  # gelu takes [E, F, H], not the swiglu layout
        kw["activation"] = "gelu"
    elif which == "shared_w_in":
        t.update(shared_w_in=torch.randn(7, H), shared_w_out=torch.randn(H, 4))
    elif which == "shared_w_out":
        t.update(shared_w_in=torch.randn(8, H), shared_w_out=torch.randn(H + 1, 4))
    OverlapMoE.from_dense(t["router_weight"], t["w_in"], t["w_out"], top_k=2, shared_w_in=t["shared_w_in"],
                          shared_w_out=t["shared_w_out"], group=dist.group.WORLD, **kw)


@pytest.mark.parametrize("which,match", [
    ("router_weight", "router_weight"), ("w_in", "w_in"), ("w_in_experts", ("w_in", "router_weight")),
    ("w_out", "w_out"), ("w_out_ffn", ("w_out", "w_in")), ("w_in_gelu", "w_in"), ("shared_w_in", "shared_w_in"),
    ("shared_w_out", "shared_w_out"),
])
def test_from_dense_bad_shapes(pool2, which, match):
    expect_value_error_on_every_rank(pool2, _from_dense_bad, which, match=match)


def _call_with(rank, ws, name):
    layer = OverlapMoE(8, 6, 4, 2, group=dist.group.WORLD, num_tiles=2)
    x = torch.randn(2, 3, 8)
    if name == "rank0_2d":
        x = torch.randn(6, 8) if rank == 0 else x
    elif name == "hidden":
        x = torch.randn(2, 3, 6)
    elif name == "hidden_rank1":
        x = torch.randn(2, 3, 6) if rank == 1 else x
    elif name == "dtype":
        x = x.double()
    elif name == "dtype_rank1":
        x = x.double() if rank == 1 else x
    elif name == "device":
        x = torch.randn(2, 3, 8, device="meta")
    layer(x)


@pytest.mark.parametrize("name,match", [
    ("rank0_2d", "3-D"), ("hidden", "hidden"), ("hidden_rank1", "hidden"), ("dtype", "dtype"),
    ("dtype_rank1", "dtype"), ("device", "device"),
])
def test_bad_input_raises_on_every_rank(pool2, name, match):
    expect_value_error_on_every_rank(pool2, _call_with, name, match=match)


def _different_kw_per_rank(rank, ws, kw):
    layer = OverlapMoE(8, 6, 4, 2, group=dist.group.WORLD, **{k: v[rank] for k, v in kw.items()})
    layer(torch.randn(2, 3, 8))


@pytest.mark.parametrize("kw,match", [(dict(num_tiles=(1, 2)), "num_tiles differs"),
                                      (dict(capacity_factor=(None, 1.0)), "capacity_factor differs: rank 0: None, rank 1: 1.0")])
def test_ranks_disagreeing_raise_on_every_rank(pool2, kw, match):
    expect_value_error_on_every_rank(pool2, _different_kw_per_rank, kw, match=match)


def _no_grad_run(rank, ws, case, opts, pin, dtype):
    layer = build_from_dense(case, dtype, opts)
    if pin is not None:
        layer.pin_plan(pin)
    with torch.no_grad():
        y = layer(case["xs"][rank].to(dtype))
    return y, y.grad_fn is None


@pytest.mark.parametrize("pin", [None, TilePlan(1, decomposition="rank")], ids=["tiles", "rank"])
@pytest.mark.parametrize("cf,routing,dtype", [(None, "random", torch.float64), (0.5, "skewed", torch.float64),
                                              (0.5, "skewed", torch.float32)])
def test_no_grad_forward(pools, pin, cf, routing, dtype):
    """A call without autograd combines in send order ([Note: MoE no-grad combine]): tiles and rank
    chunks (float32: the grouped GEMMs where this torch has them on CPU), with assignments dropped
    by capacity (skewed routing overflows the favoured experts), a rank without tokens."""
    ws = 2 if cf is None else 4
    case = make_case(51 + ws, ws=ws, E=2 * ws, top_k=2, shapes="zero_batch", Fs=4, F=8, routing=routing)
    opts = dict(num_tiles=3, capacity_factor=cf) if pin is None else dict(capacity_factor=cf)
    ref = reference(case, opts)
    for rank, (y, no_graph) in enumerate(pools(ws).run(_no_grad_run, case, opts, pin, dtype)):
        assert no_graph
        assert rel_err(y, ref[rank]["y"]) < TOL[dtype]


def test_pool_survives_errors(pool2):
    assert pool2.run(all_reduce_ranks) == [3, 3]


def _frozen_router_run(rank, ws, case, opts, dtype):
    layer = build_from_dense(case, dtype, opts)
    layer.router_weight.requires_grad_(False)
    (layer(case["xs"][rank].to(dtype)) * case["dys"][rank].to(dtype)).sum().backward()
    return dict(w_in=layer.w_in.grad, w_out=layer.w_out.grad, router=layer.router_weight.grad)


@pytest.mark.parametrize("dtype,cf", [(torch.float32, None), (torch.float64, 0.5)])
def test_frozen_router_plain_call(pools, dtype, cf):
    """One rank, a router that takes no gradient and an input that takes none: the combine weights
    need no gradient, so the plain call's backward weighs each row's gradient itself ([Note: MoE
    plain call]); the experts' gradients equal the dense reference's."""
    case = make_case(61, ws=1, E=4, top_k=2, shapes="uneven")
    opts = dict(num_tiles=1, capacity_factor=cf)
    ref = reference(rounded(case, dtype), opts)[0]
    got = pools(1).run(_frozen_router_run, case, opts, dtype)[0]
    assert got["router"] is None
    for name in ("w_in", "w_out"):
        assert rel_err(got[name], ref["grads"][name]) < TOL[dtype], name
