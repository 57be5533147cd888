"""The sequence-parallel block's attention and MLP as one tiled program, so one sublayer's
collectives run under the other's GEMMs ([Note: fused block]).

Reference (what :class:`FusedBlock` must equal, up to rounding): the block of
``layers/block/layer.py`` with a dense MLP, per rank on its positions, given ``n1 = attn_norm(x)``::

    h = x + attention(n1) (+ bo);   y = h + mlp(mlp_norm(h)) (+ b_out)

Per batch tile of the attention's plan (its K), with the two sublayers' own tile programs
(``layers/attention/tiles.py``, ``layers/mlp/layer.py``): the attention's under the prefix ``a.``,
and the MLP's once per MLP tile of the block tile (``K_mlp // K`` of them, :func:`fused_plans`)
under ``m0.``, ``m1.``, ... (their all-gathers first, then each one's body, then their closing
waits: the MLP's own pipeline inside the block tile)::

    forward   a.ag(n1) | attention | a.rs -> h = x + a.y; n2 = mlp_norm(h);
              m_j.ag(n2 rows j) | MLP | m_j.rs -> y = h + m.y
    backward  m_j.ag(dy rows j) | MLP dgrads | m_j.rs -> dh = dy + mlp_norm'(m.dx);
              a.ag(dh) | attention dgrads | a.rs -> dn1 = a.dx

(weight gradients where each sublayer's program puts them, except that the attention's do not
take a round of their own here ([Note: attention weight gradients last]): the fused program runs
on the MLP's two streams, which measured faster than one; the MLP copies share its accumulators,
ordered by their chains). The returned gradients: ``dh`` for
``x`` (the residual path) and ``dn1`` for ``n1`` (autograd takes it through ``attn_norm``).

[Note: fused block]
Each sublayer alone leaves its first all-gather and last reduce-scatter exposed: nothing of its
own is left to compute under them. Run one after the other, the attention's last reduce-scatter
and the MLP's first all-gather are both exposed at the seam. Here a tile's wait on the
attention's reduce-scatter opens no round of the segmented round-robin (``round_robin(join=)``):
its residual, norm and the MLP's all-gather launch right after its reduce-scatter, before the
next tile's, so NCCL runs ``a.rs[t], m.ag[t], a.rs[t+1]`` and the MLP of tile t computes while the
attention's later reduce-scatters run. The backward joins at the MLP's dx reduce-scatters the
same way. With the attention communication-bound and the MLP compute-bound (NCCL over host
memory), the block's limit is well below the sum of its sublayers' limits; only a program that
overlaps across the seam can get near it. Where both sublayers are communication-bound (llama3-8b
with P2P disabled) it ties with the sublayers in turn; the MLP keeps its own tiles inside each
block tile, since at the attention's K the MLP loses its own overlap. Measured: see
docs/measurements.md (Transformer block).

The block decides at the first calls of a shape, once both sublayers have settled their plans,
by timing both (:class:`~overlap_layers.planning.plan_cache.PlanCache`): fused against the
sublayers one after the other with their own plans; the fused program must win
by more than ``config.margin``. It is tried only where both sublayers run batch tiles over NCCL
(K >= 2, no re-gather): rank chunks start and end on their own rows already.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ...config import Decomposition
from ...planning.calls import run_tiles
from ...planning.first_order import first_order, keeps_graph, take
from ...planning.tiling import tile_bounds
from ...schedule import TileProgram, compute, round_robin, scoped
from ..attention.call import AttentionCall
from ..attention.tiles import attention_backward_program as attention_backward
from ..attention.tiles import attention_forward_program as attention_forward
from ..common.tp_program import Accumulator, recording_graph
from ..mlp.layer import MLPCall
from ..mlp.layer import mlp_backward_program as mlp_backward
from ..mlp.layer import mlp_forward_program as mlp_forward


@dataclass(frozen=True)
class BlockPlan:
    """How a block call runs: its sublayers ``fused`` into one program of ``num_tiles`` batch
    tiles, or one after the other with their own plans."""

    fused: bool
    num_tiles: int = 1
    reason: str = ""
    verification: tuple = field(default=(), compare=False, repr=False)  # as TilePlan's

    @property
    def label(self) -> str:
        return f"fused K={self.num_tiles}" if self.fused else "sublayers in turn"

    @property
    def is_serial(self) -> bool:
        return not self.fused

    def digest(self) -> int:
        return zlib.crc32(repr((self.fused, self.num_tiles)).encode())


def norm(kind: str, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """The block's RMSNorm or LayerNorm over the last dim."""
    if kind == "rmsnorm":
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


class FusedCall:
    """What :class:`FusedBlock` needs besides tensors: the sublayers' calls at the block's K, the
    norm's kind and eps, and the run's settings for :func:`~overlap_layers.planning.calls.run_tiles`."""

    def __init__(self, attn: AttentionCall, mlp: MLPCall, norm_kind: str, eps: float) -> None:
        self.attn, self.mlp, self.norm_kind, self.eps = attn, mlp, norm_kind, eps
        self.sub = mlp.plan.num_tiles // attn.plan.num_tiles  # MLP tiles per block tile
        self.group, self.streams, self.save = attn.group, attn.streams, attn.save
        self.launch_log, self.trial, self.trace = attn.launch_log, None, None
        self.plan = _Carved(attn.plan, mlp.plan)


