"""Tier 2: what the integrations build on, on 2 gloo ranks.

1. Gradients when backward returns, and ``finalize_grads`` (alias ``reduce_replicated_grads``):
   every parameter replicated inside a layer's group holds the dense reference gradient
   (references: ``dense_mlp`` from test_mlp.py, ``attention_reference.dense_attention``,
   ``moe_reference.dense_moe``; float64, one process), with or without ``finalize_grads``, which
   changes none of them; data-parallel style partials (UlyssesAttention, the MoE router and
   shared expert) are left alone unless ``data_parallel=True``, which sums them over the group.
2. Activation checkpointing (``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)``):
   identical outputs and gradients to the plain layer, and a recomputation that issues the
   forward's collectives again, once, in the same order on every rank (``layer.launch_log``);
   see [Note: checkpoint and the layers].
(torch.compile: tests/test_compile.py.)

[Note: checkpoint and the layers]
Non-reentrant checkpointing recomputes a layer's forward inside its backward. Two things make that
exact and single: the per-tile graphs of the attention core and the MoE experts are recorded
outside checkpoint's saved-tensor hooks ([Note: per-tile graphs] in ``layers/common/tp_program.py``), so
their nested ``torch.autograd.grad`` does not recompute the layer again; and a forward inside a
backward replays the plan its original forward ran ([Note: recompute] in ``planning/recompute.py``),
so first-call verification and micro-batch schedules (two forwards before their backwards) keep
the saved tensors consistent.
"""
import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import overlap_layers
from attention_reference import dense_attention
from moe_reference import dense_moe
from overlap_layers import (OverlapAttention, OverlapConfig, OverlapMLP, OverlapMoE, UlyssesAttention, finalize_grads,
                            reduce_replicated_grads)
from overlap_layers.planning.plan import TilePlan
from pool import RankFailure, call_each
from test_mlp import dense_mlp, shard_in
from test_verify import VERIFY_KS

TOL = 1e-10
WS = 2
H_MLP, F_MLP = 12, 16
ATTN = dict(B=2, S=8, H=16, nq=4, nkv=1, d=4)  # nkv=1 < ws: the KV head is replicated on both ranks
MOE = dict(E=4, top_k=2, H=8, F=6, Fs=4, aux=0.01, sizes=[(2, 3), (1, 5)])  # tokens differ per rank


# ------------------------------------------------------------------ cases (float64, dense layouts)
def _rand(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)


def make_cases(seed=0):
    r = _rand(seed)
    mlp = dict(x=r(2, 8, H_MLP), dy=r(2, 8, H_MLP), w_in=r(2 * F_MLP, H_MLP) / math.sqrt(H_MLP),
               w_out=r(H_MLP, F_MLP) / math.sqrt(F_MLP), b_in=r(2 * F_MLP), b_out=r(H_MLP))
    B, S, H, nq, nkv, d = (ATTN[k] for k in ("B", "S", "H", "nq", "nkv", "d"))
    attn = dict(x=r(B, S, H), dy=r(B, S, H), wq=r(nq * d, H) / math.sqrt(H), wk=r(nkv * d, H) / math.sqrt(H),
                wv=r(nkv * d, H) / math.sqrt(H), wo=r(H, nq * d) / math.sqrt(nq * d), bq=r(nq * d), bk=r(nkv * d),
                bv=r(nkv * d), bo=r(H), q_norm=1 + 0.3 * r(d), k_norm=1 + 0.3 * r(d))
    uly = dict(attn, dy=r(B, S, H))  # the same weights and input, another output gradient
    E, He, F, Fs = (MOE[k] for k in ("E", "H", "F", "Fs"))
    moe = dict(xs=[r(b, s, He) for b, s in MOE["sizes"]], dys=[r(b, s, He) for b, s in MOE["sizes"]],
               router_weight=2 * r(E, He) / math.sqrt(He), w_in=r(E, 2 * F, He) / math.sqrt(He),
               w_out=r(E, He, F) / math.sqrt(F), shared_w_in=r(2 * Fs, He) / math.sqrt(He),
               shared_w_out=r(He, Fs) / math.sqrt(Fs))
    return dict(mlp=mlp, attn=attn, uly=uly, moe=moe)


