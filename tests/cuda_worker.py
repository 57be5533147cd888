"""CUDA checks, one process per GPU under torchrun (run by test_cuda.py; tier 3).

Numerics of OverlapMLP on NCCL with real streams against a float64 dense reference computed on
each rank, autocast bf16, no_grad, and peak memory: the tiled layer must stay within the serial
layer's peak plus one tile of intermediates. Exits non-zero on the first failure.
"""
import gc
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap_layers import OverlapMLP  # noqa: E402
from overlap_layers.layers.mlp.layer import MLPPlan  # noqa: E402
from pool import call_each  # noqa: E402


def dense(x, w_in, w_out, b_in, b_out, act):
    pre = x @ w_in.T + (0 if b_in is None else b_in)
    if act == "swiglu":
        g, u = pre.chunk(2, -1)
        h = g * torch.sigmoid(g) * u
    else:
        h = 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2))) if act == "gelu" else pre.clamp(min=0)
    return h @ w_out.T + (0 if b_out is None else b_out)


def count_fails(rank: int, label: str, pairs, tol: float) -> int:
    """How many ``(name, got, want)`` pairs are off by a relative error of ``tol`` or more; prints each."""
    fails = 0
    for name, got, want in pairs:
        err = ((got.double().to(want.device) - want).norm() / want.norm().clamp_min(1e-12)).item()
        if not err < tol:
            fails += 1
            print(f"rank {rank} FAIL {label} {name}: rel err {err:.3g}", flush=True)
    return fails


def fell_back(rank: int, layer, plan) -> int:
    """1 (and a line) if a copy-engine ``plan`` ran without the copy engine on ``layer``."""
    if plan.transport == "copy_engine" and layer._workspace is None:
        print(f"rank {rank} FAIL {plan.label}: fell back from the copy engine ({layer._copy_engine})", flush=True)
        return 1
    return 0


def check_numerics(rank, ws, dev):
    torch.backends.cuda.matmul.allow_tf32 = False
    fails = 0
    for sp in (True, False):
        for act, bias in (("swiglu", False), ("gelu", True), ("relu", True)):
            rank_plans = (MLPPlan(1, decomposition="rank"), MLPPlan(1, decomposition="rank", transport="copy_engine"),
                          MLPPlan(1, regather=True, decomposition="rank", transport="copy_engine")) if sp else ()
            for plan in (MLPPlan(1), MLPPlan(2), MLPPlan(3), MLPPlan(4), MLPPlan(3, regather=True),
                         MLPPlan(3, carveout=(16, 8)),
                         MLPPlan(4, buckets_fwd=(("ag" if sp else "ar", ((0, 1), (2, 3))),),
                                 buckets_bwd=(("ag_dy" if sp else "ar_dx", ((0,), (1, 2, 3))),)), *rank_plans):
                g = torch.Generator(device="cpu").manual_seed(7)
                H, Fd, B, S = 64, 32 * ws, 2, 12 * ws
                n_in = 2 * Fd if act == "swiglu" else Fd
                r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dev)  # noqa: E731
                x, dy = r(B, S, H), r(B, S, H)
                w_in, w_out = r(n_in, H) / 8, r(H, Fd) / math.sqrt(Fd)
                b_in, b_out = (r(n_in), r(H)) if bias else (None, None)
                leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w_in, w_out, b_in, b_out)]
                y_ref = dense(*leaves, act)
                y_ref.backward(dy)
                f32 = lambda t: t.float() if t is not None else None  # noqa: E731
                layer = OverlapMLP.from_dense(f32(w_in), f32(w_out), b_in=f32(b_in), b_out=f32(b_out),
                                              group=dist.group.WORLD, sequence_parallel=sp, activation=act)
                layer.pin_plan(plan)
                loc = (lambda t: t.chunk(ws, 1)[rank]) if sp else (lambda t: t)
                xl = loc(x).float().requires_grad_()
                y = layer(xl)
                y.backward(loc(dy).float())
                dense_w = layer.to_dense()
                fl = Fd // ws
                want_w_in = leaves[1].grad
                if act == "swiglu":
                    want_w_in = torch.cat([want_w_in[rank * fl:(rank + 1) * fl], want_w_in[Fd + rank * fl:Fd + (rank + 1) * fl]])
                else:
                    want_w_in = want_w_in[rank * fl:(rank + 1) * fl]
                pairs = [("y", y, loc(y_ref)), ("dx", xl.grad, loc(leaves[0].grad)),
                         ("w_in.grad", layer.w_in.grad, want_w_in),
                         ("w_out.grad", layer.w_out.grad, leaves[2].grad[:, rank * fl:(rank + 1) * fl]),
                         ("to_dense", dense_w["w_in"], w_in)]
                fails += fell_back(rank, layer, plan) + count_fails(rank, f"sp={sp} {act} {plan}", pairs, 1e-5)
    return fails


