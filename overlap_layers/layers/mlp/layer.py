"""Tensor-parallel MLP with the batch tiled so communication hides under the GEMMs.

Reference (what :class:`OverlapMLP` must equal, up to rounding), with dense weights
``w_in [I, H]``, ``w_out [H, F]`` and the full token matrix ``x [N, H]``::

    y = act(x @ w_in.T + b_in) @ w_out.T + b_out

``act`` is ``silu(gate) * up`` for swiglu, ``gelu_tanh(gate) * up`` for geglu_tanh (gated: ``w_in``
= all gate rows, then all up rows), or exact gelu / relu. Under tensor parallelism rank r holds rows ``r*F/ws ..`` of gate and up and the
matching columns of ``w_out``; with sequence parallelism it holds tokens ``r*N/ws ..``.

Legend: T local tokens (batch*seq_local), t a tile's local tokens, M = ws*t gathered rows of a
tile (SP) or t (no SP), H hidden, I local fc1 width (2*F/ws swiglu, else F/ws), F local ffn width.

``_TiledMLP`` (forward / dgrad / wgrad, per rank, per tile):

=============  =========================================  ==============================
step           sequence parallel                          no sequence parallel
=============  =========================================  ==============================
forward        xg_MH = AG(x_tH); pre_MI = xg @ w_in.T;    pre = x_tH @ w_in.T; ...;
               y_tH = RS(act(pre) @ w_out.T)              y_tH = AR(act(pre) @ w_out.T)
dgrad          dyg_MH = AG(dy_tH); dpre = act'(dyg@w_out) dpre = act'(dy_tH @ w_out)
               dx_tH = RS(dpre @ w_in)                    dx_tH = AR(dpre @ w_in)
wgrad          dw_out += dyg.T @ act(pre);                same with dy_tH, x_tH
               dw_in += dpre.T @ xg (xg saved or re-gathered)
=============  =========================================  ==============================

In backward the gather of dy (and the re-gather of x) hides under the previous tile's dgrad, and
the reduce-scatter / all-reduce of dx under the wgrad GEMMs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ...config import OverlapConfig, check_positive_int
from ...planning.calls import LayerCall, apply_saving, recorded_pass, run_tiles
from ...planning.checks import X_ERRORS, x_error
from ...planning.dtensor import Layout
from ...planning.entry import planned_forward
from ...planning.first_order import first_order, keeps_graph
from ...planning.layer_spec import TiledLayer
from ...planning.plan import TilePlan
from ...planning.plan_cache import Trial
from ...planning.rank_plans import RankChunkPlans
from ...planning.tiling import tile_bounds
from ...planning.trace import TraceJob
from ...runtime import resolve_group
from ...runtime.collectives import all_gather_single as all_gather_rows
from ...schedule import TileProgram, round_robin
from ..common import rank_chunks
from ..common.activations import ACTIVATIONS, act, act_backward, gated
from ..common.grads import sum_grads_in_backward
from ..common.plain_tp import enter, leave, timed_inputs, timed_output
from ..common.cost import MLPCostModel
from ..common.tp_program import (Accumulator, backward_program, column_dgrad, column_forward, forward_program,
                                 row_forward, weight_grad)

MLPPlan = TilePlan  # the tile plan (shared by every layer), under the name the MLP API uses
MLP_PARAMS = ("w_in", "b_in", "w_out", "b_out")  # every MLP parameter, in the order the calls read them
@dataclass
class MLPCall(LayerCall):
    """Everything one call needs besides tensors (passed through the autograd Function): the
    fields of :class:`~overlap_layers.planning.calls.LayerCall`, in this order with the MLP's."""

    group: object
    activation: str
    sequence_parallel: bool
    plan: MLPPlan
    save: bool
    streams: Optional[list]
    launch_log: Optional[list]
    trial: Optional[Trial] = None  # times the backward during first-call verification
    trace: Optional[TraceJob] = None  # records every op for export_trace(measured=True)
    exchange: Optional[Callable] = None  # (sources, partial_shape, keep, recorder) -> an exchange (rank plans)


def mlp_forward_program(c: MLPCall, w_in, b_in, w_out) -> TileProgram:
    keep_xg = c.save and c.sequence_parallel and not c.plan.regather

    def activation(env):
        env["h"] = act(c.activation, env["pre"] if c.save else env.pop("pre"))

    return forward_program("mlp", c.sequence_parallel,
                           ("fc1", column_forward(c.sequence_parallel, keep_xg, w_in, b_in, "pre")),
                           ("act", activation),
                           ("fc2", row_forward(c.sequence_parallel, "h", w_out)))