ATTN_PARAMS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm")
MOE_PARAMS = ("router_weight", "w_in", "w_out", "shared_w_in", "shared_w_out")


def _leaves(case, names):
    return {k: case[k].clone().requires_grad_() for k in names}


def ref_mlp(c):
    lv = _leaves(c, ("x", "w_in", "w_out", "b_in", "b_out"))
    dense_mlp(lv["x"], lv["w_in"], lv["w_out"], lv["b_in"], lv["b_out"], "swiglu").backward(c["dy"])
    return {k: v.grad for k, v in lv.items()}


def ref_attn(c):
    lv = _leaves(c, ("x",) + ATTN_PARAMS)
    y = dense_attention(lv["x"], *(lv[k] for k in ATTN_PARAMS[:4]), num_heads=ATTN["nq"],
                        num_kv_heads=ATTN["nkv"], **{k: lv[k] for k in ATTN_PARAMS[4:]})
    y.backward(c["dy"])
    return {k: v.grad for k, v in lv.items()}


def ref_moe(c):
    """Per rank, the gradients of sum(y * dy) + aux_loss on that rank's tokens."""
    out = []
    for x, dy in zip(c["xs"], c["dys"]):
        lv = _leaves(c, MOE_PARAMS)
        y, aux = dense_moe(x, lv["router_weight"], lv["w_in"], lv["w_out"], top_k=MOE["top_k"],
                           shared_w_in=lv["shared_w_in"], shared_w_out=lv["shared_w_out"],
                           aux_loss_coef=MOE["aux"], capacity_key="prob")
        ((y * dy).sum() + aux).backward()
        out.append({k: v.grad for k, v in lv.items()})
    return out


# ------------------------------------------------------------------ worker side
class Model(nn.Module):
    """One of each layer, side by side (each on its own input)."""

    def __init__(self, cases, num_tiles=2):
        super().__init__()
        g = dist.group.WORLD
        m, a, u, e = cases["mlp"], cases["attn"], cases["uly"], cases["moe"]
        self.mlp = OverlapMLP.from_dense(m["w_in"], m["w_out"], b_in=m["b_in"], b_out=m["b_out"], group=g,
                                         num_tiles=num_tiles)
        kw = dict(num_heads=ATTN["nq"], num_kv_heads=ATTN["nkv"], group=g, num_tiles=num_tiles)
        self.attn = OverlapAttention.from_dense(*(a[k] for k in ATTN_PARAMS[:4]),
                                                **{k: a[k] for k in ATTN_PARAMS[4:]}, **kw)
        self.uly = UlyssesAttention.from_dense(*(u[k] for k in ATTN_PARAMS[:4]),
                                               **{k: u[k] for k in ATTN_PARAMS[4:]}, **kw)
        self.moe = OverlapMoE.from_dense(e["router_weight"], e["w_in"], e["w_out"], top_k=MOE["top_k"],
                                         shared_w_in=e["shared_w_in"], shared_w_out=e["shared_w_out"], group=g,
                                         aux_loss_coef=MOE["aux"], num_tiles=num_tiles)

    def loss(self, cases, rank):
        total = 0.0
        for name in ("mlp", "attn", "uly"):
            c = cases[name]
            x = c["x"].chunk(WS, dim=1)[rank]
            total = total + (getattr(self, name)(x) * c["dy"].chunk(WS, dim=1)[rank]).sum()
        y = self.moe(cases["moe"]["xs"][rank])
        return total + (y * cases["moe"]["dys"][rank]).sum() + self.moe.aux_loss