@dataclass(frozen=True)
class _Carved:
    """The fused pass's SM carveout: the larger of its sublayers' (their plans at the block's K)."""

    attn: object
    mlp: object

    def carved_sms(self, backward: bool) -> int:
        return max(self.attn.carved_sms(backward), self.mlp.carved_sms(backward))


def _split(program: TileProgram, sub: int) -> tuple:
    """``sub`` copies of the MLP's SP ``program`` (scoped ``m0.``, ``m1.``, ...) in one block
    tile: every copy's opening all-gather, then each copy's ops up to its closing wait, then the
    closing waits, so the copies pipeline inside the tile as the MLP's own tiles would."""
    assert program.ops[0].kind == "comm" and program.ops[-1].kind == "wait", program.name
    copies = [scoped(program, f"m{j}.") for j in range(sub)]
    return (*(c[0] for c in copies), *(op for c in copies for op in c[1:-1]), *(c[-1] for c in copies))


def _forward_program(c: FusedCall, w: dict, bounds) -> TileProgram:
    def residual_norm(env):
        y = env.pop("a.y")
        h = env["x"] + (y if w["bo"] is None else y + w["bo"])
        if c.save:  # the norm's graph per tile, for the backward
            leaf = h.detach().requires_grad_()
            with recording_graph():
                n2 = norm(c.norm_kind, leaf, w["n2w"], w["n2b"], c.eps)
            env["n2_leaf"], env["n2"] = leaf, n2
            n2 = n2.detach()
        else:
            n2 = norm(c.norm_kind, h, w["n2w"], w["n2b"], c.eps)
        for j, (a, b) in enumerate(env["m.rows"]):
            env[f"m{j}.x"] = n2[a:b]
        env["h"] = h

    def residual(env):
        for j in range(c.sub):
            env.pop(f"m{j}.y")  # written into m.out by the reduce-scatters
        m = env.pop("m.out")
        torch.add(env.pop("h"), m if w["b_out"] is None else m + w["b_out"], out=env.pop("y_out"))

    attn = attention_forward(c.attn, w["w_qkv"], w["b_qkv"], w["w_o"], bounds)
    mlp = _split(mlp_forward(c.mlp, w["w_in"], w["b_in"], w["w_out"]), c.sub)
    return TileProgram("block", (*scoped(attn, "a."), compute("residual_norm", residual_norm), *mlp,
                                 compute("residual", residual)))


def _backward_program(c: FusedCall, w: dict, grads: dict) -> TileProgram:
    accumulate = Accumulator(grads)
    norm_params = [p for p in (w["n2w"], w["n2b"]) if p is not None]

    def norm_backward(env):
        for j in range(c.sub):
            env.pop(f"m{j}.dx")  # written into m.dx by the reduce-scatters
        dm, dy = env.pop("m.dx"), env["dy"]
        got = torch.autograd.grad(env.pop("n2"), [env.pop("n2_leaf"), *norm_params], dm,
                                  retain_graph=keeps_graph())
        dh = dy + got[0]
        for key, g in zip(("n2w", "n2b"), got[1:]):
            accumulate(key, lambda buf, g=g: buf.copy_(g), lambda buf, g=g: buf.add_(g))
        if w["b_out"] is not None:
            accumulate("b_out", lambda buf: torch.sum(dy, 0, out=buf), lambda buf: buf.add_(dy.sum(0)))
        if w["bo"] is not None:
            accumulate("bo", lambda buf: torch.sum(dh, 0, out=buf), lambda buf: buf.add_(dh.sum(0)))
        env["a.dy"] = env.pop("dh_out").copy_(dh)

    mlp = mlp_backward(c.mlp, w["w_in"], w["w_out"], grads["mlp"], w["b_in"] is not None)
    norms = [p for p in (w["q_norm"], w["k_norm"]) if p is not None]
    attn = attention_backward(c.attn, w["w_qkv"], w["w_o"], grads["attn"], norms)
    return TileProgram("block_bwd", (*_split(mlp, c.sub), compute("norm_backward", norm_backward, chain="block"),
                                     *scoped(attn, "a.")))