def mlp_backward_program(c: MLPCall, w_in, w_out, grads: dict, has_b_in: bool) -> TileProgram:
    sp, regather = c.sequence_parallel, c.sequence_parallel and c.plan.regather
    xin = "xg" if sp else "x"
    accumulate = Accumulator(grads)

    def dgrad2(env):
        env["dh"] = torch.mm(env["dyg"] if sp else env["dy"], w_out)

    def act_bwd(env):
        env["dpre"], env["h"] = act_backward(c.activation, env.pop("pre"), env.pop("dh"))

    return backward_program("mlp_bwd", sp, regather, ("dgrad2", dgrad2), ("act_bwd", act_bwd),
                            ("dgrad1", column_dgrad(sp, "dpre", w_in)),
                            ("wgrad2", weight_grad(accumulate, "w_out", "dyg" if sp else "dy", "h"), "w_out"),
                            ("wgrad1", weight_grad(accumulate, "w_in", "dpre", xin, "b_in" if has_b_in else None),
                             "w_in"))


class _TiledMLP(torch.autograd.Function):
    """Tiled, overlapped TP MLP without ``b_out`` (added outside, see OverlapMLP.forward)."""

    @staticmethod
    def forward(ctx, x_TH, w_in, b_in, w_out, call: MLPCall):
        T, H = x_TH.shape
        bounds = tile_bounds(T, call.plan.num_tiles)
        out_TH = x_TH.new_empty((T, H))
        envs = [{"x": x_TH[a:b], "y_out": out_TH[a:b]} for a, b in bounds]
        program = mlp_forward_program(call, w_in, b_in, w_out)
        sched = round_robin(program, len(bounds), buckets=dict(call.plan.buckets_fwd))
        run_tiles(call, sched, envs, "mlp", backward=False, device=x_TH.device)
        if call.save:
            pres = [e["pre"] for e in envs]
            xgs = [e["xg"] for e in envs] if (call.sequence_parallel and not call.plan.regather) else []
            ctx.save_for_backward(x_TH, w_in, w_out, *pres, *xgs)
            ctx.call, ctx.has_b_in, ctx.n = call, b_in is not None, len(bounds)
        return out_TH

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        c: MLPCall = ctx.call
        x_TH, w_in, w_out, *rest = ctx.saved_tensors
        n = ctx.n
        pres, xgs = rest[:n], rest[n:]
        dy_TH = dy_TH.contiguous()
        T, H = x_TH.shape
        bounds = tile_bounds(T, n)
        dx_TH = x_TH.new_empty((T, H))
        grads = {"w_in": torch.empty_like(w_in), "w_out": torch.empty_like(w_out),
                 "b_in": w_in.new_empty(w_in.shape[0]) if ctx.has_b_in else None}
        envs = []
        for i, (a, b) in enumerate(bounds):
            env = {"dy": dy_TH[a:b], "pre": pres[i], "dx_out": dx_TH[a:b]}
            if c.sequence_parallel and not c.plan.regather:
                env["xg"] = xgs[i]
            else:
                env["x"] = x_TH[a:b]
            envs.append(env)
        del pres, xgs, rest
        program = mlp_backward_program(c, w_in, w_out, grads, ctx.has_b_in)
        sched = round_robin(program, n, buckets=dict(c.plan.buckets_bwd))
        run_tiles(c, sched, envs, "mlp_bwd", backward=True, device=dy_TH.device)
        return dx_TH, grads["w_in"], grads["b_in"], grads["w_out"], None