def check_sm_carveout(rank, ws, dev):
    """[Note: SM carveout]: inside ``gemm_sm_carveout`` GEMMs run on cuBLASLt with the carveout
    set and give the same product; after it, and after a carved layer call (forward and backward),
    PyTorch's settings are what they were."""
    from overlap_layers.runtime.carveout import gemm_sm_carveout

    def settings():
        return torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()

    fails, before = 0, settings()
    a = torch.randn(512, 256, device=dev, dtype=torch.bfloat16)
    b = torch.randn(256, 384, device=dev, dtype=torch.bfloat16)
    want = a.double() @ b.double()
    with gemm_sm_carveout(16):
        inside = settings()
        got = a @ b
    fails += count_fails(rank, "carved GEMM", [("a @ b", got, want)], 1e-2)
    if "cublaslt" not in str(inside[0]).lower() or inside[1] != 16:
        fails += 1
        print(f"rank {rank} FAIL carveout not set inside: {inside}", flush=True)
    after = [("after the block", settings())]
    layer = OverlapMLP(64, 32 * ws, group=dist.group.WORLD, dtype=torch.bfloat16, device=dev)
    layer.pin_plan(MLPPlan(3, carveout=(16, 8)))
    x = torch.randn(2, 12, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    torch.cuda.synchronize(dev)
    after.append(("after a carved call", settings()))
    for where, now in after:
        if now != before:
            fails += 1
            print(f"rank {rank} FAIL carveout settings {where}: {now} != {before}", flush=True)
    return fails


def check_copy_engine_trace(rank, ws, dev):
    """export_trace of the copy-engine plan: predicted and measured hold the same ops."""
    import json
    import tempfile
    from collections import Counter
    layer = OverlapMLP(64, 32 * ws, group=dist.group.WORLD, device=dev)
    layer.pin_plan(MLPPlan(1, decomposition="rank", transport="copy_engine"))
    x = torch.randn(1, 16, 64, device=dev, requires_grad=True)
    layer(x).sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        layer.export_trace(f"{tmp}/pred.json")
        layer.export_trace(f"{tmp}/meas.json", measured=True)
        layer(x).sum().backward()
        got = [Counter(e["name"] for e in json.load(open(f"{tmp}/{n}.json"))["traceEvents"] if e["ph"] == "X")
               for n in ("pred", "meas")]
    if got[0] != got[1] or got[0]["to_symmetric[0]"] != 2 or got[0]["pull[1]"] != 2:
        print(f"rank {rank} FAIL copy-engine trace: predicted {got[0]} measured {got[1]}", flush=True)
        return 1
    return 0


def check_copy_engine_reuse(rank, ws, dev):
    """Two layers sharing one symmetric workspace, called back to back for several steps with
    growing token counts (the workspace grows), forward and backward: every result equals the same
    plan over NCCL send/recv (the same arithmetic, another transport)."""
    fails = 0
    torch.manual_seed(3)
    outs = {}
    for transport in ("nccl", "copy_engine"):
        torch.manual_seed(3)
        layers = [OverlapMLP(64, 32 * ws, group=dist.group.WORLD, device=dev) for _ in range(2)]
        for layer in layers:
            layer.pin_plan(MLPPlan(1, decomposition="rank", transport=transport))
        res = []
        for step, rows in enumerate((8, 8, 24, 16, 40)):
            g = torch.Generator(device="cpu").manual_seed(100 + step * ws + rank)
            x = torch.randn(1, rows, 64, generator=g).to(dev).requires_grad_()
            y = layers[1](layers[0](x))
            y.square().sum().backward()
            res += [y.detach(), x.grad]
        res += [p.grad for layer in layers for p in layer.parameters()]
        outs[transport] = res
        if transport == "copy_engine" and layers[0]._workspace is not layers[1]._workspace:
            fails += 1
            print(f"rank {rank} FAIL: the layers do not share one workspace", flush=True)
    for i, (a, b) in enumerate(zip(outs["nccl"], outs["copy_engine"])):
        err = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
        if not err < 1e-6:
            fails += 1
            print(f"rank {rank} FAIL copy-engine reuse, tensor {i}: rel err {err:.3g}", flush=True)
    return fails


def check_autocast_and_no_grad(rank, ws, dev):
    layer = OverlapMLP(256, 512, group=dist.group.WORLD, num_tiles=2, device=dev)
    x = torch.randn(2, 64, 256, device=dev, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    ok = y.dtype == torch.bfloat16 and layer.w_in.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    with torch.no_grad():
        y2 = layer(x)
    ok = ok and y2.grad_fn is None
    if not ok:
        print(f"rank {rank} FAIL autocast/no_grad", flush=True)
    return 0 if ok else 1


def check_mismatch_raises(rank, ws, dev):
    """Ranks passing different shapes all get the same ValueError (the host-side agreement)."""
    layer = OverlapMLP(64, 64 * ws, group=dist.group.WORLD, device=dev, num_tiles=2)
    try:
        layer(torch.randn(1, 8 + rank, 64, device=dev))
    except ValueError as e:
        if "seq differs" in str(e):
            layer(torch.randn(1, 8, 64, device=dev))  # the group still works afterwards
            return 0
    print(f"rank {rank} FAIL: mismatched shapes did not raise", flush=True)
    return 1


def check_peak_memory(rank, ws, dev):
    H, Fd, tokens = 2048, 8192, 8192
    dtype = torch.bfloat16
    layer = OverlapMLP(H, Fd, group=dist.group.WORLD, device=dev, dtype=dtype)
    x = torch.randn(1, tokens // ws, H, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    peaks = {}
    for k in (1, 2, 4):
        layer.pin_plan(MLPPlan(k))
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            layer(x).backward(dy)
            torch.cuda.synchronize()
            peaks[k] = torch.cuda.max_memory_allocated() - base
            x.grad = None
            layer.zero_grad(set_to_none=True)
    fails = 0
    elt = torch.tensor([], dtype=dtype).element_size()
    for k in (2, 4):
        m = tokens // k  # gathered rows of one tile
        tile = m * (2 * Fd // ws + Fd // ws + H) * elt  # pre + h + partial output
        if rank == 0:
            print(f"peak fwd+bwd: K=1 {peaks[1] / 2**20:.1f} MiB, K={k} {peaks[k] / 2**20:.1f} MiB, "
                  f"one tile {tile / 2**20:.1f} MiB", flush=True)
        if peaks[k] > peaks[1] + tile:
            fails += 1
            print(f"rank {rank} FAIL peak K={k}: {peaks[k]} > {peaks[1]} + {tile}", flush=True)
    return fails


def check_auto_plan_cache_and_trace(rank, ws, dev):
    """Auto planning on CUDA: calibration stored to the cache dir and reused by a second layer
    (no recalibration), first-call verification settles with CUDA events, measured trace."""
    import json
    import tempfile
    import overlap_layers.planning.plan_maker as mlp_module
    from overlap_layers import OverlapConfig
    fails = 0
    name = [tempfile.mkdtemp(prefix="ol_cache_") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    cfg = OverlapConfig(cache_dir=name[0])
    layer = OverlapMLP(1024, 1024 * ws, group=dist.group.WORLD, device=dev, dtype=torch.bfloat16, config=cfg)
    x = torch.randn(2, 512, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(128):  # past first-call verification (2 calls x 3 rounds per contender, twice if disturbed)
        layer(x).sum().backward()
        if not layer.verifying:  # equal on every rank (the same step count), so every rank stops together
            break
    digests = [None] * ws
    dist.all_gather_object(digests, (layer.plan.digest(), layer.verifying, layer.plan.reason))
    if len({d[0] for d in digests}) != 1 or any(d[1] for d in digests):
        fails += 1
        print(f"rank {rank} FAIL auto plan: {digests}", flush=True)
    if rank == 0:
        print(f"auto plan on CUDA: K={layer.plan.num_tiles}; {layer.plan.reason}", flush=True)
    calibrate = mlp_module.calibrate
    mlp_module.calibrate = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("recalibrated"))
    try:
        again = OverlapMLP(1024, 1024 * ws, group=dist.group.WORLD, device=dev, dtype=torch.bfloat16, config=cfg)
        again(x).sum().backward()
    except RuntimeError as e:
        fails += 1
        print(f"rank {rank} FAIL cache not reused: {e}", flush=True)
    finally:
        mlp_module.calibrate = calibrate
    layer.pin_plan(MLPPlan(2))
    path = os.path.join(name[0], f"trace{rank}.json")
    layer.export_trace(path, measured=True)
    layer(x).sum().backward()
    rows = {e["args"]["name"] for e in json.load(open(path))["traceEvents"] if e.get("name") == "thread_name"}
    if rows != {"compute0", "compute1", "comm"}:
        fails += 1
        print(f"rank {rank} FAIL measured trace rows {rows}", flush=True)
    return fails


def check_attention(rank, ws, dev):
    """OverlapAttention on NCCL with streams: float32 vs a float64 dense reference (GQA, qk-norm,
    SP, K=2 with a bucket) for output and gradients; then auto planning settles in bf16."""
    from attention_reference import dense_attention
    from overlap_layers import OverlapAttention, reduce_replicated_grads
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cpu").manual_seed(3)
    B, S, H, nq, nkv, d = 2, 16 * ws, 64, 2 * ws, max(ws // 2, 1), 16
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * 0.3).to(dev)  # noqa: E731
    x, dy = r(B, S, H), r(B, S, H)
    ws_ = [r(nq * d, H), r(nkv * d, H), r(nkv * d, H), r(H, nq * d)]
    qn, kn = r(d) + 1, r(d) + 1
    leaves = [t.clone().requires_grad_() for t in [x, *ws_, qn, kn]]
    y_ref = dense_attention(leaves[0], *leaves[1:5], num_heads=nq, num_kv_heads=nkv, q_norm=leaves[5],
                            k_norm=leaves[6])
    y_ref.backward(dy)
    fails = 0
    for plan in (MLPPlan(2, buckets_bwd=(("ag_dy", ((0, 1),)),)), MLPPlan(1, decomposition="rank"),
                 MLPPlan(1, decomposition="rank", transport="copy_engine"),
                 MLPPlan(1, regather=True, decomposition="rank", transport="copy_engine"),
                 MLPPlan(2, decomposition="rank", transport="copy_engine"),  # rank chunks in 2 batch tiles
                 MLPPlan(2, regather=True, decomposition="rank", transport="copy_engine")):
        layer = OverlapAttention.from_dense(*[t.float() for t in ws_], num_heads=nq, num_kv_heads=nkv,
                                            q_norm=qn.float(), k_norm=kn.float(), group=dist.group.WORLD)
        layer.pin_plan(plan)
        xl = x.chunk(ws, 1)[rank].float().requires_grad_()
        y = layer(xl)
        y.backward(dy.chunk(ws, 1)[rank].float())
        reduce_replicated_grads(layer)
        qh = range(rank * (nq // ws), (rank + 1) * (nq // ws))
        pairs = [("y", y, y_ref.chunk(ws, 1)[rank]), ("dx", xl.grad, leaves[0].grad.chunk(ws, 1)[rank]),
                 ("wq", layer.wq.grad, leaves[1].grad[qh.start * d:qh.stop * d]),
                 ("wo", layer.wo.grad, leaves[4].grad[:, qh.start * d:qh.stop * d]), ("q_norm", layer.q_norm.grad,
                                                                                      leaves[5].grad)]
        fails += fell_back(rank, layer, plan) + count_fails(rank, f"attention {plan.label}", pairs, 1e-4)
    fails += check_attention_query_chunks(rank, ws, dev, x, dy, ws_, nq, nkv, d)
    auto = OverlapAttention(512, 8, 4, group=dist.group.WORLD, device=dev, dtype=torch.bfloat16)
    xa = torch.randn(4, 256, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(128):  # verification takes 2 calls per contender and trial (28 for 4 contenders, or 52)
        auto(xa).sum().backward()
        if not auto.verifying:  # equal on every rank (the same step count), so every rank stops together
            break
    digests = [None] * ws
    dist.all_gather_object(digests, (auto.plan.digest(), auto.verifying))
    if len({dg[0] for dg in digests}) != 1 or any(dg[1] for dg in digests):
        fails += 1
        print(f"rank {rank} FAIL attention auto plan: {digests}", flush=True)
    if rank == 0:
        print(f"attention auto plan on CUDA: K={auto.plan.num_tiles}; {auto.plan.reason}", flush=True)
    return fails


def check_attention_query_chunks(rank, ws, dev, x, dy, ws_, nq, nkv, d):
    """bf16 rank chunks without qk-norm, where the core runs by query chunks (cuDNN pieces and the
    Triton merge): against the float64 dense reference at bf16's tolerance, output and gradients,
    causal and not."""
    from attention_reference import dense_attention
    from overlap_layers import OverlapAttention
    fails = 0
    for causal in (True, False):
        leaves = [t.clone().requires_grad_() for t in [x, *ws_]]
        y_ref = dense_attention(leaves[0], *leaves[1:5], num_heads=nq, num_kv_heads=nkv, causal=causal)
        y_ref.backward(dy)
        for plan in (MLPPlan(1, decomposition="rank", transport="copy_engine"),
                     MLPPlan(2, decomposition="rank", transport="copy_engine"), MLPPlan(1, decomposition="rank"),
                     MLPPlan(1)):  # and the serial layer (the core's autograd graph), in bf16 too
            layer = OverlapAttention.from_dense(*[t.bfloat16() for t in ws_], num_heads=nq, num_kv_heads=nkv,
                                                causal=causal, group=dist.group.WORLD)
            assert layer._query_chunk_core(torch.bfloat16, dev), "cuDNN SDPA should run the query-chunk core here"
            layer.pin_plan(plan)
            xl = x.chunk(ws, 1)[rank].bfloat16().requires_grad_()
            y = layer(xl)
            y.backward(dy.chunk(ws, 1)[rank].bfloat16())
            qh = range(rank * (nq // ws), (rank + 1) * (nq // ws))
            pairs = [("y", y, y_ref.chunk(ws, 1)[rank]), ("dx", xl.grad, leaves[0].grad.chunk(ws, 1)[rank]),
                     ("wq", layer.wq.grad, leaves[1].grad[qh.start * d:qh.stop * d]),
                     ("wo", layer.wo.grad, leaves[4].grad[:, qh.start * d:qh.stop * d])]
            label = f"attention bf16 query chunks causal={causal} {plan.label}"
            fails += fell_back(rank, layer, plan) + count_fails(rank, label, pairs, 3e-2)
    return fails


def check_moe_and_ulysses(rank, ws, dev):
    """OverlapMoE (uneven tokens per rank, K=2) and UlyssesAttention (K=2) on NCCL streams,
    float32 against float64 dense references; expert gradients summed over every rank's tokens."""
    from attention_reference import dense_attention
    from moe_reference import dense_moe
    from overlap_layers import OverlapMoE, UlyssesAttention
    torch.backends.cuda.matmul.allow_tf32 = False
    fails = 0
    g = torch.Generator(device="cpu").manual_seed(5)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * 0.3).to(dev)  # noqa: E731
    E, H, F = 2 * ws, 32, 16
    rw, wi, wo = r(E, H), r(E, 2 * F, H), r(E, H, F)
    xs = [r(1 + j, 8, H) for j in range(ws)]
    leaves = [t.clone().requires_grad_() for t in (xs[rank], rw, wi, wo)]
    y_ref, _ = dense_moe(*leaves, top_k=2)
    dy = torch.ones_like(y_ref)
    y_ref.backward(dy)
    layer = OverlapMoE.from_dense(rw.float(), wi.float(), wo.float(), top_k=2, group=dist.group.WORLD, num_tiles=2)
    x = xs[rank].float().requires_grad_()
    y = layer(x)
    y.backward(dy.float())
    gi = leaves[2].grad.clone()
    dist.all_reduce(gi)
    El = E // ws
    pairs = [("moe y", y, y_ref), ("moe dx", x.grad, leaves[0].grad), ("moe router", layer.router_weight.grad,
                                                                     leaves[1].grad),
             ("moe w_in", layer.w_in.grad, gi[rank * El:(rank + 1) * El])]
    nq, nkv, d, S = 2 * ws, ws, 8, 8 * ws
    xa, dya = r(2, S, 4 * d), r(2, S, 4 * d)
    wts = [r(nq * d, 4 * d), r(nkv * d, 4 * d), r(nkv * d, 4 * d), r(4 * d, nq * d)]
    la = [t.clone().requires_grad_() for t in [xa, *wts]]
    ya_ref = dense_attention(la[0], *la[1:], num_heads=nq, num_kv_heads=nkv)
    ya_ref.backward(dya)
    ul = UlyssesAttention.from_dense(*[t.float() for t in wts], num_heads=nq, num_kv_heads=nkv,
                                     group=dist.group.WORLD, num_tiles=2)
    xl = xa.chunk(ws, 1)[rank].float().requires_grad_()
    yl = ul(xl)
    yl.backward(dya.chunk(ws, 1)[rank].float())
    gq = ul.wq.grad.clone()
    dist.all_reduce(gq)
    pairs += [("ulysses y", yl, ya_ref.chunk(ws, 1)[rank]), ("ulysses dx", xl.grad, la[0].grad.chunk(ws, 1)[rank]),
              ("ulysses wq", gq, la[1].grad)]
    return fails + count_fails(rank, "", pairs, 1e-4)


def check_half_router_logits(rank, ws, dev):
    """The MoE's router GEMM on half operands with float32 output (moe.router_logits) against the
    float64 product of the same values, forward and both gradients (gradients cast to bf16 /
    fp16, as the converted reference's), and that it takes the out_dtype path."""
    from overlap_layers.layers.moe.routing import router_logits
    g = torch.Generator(device="cpu").manual_seed(21 + rank)
    fails = 0
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(300, 256, generator=g).to(dev, dtype).requires_grad_()
        w = (torch.randn(40, 256, generator=g) * 0.05).to(dev, dtype).requires_grad_()
        gy = torch.randn(300, 40, generator=g).to(dev)
        y = router_logits(x, w)
        if y.dtype != torch.float32 or y.grad_fn is None or "_HalfRouterLogits" not in type(y.grad_fn).__name__:
            fails += 1
            print(f"rank {rank} FAIL router logits {dtype}: {y.dtype}, {type(y.grad_fn).__name__}", flush=True)
        with torch.no_grad():  # the GEMM alone, no autograd function: the same product
            y0 = router_logits(x, w)
        if y0.grad_fn is not None or not torch.equal(y0, y.detach()):
            fails += 1
            print(f"rank {rank} FAIL router logits {dtype} without grad: differs from the GEMM with grad", flush=True)
        y.backward(gy)
        xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        yd = xd @ wd.t()
        yd.backward(gy.double())
        fails += count_fails(rank, f"router logits {dtype}", [("y", y, yd)], 1e-5)
        fails += count_fails(rank, f"router logits {dtype}", [("dx", x.grad, xd.grad), ("dw", w.grad, wd.grad)], 1e-2)
    return fails


def check_moe_rank_chunks(rank, ws, dev):
    """OverlapMoE split by source rank (layers/moe/ranks.py), over the copy engine and over NCCL
    send/recv, float32 (dropless and with capacity drops) and bf16, uneven tokens per rank, two
    calls each (the symmetric buffer reused), against the float64 dense reference; 4 local
    experts (weight gradients by an accumulating GEMM per expert) and 10 (grouped, each later
    piece added in its GEMM: [Note: expert weight gradients in the GEMM])."""
    from moe_reference import dense_moe
    from overlap_layers import OverlapMoE
    from overlap_layers.planning.plan import TilePlan
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cpu").manual_seed(11)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * 0.3).to(dev)  # noqa: E731
    H, F, k = 64, 32, 3
    xs = [r(1, 40 + 24 * j, H) for j in range(ws)]
    # every rank draws the same weights, before the per-rank dy draws make the generators differ
    weights = {El: (r(El * ws, H), r(El * ws, 2 * F, H), r(El * ws, H, F)) for El in (4, 10)}
    fails = 0
    for El, transport, dtype, cf, tol in ((4, "copy_engine", torch.float32, None, 1e-4),
                                          (4, "nccl", torch.float32, None, 1e-4),
                                          (4, "copy_engine", torch.float32, 0.5, 1e-4),
                                          (4, "copy_engine", torch.bfloat16, None, 3e-2),
                                          (10, "copy_engine", torch.float32, None, 1e-4),
                                          (10, "copy_engine", torch.bfloat16, 0.5, 3e-2)):
        rw, wi, wo = weights[El]
        leaves = [t.to(dtype).double().clone().requires_grad_() for t in (xs[rank], rw, wi, wo)]
        y_ref, _ = dense_moe(*leaves, top_k=k, capacity_factor=cf, capacity_key="prob")
        dy = torch.randn(y_ref.shape, generator=g, dtype=torch.float64).to(dev).to(dtype)
        y_ref.backward(dy.double())
        gi, go = leaves[2].grad.clone(), leaves[3].grad.clone()
        dist.all_reduce(gi)
        dist.all_reduce(go)
        layer = OverlapMoE.from_dense(rw.to(dtype), wi.to(dtype), wo.to(dtype), top_k=k, group=dist.group.WORLD,
                                      capacity_factor=cf)
        plan = TilePlan(1, decomposition="rank", transport=transport)
        layer.pin_plan(plan)
        for _ in range(2):
            layer.zero_grad(set_to_none=True)
            x = xs[rank].to(dtype).requires_grad_()
            y = layer(x)
            y.backward(dy)
        label = f"moe rank {transport} {dtype} cf={cf} El={El}"
        if layer.plan.decomposition != "rank":
            print(f"rank {rank} FAIL {label}: ran {layer.plan.label}", flush=True)
            fails += 1
        fails += fell_back(rank, layer, plan)
        fails += count_fails(rank, label, [("y", y, y_ref), ("dx", x.grad, leaves[0].grad),
                                           ("router", layer.router_weight.grad, leaves[1].grad),
                                           ("w_in", layer.w_in.grad, gi[rank * El:(rank + 1) * El]),
                                           ("w_out", layer.w_out.grad, go[rank * El:(rank + 1) * El])], tol)
    return fails


def check_block(rank, ws, dev):
    """OverlapTransformerBlock (MLP and MoE, sequence parallel, K=2) on NCCL streams, float32 on
    the GPU against the float64 dense block on the CPU; norm and router gradients after
    finalize_grads."""
    from block_reference import EPS, NKV, NQ, THETA, TOPK, make_case, reference
    from overlap_layers import OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock, finalize_grads
    torch.backends.cuda.matmul.allow_tf32 = False
    fails, group = 0, dist.group.WORLD
    for moe in (False, True):
        c = make_case(7, moe=moe, S=4 * ws)
        y_ref, g = reference(c)
        f = lambda t: t.to(dev, torch.float32)  # noqa: E731
        attn = OverlapAttention.from_dense(f(c["wq"]), f(c["wk"]), f(c["wv"]), f(c["wo"]), num_heads=NQ,
                                           num_kv_heads=NKV, group=group, rope_theta=THETA, num_tiles=2)
        mlp = OverlapMoE.from_dense(f(c["router"]), f(c["w_in"]), f(c["w_out"]), top_k=TOPK, group=group,
                                    num_tiles=2) if moe else \
            OverlapMLP.from_dense(f(c["w_in"]), f(c["w_out"]), group=group, activation="swiglu", num_tiles=2)
        blk = OverlapTransformerBlock.from_layers(attn, mlp, norm=c["norm"], norm_eps=EPS,
                                                  attn_norm_weight=f(c["an_w"]), mlp_norm_weight=f(c["mn_w"]))
        own = slice(rank * 4, (rank + 1) * 4)
        x = f(c["x"][:, own]).requires_grad_()
        y = blk(x)
        y.backward(f(c["dy"][:, own]))
        finalize_grads(blk)
        # the same block under torch.compile (fullgraph: every sublayer call one opaque op)
        import torch._dynamo as dynamo
        dynamo.reset()
        grads = [p.grad.clone() for p in blk.parameters()]
        blk.zero_grad(set_to_none=True)
        xc = x.detach().clone().requires_grad_()
        yc = torch.compile(blk, backend="aot_eager", fullgraph=True)(xc)
        yc.backward(f(c["dy"][:, own]))
        finalize_grads(blk)
        same = torch.allclose(yc, y, rtol=1e-5, atol=1e-6) and torch.allclose(xc.grad, x.grad, rtol=1e-5, atol=1e-6) \
            and all(torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6) for p, g in zip(blk.parameters(), grads))
        dynamo.reset()
        if not same:
            fails += 1
            print(f"rank {rank} FAIL block (moe={moe}) under torch.compile differs from eager", flush=True)
        pairs = [("y", y, y_ref[:, own]), ("dx", x.grad, g["x"][:, own]), ("attn_norm", blk.attn_norm.weight.grad,
                                                                         g["an_w"])]
        if moe:
            pairs.append(("router", blk.mlp.router_weight.grad, g["router"]))
        fails += count_fails(rank, f"block (moe={moe})", pairs, 1e-4)
    return fails


def check_fused_block(rank, ws, dev):
    """The fused block program (``layers/block/fused.py``: the attention at K=2, each tile two MLP tiles, in
    one program on the layers' streams and NCCL) in float32 against the float64 dense block, forward and gradients,
    for every call of the block's verification (fused and in turn) and the call after it."""
    from block_reference import EPS, NKV, NQ, THETA, make_case, reference
    from overlap_layers import OverlapAttention, OverlapMLP, OverlapTransformerBlock, finalize_grads
    from overlap_layers.planning.plan import TilePlan
    torch.backends.cuda.matmul.allow_tf32 = False
    fails, group = 0, dist.group.WORLD
    c = make_case(8, S=4 * ws, norm="layernorm")
    y_ref, g = reference(c)
    f = lambda t: t.to(dev, torch.float32)  # noqa: E731
    attn = OverlapAttention.from_dense(f(c["wq"]), f(c["wk"]), f(c["wv"]), f(c["wo"]), num_heads=NQ,
                                       num_kv_heads=NKV, group=group, rope_theta=THETA, num_tiles="auto")
    mlp = OverlapMLP.from_dense(f(c["w_in"]), f(c["w_out"]), group=group, activation="swiglu", num_tiles="auto")
    blk = OverlapTransformerBlock.from_layers(attn, mlp, norm=c["norm"], norm_eps=EPS, attn_norm_weight=f(c["an_w"]),
                                              mlp_norm_weight=f(c["mn_w"]), attn_norm_bias=f(c["an_b"]),
                                              mlp_norm_bias=f(c["mn_b"]))
    attn.settled_plan = lambda *a: TilePlan(2)
    mlp.settled_plan = lambda *a: TilePlan(4)  # two MLP tiles in each of the attention's
    own = slice(rank * 4, (rank + 1) * 4)
    seen = set()
    for _ in range(2 + 2 * 2 * 3 + 1):  # every verification call (warm-up, three trials of two), then one
        blk.zero_grad(set_to_none=True)
        x = f(c["x"][:, own]).requires_grad_()
        y = blk(x)
        y.backward(f(c["dy"][:, own]))
        finalize_grads(blk)
        seen.add(blk.plan.label)
        pairs = [("y", y, y_ref[:, own]), ("dx", x.grad, g["x"][:, own]),
                 ("attn_norm", blk.attn_norm.weight.grad, g["an_w"]), ("mlp_norm", blk.mlp_norm.bias.grad, g["mn_b"])]
        fails += count_fails(rank, f"fused block ({blk.plan.label})", pairs, 1e-4)
    if "fused K=2" not in seen:
        fails += 1
        print(f"rank {rank} FAIL the fused block never ran fused: {seen}", flush=True)
    return fails


def _graphed_step(layer, x, dy):
    """A CUDA graph of one forward+backward of ``layer`` on static ``x`` / ``dy`` (after two eager
    warm-up steps on a side stream); returns (graph, y, grads of x and the parameters)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.autograd.grad(layer(x), [x, *params], dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
        grads = torch.autograd.grad(y, [x, *params], dy)
    return graph, y, grads


def check_cuda_graphs(rank, ws, dev):
    """[Note: CUDA graphs]: a captured forward+backward replayed on new inputs equals the eager
    call on them (OverlapMLP serial, K=2, rank chunks over NCCL and the copy engine; OverlapAttention
    over the copy engine), also after another layer grew the shared symmetric workspace; capture
    before a plan exists, and OverlapMoE capture, raise RuntimeError on every rank."""
    from overlap_layers import OverlapAttention, OverlapMoE
    torch.backends.cuda.matmul.allow_tf32 = False
    fails = 0
    g = torch.Generator(device="cpu").manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    cases = [(lambda: OverlapMLP(64, 32 * ws, group=dist.group.WORLD, device=dev), p)
             for p in (MLPPlan(1), MLPPlan(2), MLPPlan(1, decomposition="rank"),
                       MLPPlan(1, decomposition="rank", transport="copy_engine"))]
    cases += [(lambda: OverlapAttention(64, 2 * ws, ws, group=dist.group.WORLD, head_dim=16, device=dev), p)
              for p in (MLPPlan(1, decomposition="rank", transport="copy_engine"),
                        MLPPlan(2, decomposition="rank", transport="copy_engine"))]
    for make, plan in cases:
        torch.manual_seed(5)
        layer = make()
        layer.pin_plan(plan)
        x, dy = r(2, 8, 64).requires_grad_(), r(2, 8, 64)
        graph, y, grads = _graphed_step(layer, x, dy)
        grower = OverlapMLP(64, 32 * ws, group=dist.group.WORLD, device=dev)  # a larger exchange afterwards
        grower.pin_plan(MLPPlan(1, decomposition="rank", transport="copy_engine"))
        grower(r(4, 64, 64)).sum().backward()
        for step in range(2):
            with torch.no_grad():
                x.copy_(r(2, 8, 64))
                dy.copy_(r(2, 8, 64))
            graph.replay()
            want_y = layer(x)
            want = torch.autograd.grad(want_y, [x, *[p for p in layer.parameters() if p.requires_grad]], dy)
            pairs = [("y", y, want_y.double())] + [(f"grad {i}", a, b.double()) for i, (a, b) in
                                                  enumerate(zip(grads, want))]
            fails += count_fails(rank, f"graph {type(layer).__name__} {plan.label} replay {step}", pairs, 1e-5)
    fails += _capture_raises(rank, "capture before planning", OverlapMLP(64, 32 * ws, group=dist.group.WORLD,
                                                                         device=dev), r(2, 8, 64), "before its plan")
    moe = OverlapMoE(64, 32, 2 * ws, 2, group=dist.group.WORLD, num_tiles=1, device=dev)
    xm = r(1, 8, 64)
    moe(xm)
    return fails + _capture_raises(rank, "OverlapMoE capture", moe, xm, "cannot be captured")


def _capture_raises(rank, what: str, layer, x, match: str) -> int:
    """0 if capturing ``layer(x)`` into a CUDA graph raises RuntimeError holding ``match``, else 1
    (and a line)."""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer(x)
    except RuntimeError as e:
        if match in str(e):
            return 0
        print(f"rank {rank} FAIL: {what} raised {e}", flush=True)
        return 1
    print(f"rank {rank} FAIL: {what} did not raise", flush=True)
    return 1


def check_caller_stream_kept(rank, ws, dev):
    """The executor leaves the caller's stream current ([Note: executor streams]): after a layer
    call on two compute streams issued from a side stream (forward and backward), and after an op
    that raises on a tile stream."""
    from overlap_layers.runtime.executor import execute
    from overlap_layers.schedule import TileProgram, compute, round_robin
    fails = 0
    layer = OverlapMLP(64, 128, group=dist.group.WORLD, num_tiles=2, device=dev)
    x = torch.randn(2, 8, 64, device=dev, requires_grad=True)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = layer(x)
        fails += torch.cuda.current_stream() != side
        y.sum().backward()
        fails += torch.cuda.current_stream() != side
    torch.cuda.current_stream().wait_stream(side)

    def boom(env):
        raise RuntimeError("boom")
    prog = TileProgram("t", (compute("ok", lambda env: None), compute("boom", boom)))
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    before = torch.cuda.current_stream()
    try:
        execute(round_robin(prog, 2), [{}, {}], dist.group.WORLD, streams=streams)
        fails += 1  # it must raise
    except RuntimeError:
        pass
    fails += torch.cuda.current_stream() != before
    if fails:
        print(f"rank {rank}: the caller's stream was not current after a layer call or a raising op", flush=True)
    return fails


def check_workspace_kept_on_some_ranks(rank, ws, dev):
    """Layers freed on every rank while rank 1 still holds their symmetric workspace (as a late
    garbage collection would): the next copy-engine layer's agreement makes every rank release
    it, and the call equals the same plan over NCCL send/recv."""
    plan = lambda t: MLPPlan(1, decomposition="rank", transport=t)  # noqa: E731
    torch.manual_seed(4)
    old = OverlapMLP(64, 32 * ws, group=dist.group.WORLD, device=dev)
    old.pin_plan(plan("copy_engine"))
    x = torch.randn(2, 16, 64, device=dev)
    old(x).sum().backward()
    from overlap_layers.runtime.symmetric import held_workspace_bytes
    keep = old._workspace if rank == 1 else None
    del old
    held = [None] * ws
    dist.all_gather_object(held, held_workspace_bytes(dist.group.WORLD, dev) > 0)
    fails = 0
    if held[0] or not held[1]:
        fails += 1
        print(f"rank {rank} FAIL: the scenario did not arise (workspace held per rank: {held})", flush=True)
    outs = {}
    for transport in ("copy_engine", "nccl"):
        torch.manual_seed(5)
        layer = OverlapMLP(64, 32 * ws, group=dist.group.WORLD, device=dev)
        layer.pin_plan(plan(transport))
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.square().sum().backward()
        outs[transport] = [y.detach(), xx.grad, *[p.grad for p in layer.parameters()]]
        if transport == "copy_engine" and keep is not None and layer._workspace is not keep:
            fails += 1
            print(f"rank {rank} FAIL: rank 1 did not reuse the workspace it kept", flush=True)
    pairs = [(f"tensor {i}", got, want.double()) for i, (want, got) in enumerate(zip(outs["nccl"], outs["copy_engine"]))]
    return fails + count_fails(rank, "workspace kept on rank 1", pairs, 1e-6)


def check_copies_and_edge_calls(rank, ws, dev):
    """On copy-engine rank chunks (MLP, attention): a ``copy.deepcopy`` after a call computes
    what the original does and shares its symmetric workspace ([Note: copying a layer]); a
    call without tokens gives an empty output and zero gradients; ``create_graph=True`` raises
    RuntimeError, and a second backward after ``retain_graph=True`` gives the same gradients
    again ([Note: first-order backward])."""
    import copy
    from overlap_layers import OverlapAttention
    fails = 0
    torch.manual_seed(6)
    plan = MLPPlan(1, decomposition="rank", transport="copy_engine")
    for name, layer in (("mlp", OverlapMLP(64, 32 * ws, group=dist.group.WORLD, device=dev)),
                        ("attention", OverlapAttention(64, 2 * ws, ws, group=dist.group.WORLD, head_dim=16,
                                                       device=dev))):
        layer.pin_plan(plan)
        x = torch.randn(2, 16, 64, device=dev, requires_grad=True)
        layer(x).sum().backward()
        fails += fell_back(rank, layer, plan)
        twin = copy.deepcopy(layer)
        outs = call_each((layer, twin), x, lambda y: y.square().sum())
        fails += count_fails(rank, f"{name} deepcopy", [(f"tensor {i}", b, a.double()) for i, (a, b)
                                                        in enumerate(zip(*outs))], 1e-6)
        if twin._workspace is not layer._workspace:
            fails += 1
            print(f"rank {rank} FAIL {name} deepcopy: a workspace of its own", flush=True)
        empty = torch.randn(0, 16, 64, device=dev, requires_grad=True)
        layer.zero_grad(set_to_none=True)
        y = layer(empty)
        y.sum().backward()
        if y.shape != empty.shape or any(p.grad is None or p.grad.any() for p in layer.parameters()):
            fails += 1
            print(f"rank {rank} FAIL {name} without tokens: {tuple(y.shape)}", flush=True)
        try:
            torch.autograd.grad(layer(x).sum(), x, create_graph=True)
            fails += 1
            print(f"rank {rank} FAIL {name}: create_graph=True did not raise", flush=True)
        except RuntimeError:
            pass
        once = call_each((layer,), x, torch.sum)[0]
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        y.sum().backward(retain_graph=True)
        y.sum().backward()
        twice = [x.grad, *[p.grad for p in layer.parameters()]]
        fails += count_fails(rank, f"{name} retain_graph", [(f"grad {i}", b, 2 * a.double()) for i, (a, b)
                                                            in enumerate(zip(once[1:], twice))], 1e-6)
    return fails


def check_graph_calls(rank, ws, dev):
    """[Note: graph calls]: with ``config.graph_calls``, no-grad calls equal an eager twin's (same
    weights) on new inputs and positions, one graph per call signature; an output survives the
    next call; in-place weight updates are replayed, a replaced weight is recaptured; training
    steps (forward and backward graphs) give the eager twin's outputs and gradients, also with two
    forwards in flight; an auto layer captures once verification settles (OverlapMLP serial, K=2,
    rank chunks over NCCL and the copy engine; OverlapAttention rank chunks over the copy engine)."""
    from overlap_layers import OverlapAttention, OverlapConfig
    from overlap_layers.layers.attention.core import rope_cos_sin
    fails = 0
    g = torch.Generator(device="cpu").manual_seed(12)
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    mlp = lambda cfg: OverlapMLP(64, 32 * ws, group=dist.group.WORLD, device=dev, config=cfg)  # noqa: E731
    attn = lambda cfg: OverlapAttention(64, 2 * ws, ws, group=dist.group.WORLD, head_dim=16, device=dev,  # noqa: E731
                                        config=cfg)
    cases = [(mlp, p) for p in (MLPPlan(1), MLPPlan(2), MLPPlan(1, decomposition="rank"),
                                MLPPlan(1, decomposition="rank", transport="copy_engine"),
                                MLPPlan(1, regather=True, decomposition="rank", transport="copy_engine"), None)]
    cases += [(attn, MLPPlan(1, decomposition="rank", transport="copy_engine"))]
    for make, plan in cases:
        pair = []
        for graph_calls in (True, False):
            torch.manual_seed(5)
            layer = make(OverlapConfig(graph_calls=graph_calls, num_tiles="auto" if plan is None else 1))
            if plan is not None:
                layer.pin_plan(plan)
            pair.append(layer)
        graphed, eager = pair
        name = f"graph_calls {type(graphed).__name__} {plan.label if plan is not None else 'auto'}"
        positions = isinstance(graphed, OverlapAttention)

        def kwargs(seq):
            if not positions:
                return {}
            pos = torch.randint(0, 1000, (2, seq), generator=g).to(dev)
            return dict(position_embeddings=rope_cos_sin(pos, 16, 10000.0, torch.float32))

        def both(x, **kw):
            with torch.no_grad():
                return graphed(x, **kw), eager(x, **kw)
        for _ in range(128 if plan is None else 1):  # auto: until verification settles
            both(r(2, 8, 64), **kwargs(8 * ws))
            if not graphed.verifying:  # the same on every rank: a function of the call history
                break
        if plan is None and eager.plan != graphed.plan:
            eager.pin_plan(graphed.plan)  # the same kernels: verification may settle differently
        x1, kw1 = r(2, 8, 64), kwargs(8 * ws)
        y1, want1 = both(x1, **kw1)
        y2, want2 = both(r(2, 8, 64), **kwargs(8 * ws))
        fails += count_fails(rank, f"{name} call", [("y1", y1, want1.double()), ("y2", y2, want2.double()),
                                                    ("y1 after y2", y1, eager(x1, **kw1).double())], 1e-5)
        if len(graphed.planner.call_graphs) != 1:
            fails += 1
            print(f"rank {rank} FAIL {name}: {len(graphed.planner.call_graphs)} graphs after one shape", flush=True)
        y3, want3 = both(r(2, 4, 64), **kwargs(4 * ws))
        name_w = "wq" if positions else "w_in"
        with torch.no_grad():
            for layer in pair:
                getattr(layer, name_w).mul_(2)
        y4, want4 = both(r(2, 8, 64), **kwargs(8 * ws))
        for layer in pair:
            setattr(layer, name_w, torch.nn.Parameter(getattr(layer, name_w).detach() * 0.5))
        y5, want5 = both(r(2, 8, 64), **kwargs(8 * ws))
        fails += count_fails(rank, f"{name} shapes and weights", [
            ("second shape", y3, want3.double()), ("in-place weights", y4, want4.double()),
            ("replaced weight", y5, want5.double())], 1e-5)
        if len(graphed.planner.call_graphs) != 1:  # the replaced weight dropped both graphs; one recaptured
            fails += 1
            print(f"rank {rank} FAIL {name}: {len(graphed.planner.call_graphs)} graphs after a replaced weight", flush=True)
        # training: three forward+backward steps (the first captures both graphs), then two forwards
        # in flight before their backwards (the second runs eagerly: the first's activations are kept)
        for step in range(4):
            calls = [(r(2, 8, 64), r(2, 8, 64), kwargs(8 * ws)) for _ in range(2 if step == 3 else 1)]
            got = []
            for layer in pair:
                layer.zero_grad(set_to_none=True)
                xs = [x.clone().requires_grad_() for x, _, _ in calls]
                ys = [layer(x, **kw) for x, (_, _, kw) in zip(xs, calls)]
                for y, (_, dy, _) in zip(ys, calls):
                    y.backward(dy)
                got.append([y.detach() for y in ys] + [x.grad for x in xs]
                           + [p.grad for p in layer.parameters() if p.grad is not None])
            if len(got[0]) != len(got[1]):
                fails += 1
                print(f"rank {rank} FAIL {name} training step {step}: {len(got[0])} tensors, eager {len(got[1])}",
                      flush=True)
            fails += count_fails(rank, f"{name} training step {step}",
                                 [(f"tensor {i}", a, b.double()) for i, (a, b) in enumerate(zip(*got))], 1e-5)
        if plan is not None and len(graphed.planner.call_graphs) != 2:  # the no-grad call's and the training call's
            # (auto: the training calls' key is still being verified, eagerly)
            fails += 1
            print(f"rank {rank} FAIL {name}: {len(graphed.planner.call_graphs)} graphs after training", flush=True)
        if plan is not None:  # [Note: staged input]: a copy-engine training graph's output gradient, and
            # its input where the backward reads the kept own rows instead (not re-gathered)
            from overlap_layers.runtime.symmetric import staged_source
            trained = [e for e in graphed.planner.call_graphs._graphs.values() if hasattr(e, "grad_output")]

            def in_place(t):
                place = None if graphed._workspace is None else staged_source(graphed._workspace, t)
                return place is not None and place.data_ptr() == t.data_ptr()
            staged = [(in_place(e.grad_output), in_place(e.inputs[0])) for e in trained]
            ce = plan.transport == "copy_engine"
            if staged != [(ce, ce and not plan.regather)]:
                fails += 1
                print(f"rank {rank} FAIL {name}: training graphs' (output gradient, input) staged {staged}",
                      flush=True)
    return fails


def check_graph_calls_shared_pool(rank, ws, dev):
    """[Note: shared no-grad pool]: two MLP layers of one group whose no-grad calls replay graphs
    from one pool equal eager twins (same weights) at every call, chained and in the reverse
    order, an earlier output intact (serial, and rank chunks over the copy engine, whose replays
    take their input in the exchange's place: [Note: staged input]), and a layer
    built after those layers are gone captures too (a new pool); with the
    serial plan the second layer's capture (the same shapes) adds less memory than the first
    one's (with a pool each it adds the same). Only what the capture stream freed is shared: the
    plan's side streams are each layer's own, and a block is reused on its stream only (so the
    serial plan shares little; a stack of rank-chunk layers shares far more, [Note: shared no-grad
    pool])."""
    from overlap_layers import OverlapConfig
    fails = 0
    g = torch.Generator(device="cpu").manual_seed(21)
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    for plan in (MLPPlan(1), MLPPlan(1, decomposition="rank", transport="copy_engine")):
        pair = []
        for graph_calls in (True, False):
            torch.manual_seed(9)
            layers = [OverlapMLP(256, 1024 * ws, group=dist.group.WORLD, device=dev,
                                 config=OverlapConfig(graph_calls=graph_calls, num_tiles=1)) for _ in range(2)]
            for layer in layers:
                layer.pin_plan(plan)
            pair.append(layers)
        (a0, a1), (e0, e1) = pair
        with torch.no_grad():
            x = r(4, 512, 256)
            y_first, want_first = a1(a0(x)), e1(e0(x))
            nbytes = [layer.planner.call_graphs.last_nbytes for layer in (a0, a1)]
            checks = [("chained, capturing", y_first, want_first.double())]
            for step in range(2):
                x = r(4, 512, 256)
                checks.append((f"chained {step}", a1(a0(x)), e1(e0(x)).double()))
            x1, x0 = r(4, 512, 256), r(4, 512, 256)
            checks += [("second layer alone", a1(x1), e1(x1).double()), ("then the first", a0(x0), e0(x0).double()),
                       ("first output after", y_first, want_first.double())]
        fails += count_fails(rank, f"shared pool {plan.label}", checks, 1e-5)
        # (a staged capture can add nothing to a shared pool: the first layer's freed blocks hold it)
        if not (len(a0.planner.call_graphs) == len(a1.planner.call_graphs) == 1 and nbytes[0] > 0):
            fails += 1
            print(f"rank {rank} FAIL shared pool {plan.label}: graphs {len(a0.planner.call_graphs)}, "
                  f"{len(a1.planner.call_graphs)}, bytes {nbytes}", flush=True)
        if plan.decomposition == "rank":  # [Note: staged input]: the graph's input is the exchange's place
            from overlap_layers.runtime.symmetric import staged_source
            place = staged_source(a0._workspace, x)
            staged = [next(iter(layer.planner.call_graphs._graphs.values())).inputs[0] for layer in (a0, a1)]
            if place is None or any(t.data_ptr() != place.data_ptr() for t in staged):
                fails += 1
                print(f"rank {rank} FAIL shared pool {plan.label}: static inputs not staged in the workspace", flush=True)
        if plan.decomposition != "rank" and not nbytes[1] < nbytes[0]:
            fails += 1
            print(f"rank {rank} FAIL shared pool {plan.label}: the second capture kept {nbytes[1]} bytes, "
                  f"the first {nbytes[0]}", flush=True)
    # every graph of the pool gone (a benchmark's next shape): the next layer captures into a new one
    del pair, a0, a1
    gc.collect()
    fresh = OverlapMLP(256, 1024 * ws, group=dist.group.WORLD, device=dev,
                       config=OverlapConfig(graph_calls=True, num_tiles=1))
    twin = OverlapMLP(256, 1024 * ws, group=dist.group.WORLD, device=dev, config=OverlapConfig(num_tiles=1))
    twin.load_state_dict(fresh.state_dict())
    with torch.no_grad():
        x = r(2, 512, 256)
        checks = [(f"after the pool's graphs are gone, call {i}", fresh(x), twin(x).double()) for i in range(2)]
    fails += count_fails(rank, "shared pool renewed", checks, 1e-5)
    if len(fresh.planner.call_graphs) != 1:
        fails += 1
        print(f"rank {rank} FAIL shared pool renewed: {len(fresh.planner.call_graphs)} graphs", flush=True)
    return fails


def check_graph_calls_block(rank, ws, dev):
    """[Note: graph calls] in a block: OverlapTransformerBlock whose attention and MLP replay their
    calls (K=2 over NCCL, and rank chunks over the copy engine), float32 on the GPU, equals the
    float64 dense block on the CPU at every one of three training steps (the first captures, the
    others replay forward and backward) and in a no-grad call."""
    from block_reference import EPS, NKV, NQ, THETA, make_case, reference
    from overlap_layers import OverlapAttention, OverlapConfig, OverlapTransformerBlock, finalize_grads
    torch.backends.cuda.matmul.allow_tf32 = False
    fails, group = 0, dist.group.WORLD
    c = make_case(7, moe=False, S=4 * ws)
    y_ref, g = reference(c)
    f = lambda t: t.to(dev, torch.float32)  # noqa: E731
    own = slice(rank * 4, (rank + 1) * 4)
    for plan in (MLPPlan(2), MLPPlan(1, decomposition="rank", transport="copy_engine")):
        cfg = OverlapConfig(graph_calls=True)
        attn = OverlapAttention.from_dense(f(c["wq"]), f(c["wk"]), f(c["wv"]), f(c["wo"]), num_heads=NQ,
                                           num_kv_heads=NKV, group=group, rope_theta=THETA, config=cfg)
        mlp = OverlapMLP.from_dense(f(c["w_in"]), f(c["w_out"]), group=group, activation="swiglu", config=cfg)
        for layer in (attn, mlp):
            layer.pin_plan(plan)
        blk = OverlapTransformerBlock.from_layers(attn, mlp, norm=c["norm"], norm_eps=EPS,
                                                  attn_norm_weight=f(c["an_w"]), mlp_norm_weight=f(c["mn_w"]))
        for step in range(3):
            blk.zero_grad(set_to_none=True)
            x = f(c["x"][:, own]).requires_grad_()
            y = blk(x)
            y.backward(f(c["dy"][:, own]))
            finalize_grads(blk)
            fails += count_fails(rank, f"graph_calls block {plan.label} step {step}", [
                ("y", y, y_ref[:, own]), ("dx", x.grad, g["x"][:, own]),
                ("attn_norm", blk.attn_norm.weight.grad, g["an_w"])], 1e-4)
        with torch.no_grad():
            y = blk(f(c["x"][:, own]))
        fails += count_fails(rank, f"graph_calls block {plan.label} no grad", [("y", y, y_ref[:, own])], 1e-4)
        if len(attn.planner.call_graphs) != 2 or len(mlp.planner.call_graphs) != 2:
            fails += 1
            print(f"rank {rank} FAIL graph_calls block {plan.label}: {len(attn.planner.call_graphs)} and "
                  f"{len(mlp.planner.call_graphs)} graphs, not 2 each", flush=True)
    return fails


def check_device_all_to_all(rank, ws, dev):
    """[Note: sync-free exchange]: DeviceCountAllToAll over the group's symmetric workspace equals
    the all-to-all from its definition (every rank draws every rank's counts and rows from one
    seed per step), eagerly and replayed from a CUDA graph captured once and given other counts
    and rows at each replay: the send rows placed from their keys (``place``), the pulls of
    every peer's parts (regions on the pull stream, overflow on the main one), then the pushes of
    each row's result (3 x + 1) back, which ``finish`` returns at the rows' places (the own rows
    at theirs, untouched). Three groups
    per rank; the steps alternate between counts past the regions and counts that fit them."""
    from overlap_layers.runtime.device_all_to_all import DeviceCountAllToAll
    from overlap_layers.runtime.symmetric import shared_workspace
    fails, rows, W, dt, G = 0, 96, 80, torch.bfloat16, 3
    ex = DeviceCountAllToAll(shared_workspace(dist.group.WORLD, dev, "device_counts"), rows, W, dt, groups=G)
    pulled = torch.empty(ws, G, rows, W, device=dev, dtype=dt)  # [source, part]: at most a part per group
    counts = torch.zeros(ws, G, dtype=torch.int32, device=dev)
    mine = torch.empty(rows, W, device=dev, dtype=dt)  # this rank's send rows in send order
    keys = torch.empty(rows, dtype=torch.int64, device=dev)  # their send-order indices (ws * G: not sent)

    def table(step):
        g = torch.Generator().manual_seed(1000 + step)
        t = torch.zeros(ws, ws * G, dtype=torch.int32)
        for s in range(ws):
            if step % 2:  # even: every part within its region
                t[s] = rows // (ws * G)
                continue
            cuts = sorted(torch.randint(0, rows + 1, (ws * G,), generator=g).tolist())
            t[s] = torch.tensor([cuts[0]] + [b - a for a, b in zip(cuts, cuts[1:])], dtype=torch.int32)
        return t.view(ws, ws, G)

    def send_rows(step, s):
        return torch.randn(rows, W, generator=torch.Generator().manual_seed(2000 + ws * step + s)).to(dev, dt)

    def call():
        places = ex.place(mine, keys, 1, counts)
        ex.ready(counts)
        got = ex.recv_counts.clone()  # valid until finish: peers may write the next call's table after it
        main, (pull, push) = torch.cuda.current_stream(), ex.streams
        peers = [((rank + j) % ws, p, part) for j in range(1, ws) for p, part in enumerate(ex.parts((rank + j) % ws))]
        pull.wait_stream(main)
        with torch.cuda.stream(pull):
            for s, p, part in peers:
                ex.pull(s, pulled[s, p], part)
        main.wait_stream(pull)
        for s, p, part in peers:
            ex.pull_rest(s, pulled[s, p], part)
        results = pulled * 3 + 1
        for s, p, part in peers:
            ex.push_rest(s, results[s, p], part)
        push.wait_stream(main)
        with torch.cuda.stream(push):
            for s, p, part in peers:
                ex.push(s, results[s, p], part)
        main.wait_stream(push)
        return ex.finish(), got, places

    graph, out = None, None
    for step in range(6):
        t = table(step)
        counts.copy_(t[rank].to(dev))
        mine.copy_(send_rows(step, rank))
        in_send_order = torch.cat([t[rank, (rank + j) % ws] for j in range(ws)]).to(torch.int64)
        keys.fill_(ws * G)
        keys[:int(in_send_order.sum())] = torch.repeat_interleave(torch.arange(ws * G), in_send_order).to(dev)
        if step == 3:  # every rank captures at the same call, then replays from here on
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
        if graph is None:
            out = call()
        else:
            graph.replay()
        back, got, places = out[0].clone(), out[1].cpu(), out[2].cpu()
        ok = torch.equal(got, t[:, rank])
        for s in range(ws):  # s's send rows by destination s, s + 1, ...: its rows for rank begin after those
            if s == rank:
                continue
            start = int(sum(t[s, (s + j) % ws].sum() for j in range((rank - s) % ws)))
            for p, part in enumerate(ex.parts(s)):
                a, b = (0, G) if part is None else part
                first = start + int(t[s, rank, :a].sum())
                want = send_rows(step, s)[first:first + int(t[s, rank, a:b].sum())]
                ok = ok and torch.equal(pulled[s, p, :want.shape[0]], want)
        own, n = int(t[rank, rank].sum()), int(t[rank].sum())
        ok = ok and torch.equal(back[places[own:n].to(dev)], send_rows(step, rank)[own:n] * 3 + 1)
        # back is send: the own rows stay at their places ([Note: results where their rows were])
        ok = ok and torch.equal(back[places[:own].to(dev)], send_rows(step, rank)[:own])
        if not ok:
            fails += 1
            print(f"rank {rank} FAIL device all-to-all step {step} ({'replayed' if graph else 'eager'})", flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    return fails


def moe_graph_case(ws, dev, seed):
    """The MoE graph-call checks' case: ``(r, (router, w_in, w_out, shared_w_in, shared_w_out),
    H, k, dtype)``, ``r`` making float64 random tensors on ``dev`` (from ``seed``), the weights
    float64 (4 experts per rank, top-3, hidden 64, ffn 32, shared ffn 16, bf16 calls)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * 0.3).to(dev)  # noqa: E731
    H, F, Fs, El, k, dt = 64, 32, 16, 4, 3, torch.bfloat16
    return r, (r(El * ws, H), r(El * ws, 2 * F, H), r(El * ws, H, F), r(2 * Fs, H), r(H, Fs)), H, k, dt


def moe_graph_reference(x, weights, k, cf, dt):
    """The float64 dense MoE's output for ``x`` with ``weights`` (the case's) rounded to ``dt``."""
    from moe_reference import dense_moe
    rw, wi, wo, swi, swo = (t.to(dt).double() for t in weights)
    return dense_moe(x.double(), rw, wi, wo, top_k=k, capacity_factor=cf, capacity_key="prob", shared_w_in=swi,
                     shared_w_out=swo)[0]


def race_fails(rank, label, layer, races, check_held=False) -> int:
    """1 (and a FAIL line) unless the MoE layer's race decided its ``races`` signatures and the
    layer keeps a graph per device-path win (with ``check_held``: and its last call held graph
    memory exactly where its signature chose the device path), else 0."""
    choices = [race["choice"] for race in layer._device_path.race._races.values()]
    held = layer.planner.call_graphs.last_nbytes
    if len(choices) != races or None in choices or len(layer.planner.call_graphs) != sum(choices) \
            or (check_held and bool(held) != choices[-1]):
        print(f"rank {rank} FAIL {label}: device path chosen {choices}, {len(layer.planner.call_graphs)} graphs kept, "
              f"last call held {held} graph bytes", flush=True)
        return 1
    if rank == 0:
        print(f"{label}: device path chosen {choices}", flush=True)
    return 0


def capture_warning_fails(rank, label, caught) -> int:
    """1 (and a FAIL line) if a graph capture failed (its warning among ``caught``: the signature
    then runs eagerly and the race counts it lost, so no other check would show it), else 0."""
    failed = [str(w.message) for w in caught if "capturing a call failed" in str(w.message)]
    if failed:
        print(f"rank {rank} FAIL {label}: {failed[0][:300]}", flush=True)
        return 1
    return 0


def eager_workspace_fails(rank, label, layer, dev) -> int:
    """1 (and a FAIL line) if the race chose the device path for the layer's last signature but
    the layer still holds its eager calls' workspace, or (no other layer alive to hold it, after a
    collection) the group's "exchange" workspace still has bytes, else 0."""
    from overlap_layers.runtime.symmetric import held_workspace_bytes
    gc.collect()
    held = held_workspace_bytes(dist.group.WORLD, dev, "exchange")
    if list(layer._device_path.race._races.values())[-1]["choice"] and (layer._workspace is not None or held):
        print(f"rank {rank} FAIL {label}: the device path won, but the eager workspace is held "
              f"({layer._workspace is not None}, {held} bytes)", flush=True)
        return 1
    return 0


def skewed_tokens(r, router, tokens, H, dt):
    """``[1, tokens, H]`` whose top 3 are experts 0, 1 and 2 (rank 0's): every rank sends rank 0
    three rows per token, past an even routing's slot rows ([Note: MoE slot rows]) in the
    graph-call checks' case (top-3, 4 experts per rank)."""
    return (4 * router[:3].sum(0).expand(1, tokens, H) + 0.3 * r(1, tokens, H)).to(dt)


def slots_fails(rank, label, layer) -> int:
    """1 (and a FAIL line) if the race chose the device path for the layer's last signature but no
    call raised its slots ([Note: MoE slot rows]: the skewed call must have run again), else 0."""
    last = list(layer._device_path.race._races.values())[-1]["choice"]
    if last and not any(layer._device_path.needs.values()):
        print(f"rank {rank} FAIL {label}: the device path ran a skewed call without raising its slots", flush=True)
        return 1
    if rank == 0:
        print(f"{label}: slots raised for {layer._device_path.needs}", flush=True)
    return 0


def check_moe_graph_calls(rank, ws, dev):
    """[Note: MoE graph calls]: OverlapMoE with config.graph_calls, calls without autograd, bf16,
    uneven tokens per rank (one rank's count changing between two shapes, so two signatures), new
    tokens at every call (new routing), dropless and with capacity drops, with a shared expert:
    every call against the float64 dense reference, the race's eager calls, capture and replays
    ([Note: MoE graph calls: the race]) and the calls after it; each signature's race decided, the
    layer keeping a graph for each signature the device path won and the last call replaying
    it if it did; no capture failed."""
    from overlap_layers import OverlapConfig, OverlapMoE
    r, (rw, wi, wo, swi, swo), H, k, dt = moe_graph_case(ws, dev, 23)
    fails = 0
    with warnings.catch_warnings(record=True) as caught:  # a failed capture runs eagerly: only its warning shows
        warnings.simplefilter("always")
        for cf in (None, 0.5):
            layer = OverlapMoE.from_dense(rw.to(dt), wi.to(dt), wo.to(dt), top_k=k, group=dist.group.WORLD,
                                          capacity_factor=cf, shared_w_in=swi.to(dt), shared_w_out=swo.to(dt),
                                          num_tiles=1, config=OverlapConfig(graph_calls=True))
            for step in range(16):
                tokens = 40 + 24 * rank + (16 if rank == 0 and step >= 8 else 0)  # a second signature from step 8
                x = r(1, tokens, H).to(dt)
                with torch.no_grad():
                    y = layer(x)
                y_ref = moe_graph_reference(x, (rw, wi, wo, swi, swo), k, cf, dt)
                fails += count_fails(rank, f"moe graph_calls cf={cf} step {step}", [("y", y, y_ref)], 3e-2)
            fails += race_fails(rank, f"moe graph_calls cf={cf}", layer, 2, check_held=True)
            fails += eager_workspace_fails(rank, f"moe graph_calls cf={cf}", layer, dev)
            for step in range(2 if cf is None else 0):  # past the slots, then replayed with the raised ones
                # (not with capacity: its drops among tokens of near-equal probability differ from the reference's)
                x = skewed_tokens(r, rw, 40 + 24 * rank + (16 if rank == 0 else 0), H, dt)
                with torch.no_grad():
                    y = layer(x)
                y_ref = moe_graph_reference(x, (rw, wi, wo, swi, swo), k, cf, dt)
                fails += count_fails(rank, f"moe graph_calls cf={cf} skewed {step}", [("y", y, y_ref)], 3e-2)
            fails += slots_fails(rank, f"moe graph_calls cf={cf}", layer) if cf is None else 0
    fails += capture_warning_fails(rank, "moe graph_calls", caught)
    torch.cuda.synchronize()
    dist.barrier()
    return fails


def check_moe_training_graph_calls(rank, ws, dev):
    """[Note: MoE training graphs]: OverlapMoE with config.graph_calls, training calls (bf16, uneven
    tokens per rank, new tokens and output gradients at every call, dropless and with capacity
    drops, a shared expert): y against the float64 dense reference, and y, dx and every
    parameter's gradient against a twin layer's eager calls on the same weights and tensors (the
    eager path is checked against the dense reference's gradients in check_moe_rank_chunks),
    through the race's eager calls, capture and replays; the race decided, the layer keeping
    a graph if the device path won, and no capture failed."""
    from overlap_layers import OverlapConfig, OverlapMoE
    r, (rw, wi, wo, swi, swo), H, k, dt = moe_graph_case(ws, dev, 31)
    fails = 0
    with warnings.catch_warnings(record=True) as caught:  # a failed capture runs eagerly: only its warning shows
        warnings.simplefilter("always")
        for cf in (None, 0.5):
            layers = [OverlapMoE.from_dense(rw.to(dt), wi.to(dt), wo.to(dt), top_k=k, group=dist.group.WORLD,
                                            capacity_factor=cf, shared_w_in=swi.to(dt), shared_w_out=swo.to(dt),
                                            num_tiles=1, config=OverlapConfig(graph_calls=graphs))
                      for graphs in (True, False)]
            for step in range(12 if cf is None else 10):  # the last two skewed (as in check_moe_graph_calls)
                tokens = 40 + 24 * rank
                x = r(1, tokens, H).to(dt) if step < 10 else skewed_tokens(r, rw, tokens, H, dt)
                dy = r(1, tokens, H).to(dt)
                outs = []
                for layer in layers:
                    layer.zero_grad(set_to_none=True)
                    xx = x.clone().requires_grad_()
                    y = layer(xx)
                    y.backward(dy)
                    outs.append([("y", y.detach()), ("dx", xx.grad)]
                                + [(n, p.grad) for n, p in layer.named_parameters()])
                y_ref = moe_graph_reference(x, (rw, wi, wo, swi, swo), k, cf, dt)
                label = f"moe training graph_calls cf={cf} step {step}"
                fails += count_fails(rank, label, [("y", outs[0][0][1], y_ref)], 3e-2)
                fails += count_fails(rank, label + " against eager", [(n, got, want.double()) for (n, got), (_, want)
                                                                      in zip(*outs)], 5e-2)
            fails += race_fails(rank, f"moe training graph_calls cf={cf}", layers[0], 1)
            fails += slots_fails(rank, f"moe training graph_calls cf={cf}", layers[0]) if cf is None else 0
    fails += capture_warning_fails(rank, "moe training graph_calls", caught)
    torch.cuda.synchronize()
    dist.barrier()
    return fails


def check_aligned_trials(rank, ws, dev):
    """[Note: aligned trials]: a prequeued region holding an all-reduce, its start on the last rank
    delayed by 40 ms of host time. Without ``align`` the other ranks' regions count the wait for
    it; with it none does."""
    import time
    from overlap_layers.runtime.timing import Stopwatch, rank_barrier
    align, fails = rank_barrier(dist.group.WORLD), 0
    if align is None:
        print(f"rank {rank} FAIL aligned trials: no barrier on an NCCL group of {ws}", flush=True)
        return 1
    t = torch.ones(1 << 20, device=dev)
    dist.all_reduce(t)  # the communicator is up
    got = {}
    for name, a in (("plain", None), ("aligned", align)):
        torch.cuda.synchronize()
        dist.barrier()
        if rank == ws - 1:
            time.sleep(0.04)
        w = Stopwatch(dev, 20.0, a)
        w.start()
        dist.all_reduce(t)
        w.stop()
        got[name] = w.elapsed_ms()
    worst = torch.tensor([got["plain"], got["aligned"]], device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    plain, aligned = worst.tolist()
    if not (plain > 15.0 and aligned < 5.0):
        print(f"rank {rank} FAIL aligned trials: the slowest rank's region took {plain:.2f} ms plain and "
              f"{aligned:.2f} aligned (want > 15 and < 5: a 40 ms late host)", flush=True)
        fails += 1
    return fails


def _compiled_variants(dev) -> int:
    """Kernel variants the package's Triton functions have compiled (or loaded) for ``dev`` so far."""
    from triton.runtime.jit import JITFunction
    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("overlap_layers"):
            for obj in list(vars(mod).values()):
                if isinstance(obj, JITFunction):
                    caches = obj.device_caches.get(dev.index)
                    n += 0 if caches is None else len(caches[0])
    return n


SPACERS_MIB = (0, 4608, 37, 2253, 5222, 701, 4608, 0)  # held across one call each: other placements


def check_no_late_compiles(rank, ws, dev):
    """Once a layer has run a shape (two calls), later calls of that shape compile and load no
    Triton variant, whatever the caching allocator's placement (a spacer of up to 5 GiB held across
    each call) and the routing (a fresh input each call): a variant chosen at run time compiles or
    loads its module inside some later call, which stalled first-call verification's trials for
    hundreds of milliseconds ([Note: one heads launch] in ``kernels/heads.py``). bf16, forward
    and backward: the attention's rank chunks over the copy engine (RoPE by the heads kernel) and
    K=2, the MLP's rank chunks, the MoE's rank chunks over the copy engine (the combine's counts
    change with the routing)."""
    from overlap_layers import OverlapAttention, OverlapMoE
    from overlap_layers.planning.plan import TilePlan
    from overlap_layers.kernels import triton_gate
    if triton_gate.triton is None:
        return 0
    group, bf16, fails = dist.group.WORLD, torch.bfloat16, 0
    torch.manual_seed(17)  # the same weights on every rank
    H, E, F = 256, 4 * ws, 128
    router, w_in, w_out = (torch.randn(*shape, device=dev) * 0.1 for shape in ((E, H), (E, 2 * F, H), (E, H, F)))
    cases = [("attention rank chunks", OverlapAttention(H, 8, 4, group=group, device=dev, dtype=bf16),
              MLPPlan(1, decomposition="rank", transport="copy_engine"), (2, 64, H)),
             ("attention K=2", OverlapAttention(H, 8, 4, group=group, device=dev, dtype=bf16), MLPPlan(2), (2, 64, H)),
             ("mlp rank chunks", OverlapMLP(H, 512, group=group, device=dev, dtype=bf16),
              MLPPlan(1, decomposition="rank", transport="copy_engine"), (2, 64, H)),
             ("moe rank chunks", OverlapMoE.from_dense(router.to(bf16), w_in.to(bf16), w_out.to(bf16), top_k=2,
                                                       group=group),
              TilePlan(1, decomposition="rank", transport="copy_engine"), (1, 96, H))]
    g = torch.Generator(device="cpu").manual_seed(100 + rank)  # inputs, and so routing, differ by rank and call
    for label, layer, plan, shape in cases:
        layer.pin_plan(plan)

        def call():
            x = torch.randn(*shape, generator=g).to(dev, bf16).requires_grad_()
            layer(x).float().square().sum().backward()
        for _ in range(2):
            call()
        before = _compiled_variants(dev)
        for i in range(16):
            spacer = torch.empty(SPACERS_MIB[i % len(SPACERS_MIB)] << 20, dtype=torch.uint8, device=dev)
            call()
            del spacer
        torch.cuda.synchronize()
        after = _compiled_variants(dev)
        if after != before:
            fails += 1
            print(f"rank {rank} FAIL {label}: {after - before} Triton variants compiled after the first calls",
                  flush=True)
        fails += fell_back(rank, layer, plan)
    torch.cuda.empty_cache()  # the spacers' cached blocks
    return fails


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, ws = dist.get_rank(), dist.get_world_size()
    fails = check_numerics(rank, ws, dev) + check_sm_carveout(rank, ws, dev) \
        + check_copy_engine_reuse(rank, ws, dev) + check_copy_engine_trace(rank, ws, dev) \
        + check_autocast_and_no_grad(rank, ws, dev) \
        + check_mismatch_raises(rank, ws, dev) + check_peak_memory(rank, ws, dev) \
        + check_auto_plan_cache_and_trace(rank, ws, dev) + check_attention(rank, ws, dev) \
        + check_moe_and_ulysses(rank, ws, dev) + check_half_router_logits(rank, ws, dev) \
        + check_moe_rank_chunks(rank, ws, dev) + check_block(rank, ws, dev) \
        + check_fused_block(rank, ws, dev) + check_cuda_graphs(rank, ws, dev) \
        + check_workspace_kept_on_some_ranks(rank, ws, dev) + check_caller_stream_kept(rank, ws, dev) \
        + check_copies_and_edge_calls(rank, ws, dev) + check_graph_calls(rank, ws, dev) \
        + check_graph_calls_block(rank, ws, dev) + check_graph_calls_shared_pool(rank, ws, dev) \
        + check_device_all_to_all(rank, ws, dev) + check_moe_graph_calls(rank, ws, dev) \
        + check_moe_training_graph_calls(rank, ws, dev) + check_aligned_trials(rank, ws, dev) \
        + check_no_late_compiles(rank, ws, dev)
    t = torch.tensor([fails], device=dev)
    dist.all_reduce(t)
    dist.destroy_process_group()
    if rank == 0:
        print(f"cuda checks: {int(t)} failures", flush=True)
    sys.exit(1 if int(t) else 0)


if __name__ == "__main__":
    main()