def finalize_run(rank, ws, cases, data_parallel, use_alias):
    model = Model(cases)
    model.loss(cases, rank).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    (reduce_replicated_grads if use_alias else finalize_grads)(model, data_parallel=data_parallel)
    return dict(before=before, after={n: p.grad for n, p in model.named_parameters()})


# ------------------------------------------------------------------ 1. finalize_grads
def _close(name, got, want):
    assert got is not None, f"{name} is None"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = ((got.double() - want).norm() / max(want.norm().item(), 1e-30)).item()
    assert err < TOL, f"{name}: relative error {err:.3g}"


@pytest.fixture(scope="module")
def cases():
    return make_cases()


@pytest.fixture(scope="module")
def references(cases):
    return dict(mlp=ref_mlp(cases["mlp"]), attn=ref_attn(cases["attn"]), uly=ref_attn(cases["uly"]),
                moe=ref_moe(cases["moe"]))


@pytest.mark.parametrize("data_parallel,use_alias", [(False, False), (True, False), (False, True)])
def test_finalize_grads_gives_the_dense_gradients(pool2, cases, references, data_parallel, use_alias):
    res = pool2.run(finalize_run, cases, data_parallel, use_alias)
    ref = references
    d, nql = ATTN["d"], ATTN["nq"] // WS
    fl = F_MLP // WS
    for rank, r in enumerate(res):
        g = r["after"]
        for n in g:  # finalize_grads touches nothing but the data-parallel style partials
            if not n.startswith("uly.") and n not in ("moe.router_weight", "moe.shared_w_in", "moe.shared_w_out"):
                assert torch.equal(g[n], r["before"][n]), f"{n} changed"
        # OverlapMLP (sequence parallel): shards, and b_out completed on every rank.
        _close("mlp.w_in", g["mlp.w_in"], shard_in(ref["mlp"]["w_in"], rank, WS, F_MLP, "swiglu"))
        _close("mlp.b_in", g["mlp.b_in"], shard_in(ref["mlp"]["b_in"], rank, WS, F_MLP, "swiglu"))
        _close("mlp.w_out", g["mlp.w_out"], ref["mlp"]["w_out"][:, rank * fl:(rank + 1) * fl])
        _close("mlp.b_out (complete)", g["mlp.b_out"], ref["mlp"]["b_out"])
        # OverlapAttention: query-head shards; bo, q_norm, k_norm and the replicated KV head complete.
        q = slice(rank * nql * d, (rank + 1) * nql * d)
        _close("attn.wq", g["attn.wq"], ref["attn"]["wq"][q])
        _close("attn.bq", g["attn.bq"], ref["attn"]["bq"][q])
        _close("attn.wo", g["attn.wo"], ref["attn"]["wo"][:, q])
        for n in ("wk", "wv", "bk", "bv", "bo", "q_norm", "k_norm"):
            _close(f"attn.{n} (complete)", g[f"attn.{n}"], ref["attn"][n])
        # UlyssesAttention: every parameter is a DP-style partial.
        for n in ATTN_PARAMS:
            if data_parallel:
                _close(f"uly.{n} (summed)", g[f"uly.{n}"], ref["uly"][n])
            else:
                assert torch.equal(g[f"uly.{n}"], r["before"][f"uly.{n}"]), f"uly.{n} was reduced"
        # OverlapMoE: experts complete (every rank's tokens routed to them); router, shared expert DP-style.
        El = MOE["E"] // WS
        for n in ("w_in", "w_out"):
            _close(f"moe.{n}", g[f"moe.{n}"], sum(x[n] for x in ref["moe"])[rank * El:(rank + 1) * El])
        for n in ("router_weight", "shared_w_in", "shared_w_out"):
            want = sum(x[n] for x in ref["moe"]) if data_parallel else ref["moe"][rank][n]
            _close(f"moe.{n}", g[f"moe.{n}"], want)
    if not data_parallel:  # the partials really were partial: their sum is the dense gradient
        for n in ATTN_PARAMS:
            _close(f"uly.{n} (sum of partials)", sum(r["after"][f"uly.{n}"] for r in res), ref["uly"][n])


