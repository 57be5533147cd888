"""Tier 2: torch.compile of models holding the layers, on 2 gloo ranks ([Note: compiled calls]).

Each layer call is one opaque op, so a model compiles with ``fullgraph=True`` (any graph break
would raise). What each rank must hold, against the same model run eagerly:
  outputs, input gradients, parameter gradients   bit for bit (the op runs the eager layer), and
                                                   the same collectives (``launch_log``)
  the layers' kept graphs                          none after backward, none after a forward whose
                                                   output died without backward
Backends: aot_eager for the layers one by one (fast); inductor once, for a decoder block whose
norms and residuals inductor compiles around the opaque sublayer calls.
"""
import gc

import pytest
import torch
import torch.distributed as dist

from overlap_layers import (OverlapAttention, OverlapMLP, OverlapMoE, OverlapTransformerBlock, UlyssesAttention,
                            finalize_grads)
from overlap_layers.layers import TilePlan

H = 16


def _layer(kind):
    torch.manual_seed(0)
    g, kw = dist.group.WORLD, dict(num_tiles=2, dtype=torch.float64)
    if kind in ("mlp_rank", "attention_rank"):  # split by source rank, over send/recv on gloo
        layer = _layer(kind[:-5] if kind == "attention_rank" else "mlp_sp")
        layer.pin_plan(TilePlan(1, decomposition="rank"))
        return layer
    if kind == "mlp_sp":
        return OverlapMLP(H, 32, group=g, sequence_parallel=True, bias=True, **kw)
    if kind == "mlp":
        return OverlapMLP(H, 32, group=g, sequence_parallel=False, **kw)
    if kind == "attention":
        return OverlapAttention(H, 4, 2, group=g, qk_norm=True, **kw)
    if kind == "ulysses":
        return UlyssesAttention(H, 4, 2, group=g, **kw)
    if kind == "moe":
        return OverlapMoE(H, 8, 4, 2, group=g, shared_expert_ffn=8, **kw)
    if kind == "block":
        return OverlapTransformerBlock(H, 4, 32, num_kv_heads=2, group=g, **kw)
    return OverlapTransformerBlock(H, 4, 8, num_kv_heads=2, moe=dict(num_experts=4, top_k=2), norm="layernorm",
                                   group=g, **kw)


class _Model(torch.nn.Module):
    """Plain ops around a layer: what the compiler must trace through, no break allowed."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.inner = kind, _layer(kind)
        self.scale = torch.nn.Parameter(torch.full((H,), 0.5, dtype=torch.float64))

    def forward(self, x, pos=None):
        h = torch.tanh(x) * self.scale
        y = self.inner(h, position_ids=pos) if self.kind in ("attention", "attention_rank", "ulysses", "block",
                                                              "block_moe") \
            else self.inner(h)
        return (x + y).sin()


def compile_run(rank, ws, kind, backend):
    import torch._dynamo
    torch._dynamo.reset()
    try:
        model = _Model(kind)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(2, 4, H, generator=g, dtype=torch.float64)  # sequence parallel: 4 * ws in all
        dy = torch.randn_like(x)
        pos = torch.arange(4 * ws)[None].expand(2, -1) if kind in ("attention", "attention_rank", "block") else None
        if kind in ("ulysses", "block_moe", "block"):
            pos = None
        out = []
        for call in range(2):
            for fn in (model, compiled):
                model.zero_grad(set_to_none=True)
                layers = [m for m in model.modules() if hasattr(m, "launch_log")]
                for m in layers:
                    m.launch_log = []
                xc = x.clone().requires_grad_()
                y = fn(xc, pos)
                (y * dy).sum().backward()
                finalize_grads(model)
                out.append(dict(y=y.detach(), dx=xc.grad, grads={n: p.grad for n, p in model.named_parameters()},
                                log=[list(m.launch_log) for m in layers]))
        kept = sum(len(m.planner.compiled_graphs) for m in model.modules() if hasattr(m, "planner"))
        y = compiled(x.clone().requires_grad_(), pos)  # a forward whose output dies without backward
        pending = sum(len(m.planner.compiled_graphs) for m in model.modules() if hasattr(m, "planner"))
        del y
        gc.collect()
        dropped = sum(len(m.planner.compiled_graphs) for m in model.modules() if hasattr(m, "planner"))
        with torch.no_grad():
            compiled(x, pos)
        no_grad_kept = sum(len(m.planner.compiled_graphs) for m in model.modules() if hasattr(m, "planner"))
        return dict(out=out, kept=kept, pending=pending, dropped=dropped, no_grad_kept=no_grad_kept)
    finally:
        torch._dynamo.reset()


def _check(results, exact=True):
    """``exact``: bit for bit (aot_eager runs the same kernels); else float64 rounding (inductor
    fuses the ops around the layers)."""
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-12))
    for rank, res in enumerate(results):
        for call in range(2):
            eager, comp = res["out"][2 * call], res["out"][2 * call + 1]
            assert same(comp["y"], eager["y"]), (rank, call)
            assert same(comp["dx"], eager["dx"]), (rank, call)
            for n, g in eager["grads"].items():
                assert (g is None) == (comp["grads"][n] is None) and (g is None or same(comp["grads"][n], g)), \
                    (rank, call, n)
            assert comp["log"] == eager["log"] and any(comp["log"]), (rank, call)
        assert res["kept"] == 0 and res["pending"] >= 1 and res["dropped"] == 0 and res["no_grad_kept"] == 0, res


@pytest.mark.parametrize("kind", ["mlp_sp", "mlp", "attention", "ulysses", "moe", "block_moe", "mlp_rank",
                                  "attention_rank"])
def test_fullgraph_compile_matches_eager(pool2, kind):
    _check(pool2.run(compile_run, kind, "aot_eager", timeout=300))


def test_inductor_fullgraph_block(pool2):
    """inductor compiles the norms, residuals and surrounding ops of a decoder block around the
    opaque attention and MLP calls."""
    _check(pool2.run(compile_run, "block", "inductor", timeout=600), exact=False)


def hf_compile_run(rank, ws, block):
    """A swapped tiny HF Llama (HF builds a 4-D causal mask tensor when compiling) compiled with
    fullgraph: the mask enters the attention's op and is checked there."""
    import torch._dynamo
    from test_swap_hf import batch, build
    from overlap_layers import swap
    torch._dynamo.reset()
    try:
        model = build("llama")
        swap(model, group=dist.group.WORLD, block=block)
        ids = batch()
        eager = model(ids, labels=ids).loss
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(ids, labels=ids).loss
        return abs(float(compiled - eager)) / abs(float(eager))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("block", [False, True])