class _RankChunkMLP(torch.autograd.Function):
    """The SP MLP split by source rank (``layers/common/rank_chunks.py``), without ``b_out``."""

    @staticmethod
    def forward(ctx, x_TH, w_in, b_in, w_out, call: MLPCall):
        T, H = x_TH.shape
        keep_xg = call.save and not call.plan.regather
        with recorded_pass(call, backward=False, device=x_TH.device) as recorder:
            ex = call.exchange([x_TH], (T, H), (keep_xg,), recorder)
            pre_all = x_TH.new_empty((ex.ws, T, w_in.shape[0])) if call.save else None  # no grad: per piece
            y_TH = rank_chunks.forward(ex, x_TH, w_in, b_in, w_out, partial(act, call.activation), pre_all,
                                       call.launch_log, recorder)
        if call.save:  # the own rows as kept in the gathered buffer: the input may be a graph's staged one
            ctx.save_for_backward(ex.gathered[0][ex.rank] if keep_xg else x_TH, w_in, w_out, pre_all,
                                  *([ex.gathered[0]] if keep_xg else []))
            ctx.call, ctx.has_b_in = call, b_in is not None
        return y_TH

    @staticmethod
    @first_order  # [Note: first-order backward]
    def backward(ctx, dy_TH):
        c: MLPCall = ctx.call
        x_TH, w_in, w_out, pre_all, *xg = ctx.saved_tensors
        dy_TH = dy_TH.contiguous()
        T, H = x_TH.shape

        with recorded_pass(c, backward=True, device=dy_TH.device) as recorder:
            grads = {"w_in": torch.empty_like(w_in), "w_out": torch.empty_like(w_out),
                     "b_in": w_in.new_empty(w_in.shape[0]) if ctx.has_b_in else None}
            # [Note: weight gradients over every row]: dy of every rank (and x, re-gathered), own rows copied in
            ex = c.exchange([dy_TH, x_TH] if c.plan.regather else [dy_TH], (T, H), (True, c.plan.regather),
                            recorder)

            def x_all():
                return ex.whole(1) if c.plan.regather else xg[0]

            dx_TH = rank_chunks.backward(ex, dy_TH, x_all, pre_all, w_in, w_out,
                                         partial(act_backward, c.activation), grads, c.launch_log, recorder,
                                         in_place=not keeps_graph())
        return dx_TH, grads["w_in"], grads["b_in"], grads["w_out"], None