def missing_grads_run(rank, ws, cases):
    """Data-parallel style partials: the MoE router's gradient on both ranks, the shared expert's
    on rank 0 only, Ulysses' wq on rank 1 only, its other parameters' on no rank; b_out (summed
    inside backward, never by finalize_grads) on rank 0 only."""
    model = Model(cases)
    for p in model.parameters():
        p.grad = None
    model.mlp.b_out.grad = torch.full_like(model.mlp.b_out, 3.0) if rank == 0 else None
    model.moe.router_weight.grad = torch.full_like(model.moe.router_weight, 1.0 + rank)
    model.moe.shared_w_in.grad = torch.full_like(model.moe.shared_w_in, 2.0) if rank == 0 else None
    model.uly.wq.grad = torch.full_like(model.uly.wq, 5.0) if rank == 1 else None
    finalize_grads(model, data_parallel=True)
    return dict(b_out=model.mlp.b_out.grad, router=model.moe.router_weight.grad, shared=model.moe.shared_w_in.grad,
                shared_out=model.moe.shared_w_out.grad, uly_wq=model.uly.wq.grad,
                uly=[p.grad for n, p in model.uly.named_parameters() if n != "wq"])


def test_finalize_grads_with_missing_grads_never_hangs(pool2, cases):
    """Which collectives run depends on the model only: a gradient missing on some ranks counts as
    zeros, the sum reaches every rank, and one missing everywhere stays None."""
    for rank, r in enumerate(pool2.run(missing_grads_run, cases)):
        assert (r["b_out"] is not None) == (rank == 0)  # not a data-parallel style partial: untouched
        assert torch.equal(r["router"], torch.full_like(r["router"], 3.0))
        assert torch.equal(r["shared"], torch.full_like(r["shared"], 2.0))
        assert torch.equal(r["uly_wq"], torch.full_like(r["uly_wq"], 5.0))
        assert r["shared_out"] is None and all(g is None for g in r["uly"])


def _bad_flag(rank, ws, cases):
    finalize_grads(Model(cases), data_parallel="yes")


def test_finalize_grads_api(pool2, cases):
    assert overlap_layers.finalize_grads is finalize_grads is reduce_replicated_grads
    assert "finalize_grads" in overlap_layers.__all__
    with pytest.raises(RankFailure) as info:
        pool2.run(_bad_flag, cases)
    assert all(e is not None and e[0] == "ValueError" and "data_parallel" in e[1] for e in info.value.errors())


# ------------------------------------------------------------------ 2. activation checkpointing
def _build(kind, num_tiles, cases, force_k=None, verify=True):
    """One layer from ``cases`` (float64); ``force_k``: the planner always proposes K=force_k, so
    "auto" verifies it against K=1 on the first calls (on CPU's nominal model it plans K=1)."""
    g, cfg = dist.group.WORLD, OverlapConfig(verify_first_calls=verify)
    if kind in ("mlp_sp", "mlp"):
        m = cases["mlp"]
        layer = OverlapMLP.from_dense(m["w_in"], m["w_out"], b_in=m["b_in"], b_out=m["b_out"], group=g,
                                      sequence_parallel=kind == "mlp_sp", num_tiles=num_tiles, config=cfg)
    elif kind == "attn":
        a = cases["attn"]
        layer = OverlapAttention.from_dense(*(a[k] for k in ATTN_PARAMS[:4]), **{k: a[k] for k in ATTN_PARAMS[4:]},
                                            num_heads=ATTN["nq"], num_kv_heads=ATTN["nkv"], group=g,
                                            num_tiles=num_tiles, config=cfg)
    else:
        e = cases["moe"]
        layer = OverlapMoE.from_dense(e["router_weight"], e["w_in"], e["w_out"], top_k=MOE["top_k"],
                                      shared_w_in=e["shared_w_in"], shared_w_out=e["shared_w_out"], group=g,
                                      aux_loss_coef=MOE["aux"], num_tiles=num_tiles, config=cfg)
    if force_k is not None:
        layer.planner.make_plan = lambda *key: TilePlan(force_k, reason="forced by the test")
    return layer


