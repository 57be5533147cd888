"""The host-overhead benchmark and its plain references.

What must hold: each plain reference of ``overlap_layers/bench/references.py`` equals a dense
computation written here (one process, the full weights, plain formulas) in its output and in the
gradients of its input and of every parameter (the rank's slices of the dense gradients; the MoE
router's: this rank's tokens' share), at world sizes 1 and 2 over gloo, with and without sequence
parallelism, the MoE's experts by grouped GEMMs (float32) and by the per-expert loop (float64);
the references import nothing but torch and the standard library; and ``python -m
overlap_layers.bench.host`` runs end to end at world sizes 1 and 2, its JSON valid against
``bench/results/schema.json`` with a plain and a layer record per layer and pass.
"""
import ast
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
B, S = 2, 8


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _check(got, want, dtype, what):
    err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e}"


def _dense_grads(fn, x, weights, dy):
    """``fn(x, *weights)`` and the gradients of ``(y * dy).sum()`` for x and each weight."""
    leaves = [t.clone().requires_grad_() for t in (x, *weights)]
    y = fn(*leaves)
    (y * dy).sum().backward()
    return y.detach(), [t.grad for t in leaves]


def _module_grads(module, x, dy):
    """The module's output on ``x`` and the gradients of ``(y * dy).sum()`` for x and by parameter name."""
    xr = x.clone().requires_grad_()
    y = module(xr)
    (y * dy).sum().backward()
    return y.detach(), xr.grad, {n: p.grad for n, p in module.named_parameters()}


# ------------------------------------------------------------------ MLP
def dense_mlp(x, w_gate, w_up, w_down):
    g = x @ w_gate.T
    return (g / (1 + torch.exp(-g)) * (x @ w_up.T)) @ w_down.T


