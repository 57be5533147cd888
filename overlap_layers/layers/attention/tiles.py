"""The tensor-parallel attention over batch tiles: each tile's all-gather / reduce-scatter (or
all-reduce) hides under another tile's projections and core (the reference:
``layers/attention/layer.py``'s module docstring).

Legend: B batch, s local sequence (S/ws with SP, else S), b a tile's batch, g = ws (SP) or 1,
M = g*b*s gathered rows of a tile, stored rank-major ``[g, b, s]``; C = (nq_l + 2*nkv_l) * d the
local qkv width, A = nq_l * d the local attention width.

``TiledAttention`` (per rank, per tile):

==========  ==============================================  ===========================
step        sequence parallel                               no sequence parallel
==========  ==============================================  ===========================
forward     xg_MH = AG(x); qkv_MC = xg @ wqkv.T + bqkv;      same without AG, and
            o_MA = core(qkv) (sequences put in order by the   y = AR(o @ wo.T)
            core's permute); y = RS(o @ wo.T)
dgrad       dyg_MH = AG(dy); do = dyg @ wo;                  same with dy, AR
            dqkv = core'(do) (autograd of the saved core);
            dx = RS(dqkv @ wqkv)
wgrad       dwo += dyg.T @ o; dwqkv += dqkv.T @ xg (saved or  same with x
            re-gathered); dbqkv += sum(dqkv); dq_norm, dk_norm
==========  ==============================================  ===========================

The core's backward is ``torch.autograd.grad`` of a graph recorded per tile in the forward (SDPA's
own saved tensors), so it costs what autograd would and is never recomputed.

[Note: attention weight gradients last]
A tile's weight gradients open a round of their own in the backward's segmented round-robin
(``TileProgram.cut``): every tile's data gradients, and so its dx reduce-scatter,
launch before any tile's weight gradients, which then run under the last reduce-scatters. The
planner's plans and a fixed ``num_tiles`` run on one compute stream (``num_streams=1``, as the
planner simulates them; a pinned plan keeps its own), so the device keeps that order. On two
streams the device interleaves the tiles' kernels as they come: tile 0's weight gradients run
beside tile 1's flash backward and delay the dx reduce-scatter after it, and the link waits. The
round and the one stream pay together, not apart, and most where the link is slow (NCCL over
host memory). The MLP keeps its order and its two streams: the same change is slower there.
Measured: see docs/measurements.md (Attention, weight gradients last).
"""
from __future__ import annotations

import torch

from ...planning.calls import run_tiles
from ...planning.first_order import first_order, keeps_graph, take
from ...planning.tiling import tile_bounds
from ...schedule import TileProgram, round_robin
from ..common.tp_program import (Accumulator, backward_program, column_dgrad, column_forward, forward_program,
                                 recording_graph, row_forward, weight_grad)
from .call import AttentionCall


def attention_forward_program(c: AttentionCall, w_qkv, b_qkv, w_o, bounds) -> TileProgram:
    keep_xg = c.save and c.sp and not c.plan.regather

    def core(env):
        b0, b1 = bounds[env["tile"]]
        if c.save:  # record the core's graph for the backward (SDPA's own saved tensors)
            leaf = env.pop("qkv").detach().requires_grad_()
            with recording_graph():  # [Note: per-tile graphs]
                o = c.core(leaf, b0, b1)
            env["leaf"], env["o"] = leaf, o
            env["o_in"] = o.detach()
        else:
            env["o_in"] = c.core(env.pop("qkv"), b0, b1)

    return forward_program("attn", c.sp, ("qkv", column_forward(c.sp, keep_xg, w_qkv, b_qkv, "qkv")),
                           ("core", core), ("proj", row_forward(c.sp, "o_in", w_o, c.save)))