def _inputs(kind, cases, rank, call):
    """(x, dy) of this rank for call ``call`` (different every call)."""
    if kind == "moe":
        c = cases["moe"]
        x, dy = c["xs"][rank], c["dys"][rank]
    else:
        c = cases["attn" if kind == "attn" else "mlp"]
        x, dy = c["x"], c["dy"]
        if kind != "mlp":  # sequence parallel: this rank's positions
            x, dy = x.chunk(WS, dim=1)[rank], dy.chunk(WS, dim=1)[rank]
    return x * (1 + 0.1 * call), dy


def _one_call(layer, kind, x, dy, ckpt):
    layer.zero_grad(set_to_none=True)
    layer.launch_log = []
    x = x.clone().requires_grad_()
    y = checkpoint(layer, x, use_reentrant=False) if ckpt else layer(x)
    n_fwd = len(layer.launch_log)
    loss = (y * dy).sum() + (layer.aux_loss if kind == "moe" else 0.0)
    loss.backward()
    log = [f"{name}[{t}]" for t, name, _ in layer.launch_log]
    return dict(y=y.detach(), dx=x.grad, grads={n: p.grad for n, p in layer.named_parameters()},
                fwd=log[:n_fwd], log=log, k=layer.plan.num_tiles)


def ckpt_run(rank, ws, cases, kind, num_tiles, calls, force_k=None):
    """``calls`` calls of a plain layer and of an identical checkpointed one, on the same inputs."""
    plain, ckpt = (_build(kind, num_tiles, cases, force_k) for _ in range(2))
    out = []
    for c in range(calls):
        x, dy = _inputs(kind, cases, rank, c)
        out.append((_one_call(plain, kind, x, dy, False), _one_call(ckpt, kind, x, dy, True)))
    return out


def _recomputations(plain, ck):
    """How many times the checkpointed call ran its forward again, checking that its launches are
    the forward's launches that many more times plus the plain backward's."""
    fwd, bwd = ck["fwd"], plain["log"][len(plain["fwd"]):]
    extra, rem = divmod(len(ck["log"]) - len(fwd) - len(bwd), len(fwd))
    assert rem == 0 and Counter(ck["log"]) == Counter(fwd * (1 + extra) + bwd), (ck["log"], plain["log"])
    return extra


def _check_ckpt(res, exact):
    """``exact``: plain and checkpointed layers ran the same plans, so results are equal bit for bit
    and the launches comparable one for one; else (verification cycling at different paces) the
    results agree to rounding and the recomputation must replay its own forward's launches."""
    for c in range(len(res[0])):
        assert res[0][c][1]["log"] == res[1][c][1]["log"], f"call {c}: the ranks launched differently"
        for rank in range(WS):
            plain, ck = res[rank][c]
            pairs = [("y", plain["y"], ck["y"]), ("dx", plain["dx"], ck["dx"])] + \
                    [(n, plain["grads"][n], ck["grads"][n]) for n in plain["grads"]]
            for name, want, got in pairs:
                if exact:
                    assert torch.equal(got, want), f"call {c}, rank {rank}: {name} differs"
                else:
                    _close(f"call {c}, rank {rank}: {name}", got, want)
            fwd = ck["fwd"]
            if not exact:
                assert ck["log"][len(fwd):2 * len(fwd)] == fwd, (c, ck["log"])
                continue
            assert fwd == plain["fwd"]
            n = _recomputations(plain, ck)
            assert n == 1 and ck["log"] == fwd * 2 + plain["log"][len(plain["fwd"]):], n


KINDS = ["mlp_sp", "mlp", "attn", "moe"]