class FusedBlock(torch.autograd.Function):
    """The fused program (module docstring). Inputs: ``x`` and ``n1`` as rows ``[B*s, H]``
    (batch-major), then the weights in the order of :data:`WEIGHTS` (None where absent), then
    the :class:`FusedCall`. Returns ``y [B*s, H]``."""

    @staticmethod
    def forward(ctx, x_TH, n1_TH, *args):
        *ws, call = args
        w = dict(zip(WEIGHTS, ws))
        c, s = call, call.attn.s
        T, H = x_TH.shape
        bounds = tile_bounds(c.attn.batch, c.attn.plan.num_tiles)
        attn_out, mlp_out, out = (x_TH.new_empty((T, H)) for _ in range(3))
        # the MLP's rows in each block tile (every tile has at least c.sub rows: fused_plans)
        rows = [tile_bounds((b1 - b0) * s, c.sub) for b0, b1 in bounds]
        envs = []
        for i, (b0, b1) in enumerate(bounds):
            r = slice(b0 * s, b1 * s)
            env = {"a.tile": i, "a.x": n1_TH[r], "a.y_out": attn_out[r], "x": x_TH[r], "y_out": out[r],
                   "m.out": mlp_out[r], "m.rows": rows[i]}
            env.update((f"m{j}.y_out", mlp_out[r][a:b]) for j, (a, b) in enumerate(rows[i]))
            envs.append(env)
        sched = round_robin(_forward_program(c, w, bounds), len(bounds), join=("a.rs",))
        run_tiles(c, sched, envs, "block", backward=False, device=x_TH.device)
        if c.save:
            keys = ("a.o_in", "a.leaf", "a.o", "a.xg", "n2", "n2_leaf",
                    *(f"m{j}.{k}" for j in range(c.sub) for k in ("pre", "xg")))
            ctx.envs = [{k: e[k] for k in keys} for e in envs]
            ctx.rows = rows
            ctx.w, ctx.call, ctx.bounds = w, c, bounds
        return out

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        c, w, bounds, saved = ctx.call, ctx.w, ctx.bounds, take(ctx, "envs")
        s = c.attn.s
        dy_TH = dy_TH.contiguous()
        T, H = dy_TH.shape
        dh_TH, dn1_TH = dy_TH.new_empty((T, H)), dy_TH.new_empty((T, H))
        like = lambda key: torch.empty_like(w[key]) if w[key] is not None else None  # noqa: E731
        grads = {"attn": {"w_qkv": like("w_qkv"), "w_o": like("w_o"), "b_qkv": like("b_qkv")},
                 "mlp": {"w_in": like("w_in"), "w_out": like("w_out"), "b_in": like("b_in")},
                 **{k: like(k) for k in ("n2w", "n2b", "bo", "b_out")}}
        for i, key in enumerate(("q_norm", "k_norm")):
            if w[key] is not None:
                grads["attn"][f"norm{i}"] = like(key)
        envs = []
        for (b0, b1), e, rows in zip(bounds, saved, ctx.rows):
            r = slice(b0 * s, b1 * s)
            dm = dy_TH.new_empty((r.stop - r.start, H))
            env = {**e, "dy": dy_TH[r], "m.dx": dm, "dh_out": dh_TH[r], "a.dx_out": dn1_TH[r]}
            for j, (a, b) in enumerate(rows):
                env[f"m{j}.dy"], env[f"m{j}.dx_out"] = dy_TH[r][a:b], dm[a:b]
            envs.append(env)
        del saved
        sched = round_robin(_backward_program(c, w, grads), len(bounds),
                            join=tuple(f"m{j}.rs_dx" for j in range(c.sub)))
        run_tiles(c, sched, envs, "block_bwd", backward=True, device=dy_TH.device)
        ga, gm = grads["attn"], grads["mlp"]
        out = {"w_qkv": ga["w_qkv"], "b_qkv": ga["b_qkv"], "w_o": ga["w_o"], "q_norm": ga.get("norm0"),
               "k_norm": ga.get("norm1") if w["q_norm"] is not None else ga.get("norm0"),
               "w_in": gm["w_in"], "b_in": gm["b_in"], "w_out": gm["w_out"],
               **{k: grads[k] for k in ("n2w", "n2b", "bo", "b_out")}}
        return (dh_TH, dn1_TH, *[out[k] if w[k] is not None else None for k in WEIGHTS], None)


#: The weights :class:`FusedBlock` takes, in order.
WEIGHTS = ("w_qkv", "b_qkv", "w_o", "q_norm", "k_norm", "bo", "n2w", "n2b", "w_in", "b_in", "w_out", "b_out")


class OnBackward(torch.autograd.Function):
    """The identity, whose backward calls ``hook()`` when the gradient reaches it (the block times
    its backward from its output's gradient to its input's with a stopwatch's start and stop)."""

    @staticmethod
    def forward(ctx, t, hook: Callable[[], None]):
        ctx.hook = hook
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        ctx.hook()
        return g, None


def fused_plans(attn_plan, mlp_plan, tile_rows: int):
    """``(attention plan, MLP plan)`` for the fused program, or None where the sublayers' plans do
    not fuse (module docstring): the attention's K block tiles, each of ``K_mlp // K`` MLP tiles
    (at least 1, at most ``tile_rows``, the smallest block tile's rows)."""
    k = attn_plan.num_tiles
    if k < 2 or any(p.decomposition != Decomposition.BATCH or p.regather for p in (attn_plan, mlp_plan)):
        return None
    sub = max(1, min(mlp_plan.num_tiles // k, tile_rows))
    return (replace(attn_plan, buckets_fwd=(), buckets_bwd=()),
            replace(mlp_plan, num_tiles=k * sub, buckets_fwd=(), buckets_bwd=()))