def attention_backward_program(c: AttentionCall, w_qkv, w_o, grads: dict, norms: list) -> TileProgram:
    sp, regather = c.sp, c.sp and c.plan.regather
    xin = "xg" if sp else "x"
    accumulate = Accumulator(grads)

    def dgrad_o(env):
        env["do"] = torch.mm(env["dyg"] if sp else env["dy"], w_o)

    def core_bwd(env):
        got = torch.autograd.grad(env.pop("o"), [env.pop("leaf"), *norms], env.pop("do"),
                                  retain_graph=keeps_graph())
        env["dqkv"] = got[0]
        for i, gn in enumerate(got[1:]):
            accumulate(f"norm{i}", lambda g, gn=gn: g.copy_(gn), lambda g, gn=gn: g.add_(gn))

    return backward_program("attn_bwd", sp, regather, ("dgrad_o", dgrad_o), ("core_bwd", core_bwd),
                            ("dgrad_qkv", column_dgrad(sp, "dqkv", w_qkv)),
                            ("wgrad_o", weight_grad(accumulate, "w_o", "dyg" if sp else "dy", "o_in"), "w_o"),
                            ("wgrad_qkv", weight_grad(accumulate, "w_qkv", "dqkv", xin,
                                                      "b_qkv" if grads.get("b_qkv") is not None else None), "w_qkv"),
                            wgrad_last=True)  # [Note: attention weight gradients last]


class TiledAttention(torch.autograd.Function):
    """Tiled, overlapped TP attention without ``bo`` (added outside). Inputs: rows of x in
    batch-major order ``[B*s, H]``, the fused qkv weight/bias and wo, and the qk-norm weights (so
    autograd routes their gradients here)."""

    @staticmethod
    def forward(ctx, x_TH, w_qkv, b_qkv, w_o, q_norm, k_norm, call: AttentionCall):
        T, H = x_TH.shape
        s = call.s
        bounds = tile_bounds(call.batch, call.plan.num_tiles)
        out_TH = x_TH.new_empty((T, H))
        envs = [{"tile": i, "x": x_TH[b0 * s:b1 * s], "y_out": out_TH[b0 * s:b1 * s]}
                for i, (b0, b1) in enumerate(bounds)]
        program = attention_forward_program(call, w_qkv, b_qkv, w_o, bounds)
        sched = round_robin(program, len(bounds), buckets=dict(call.plan.buckets_fwd))
        run_tiles(call, sched, envs, "attn", backward=False, device=x_TH.device)
        if call.save:
            ctx.graphs = [(e["leaf"], e["o"]) for e in envs]
            keep_xg = call.sp and not call.plan.regather
            ctx.save_for_backward(x_TH, w_qkv, w_o, *[e["o_in"] for e in envs],
                                  *([e["xg"] for e in envs] if keep_xg else []))
            ctx.call, ctx.has_b, ctx.n, ctx.bounds = call, b_qkv is not None, len(bounds), bounds
        return out_TH

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        c: AttentionCall = ctx.call
        x_TH, w_qkv, w_o, *rest = ctx.saved_tensors
        n, s, bounds = ctx.n, c.s, ctx.bounds
        o_ins, xgs = rest[:n], rest[n:]
        graphs = take(ctx, "graphs")
        dy_TH = dy_TH.contiguous()
        T, H = x_TH.shape
        dx_TH = x_TH.new_empty((T, H))
        norms = [p for p in (c.q_norm, c.k_norm) if p is not None]
        grads = {"w_qkv": torch.empty_like(w_qkv), "w_o": torch.empty_like(w_o),
                 "b_qkv": w_qkv.new_empty(w_qkv.shape[0]) if ctx.has_b else None}
        for i, p in enumerate(norms):
            grads[f"norm{i}"] = torch.empty_like(p)
        envs = []
        for i, (b0, b1) in enumerate(bounds):
            env = {"dy": dy_TH[b0 * s:b1 * s], "dx_out": dx_TH[b0 * s:b1 * s], "o_in": o_ins[i],
                   "leaf": graphs[i][0], "o": graphs[i][1]}
            if c.sp and not c.plan.regather:
                env["xg"] = xgs[i]
            else:
                env["x"] = x_TH[b0 * s:b1 * s]
            envs.append(env)
        del graphs, o_ins, xgs, rest
        program = attention_backward_program(c, w_qkv, w_o, grads, norms)
        sched = round_robin(program, n, buckets=dict(c.plan.buckets_bwd))
        run_tiles(c, sched, envs, "attn_bwd", backward=True, device=dy_TH.device)
        d_norms = [grads.get("norm0"), grads.get("norm1")] if norms else [None, None]
        return dx_TH, grads["w_qkv"], grads["b_qkv"], grads["w_o"], d_norms[0], d_norms[1], None