@pytest.mark.parametrize("num_tiles", [2, "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_identical_to_plain(pool2, cases, kind, num_tiles):
    """Same outputs and gradients, bit for bit; the recomputation launches the forward again, once,
    the same on both ranks."""
    res = pool2.run(ckpt_run, cases, kind, num_tiles, 2)
    _check_ckpt(res, exact=True)


# "auto" while first-call verification runs K=2, K=1 (warm-up), then K=2, K=2, K=1, K=1, ... (three
# rounds, the second in reverse order): every
# recomputation replays its own forward's plan. The plain layer runs the same sequence, but the
# contenders' timings differ, so after the decision the two may differ: compare to rounding.
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_during_verification(pool2, cases, kind):
    res = pool2.run(ckpt_run, cases, kind, "auto", 16, 2)
    ks = [c[1]["k"] for c in res[0]]
    assert ks[:14] == VERIFY_KS and ks[14] == ks[15], ks  # 14 verification calls, then the decision
    _check_ckpt(res, exact=False)


def microbatch_run(rank, ws, cases, verify):
    """Two forwards, then their two backwards (micro-batches), three times, under checkpoint."""
    layer = _build("mlp_sp", "auto", cases, force_k=2, verify=verify)
    ys = []
    for c in range(6):
        x, dy = _inputs("mlp_sp", cases, rank, c)
        ys.append((checkpoint(layer, x.clone().requires_grad_(), use_reentrant=False), dy))
        if len(ys) == 2:
            for y, dy in ys:
                (y * dy).sum().backward()
            ys = []
    return layer.plan.num_tiles


def test_checkpoint_microbatches_without_verification(pool2, cases):
    assert pool2.run(microbatch_run, cases, False) == [2, 2]


def test_checkpoint_microbatches_during_verification(pool2, cases):
    ks = pool2.run(microbatch_run, cases, True)  # no CheckpointError: recomputations replay their plan
    assert ks[0] == ks[1] and ks[0] in (1, 2)




def wrapped_microbatch_run(rank, ws, cases, per_step, reverse):
    """Checkpoints around a module whose layer input is computed inside the region (a norm, a
    block), so the recomputation feeds the layer a new tensor; ``per_step`` forwards, then their
    backwards (in reverse order with ``reverse``), during first-call verification. Returns the
    plans run and whether the gradients match the same schedule without checkpoints."""
    layers = [_build("mlp_sp", "auto", cases, force_k=2) for _ in range(2)]
    out = []
    for ckpt, layer in zip((True, False), layers):
        fn = lambda t, layer=layer: layer(torch.tanh(t))  # noqa: E731
        ks, grads, pending = [], [], []
        for c in range(16):
            x, dy = _inputs("mlp_sp", cases, rank, c)
            x = x.clone().requires_grad_()
            pending.append((x, checkpoint(fn, x, use_reentrant=False) if ckpt else fn(x), dy))
            ks.append(layer.plan.num_tiles)
            if len(pending) == per_step:
                for x, y, dy in (reversed(pending) if reverse else pending):
                    (y * dy).sum().backward()
                    grads.append(x.grad)
                pending = []
        out.append((ks, grads))
    (ks_c, g_c), (ks_p, g_p) = out
    return ks_c, ks_p, all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(g_c, g_p))


@pytest.mark.parametrize("per_step,reverse", [(1, False), (2, False), (2, True)])
def test_checkpoint_around_a_module_holding_the_layer_during_verification(pool2, cases, per_step, reverse):
    """No CheckpointError, whatever the recomputation order: every recomputation runs its forward's
    plan ([Note: recompute]). One region at a time, the checkpointed layer verifies as the plain
    one does (K=2, 2, 1, 1, ... then a decision)."""
    res = pool2.run(wrapped_microbatch_run, cases, per_step, reverse)
    assert res[0][0] == res[1][0], "the ranks ran different plans"
    for ks_c, ks_p, same in res:
        assert same
        if per_step == 1:
            assert ks_c[:14] == ks_p[:14] == VERIFY_KS, (ks_c, ks_p)


# ------------------------------------------------------------------ higher-order gradients
def _create_graph_run(rank, ws, kind):
    """A few calls with plain backward (the block reaches its fused program), then one with
    ``create_graph=True``: its error, and whether a plain backward still matches afterwards."""
    from overlap_layers import OverlapTransformerBlock
    g = dist.group.WORLD
    torch.manual_seed(0)
    layer = {"mlp": lambda: OverlapMLP(8, 8, group=g), "attention": lambda: OverlapAttention(8, 2, group=g),
             "ulysses": lambda: UlyssesAttention(8, 2, group=g), "moe": lambda: OverlapMoE(8, 8, 4, 2, group=g),
             "block": lambda: OverlapTransformerBlock(8, 2, 16, group=g)}[kind]().double()
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    for _ in range(6):
        x.grad = None
        layer(x).sum().backward()
    before = x.grad.clone()
    try:
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)
        error = None
    except RuntimeError as e:
        error = str(e)
    x.grad = None
    layer(x).sum().backward()
    return error, torch.allclose(x.grad, before, rtol=1e-10, atol=1e-12)  # plans may differ while verifying