def run_mlp(rank, ws, sp, dtype):
    import torch.distributed as dist
    from overlap_layers.bench.references import PlainMLP
    H, Fd = 16, 24
    fl = Fd // ws
    g = torch.Generator().manual_seed(3)
    x, dy = _randn(g, B, S, H), _randn(g, B, S, H)
    wg, wu = _randn(g, Fd, H, scale=H ** -0.5), _randn(g, Fd, H, scale=H ** -0.5)
    wd = _randn(g, H, Fd, scale=Fd ** -0.5)
    y, (dx, dwg, dwu, dwd) = _dense_grads(dense_mlp, x, (wg, wu, wd), dy)
    mine = slice(rank * fl, (rank + 1) * fl)
    m = PlainMLP(H, Fd, group=dist.group.WORLD, sequence_parallel=sp, dtype=dtype)
    with torch.no_grad():
        m.fc1.weight.copy_(torch.cat([wg[mine], wu[mine]]))
        m.fc2.weight.copy_(wd[:, mine])
    rows = slice(rank * S // ws, (rank + 1) * S // ws) if sp else slice(None)
    got_y, got_dx, grads = _module_grads(m, x[:, rows].to(dtype), dy[:, rows].to(dtype))
    _check(got_y, y[:, rows], dtype, "y")
    _check(got_dx, dx[:, rows], dtype, "dx")
    _check(grads["fc1.weight"], torch.cat([dwg[mine], dwu[mine]]), dtype, "fc1")
    _check(grads["fc2.weight"], dwd[:, mine], dtype, "fc2")
    return True


# ------------------------------------------------------------------ attention
def rope(t, theta):
    """Rotates each pair (i, i + d/2) of t [b, heads, S, d] by position * theta^(-2i/d)."""
    d, seq = t.shape[-1], t.shape[-2]
    half = d // 2
    out = torch.empty_like(t)
    for i in range(half):
        angle = torch.arange(seq, dtype=torch.float64) * theta ** (-2 * i / d)
        c, s = torch.cos(angle), torch.sin(angle)
        a, b = t[..., i], t[..., i + half]
        out[..., i] = a * c - b * s
        out[..., i + half] = b * c + a * s
    return out


def dense_attention(x, wq, wk, wv, wo, heads, kv_heads):
    b, seq, _ = x.shape
    d = wq.shape[0] // heads
    q = rope((x @ wq.T).view(b, seq, heads, d).transpose(1, 2), 10000.0)
    k = rope((x @ wk.T).view(b, seq, kv_heads, d).transpose(1, 2), 10000.0)
    v = (x @ wv.T).view(b, seq, kv_heads, d).transpose(1, 2)
    per_kv = heads // kv_heads
    k, v = k[:, [h // per_kv for h in range(heads)]], v[:, [h // per_kv for h in range(heads)]]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    p = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (p @ v).transpose(1, 2).reshape(b, seq, heads * d) @ wo.T


def run_attention(rank, ws, sp, dtype):
    import torch.distributed as dist
    from overlap_layers.bench.references import PlainAttention
    H, nq, nkv = 32, 4, 2
    d = H // nq
    g = torch.Generator().manual_seed(5)
    x, dy = _randn(g, B, S, H), _randn(g, B, S, H)
    wq, wk, wv = _randn(g, nq * d, H, scale=H ** -0.5), _randn(g, nkv * d, H, scale=H ** -0.5), \
        _randn(g, nkv * d, H, scale=H ** -0.5)
    wo = _randn(g, H, nq * d, scale=H ** -0.5)
    y, (dx, dq, dk, dv, do) = _dense_grads(lambda *a: dense_attention(*a, nq, nkv), x, (wq, wk, wv, wo), dy)
    q_rows = slice(rank * nq // ws * d, (rank + 1) * nq // ws * d)
    kv_rows = slice(rank * nkv // ws * d, (rank + 1) * nkv // ws * d)
    m = PlainAttention(H, nq, nkv, group=dist.group.WORLD, sequence_parallel=sp, dtype=dtype)
    with torch.no_grad():
        m.q.weight.copy_(wq[q_rows])
        m.k.weight.copy_(wk[kv_rows])
        m.v.weight.copy_(wv[kv_rows])
        m.o.weight.copy_(wo[:, q_rows])
    rows = slice(rank * S // ws, (rank + 1) * S // ws) if sp else slice(None)
    got_y, got_dx, grads = _module_grads(m, x[:, rows].to(dtype), dy[:, rows].to(dtype))
    _check(got_y, y[:, rows], dtype, "y")
    _check(got_dx, dx[:, rows], dtype, "dx")
    for name, want in (("q", dq[q_rows]), ("k", dk[kv_rows]), ("v", dv[kv_rows]), ("o", do[:, q_rows])):
        _check(grads[f"{name}.weight"], want, dtype, name)
    return True


# ------------------------------------------------------------------ MoE
def dense_moe(x, router, w_gate_up, w_down, top_k):
    """Token by token: its top-k experts by softmax probability, weights renormalised."""
    T, E, Fd = x.shape[0], router.shape[0], w_down.shape[1]
    p = torch.softmax(x @ router.T, dim=-1)
    rows = []
    for t in range(T):
        chosen = sorted(range(E), key=lambda e: -p[t, e].item())[:top_k]
        total = sum(p[t, e] for e in chosen)
        acc = torch.zeros_like(x[t])
        for e in chosen:
            h = x[t] @ w_gate_up[e]
            gate, up = h[:Fd], h[Fd:]
            acc = acc + p[t, e] / total * ((gate * torch.sigmoid(gate) * up) @ w_down[e])
        rows.append(acc)
    return torch.stack(rows)


def run_moe(rank, ws, dtype):
    import torch.distributed as dist
    from overlap_layers.bench.references import ExpertImpl, PlainMoE
    H, Fd, E, k, T = 16, 8, 4, 2, 12
    el = E // ws
    g = torch.Generator().manual_seed(7)
    router = _randn(g, E, H, scale=2 * H ** -0.5)
    w_gate_up, w_down = _randn(g, E, H, 2 * Fd, scale=H ** -0.5), _randn(g, E, Fd, H, scale=Fd ** -0.5)
    xs = [_randn(g, T, H) for _ in range(ws)]  # every rank's own tokens
    dys = [_randn(g, T, H) for _ in range(ws)]
    d_gu, d_down = torch.zeros_like(w_gate_up), torch.zeros_like(w_down)
    for q in range(ws):  # the experts' gradients: every rank's tokens routed to them
        y_q, (dx_q, d_router_q, dgu_q, dd_q) = _dense_grads(lambda *a: dense_moe(*a, k), xs[q],
                                                            (router, w_gate_up, w_down), dys[q])
        d_gu, d_down = d_gu + dgu_q, d_down + dd_q
        if q == rank:
            y, dx, d_router = y_q, dx_q, d_router_q
    m = PlainMoE(H, Fd, E, k, group=dist.group.WORLD, dtype=dtype)
    mine = slice(rank * el, (rank + 1) * el)
    with torch.no_grad():
        m.router.weight.copy_(router)
        m.w_gate_up.copy_(w_gate_up[mine])
        m.w_down.copy_(w_down[mine])
    got_y, got_dx, grads = _module_grads(m, xs[rank].view(1, T, H).to(dtype), dys[rank].view(1, T, H).to(dtype))
    _check(got_y.view(T, H), y, dtype, "y")
    _check(got_dx.view(T, H), dx, dtype, "dx")
    _check(grads["router.weight"], d_router, dtype, "router")
    _check(grads["w_gate_up"], d_gu[mine], dtype, "w_gate_up")
    _check(grads["w_down"], d_down[mine], dtype, "w_down")
    runs = dtype == torch.float32 and hasattr(torch, "_grouped_mm")  # CPU grouped GEMMs: no float64
    assert m.expert_impl is (ExpertImpl.GROUPED_MM if runs else ExpertImpl.LOOP), m.expert_impl
    return True


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_plain_mlp_and_attention_equal_dense(pools, ws, sp, dtype):
    assert pools(ws).run(run_mlp, sp, dtype) == [True] * ws
    assert pools(ws).run(run_attention, sp, dtype) == [True] * ws


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_plain_moe_equals_dense(pools, ws, dtype):
    assert pools(ws).run(run_moe, dtype) == [True] * ws


def test_dense_checks_can_fail(pool2):
    """A reference whose fc2 misses its all-reduce / reduce-scatter fails the MLP check."""
    from pool import RankFailure
    with pytest.raises(RankFailure, match="relative error"):
        pool2.run(run_broken_mlp)


def run_broken_mlp(rank, ws):
    from overlap_layers.bench import references
    leave = references._TensorParallel.leave
    references._TensorParallel.leave = lambda self, y: y  # in this worker only, and put back
    try:
        return run_mlp(rank, ws, False, torch.float64)
    finally:
        references._TensorParallel.leave = leave


def test_references_import_only_torch():
    tree = ast.parse(open(os.path.join(ROOT, "overlap_layers", "bench", "references.py")).read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    allowed = {"__future__", "enum", "math", "typing"}
    assert all(n == "torch" or n.startswith("torch.") or n in allowed for n in names), names


# ------------------------------------------------------------------ the benchmark
def _run_host_bench(tmp_path, nprocs):
    out = tmp_path / f"host_ws{nprocs}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "overlap_layers.bench.host", "--nprocs", str(nprocs), "--out",
                           str(out), "--iters", "2", "--repeats", "3", "--warmup", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("nprocs", [1, 2])
def test_host_bench_runs_and_writes_its_records(tmp_path, nprocs):
    data, stdout = _run_host_bench(tmp_path, nprocs)
    meta, recs = data["meta"], data["records"]
    assert meta["kind"] == "host" and meta["world_size"] == nprocs and meta["threads"] == 1
    assert meta["command"].startswith("python -m overlap_layers.bench.host ")
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(data, json.load(open(os.path.join(ROOT, "bench", "results", "schema.json"))))
    assert [(r["layer"], r["pass"], r["mode"]) for r in recs] == [
        (layer, p, mode) for layer in ("mlp", "attention", "moe") for p in ("fwd", "fwdbwd")
        for mode in ("plain", "layer")]
    for plain, layer in zip(recs[::2], recs[1::2]):
        for r in (plain, layer):
            assert r["world_size"] == nprocs and len(r["repeat_us"]) == 3 and len(r["synced_repeat_us"]) == 3
            assert r["host_us"] == sorted(r["repeat_us"])[1] > 0 and r["ms"] == r["host_us"] / 1e3
            assert r["spread"] == dict(min_ms=min(r["repeat_us"]) / 1e3, max_ms=max(r["repeat_us"]) / 1e3, n=3)
            assert r["synced_us"] >= r["host_us"] * (1 - 1e-9)  # each repeat waited for the device too
        assert plain["warmup_calls"] == 1 and layer["warmup_calls"] >= 1
        assert layer["settled"] and layer["plan"]  # verification ended within the cap; the plan's label
        assert layer["ratio_plain"] == layer["host_us"] / plain["host_us"]
    assert {r["expert_impl"] for r in recs if r["layer"] == "moe" and r["mode"] == "plain"} <= {"grouped_mm", "loop"}
    table = stdout[stdout.index("host time per call"):].splitlines()  # printed last
    assert table[1].split()[:4] == ["layer", "pass", "plain", "us"] and table[-1].startswith("ratio = ")
    assert [row.split()[:2] for row in table[3:-1]] == [[r["layer"], r["pass"]] for r in recs[::2]]


def run_same_function(rank, ws, sp):
    """Each plain reference and its layer built from the same dense weights, on the same input:
    ``(name, relative error of y, of dx)`` per layer kind (float64)."""
    import torch.distributed as dist
    from overlap_layers import OverlapAttention, OverlapMLP, OverlapMoE
    from overlap_layers.bench.references import PlainAttention, PlainMLP, PlainMoE
    g, dt, group = torch.Generator().manual_seed(11), torch.float64, dist.group.WORLD
    H, Fd, nq, nkv, E, k, B, S = 16, 8, 4, 2, 4, 2, 2, 8
    d, fl, el = H // nq, Fd // ws, E // ws
    r = slice(rank * fl, (rank + 1) * fl)

    def heads(w, n):  # this rank's heads' rows of a [n*d, H] projection
        return w.view(n, d, H)[rank * n // ws:(rank + 1) * n // ws].reshape(-1, H)
    w1, w2 = _randn(g, 2 * Fd, H, scale=H ** -0.5), _randn(g, H, Fd, scale=Fd ** -0.5)
    wq, wk, wv = (_randn(g, n * d, H, scale=H ** -0.5) for n in (nq, nkv, nkv))
    wo = _randn(g, H, nq * d, scale=(nq * d) ** -0.5)
    router = _randn(g, E, H, scale=2 * H ** -0.5)
    w_in, w_out = _randn(g, E, 2 * Fd, H, scale=H ** -0.5), _randn(g, E, H, Fd, scale=Fd ** -0.5)
    mlp = PlainMLP(H, Fd, group=group, sequence_parallel=sp, dtype=dt)
    attn = PlainAttention(H, nq, nkv, group=group, sequence_parallel=sp, dtype=dt)
    moe = PlainMoE(H, Fd, E, k, group=group, dtype=dt)
    with torch.no_grad():
        mlp.fc1.weight.copy_(torch.cat([w1[:Fd][r], w1[Fd:][r]]))
        mlp.fc2.weight.copy_(w2[:, r])
        for lin, w, n in ((attn.q, wq, nq), (attn.k, wk, nkv), (attn.v, wv, nkv)):
            lin.weight.copy_(heads(w, n))
        attn.o.weight.copy_(heads(wo.t(), nq).t())
        moe.router.weight.copy_(router)
        moe.w_gate_up.copy_(w_in[rank * el:(rank + 1) * el].transpose(1, 2))
        moe.w_down.copy_(w_out[rank * el:(rank + 1) * el].transpose(1, 2))
    pairs = {"mlp": (mlp, OverlapMLP.from_dense(w1, w2, group=group, sequence_parallel=sp)),
             "attention": (attn, OverlapAttention.from_dense(wq, wk, wv, wo, num_heads=nq, num_kv_heads=nkv,
                                                             group=group, sequence_parallel=sp)),
             "moe": (moe, OverlapMoE.from_dense(router, w_in, w_out, top_k=k, group=group))}
    out = []
    for name, (ref, layer) in pairs.items():
        x = _randn(g, B, S, H)  # the same on every rank: each takes its part where the layer wants one
        if sp and name != "moe":
            x = x.view(B, ws, S // ws, H)[:, rank]
        errs = []
        ys = []
        for m in (ref, layer):
            xi = x.clone().to(dt).requires_grad_()
            y = m(xi)
            y.backward(torch.ones_like(y))
            ys.append((y.detach(), xi.grad))
        for a, b in zip(*ys):
            errs.append(((a - b).norm() / b.norm()).item())
        out.append((name, *errs))
    return out


@pytest.mark.parametrize("ws,sp", [(1, False), (2, False), (2, True)])
def test_references_compute_the_layers_function(pools, ws, sp):
    """The per-layer bench's ``reference`` mode compares the same function: each plain reference
    and its overlap layer, given the same dense weights and input, give the same output and input
    gradient (float64), so ``ratio_reference`` is a ratio of two implementations of one layer."""
    for res in pools(ws).run(run_same_function, sp):
        for name, err_y, err_dx in res:
            assert err_y < 1e-12 and err_dx < 1e-12, (name, err_y, err_dx)
