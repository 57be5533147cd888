"""Expert-parallel mixture of experts: route on the local tokens, dispatch by all-to-all, run the
local experts, combine by all-to-all; the tokens are cut into K tiles so one tile's exchanges
hide under another tile's experts, in forward and backward.

Reference (what :class:`OverlapMoE` must equal, up to rounding), per rank on its own tokens
``x [T, H]``, with all E experts' dense weights::

    p = softmax(x @ router_weight.T)               # in float32, or the input dtype if wider
    (w, e) = top-k of p per token                  # ties to the lower expert index
    w = w / sum(w)                                 # if normalize_topk
    w = w * routing.scaling                        # the routed scaling factor (1 by default)
    # routing.kind GROUP_LIMITED_GREEDY / NOAUX_TC (DeepSeek-V2 / V3): p, e and w as route_grouped
    # (layers/moe/routing.py) states them: the top-k within the best expert groups; V3: sigmoid p,
    # e chosen by p + e_score_correction_bias
    drop assignments over capacity                 # capacity_factor c: per expert, at most
                                                   # ceil(c*T*k/E), by decreasing p, then token
    y = sum over kept (t, e, w) of w * expert_e(x_t) + shared_expert(x)
    shared_expert(x) = act(x @ shared_w_in.T) @ shared_w_out.T
                       * sigmoid(x @ shared_gate.T)      # only with shared_expert_gate (Qwen2-MoE)
    expert_e(x) = act(x @ w_in[e].T) @ w_out[e].T   # act: swiglu / geglu_tanh (gate rows, then up), gelu, relu
    aux_loss = aux_loss_coef * E * sum_e f_e * P_e  # f_e = assignments to e / (T*k), P_e = mean p_e

Rank r holds experts ``r*E/ws ..`` (``w_in``, ``w_out``); the router and the shared expert are
replicated. Legend: T local tokens, N kept assignments, H hidden, E experts, El = E/ws local
experts, K tiles (of the local tokens; every rank runs K tiles, some possibly empty).

A call (``layers/moe/eager.py``) routes on the whole local batch, exchanges every rank's split
sizes once ([Note: MoE host syncs] in ``layers/moe/eager.py``), runs the exchange and the local
experts, and combines each token's rows weighted in autograd (so the router gets its gradient
through the weights and the aux loss). The exchange is cut into K batch tiles
(``layers/moe/tiles.py``: each tile's dispatch and combine all-to-alls hide under another tile's
experts), or, with ``plan.decomposition == "rank"`` (one tile), split by source rank
(``layers/moe/ranks.py``: the assignment rows go straight into a rank all-to-all's send buffer,
each source's rows run as they arrive, and the results come back in place, in send order). With
``config.graph_calls`` some calls run with every size on the device instead, replayed from CUDA
graphs ([Note: MoE graph calls] in ``layers/moe/device.py``; which calls:
``layers/moe/device_path.py``). The modules of the family:

===============  ================================================================================
layer.py         :class:`OverlapMoE`: parameters, planning hooks, forward
routing.py       router logits, top-k, grouped routers, capacity, aux loss, send-order keys
eager.py         one eager call: counts exchange, the exchange's path, combine
tiles.py         the exchange by batch tiles (tile programs, autograd Function)
ranks.py         the exchange by source rank (pieces, autograd Function)
experts.py       the local experts' GEMMs (grouped or per expert)
combine.py       the weighted combine of each token's rows
device.py        the device path's passes (every size on the device)
device_path.py   which calls take the device path: the race, slot rows, its exchanges
cost.py          the cost model
tokens.py        replicated tokens split across the group and gathered back (the block's)
===============  ================================================================================
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, Optional

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ...config import OverlapConfig
from ...planning.checks import X_ERRORS, x_error
from ...planning.dtensor import Layout
from ...planning.entry import planned_forward
from ...planning.layer_spec import TiledLayer
from ...planning.plan import TilePlan
from ...planning.rank_plans import RankChunkPlans
from ...runtime import resolve_group
from ...runtime.collectives import gathered_rows
from ...runtime.rank_all_to_all import CopyEngineAllToAll, PointToPointAllToAll
from ...runtime.streams import HostReader
from ..common.activations import gated
from ..common.init import init_linear_
from ..common.plain_tp import timed_inputs, timed_output
from ..common.tp_program import Accumulator
from .checks import check_args, check_dense, check_routing
from .cost import MoECostModel
from .device_path import DevicePath
from .eager import eager_call
from .experts import grouped_for, grouped_setups, shared_expert
from .plain import plain_call
from .routing import RouterKind, Routing, route_call, zero_aux
from .tiles import TileCall, backward_program, forward_program

_INPUT_ERRORS = {**X_ERRORS, 1: X_ERRORS[1] + " (batch*seq may be 0 and may differ across ranks)"}


class OverlapMoE(RankChunkPlans, TiledLayer, nn.Module):
    """Drop-in expert-parallel MoE; equals the module docstring's reference on each rank's tokens.

    Parameters (``group=`` the expert-parallel group): ``router_weight [E, H]`` (replicated),
    ``w_in [E/ws, 2*ffn, H]`` (swiglu: gate rows then up rows; else ``[E/ws, ffn, H]``),
    ``w_out [E/ws, H, ffn]`` for experts ``r*E/ws ..``, and the replicated shared expert
    ``shared_w_in [2*shared_ffn, H]``, ``shared_w_out [H, shared_ffn]`` and, with
    ``shared_expert_gate``, ``shared_gate [1, H]`` (its sigmoid scales the shared expert's output per
    token); with ``routing=Routing(RouterKind.NOAUX_TC, ...)`` (DeepSeek-V3) the buffer
    ``e_score_correction_bias [E]`` (float32, zeros: set it in place; no gradient), else None.
    ``routing`` (:class:`~overlap_layers.layers.moe.routing.Routing`) picks the router: softmax
    top-k (the default), DeepSeek-V2's group-limited greedy, DeepSeek-V3's ``noaux_tc``, each with
    its expert groups and weight scaling. ``router_weight.grad`` and
    the shared expert's gradients hold *this rank's tokens'* contribution (the data-parallel
    reduction over the group sums them); expert gradients hold every rank's tokens routed to them.
    With ``mesh=`` the same tensors are the local parts of DTensor parameters (experts Shard(0),
    the rest Replicate); see overlap_layers.planning.dtensor.

    Input ``[batch, seq, hidden]``: this rank's own tokens (the count may differ across ranks and
    may be 0); output the same shape. Capacity drops order by the router probability (before
    renormalisation). ``layer.aux_loss`` is set by every call (0 unless ``aux_loss_coef > 0``).
    ``num_tiles`` is K (tiles of the local tokens; every rank runs K, some tiles may be empty) or
    "auto": planned from the group's largest token count (bucketed) assuming balanced routing,
    then verified on the first calls. The planner also weighs the exchange split by source rank
    (``plan.decomposition == "rank"``, ``layers/moe/ranks.py``): on CUDA over the copy engine where every
    rank has symmetric memory, else over send/recv. With ``config.graph_calls``, calls without
    autograd (and without aux loss) where every rank has symmetric memory run with their sizes on
    the device and are replayed from CUDA graphs ([Note: MoE graph calls] in ``layers/moe/device.py``).
    """

    _exchanges = (CopyEngineAllToAll, PointToPointAllToAll)
    _planned_send_recv = True
    _source_split = True  # every rank's rows for this rank's experts are a piece
    _dense_when_empty = False  # ranks may hold no tokens while others do; routing none sets the aux loss
    _workspace_purposes = ("exchange", "device_counts")  # the rank chunks' and the device path's
    #: the replicated parameters, used on this rank's tokens only (their gradients are partial)
    replicated_params = ("router_weight", "shared_w_in", "shared_w_out", "shared_gate")

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *, group=None,
                 mesh=None, axis=None, activation: str = "swiglu", normalize_topk: bool = True,
                 capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0,
                 shared_expert_ffn: Optional[int] = None, shared_expert_gate: bool = False,
                 routing: Routing = Routing(), num_tiles=None,
                 config: Optional[OverlapConfig] = None, dtype=None, device=None):
        super().__init__()
        check_args(hidden_size, ffn_hidden_size, num_experts, top_k, activation, capacity_factor, aux_loss_coef,
                   shared_expert_ffn)
        if not isinstance(shared_expert_gate, bool) or (shared_expert_gate and not shared_expert_ffn):
            raise ValueError(f"shared_expert_gate={shared_expert_gate!r}; must be False, or True with a shared expert "
                             f"(shared_expert_ffn > 0; got {shared_expert_ffn!r})")
        check_routing(routing, num_experts, top_k)
        ws = self._init_group(config, num_tiles, dtype, group, mesh, axis)
        if num_experts % ws:
            raise ValueError(f"num_experts={num_experts} must be divisible by the group size {ws}")
        self.hidden_size, self.ffn_hidden_size, self.num_experts, self.top_k = \
            hidden_size, ffn_hidden_size, num_experts, top_k
        self.activation, self.normalize_topk, self.capacity_factor = activation, bool(normalize_topk), capacity_factor
        self.aux_loss_coef, self.shared_expert_ffn, self.routing = float(aux_loss_coef), shared_expert_ffn, routing
        self.shared_expert_gate = shared_expert_gate
        self.num_local_experts = num_experts // ws
        kw = {"dtype": dtype, "device": device}
        n_in = (2 if gated(activation) else 1) * ffn_hidden_size
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.w_in = nn.Parameter(torch.empty(self.num_local_experts, n_in, hidden_size, **kw))
        self.w_out = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, ffn_hidden_size, **kw))
        if shared_expert_ffn:
            s_in = (2 if gated(activation) else 1) * shared_expert_ffn
            self.shared_w_in = nn.Parameter(torch.empty(s_in, hidden_size, **kw))
            self.shared_w_out = nn.Parameter(torch.empty(hidden_size, shared_expert_ffn, **kw))
        else:
            self.shared_w_in = self.shared_w_out = None
        self.shared_gate = nn.Parameter(torch.empty(1, hidden_size, **kw)) if shared_expert_gate else None
        # DeepSeek-V3's selection bias: float32 as transformers keeps it, whatever the weights' dtype
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) \
            if routing.kind is RouterKind.NOAUX_TC else None
        self.register_buffer("e_score_correction_bias", bias)
        self._init_planner(mesh, axis)

    def _init_caches(self) -> None:
        self._aux: Optional[torch.Tensor] = None  # the last call's aux loss (see aux_loss), once made
        self._aux_zero_of = None  # while it is 0 and not made: (device, dtype, whether the call had autograd)
        self._host_reader = HostReader()
        self._device_path = DevicePath(self)  # [Note: MoE graph calls] (layers/moe/device.py)

    # ----------------------------------------------------------------- weights
    def _dtensor_layouts(self) -> Dict[str, Layout]:
        """[Note: DTensor parameters] (``planning/dtensor.py``): the experts Shard(0) over experts,
        the router and the shared expert Replicate; a gated activation's ``shared_w_in`` as ``[2,
        shared_ffn, H]`` (gate, up), as OverlapMLP's ``w_in``."""
        sffn = self.shared_expert_ffn
        shared_in = (2, sffn, self.hidden_size) if sffn and gated(self.activation) else None
        return {"router_weight": Layout(Replicate()), "w_in": Layout(Shard(0)), "w_out": Layout(Shard(0)),
                "shared_w_in": Layout(Replicate(), shared_in), "shared_w_out": Layout(Replicate()),
                "shared_gate": Layout(Replicate())}

    def _dtensor_input_placements(self) -> tuple:
        """[Note: DTensor inputs]: tokens split across the group, by batch or by sequence."""
        return (Shard(0), Shard(1))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Router and experts as ``nn.Linear`` (no bias) would initialise them under the same seed,
        in the order router, every expert's fc1 then fc2 (dense, then this rank's slice), shared
        fc1, fc2, gate: the same on every rank; ``e_score_correction_bias`` zeros."""
        if self.w_in.device.type == "meta":
            return
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()
        init_linear_(self.router_weight, None)
        kw = {"dtype": self.w_in.dtype, "device": self.w_in.device}
        dense_in = torch.empty(self.num_experts, *self.w_in.shape[1:], **kw)
        dense_out = torch.empty(self.num_experts, *self.w_out.shape[1:], **kw)
        for e in range(self.num_experts):
            init_linear_(dense_in[e], None)
            init_linear_(dense_out[e], None)
        mine = slice(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)
        self.w_in.copy_(dense_in[mine])
        self.w_out.copy_(dense_out[mine])
        if self.shared_w_in is not None:
            init_linear_(self.shared_w_in, None)
            init_linear_(self.shared_w_out, None)
        if self.shared_gate is not None:
            init_linear_(self.shared_gate, None)

    @classmethod
    def from_dense(cls, router_weight: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, *, top_k: int,
                   shared_w_in=None, shared_w_out=None, shared_gate=None, group=None, mesh=None, axis=None,
                   activation: str = "swiglu",
                   normalize_topk: bool = True, capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0,
                   routing: Routing = Routing(), e_score_correction_bias: Optional[torch.Tensor] = None,
                   num_tiles=None, config: Optional[OverlapConfig] = None) -> "OverlapMoE":
        """From dense weights: ``router_weight [E, H]``, ``w_in [E, 2*ffn, H]`` (swiglu; else
        ``[E, ffn, H]``), ``w_out [E, H, ffn]``, shared ``shared_w_in [2*sffn, H]`` (swiglu),
        ``shared_w_out [H, sffn]`` (both or neither), ``shared_gate [1, H]`` (with a shared expert
        only); ``e_score_correction_bias [E]`` with ``RouterKind.NOAUX_TC`` (None: zeros)."""
        E, H, ffn, sffn = check_dense(router_weight, w_in, w_out, shared_w_in, shared_w_out, activation)
        if shared_gate is not None and (not sffn or not isinstance(shared_gate, torch.Tensor)
                                        or tuple(shared_gate.shape) != (1, H)):
            raise ValueError(f"shared_gate {tuple(getattr(shared_gate, 'shape', ()))}: must be a [1, {H}] tensor, "
                             f"given with shared_w_in and shared_w_out")
        if e_score_correction_bias is not None and (getattr(routing, "kind", None) is not RouterKind.NOAUX_TC or
                                                    tuple(e_score_correction_bias.shape) != (E,)):
            raise ValueError(f"e_score_correction_bias of shape {tuple(e_score_correction_bias.shape)}: must be None, "
                             f"or [{E}] with routing.kind=RouterKind.NOAUX_TC (routing={routing!r})")
        layer = cls(H, ffn, E, top_k, group=resolve_group(group, mesh, axis), activation=activation,
                    normalize_topk=normalize_topk, capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef,
                    shared_expert_ffn=sffn, shared_expert_gate=shared_gate is not None, routing=routing,
                    num_tiles=num_tiles, config=config, dtype=w_in.dtype, device="meta")
        layer.to_empty(device=w_in.device)
        with torch.no_grad():
            if layer.e_score_correction_bias is not None:
                layer.e_score_correction_bias.copy_(0.0 if e_score_correction_bias is None else e_score_correction_bias)
            mine = slice(layer.rank * layer.num_local_experts, (layer.rank + 1) * layer.num_local_experts)
            layer.router_weight.copy_(router_weight)
            layer.w_in.copy_(w_in[mine])
            layer.w_out.copy_(w_out[mine])
            if sffn:
                layer.shared_w_in.copy_(shared_w_in)
                layer.shared_w_out.copy_(shared_w_out)
            if shared_gate is not None:
                layer.shared_gate.copy_(shared_gate)
        layer._as_dtensors(mesh, axis)
        return layer

    @torch.no_grad()
    def to_dense(self) -> dict:
        """The dense weights (keys of :meth:`from_dense` but ``e_score_correction_bias``, a buffer
        whole on every rank; None where absent; ``shared_gate`` only where the layer has one). A
        collective: every rank of the group must call it."""
        shared = self.shared_w_in is not None
        p = {n: self._local(n) for n in self.replicated_params + ("w_in", "w_out")}
        out = {"router_weight": p["router_weight"].detach().clone(), "w_in": gathered_rows(p["w_in"], self.group),
               "w_out": gathered_rows(p["w_out"], self.group), "shared_w_in": p["shared_w_in"].detach().clone() if shared else None,
               "shared_w_out": p["shared_w_out"].detach().clone() if shared else None}
        if self.shared_gate is not None:
            out["shared_gate"] = p["shared_gate"].detach().clone()
        return out

    # ----------------------------------------------------------------- forward
    @property
    def aux_loss(self) -> Optional[torch.Tensor]:
        """The last call's load-balancing loss on this rank's tokens (module docstring; a scalar,
        None before the first call). With ``aux_loss_coef == 0`` it is 0, still attached to the
        router so that ``aux_loss.backward()`` works on any rank, made when first read."""
        src, self._aux_zero_of = self._aux_zero_of, None
        if src is not None:
            self._aux = zero_aux(self._local("router_weight"), *src)
        return self._aux

    @property
    def _weight(self) -> torch.Tensor:
        return self.w_in

    def _tile_units(self, shape: tuple) -> int:
        return 1 << 30  # K is never capped by a rank's own tokens: every rank must run the same K

    def _agreed_shape(self, shape: tuple, table) -> tuple:
        """Plans come from the group's largest token count (every rank has the table)."""
        self._device_path.group_shapes = tuple((row[1], row[2]) for row in table)
        return (1, max(row[1] * row[2] for row in table), self.hidden_size)

    # ----------------------------------------------------------------- the device path (layers/moe/device_path.py)
    def _graphed_run(self, run, shape: tuple, dtype: torch.dtype, save: bool):
        """At world size 1 the plain call ([Note: plain serial calls] in
        ``layers/common/plain_tp.py``), which reads nothing on the host where the grouped GEMM
        takes the operands, without aux loss (an output besides ``y``); else the device path's."""
        if self.world_size == 1:
            return run if self.aux_loss_coef == 0 and self._grouped_for(dtype) else None
        return self._device_path.graphed_run(run, shape, dtype, save)

    def _graph_signature(self) -> tuple:
        return self._device_path.signature()

    def _graph_stage(self, plan, t: torch.Tensor, role: str):
        return None  # the device path gathers its send rows from x itself; its backward starts from others

    def _grouped_for(self, dtype: torch.dtype) -> bool:
        """Whether input rows of ``dtype`` run the experts by grouped GEMMs."""
        return grouped_for(dtype, self.hidden_size, self.w_in, self.w_out)

    def _shared_expert(self, x_TH: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared expert's output on every local token (None without one)."""
        if self.shared_w_in is None:
            return None
        return shared_expert(self.activation, x_TH, self._local("shared_w_in"), self._local("shared_w_out"),
                             self._local("shared_gate"))

    def _plan_key(self, shape: tuple, dtype: torch.dtype, save: bool) -> tuple:
        tokens = shape[0] * shape[1]
        return (1 << max(tokens - 1, 0).bit_length(), dtype, save)  # bucketed to a power of two

    def _plain_call(self, key: tuple):
        if self.world_size != 1:
            return None
        return (1, key[0], self.hidden_size), lambda x: self._run(x, TilePlan(1), True, key[0])

    def _cost_model(self, key: tuple, hw) -> MoECostModel:
        grouped = self._grouped_for(key[1])
        return MoECostModel(tokens=key[0], world_size=self.world_size, hidden=self.hidden_size,
                            n_in=self.w_in.shape[1], ffn=self.ffn_hidden_size, experts=self.num_experts,
                            top_k=self.top_k, elt=torch.tensor([], dtype=key[1]).element_size(), model=hw,
                            activation=self.activation, grouped=grouped)

    def _programs(self, k: int, save: bool, regather: bool):
        call = TileCall(self, TilePlan(k), save, None, [])
        return forward_program(call, None, None), backward_program(call, None, None, Accumulator({}))

    def _op_setups(self, cm: MoECostModel, dtype: torch.dtype) -> dict:
        """The copy engine's ops and the grouped GEMMs ([Note: grouped GEMMs cost more than dense
        ones] in ``layers/moe/cost.py``); dense GEMMs are measured by shape, the rest costed by bandwidth."""
        return {**self._copy_engine_setups(cm),
                **grouped_setups(cm, self._local("w_in"), self._local("w_out"), dtype)}  # DTensor weights: local

    def _config_fields(self) -> tuple:
        return (("hidden_size", self.hidden_size), ("ffn_hidden_size", self.ffn_hidden_size),
                ("num_experts", self.num_experts), ("top_k", self.top_k), ("activation", self.activation),
                ("normalize_topk", self.normalize_topk), ("capacity_factor", self.capacity_factor),
                ("aux_loss_coef", self.aux_loss_coef), ("shared_expert_ffn", self.shared_expert_ffn),
                ("shared_expert_gate", self.shared_expert_gate), ("routing", self.routing))

    @planned_forward  # torch.compile: one op; a DTensor x: its local tensor (planning/entry.py)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        agreed = self.planner.agree(x, x_error(x, self.hidden_size, self.w_in), _INPUT_ERRORS, "x",
                                    shape_names=(None, None, "hidden"))
        if self.planner.capturing:  # agreed: every rank raises
            raise RuntimeError("OverlapMoE cannot be captured into a CUDA graph: each call copies its all-to-all "
                               "split sizes (from the routing) to the host; run it eagerly, or build it with "
                               "OverlapConfig(graph_calls=True), whose calls (without aux loss) replay graphs of a "
                               "path with the sizes on the device")
        # [Note: MoE graph calls: the race]: a training call is timed to the end of its backward
        self._device_path.begin_call()
        run = lambda plan, trial, trace, x: self._run(x, plan, agreed.save, agreed.shape[1], trial, trace)  # noqa: E731
        y = self.planner.call(x, agreed, run)
        while self._device_path.overflowed():  # agreed: the call again, with slots for its counts (each time more)
            # dropped first: its graph holds the parameters' gradient nodes, made on this stream, which
            # the new capture's backward could not follow (as aux_loss's note says)
            y = None
            y = self.planner.call(x, agreed, run)
        self._device_path.end_call(x, agreed.save)
        return y

    def _run(self, x, plan: TilePlan, save: bool, max_tokens: int, trial=None, trace=None) -> torch.Tensor:
        """One eager call under ``plan`` (``layers/moe/eager.py``); ``max_tokens`` is the group's
        largest token count this call."""
        B, S, H = x.shape
        x, (w_in, w_out) = self._call_tensors(x, ("w_in", "w_out"))
        if self.world_size == 1 and plan.runs_plain(trace, self.launch_log):
            dev = x.device.type
            with torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else nullcontext():
                x, w_in = timed_inputs(trial, x, w_in)
                return timed_output(plain_call(self, x.view(B * S, H), w_in, w_out).view(B, S, H), trial)
        with torch.autocast(x.device.type, enabled=False):
            y = eager_call(self, x.reshape(B * S, H), w_in, w_out, plan, save, max_tokens, trial, trace)
        return y.view(B, S, H)

    def _route_keys(self, x_TH, K: int, step_order: bool = False):
        """``(keys, weights, counts)`` of the call's routing (:func:`~.routing.route_call`), its
        aux loss kept for :attr:`aux_loss`."""
        routed = route_call(self, x_TH, K, step_order)
        self._aux, self._aux_zero_of = routed.aux, routed.aux_zero_of
        return routed.keys, routed.weights, routed.counts

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, activation={self.activation}, "
                f"capacity_factor={self.capacity_factor}, shared_expert_ffn={self.shared_expert_ffn}, "
                f"routing={self.routing}, "
                f"world_size={self.world_size}, num_tiles={self.num_tiles!r}")