@pytest.mark.parametrize("kind", ["mlp", "attention", "ulysses", "moe", "block"])
def test_create_graph_raises_instead_of_gradients_without_a_graph(pool2, kind):
    """Double backward through a layer ([Note: first-order backward]): a RuntimeError on every
    rank, never first-order gradients that silently carry no graph; the layer works on after."""
    for error, same in pool2.run(_create_graph_run, kind):
        assert error is not None and "first-order gradients only" in error and "create_graph=True" in error
        assert same


def _retain_graph_run(rank, ws, kind, plan):
    """One call, backward with ``retain_graph=True`` and again: the second's error (None if it
    ran) and whether x's and the parameters' gradients are then twice one backward's; then a
    fresh call's backward, which must match one backward's."""
    from overlap_layers import OverlapTransformerBlock
    g = dist.group.WORLD
    torch.manual_seed(0)
    layer = {"mlp": lambda: OverlapMLP(8, 8, group=g), "attention": lambda: OverlapAttention(8, 2, group=g),
             "ulysses": lambda: UlyssesAttention(8, 2, group=g), "moe": lambda: OverlapMoE(8, 8, 4, 2, group=g),
             "block": lambda: OverlapTransformerBlock(8, 2, 16, group=g)}[kind]().double()
    if plan is not None:
        for m in layer.modules():
            if hasattr(m, "pin_plan"):
                m.pin_plan(plan)
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)

    def grads():
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    def one_backward(**kw):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        y.sum().backward(**kw)
        return y
    y = one_backward()
    one = grads()
    y = one_backward(retain_graph=True)
    try:
        y.sum().backward()
        error, doubled = None, all(torch.allclose(a, 2 * b, rtol=1e-10, atol=1e-12) for a, b in zip(grads(), one))
    except RuntimeError as e:
        error, doubled = str(e), None
    one_backward()
    return error, doubled, all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(grads(), one))


@pytest.mark.parametrize("kind,plan", [("mlp", TilePlan(2)), ("mlp", TilePlan(1, decomposition="rank")),
                                       ("attention", TilePlan(2)), ("attention", TilePlan(1, decomposition="rank")),
                                       ("ulysses", TilePlan(2)), ("moe", TilePlan(2)),
                                       ("moe", TilePlan(1, decomposition="rank")), ("block", None)])
def test_second_backward_through_a_call_with_retain_graph_doubles(pool2, kind, plan):
    """``retain_graph=True`` then a second backward ([Note: first-order backward]): twice one
    backward's gradients for x and every parameter, and the layer works on after."""
    for error, doubled, fresh in pool2.run(_retain_graph_run, kind, plan):
        assert error is None and doubled and fresh


