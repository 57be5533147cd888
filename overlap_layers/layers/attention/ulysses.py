"""Ulysses sequence parallelism: attention over the whole sequence with the heads split over the
group, reached by an all-to-all before and after the attention core. The batch (or, for batch 1,
the heads) is cut into tiles so each tile's all-to-alls hide under other tiles' compute.

Reference (what :class:`UlyssesAttention` must equal, up to rounding), with dense weights and the
full sequence ``x [B, S, H]``::

    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv      # heads of d = head_dim
    o = attention_core.attention(q, k, v, ...)                 # qk-norm, RoPE, SDPA with GQA
    y = o @ wo.T + bo

Rank r holds positions ``r*s .. (r+1)*s - 1`` of x and y (``s = S/ws``) and every weight whole.
Unoverlapped, per rank (DeepSpeed-Ulysses)::

    qkv = x_local @ [wq; wk; wv].T               # every head, this rank's s positions
    qkv = all_to_all(qkv)                        # rank r's nq/ws query heads and the KV heads
                                                 # they read, all S positions
    o = attention_core.attention(q, k, v, ...)   # RoPE with the global positions
    o = all_to_all(o)                            # every head, this rank's s positions
    y_local = o @ wo.T + bo

The call's pass, over batch tiles or head groups with each tile's all-to-alls under other tiles'
compute, is ``layers/attention/ulysses_tiles.py``'s (with [Note: send layout] and [Note: tiles]).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from ...config import OverlapConfig
from ...planning.dtensor import Layout
from ...planning.entry import planned_forward
from ...planning.layer_spec import TiledLayer
from ...planning.plan import TilePlan
from ...planning.tiling import tile_bounds
from ...runtime import resolve_group
from ..common.init import init_linear_
from .common import (INPUT_ERRORS, PARAMS, WHAT, call_with_positions, check_args, check_dense,
                     compiled_position_args, config_fields, input_error, position_kwargs, register_params,
                     replicated_positions)
from .common import cos_sin as cos_sin_of
from .core import attention
from .ulysses_cost import UlyssesCostModel
from .ulysses_tiles import Route, UlyssesCall, UlyssesTiles, route_of, ulysses_backward_program, ulysses_forward_program

class UlyssesAttention(TiledLayer, nn.Module):
    """Drop-in attention with Ulysses sequence parallelism; equals the module docstring's reference.

    Input and output ``[batch, seq_local, hidden]``: rank r holds positions ``r*seq_local ..``;
    every rank must pass the same ``seq_local`` (checked: ValueError on every rank otherwise).
    ``position_ids [batch or 1, seq]`` and ``position_embeddings = (cos, sin)``, each
    ``[batch or 1, seq, head_dim]``, describe the *global* sequence (``seq = seq_local *
    world_size``) and must be the same on every rank; ``position_embeddings`` overrides
    ``rope_theta``; ``rope_theta=None`` disables RoPE. ``attention_mask`` must be None (causal or
    full attention via ``causal``).

    Parameters, whole on every rank: ``wq [nq*d, H]``, ``wk``/``wv [nkv*d, H]``, ``wo [H, nq*d]``
    (``nn.Linear`` layouts), biases ``bq``, ``bk``, ``bv``, ``bo`` and ``q_norm``, ``k_norm [d]``
    (Qwen3-style RMSNorm per head before RoPE). ``num_heads`` must be divisible by the group size
    and by ``num_kv_heads``; each rank attends with ``num_heads/ws`` query heads and receives the KV
    heads they read (replicated where ``num_kv_heads`` is smaller than the group, or does not split
    evenly). Each rank's backward only sees its own tokens, so every parameter's ``.grad`` holds
    *this rank's partial*: the gradient of the layer is their sum over the group. A data-parallel
    wrapper over the group (DDP / FSDP across the ranks that share the sequence) does that
    reduction; note DDP averages, which is the gradient of the mean of per-rank mean losses.

    ``num_tiles`` (overrides ``config.num_tiles``) is K, or "auto" (planned per (batch, seq_local)
    like the other layers, then verified on the first calls). Batch tiles for batch > 1, head groups
    for batch 1 ([Note: tiles]); ``layer.plan`` tells the last call's K and ``layer.tile_by``
    ("batch" or "heads") what it tiled. Set ``launch_log`` to a list to record the launch order.
    """

    _graphable = False  # config.graph_calls: no replay of its calls has been checked on GPUs yet

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None, *, group=None,
                 mesh=None, axis=None, head_dim: Optional[int] = None, rope_theta: Optional[float] = 10000.0,
                 causal: bool = True, bias: bool = False, qk_norm: bool = False,
                 softmax_scale: Optional[float] = None, dropout_p: float = 0.0, num_tiles=None,
                 config: Optional[OverlapConfig] = None, dtype=None, device=None):
        super().__init__()
        num_kv_heads, head_dim = check_args(hidden_size, num_heads, num_kv_heads, head_dim, rope_theta,
                                            softmax_scale, dropout_p)
        ws = self._init_group(config, num_tiles, dtype, group, mesh, axis)
        if num_heads % ws:
            raise ValueError(f"num_heads={num_heads} must be divisible by the group size {ws} "
                             f"(each rank attends with num_heads/{ws} heads)")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, head_dim
        self.rope_theta, self.causal, self.bias, self.qk_norm = rope_theta, bool(causal), bool(bias), bool(qk_norm)
        self.softmax_scale, self.dropout_p = softmax_scale, dropout_p
        register_params(self, hidden=hidden_size, q_heads=num_heads, kv_heads=num_kv_heads, head_dim=head_dim,
                        bias=bias, qk_norm=qk_norm, dtype=dtype, device=device)
        self.tile_by = "batch"  # what the last call tiled
        self._init_planner(mesh, axis)

    def _init_caches(self) -> None:
        self._routes: dict = {}  # (h0, h1) -> Route; rank-dependent, but never decides a collective
        self._indices: dict = {}  # (heads, field, device) -> index tensor, so a call copies no index to the device

    # ----------------------------------------------------------------- weights
    def _dtensor_layouts(self) -> Dict[str, Layout]:
        """[Note: DTensor parameters] (``planning/dtensor.py``): whole on every rank."""
        return {n: Layout(Replicate()) for n in PARAMS}

    def _dtensor_input_placements(self) -> tuple:
        """[Note: DTensor inputs]: the sequence shard."""
        return (Shard(1),)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as ``nn.Linear`` layers q, k, v, o (weight then bias each, in that order)
        would under the same seed; norms to ones. The same on every rank given the same seed."""
        if self.wq.device.type == "meta":
            return
        for w, b in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv), (self.wo, self.bo)):
            init_linear_(w, b)
        if self.q_norm is not None:
            self.q_norm.fill_(1.0)
            self.k_norm.fill_(1.0)

    @classmethod
    def from_dense(cls, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, *, num_heads: int,
                   num_kv_heads: Optional[int] = None, bq=None, bk=None, bv=None, bo=None, q_norm=None, k_norm=None,
                   group=None, mesh=None, axis=None, rope_theta: Optional[float] = 10000.0, causal: bool = True,
                   softmax_scale: Optional[float] = None, dropout_p: float = 0.0, num_tiles=None,
                   config: Optional[OverlapConfig] = None) -> "UlyssesAttention":
        """From dense ``nn.Linear``-layout weights (copied whole): ``wq [nq*d, H]``,
        ``wk``/``wv [nkv*d, H]``, ``wo [H, nq*d]``; ``bq``, ``bk``, ``bv`` all or none, ``bo``
        independently (Qwen2 has qkv biases only); ``q_norm``/``k_norm [d]`` both or neither."""
        H, d, num_kv_heads = check_dense(wq, wk, wv, wo, num_heads=num_heads, num_kv_heads=num_kv_heads, bq=bq,
                                         bk=bk, bv=bv, bo=bo, q_norm=q_norm, k_norm=k_norm)
        layer = cls(H, num_heads, num_kv_heads, group=resolve_group(group, mesh, axis), head_dim=d,
                    rope_theta=rope_theta, causal=causal, bias=bq is not None, qk_norm=q_norm is not None, softmax_scale=softmax_scale,
                    dropout_p=dropout_p, num_tiles=num_tiles, config=config, dtype=wq.dtype, device="meta")
        if (bo is not None) != layer.bias:  # qkv biases without bo, or bo alone
            layer.bo = nn.Parameter(torch.empty(H, dtype=wq.dtype, device="meta")) if bo is not None else None
        layer.to_empty(device=wq.device)
        with torch.no_grad():
            for name, t in (("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo), ("bq", bq), ("bk", bk), ("bv", bv),
                            ("bo", bo), ("q_norm", q_norm), ("k_norm", k_norm)):
                if t is not None:
                    getattr(layer, name).copy_(t)
        layer._as_dtensors(mesh, axis)
        return layer

    @torch.no_grad()
    def to_dense(self) -> dict:
        """The dense weights (keys of :meth:`from_dense`; None where absent); copies, rank-local."""
        names = PARAMS
        return {n: (self._local(n).detach().clone() if getattr(self, n) is not None else None) for n in names}

    # ----------------------------------------------------------------- forward
    def _units(self, batch: int) -> int:
        """What K is capped by: the batch, or the local query heads for batch 1 ([Note: tiles])."""
        return batch if batch > 1 else self.num_heads // self.world_size

    def _check_pin(self, plan: TilePlan) -> None:
        super()._check_pin(plan)
        if plan.regather or plan.buckets_fwd or plan.buckets_bwd:
            raise ValueError(f"plan={plan!r}: Ulysses has no re-gather and its all-to-alls are not bucketed")

    # ----------------------------------------------------------------- planning hooks (TiledLayer)
    @property
    def _weight(self) -> torch.Tensor:
        return self.wq

    def _plan_key(self, shape: tuple, dtype: torch.dtype, save: bool) -> tuple:
        return (shape[0], shape[1], dtype, save)

    def _tile_units(self, shape: tuple) -> int:
        return self._units(shape[0])

    def _cost_model(self, key: tuple, hw) -> UlyssesCostModel:
        batch, s, dtype = key[0], key[1], key[2]
        return UlyssesCostModel(batch=batch, seq_local=s, world_size=self.world_size, hidden=self.hidden_size,
                                heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                elt=torch.tensor([], dtype=dtype).element_size(), causal=self.causal, model=hw)

    def _programs(self, k: int, save: bool, regather: bool):
        call = UlyssesCall(self, TilePlan(k), save, None, None, [], [], self.wq.device)
        return ulysses_forward_program(call, None, None, None), ulysses_backward_program(call, None, None, {})

    def _op_setups(self, cm: UlyssesCostModel, dtype: torch.dtype) -> dict:
        """The attention core (forward, and backward of a recorded graph) per tile shape."""
        dev, S, d = self.wq.device, cm.ws * cm.s, self.head_dim
        norms = (self.q_norm.detach().to(dtype), self.k_norm.detach().to(dtype)) if self.qk_norm else (None, None)

        def setup(name, b, nh):
            hk = cm._hk(nh)
            q = torch.randn(b, S, nh, d, dtype=dtype, device=dev)
            k, v = (torch.randn(b, S, hk, d, dtype=dtype, device=dev) for _ in range(2))
            cs = cos_sin_of(self.rope_theta, d, S, dev, dtype, None, None)

            def core():
                return attention(q, k, v, cos_sin=cs, q_norm=norms[0], k_norm=norms[1], causal=self.causal,
                                 scale=self.softmax_scale)
            if name == "core":
                return core
            for t in (q, k, v):
                t.requires_grad_()
            with torch.enable_grad():
                o = core()
            do = torch.randn_like(o)
            return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

        return {key: (lambda spec=spec: setup(*spec)) for key, spec in cm.core_ops().items()}

    def _config_fields(self) -> tuple:
        return (*config_fields(self), ("bo", self.bo is not None))

    _compiled_extras = staticmethod(compiled_position_args)  # [Note: compiled calls]
    _compiled_kwargs = staticmethod(position_kwargs)

    @planned_forward  # torch.compile: one op; a DTensor x: its local tensor (planning/entry.py)
    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None, position_embeddings=None,
                attention_mask=None) -> torch.Tensor:
        err = input_error(x, hidden_size=self.hidden_size, weight=self._local("wq"), seq_factor=self.world_size,
                          head_dim=self.head_dim, position_ids=position_ids, position_embeddings=position_embeddings,
                          attention_mask=attention_mask, causal=self.causal)
        agreed = self.planner.agree(x, err, INPUT_ERRORS, WHAT, shape_names=("batch", "seq_local", "hidden"),
                                    replicated=replicated_positions(position_ids, position_embeddings))
        return call_with_positions(self, x, agreed, position_ids, position_embeddings)

    def _route_of(self, h0: int, h1: int) -> Route:
        if (h0, h1) not in self._routes:
            self._routes[(h0, h1)] = route_of(self.num_heads, self.num_kv_heads, self.head_dim, self.world_size,
                                            self.rank, h0, h1)
        return self._routes[(h0, h1)]

    def _index(self, route: Route, name: str, device) -> Optional[torch.Tensor]:
        """``route.<name>`` as an index tensor on ``device`` (None stays None), made once."""
        key = (route.heads, name, device)
        if key not in self._indices:
            idx = getattr(route, name)
            self._indices[key] = torch.tensor(idx, device=device) if idx is not None else None
        return self._indices[key]

    def _tiles(self, batch: int, plan: TilePlan):
        """(tiles as (b0, b1, route index), routes); see [Note: tiles]."""
        hq = self.num_heads // self.world_size
        if batch == 1 and plan.num_tiles > 1:
            bounds = tile_bounds(hq, plan.num_tiles)
            return [(0, batch, i) for i in range(len(bounds))], [self._route_of(a, b) for a, b in bounds]
        return [(b0, b1, 0) for b0, b1 in tile_bounds(batch, plan.num_tiles)], [self._route_of(0, hq)]

    def _run(self, x, plan: TilePlan, save: bool, position_ids, position_embeddings, trial=None,
             trace=None) -> torch.Tensor:
        dev = x.device.type
        x, (wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm) = self._call_tensors(x, PARAMS)
        B, s, H = x.shape
        tiles, routes = self._tiles(B, plan)
        self.tile_by = "heads" if len(routes) > 1 else "batch"
        with torch.autocast(dev, enabled=False), torch.set_grad_enabled(save):
            w_qkv = torch.cat([wq, wk, wv])
            b_qkv = torch.cat([bq, bk, bv]) if bq is not None else None
            weights = []
            for r in routes:  # [Note: send layout]
                rows = self._index(r, "send_rows", x.device)
                weights += [w_qkv.index_select(0, rows), b_qkv.index_select(0, rows) if b_qkv is not None else None,
                            wo if r.o_cols is None else wo.index_select(1, self._index(r, "o_cols", x.device))]
            call = UlyssesCall(self, plan, save, self.planner.streams.get(x.device, min(plan.num_tiles, plan.num_streams)),
                         cos_sin_of(self.rope_theta, self.head_dim, s * self.world_size, x.device, x.dtype, position_ids,
                                    position_embeddings),
                         tiles, routes, x.device)
            call.s, call.trial, call.trace = s, trial, trace
            y_TH = UlyssesTiles.apply(x.reshape(B * s, H).contiguous(), q_norm, k_norm, call, *weights)
            if bo is not None:
                y_TH = y_TH + bo
        return y_TH.view(B, s, H)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, rope_theta={self.rope_theta}, "
                f"qk_norm={self.qk_norm}, world_size={self.world_size}, num_tiles={self.num_tiles!r}")