class OverlapMLP(RankChunkPlans, TiledLayer, nn.Module):
    """Drop-in tensor-parallel MLP (Megatron column-parallel fc1, row-parallel fc2).

    Equals the dense MLP in this module's docstring. Input ``[batch, seq_local, hidden]`` with
    ``sequence_parallel`` (rank r holds positions ``r*seq_local ..``), else the replicated
    ``[batch, seq, hidden]``; the output has the input's layout.

    Parameters (``group=``): ``w_in [I, H]`` (swiglu: this rank's gate rows, then its up rows),
    ``w_out [H, F/ws]``, ``b_in [I]``, ``b_out [H]`` replicated and added once after the reduction.
    Under sequence parallelism only the rank's own rows contribute to ``b_out``'s gradient, like
    Megatron's sequence-parallel parameters; the layer sums it over the group inside backward
    ([Note: gradients complete in backward] in ``layers/common/grads.py``), so ``b_out.grad`` is
    complete when backward returns, as it is without sequence parallelism.
    With ``mesh=`` the same tensors are the local parts of DTensor parameters whose global value is
    the dense tensor (swiglu ``w_in [2, F, H]``, Shard(1)); see overlap_layers.planning.dtensor.

    ``num_tiles`` (overrides ``config.num_tiles``) is K, or "auto". Set ``launch_log`` to a list
    to record the order in which ops were launched (a debugging aid).

    With sequence parallelism the layer can also be split by source rank instead of by batch tile
    (``plan.decomposition == "rank"``, ``layers/common/rank_chunks.py``), exchanging chunks on CUDA over the
    copy engines (``plan.transport == "copy_engine"``: ``torch.distributed._symmetric_memory``, a
    workspace shared by the group's layers; the planner's candidate) or over NCCL / gloo send/recv
    (``"nccl"``: pinned plans only). ``config.transport`` (see OverlapConfig) says whether the
    planner may use the copy engine; where it is unavailable one warning says why and NCCL runs.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, group=None, mesh=None, axis=None,
                 sequence_parallel: bool = True, activation: str = "swiglu", bias: bool = False,
                 num_tiles=None, config: Optional[OverlapConfig] = None, dtype=None, device=None):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            check_positive_int(v, name)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}; valid: {ACTIVATIONS}")
        ws = self._init_group(config, num_tiles, dtype, group, mesh, axis)
        if ffn_hidden_size % ws:
            raise ValueError(f"ffn_hidden_size={ffn_hidden_size} must be divisible by the group size {ws}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.sequence_parallel, self.activation, self.bias = bool(sequence_parallel), activation, bool(bias)
        f_local = ffn_hidden_size // ws
        n_in = 2 * f_local if gated(activation) else f_local
        kw = {"dtype": dtype, "device": device}
        self.w_in = nn.Parameter(torch.empty(n_in, hidden_size, **kw))
        self.w_out = nn.Parameter(torch.empty(hidden_size, f_local, **kw))
        self.b_in = nn.Parameter(torch.empty(n_in, **kw)) if bias else None
        self.b_out = nn.Parameter(torch.empty(hidden_size, **kw)) if bias else None
        self._init_planner(mesh, axis)
        if self.sequence_parallel:  # the rank's rows only: [Note: gradients complete in backward]
            sum_grads_in_backward(self, ("b_out",))

    # ----------------------------------------------------------------- weights
    def _dense_in_rows(self) -> int:
        return (2 if gated(self.activation) else 1) * self.ffn_hidden_size

    def _shard_in(self, dense: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a dense fc1 weight/bias (gate rows then up rows for swiglu)."""
        f, fl, r = self.ffn_hidden_size, self.ffn_hidden_size // self.world_size, self.rank
        if gated(self.activation):
            return torch.cat([dense[r * fl:(r + 1) * fl], dense[f + r * fl:f + (r + 1) * fl]])
        return dense[r * fl:(r + 1) * fl]

    def _shard_out(self, dense_w_out: torch.Tensor) -> torch.Tensor:
        fl, r = self.ffn_hidden_size // self.world_size, self.rank
        return dense_w_out[:, r * fl:(r + 1) * fl]

    def _dtensor_layouts(self) -> Dict[str, Layout]:
        """[Note: DTensor parameters] (``planning/dtensor.py``): a gated activation's ``w_in``, ``b_in`` as
        ``[2, F, H]`` / ``[2, F]`` (gate, up) Shard(1); other activations' Shard(0)."""
        fl, H = self.ffn_hidden_size // self.world_size, self.hidden_size
        glu = gated(self.activation)
        return {"w_in": Layout(Shard(1), (2, fl, H)) if glu else Layout(Shard(0)),
                "b_in": Layout(Shard(1), (2, fl)) if glu else Layout(Shard(0)),
                "w_out": Layout(Shard(1)), "b_out": Layout(Replicate())}

    def _dtensor_input_placements(self) -> tuple:
        """[Note: DTensor inputs]: the sequence shard with sequence parallelism, else replicated."""
        return (Shard(1),) if self.sequence_parallel else (Replicate(),)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as ``nn.Linear(H, I_dense)`` then ``nn.Linear(F, H)`` would under the same
        seed (weight then bias each), and keep this rank's shard: the same on every rank."""
        if self.w_in.device.type == "meta":
            return
        kw = {"dtype": self.w_in.dtype, "device": self.w_in.device}
        fc1 = torch.empty(self._dense_in_rows(), self.hidden_size, **kw)
        nn.init.kaiming_uniform_(fc1, a=math.sqrt(5))
        self.w_in.copy_(self._shard_in(fc1))
        if self.b_in is not None:
            bound = 1 / math.sqrt(self.hidden_size)
            self.b_in.copy_(self._shard_in(torch.empty(fc1.shape[0], **kw).uniform_(-bound, bound)))
        fc2 = torch.empty(self.hidden_size, self.ffn_hidden_size, **kw)
        nn.init.kaiming_uniform_(fc2, a=math.sqrt(5))
        self.w_out.copy_(self._shard_out(fc2))
        if self.b_out is not None:
            bound = 1 / math.sqrt(self.ffn_hidden_size)
            self.b_out.uniform_(-bound, bound)

    @classmethod
    def from_dense(cls, w_in: torch.Tensor, w_out: torch.Tensor, *, b_in=None, b_out=None,
                   group=None, mesh=None, axis=None, sequence_parallel: bool = True,
                   activation: str = "swiglu", bias: Optional[bool] = None, num_tiles=None,
                   config: Optional[OverlapConfig] = None) -> "OverlapMLP":
        """Shard dense ``nn.Linear``-layout weights: ``w_in [I_dense, H]``, ``w_out [H, F]``.

        ``bias`` defaults to whether biases are given; both or neither of b_in/b_out."""
        if not isinstance(w_in, torch.Tensor) or w_in.dim() != 2:
            raise ValueError(f"w_in must be a 2-D tensor [ffn (x2 for swiglu), hidden]; got "
                             f"{getattr(w_in, 'shape', w_in)!r}")
        if not isinstance(w_out, torch.Tensor) or w_out.dim() != 2:
            raise ValueError(f"w_out must be a 2-D tensor [hidden, ffn]; got {getattr(w_out, 'shape', w_out)!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}; valid: {ACTIVATIONS}")
        hidden, ffn = w_out.shape
        want_in = (2 * ffn if gated(activation) else ffn, hidden)
        if tuple(w_in.shape) != want_in:
            raise ValueError(f"w_in has shape {tuple(w_in.shape)}; with w_out {tuple(w_out.shape)} and "
                             f"activation={activation!r} it must be {want_in}")
        if (b_in is None) != (b_out is None):
            raise ValueError("pass both b_in and b_out, or neither")
        has_bias = b_in is not None
        if bias is not None and bool(bias) != has_bias:
            raise ValueError(f"bias={bias} but biases were {'given' if has_bias else 'not given'}")
        if has_bias:
            if tuple(b_in.shape) != (want_in[0],):
                raise ValueError(f"b_in has shape {tuple(b_in.shape)}; must be ({want_in[0]},)")
            if tuple(b_out.shape) != (hidden,):
                raise ValueError(f"b_out has shape {tuple(b_out.shape)}; must be ({hidden},)")
        layer = cls(hidden, ffn, group=resolve_group(group, mesh, axis), sequence_parallel=sequence_parallel,
                    activation=activation, bias=has_bias, num_tiles=num_tiles, config=config,
                    dtype=w_in.dtype, device="meta")
        layer.to_empty(device=w_in.device)
        with torch.no_grad():
            layer.w_in.copy_(layer._shard_in(w_in))
            layer.w_out.copy_(layer._shard_out(w_out))
            if has_bias:
                layer.b_in.copy_(layer._shard_in(b_in))
                layer.b_out.copy_(b_out)
        layer._as_dtensors(mesh, axis)
        return layer

    @torch.no_grad()
    def to_dense(self) -> dict:
        """The dense ``w_in``, ``w_out``, ``b_in``, ``b_out`` (None without bias); a collective:
        every rank of the group must call it."""
        ws, fl = self.world_size, self.ffn_hidden_size // self.world_size

        def gather(t):
            out = t.new_empty((ws * t.shape[0], *t.shape[1:]))
            all_gather_rows(out, t.contiguous(), group=self.group)
            return out.view(ws, *t.shape)

        def unshard_in(t):
            g = gather(t)
            if gated(self.activation):
                return torch.cat([g[:, :fl].reshape(-1, *t.shape[1:]), g[:, fl:].reshape(-1, *t.shape[1:])])
            return g.reshape(-1, *t.shape[1:])

        w_in, b_in, w_out, b_out = (self._local(n) for n in ("w_in", "b_in", "w_out", "b_out"))
        w_out = gather(w_out.t()).reshape(-1, self.hidden_size).t().contiguous()
        return {"w_in": unshard_in(w_in), "w_out": w_out,
                "b_in": unshard_in(b_in) if b_in is not None else None,
                "b_out": b_out.detach().clone() if b_out is not None else None}

    # ----------------------------------------------------------------- forward
    @planned_forward  # torch.compile: one op; a DTensor x: its local tensor (planning/entry.py)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        planner = self.planner
        direct = planner.direct_key(x)  # [Note: direct calls] in planning/planner.py
        if planner.direct_known(direct):
            return self._plain_ops(x, *self._locals_without_grad(MLP_PARAMS), None)
        agreed = planner.agree(x, x_error(x, self.hidden_size, self.w_in), X_ERRORS, "x",
                               replicated=(("x", None if self.sequence_parallel else x),))
        if direct is not None:
            return self._run(x, planner.direct_agreed(direct), False)
        return planner.call(x, agreed, lambda plan, trial, trace, x: self._run(x, plan, agreed.save, trial, trace))

    # ----------------------------------------------------------------- planning hooks (TiledLayer)
    @property
    def _weight(self) -> torch.Tensor:
        return self.w_in

    def _config_fields(self) -> tuple:
        return (("hidden_size", self.hidden_size), ("ffn_hidden_size", self.ffn_hidden_size),
                ("activation", self.activation), ("bias", self.bias), ("sequence_parallel", self.sequence_parallel))

    def _plan_key(self, shape: tuple, dtype: torch.dtype, save: bool) -> tuple:
        rows = shape[0] * shape[1]
        return (1 << max(rows - 1, 0).bit_length(), dtype, save)  # rows bucketed to a power of two

    def _tile_units(self, shape: tuple) -> int:
        return shape[0] * shape[1]

    def _plain_call(self, key: tuple):
        if self.world_size != 1:
            return None
        return (1, key[0], self.hidden_size), lambda x: self._run(x, MLPPlan(1), True)

    def _backward_reads_input(self, plan) -> bool:
        return plan.regather  # else it reads the own rows kept in the gathered x (_RankChunkMLP)

    def _programs(self, k: int, save: bool, regather: bool):
        call = MLPCall(self.group, self.activation, self.sequence_parallel, MLPPlan(k, regather=regather), save,
                     None, None)
        return (mlp_forward_program(call, None, None, None),
                mlp_backward_program(call, None, None, {}, self.b_in is not None))

    def _cost_model(self, key: tuple, hw) -> MLPCostModel:
        rows, dtype = key[0], key[1]
        n_in, f_local = self._local("w_in").shape[0], self._local("w_out").shape[1]
        return MLPCostModel(rows=rows, world_size=self.world_size, hidden=self.hidden_size, n_in=n_in,
                            f_local=f_local, elt=torch.tensor([], dtype=dtype).element_size(),
                            sequence_parallel=self.sequence_parallel, model=hw, activation=self.activation)

    def _op_setups(self, cm: MLPCostModel, dtype: torch.dtype) -> dict:
        """The activation ops to measure: key -> setup returning the callable to time."""
        dev = self.w_in.device

        def setup(name, m):
            pre = torch.randn(m, cm.I, dtype=dtype, device=dev)
            if name == "act":
                return lambda: act(self.activation, pre)
            dh = torch.randn(m, cm.F, dtype=dtype, device=dev)
            return lambda: act_backward(self.activation, pre, dh)

        return {**{key: (lambda spec=spec: setup(*spec)) for key, spec in cm.act_ops().items()},
                **self._copy_engine_setups(cm)}

    def _run(self, x: torch.Tensor, plan: MLPPlan, save: bool, trial: Optional[Trial] = None,
             trace: Optional[TraceJob] = None) -> torch.Tensor:
        dev = x.device.type
        x, (w_in, b_in, w_out, b_out) = self._call_tensors(x, MLP_PARAMS)
        if plan.runs_plain(trace, self.launch_log):  # [Note: plain serial calls]
            if torch.is_autocast_enabled(dev):
                with torch.autocast(dev, enabled=False):
                    return self._plain_ops(x, w_in, b_in, w_out, b_out, trial)
            return self._plain_ops(x, w_in, b_in, w_out, b_out, trial)
        B, S, H = x.shape
        call = MLPCall(group=self.group, activation=self.activation, sequence_parallel=self.sequence_parallel,
                     plan=plan, save=save,
                     streams=self.planner.streams.get(x.device, min(plan.num_tiles, plan.num_streams)),
                     launch_log=self.launch_log, trial=trial, trace=trace)
        fn = self._function(plan, call, x.device, _TiledMLP, _RankChunkMLP)
        with torch.autocast(dev, enabled=False):
            x_TH = x.reshape(B * S, H).contiguous()
            y_TH = apply_saving(fn, save, x_TH, w_in, b_in, w_out, call)
            if b_out is not None:
                y_TH = y_TH + b_out
        return y_TH.view(B, S, H)

    def _plain_ops(self, x, w_in, b_in, w_out, b_out, trial) -> torch.Tensor:
        """The serial plan as plain torch ops ([Note: plain serial calls] in
        ``layers/common/plain_tp.py``) on ``x`` and the local weights in the call's dtype,
        autocast off."""
        ws, sp = self.world_size, self.sequence_parallel
        x, w_in = timed_inputs(trial, x, w_in)
        h = act(self.activation, F.linear(enter(x, self.group, ws, sp), w_in, b_in))
        y = leave(F.linear(h, w_out), self.group, ws, sp)
        return timed_output(y if b_out is None else y + b_out, trial)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, sequence_parallel={self.sequence_parallel}, "
                f"bias={self.bias}, world_size={self.world_size}, num_tiles={self.num_tiles!r}")