def test_swapped_hf_model_compiles_fullgraph(pool2, block):
    pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")
    assert all(err < 1e-6 for err in pool2.run(hf_compile_run, block, timeout=300))


def group_layer_dtensor_run(rank, ws, kind, sp):
    """A ``group=`` layer given a DTensor x (Shard(1) with sequence parallelism, else Replicate; a
    1-D mesh over the group) eagerly, compiled, and compiled with fullgraph: per mode, the
    ValueError's message (under fullgraph dynamo reports it as the cause of its Unsupported), or
    "ran" if the call returned; then a plain call still works (no rank left inside a collective)."""
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        g, kw = dist.group.WORLD, dict(num_tiles=2, dtype=torch.float64, sequence_parallel=sp)
        layer = OverlapMLP(H, 32, group=g, **kw) if kind == "mlp" else OverlapAttention(H, 4, 2, group=g, **kw)
        mesh = init_device_mesh("cpu", (ws,))
        x = torch.randn(2, 4 * ws, H, dtype=torch.float64)
        xd = distribute_tensor(x, mesh, [Shard(1) if sp else Replicate()])
        out = {}
        for mode in ("eager", "compile", "fullgraph"):
            torch._dynamo.reset()
            fn = layer if mode == "eager" else torch.compile(lambda t: layer(t), fullgraph=mode == "fullgraph")
            try:
                fn(xd.clone().requires_grad_())
                out[mode] = "ran"
            except Exception as e:  # noqa: BLE001
                while e is not None and not isinstance(e, ValueError) and "ValueError(" not in str(e):
                    e = e.__cause__
                out[mode] = str(e) if e is not None else "other"
        xl = xd.to_local().clone().requires_grad_()
        layer(xl).sum().backward()
        return out, tuple(xl.grad.shape)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("kind,sp", [("mlp", True), ("mlp", False), ("attention", True), ("attention", False)])
def test_group_layer_dtensor_input_raises_compiled(pool2, kind, sp):
    """Eager raises ValueError for a DTensor x to a layer built with group=; compiled (default
    backend, with and without fullgraph) must raise it too, never run ([Note: DTensor inputs])."""
    want = "Shard(dim=1)" if sp else "Replicate()"
    name = "OverlapMLP" if kind == "mlp" else "OverlapAttention"
    for out, shape in pool2.run(group_layer_dtensor_run, kind, sp, timeout=600):
        for mode, msg in out.items():
            assert f"x: a DTensor, but this {name} was built with group=" in msg and want in msg, (mode, msg)
        assert shape == (2, 4 if sp else 8, H)