def _second_backward_without_retain(rank, ws, kind):
    from overlap_layers import OverlapTransformerBlock
    g = dist.group.WORLD
    layer = {"attention": lambda: OverlapAttention(8, 2, group=g, num_tiles=2),
             "moe": lambda: OverlapMoE(8, 8, 4, 2, group=g, num_tiles=2),
             "block": lambda: OverlapTransformerBlock(8, 2, 16, group=g)}[kind]()
    y = layer(torch.randn(2, 4, 8, requires_grad=True))
    y.sum().backward()
    try:
        y.sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["attention", "moe", "block"])
def test_second_backward_without_retain_graph_raises(pool2, kind):
    """Without ``retain_graph`` the first backward frees what the call kept: a second raises a
    RuntimeError on every rank (autograd's own, or the layers' naming retain_graph), never a
    TypeError or wrong gradients."""
    for error in pool2.run(_second_backward_without_retain, kind):
        assert error is not None and ("retain_graph" in error or "second time" in error), error


# ------------------------------------------------------------------ copy.deepcopy
def _deepcopy_run(rank, ws, kind, with_mesh):
    """A layer after a few calls, its deep copy, then one call of each on the same input:
    outputs, x's and the parameters' gradients side by side, and what the copy shares."""
    import copy
    from torch.distributed.tensor import DTensor
    from overlap_layers import OverlapTransformerBlock
    kw = dict(group=dist.group.WORLD)
    if with_mesh:
        from torch.distributed.device_mesh import init_device_mesh
        kw = dict(mesh=init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)))
    torch.manual_seed(0)
    layer = {"mlp": lambda: OverlapMLP(8, 8, **kw), "attention": lambda: OverlapAttention(8, 2, **kw),
             "ulysses": lambda: UlyssesAttention(8, 2, **kw),
             "moe": lambda: OverlapMoE(8, 8, 4, 2, aux_loss_coef=0.01, **kw),
             "block": lambda: OverlapTransformerBlock(8, 2, 16, **kw)}[kind]().double()
    if kind == "mlp":
        layer.pin_plan(TilePlan(2))
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        layer(x).sum().backward()
    twin = copy.deepcopy(layer)
    outs = [[t.to_local() if isinstance(t, DTensor) else t for t in o] for o in call_each((layer, twin), x, torch.sum)]
    same = all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(*outs))
    own = all(p is not q for p, q in zip(layer.parameters(), twin.parameters()))
    first = next(layer.parameters())
    before = (first.to_local() if isinstance(first, DTensor) else first).clone()
    with torch.no_grad():
        next(twin.parameters()).mul_(2)  # the original's parameters stay as they were
    untouched = torch.equal(first.to_local() if isinstance(first, DTensor) else first, before)
    subs = [(a, b) for a, b in zip(layer.modules(), twin.modules()) if hasattr(a, "pin_plan")]
    return dict(same=same, own=own, untouched=untouched, group=all(b.group is a.group for a, b in subs),
                pinned=[str(b.planner.pinned) == str(a.planner.pinned) for a, b in subs],
                replanned=[b.plan is not None for _, b in subs])


@pytest.mark.parametrize("kind,with_mesh", [("mlp", False), ("attention", False), ("ulysses", False), ("moe", False),
                                            ("block", False), ("mlp", True), ("block", True)])
def test_deepcopy_is_an_independent_layer_on_the_same_group(pool2, kind, with_mesh):
    """``copy.deepcopy`` ([Note: copying a layer]): the copy computes what the original does
    (outputs and gradients), holds its own parameters (changing one leaves the original alone),
    shares the group, keeps a pinned plan, and plans at its own first call."""
    for r in pool2.run(_deepcopy_run, kind, with_mesh):
        assert r["same"] and r["own"] and r["group"] and all(r["pinned"]) and all(r["replanned"]), r
