"""DTensor parameters and inputs for the layers built with ``mesh=`` (and ``axis=``); each layer
gives its parameters' layouts (``_dtensor_layouts()``) and the placements its input may have
(``_dtensor_input_placements()``), as the tables below say.

Reference: a layer built with ``mesh=`` computes exactly what the same layer built with
``group=`` (the mesh axis' process group) computes, and holds every parameter as a DTensor on the
mesh axis whose global value is the dense tensor: ``p.full_tensor()`` equals ``to_dense()[name]``
(viewed as ``p``'s global shape), so DCP checkpoints reshard to any world size and FSDP2
``fully_shard`` over another mesh axis composes (2-D).

[Note: DTensor parameters]
The layers' compute is written for the ``group=`` layout: a flat local tensor per parameter
(e.g. swiglu ``w_in [2*F/ws, H]``: this rank's gate rows, then its up rows). Where that flat
local tensor is not the local shard of any placement of the dense tensor, the DTensor changes
the *global form*, not the meaning:

================  ===============================  ==========================================
layer             parameter                        DTensor (global shape, placement on axis)
================  ===============================  ==========================================
OverlapMLP        ``w_in``, ``b_in`` (swiglu)      ``[2, F, H]`` / ``[2, F]`` (gate, up), Shard(1)
                  ``w_in``, ``b_in`` (gelu, relu)  ``[F, H]`` / ``[F]``, Shard(0)
                  ``w_out``                        ``[H, F]``, Shard(1)
                  ``b_out``                        ``[H]``, Replicate
OverlapAttention  ``wq``, ``bq``                   dense, Shard(0)
                  ``wk``, ``wv``, ``bk``, ``bv``   dense, Shard(0) if ``num_kv_heads >= ws``;
                                                   else Replicate of the dense tensor (every
                                                   rank holds every KV head; it computes with
                                                   the rows of its own head)
                  ``wo``                           dense, Shard(1)
                  ``bo``, ``q_norm``, ``k_norm``   Replicate
OverlapMoE        ``w_in``, ``w_out``              ``[E, ...]``, Shard(0) over experts
                  ``shared_w_in`` (swiglu)         ``[2, shared_ffn, H]`` (gate, up), Replicate
                  ``router_weight``, the rest      Replicate
UlyssesAttention  every parameter                  dense, Replicate
OverlapTrans-     its sublayers' as above; the     dense, Replicate
formerBlock       norms' ``weight`` / ``bias``
================  ===============================  ==========================================

The forward reads each parameter through ``layer._local(name)`` (:class:`~.layer_spec.TiledLayer`), which
for a DTensor is :func:`local`: ``p.to_local()`` (differentiable) viewed as the flat local
tensor, or sliced to the rank's rows for a Replicate of a dense tensor; no copies. Autograd
therefore puts the gradient on the DTensor parameter, as a DTensor with the parameter's
placements. Replicate gradients hold what the ``group=`` layer's plain gradient holds: complete,
the same on every rank, where the layer sums a rank partial inside backward (``b_out`` / ``bo``
under sequence parallelism, ``q_norm`` / ``k_norm``, a block's MoE router; [Note: gradients
complete in backward] in ``layers/common/grads.py``): the identity that sums wraps the whole
local tensor, so for replicated KV heads, where each rank's gradient is zero outside its own
head's rows, the sum over the group is the dense gradient on every rank. The data-parallel style
partials (a bare :class:`OverlapMoE`'s router, :class:`UlyssesAttention`'s parameters) differ
across ranks until the data-parallel reduction (or ``finalize_grads(data_parallel=True)``) sums
them.

[Note: DTensor inputs]
A layer's ``x`` may also be a DTensor on the layer's mesh axis (the 1-D mesh ``axis_mesh(mesh,
axis)``, as ``parallelize_module`` styles produce); the layer then runs on ``x.to_local()`` and
returns ``DTensor.from_local(y, ...)`` with ``x``'s placements and global shape (both
differentiable: ``x.grad`` is a DTensor with ``x``'s placements). A plain ``x`` gives a plain
output, unchanged. The placement a layer takes is the one whose local tensor is its plain input:

==================================  ==============================================================
layer                               DTensor ``x`` (placement on the layer's mesh axis)
==================================  ==============================================================
OverlapMLP, OverlapAttention        ``Shard(1)`` with ``sequence_parallel=True`` (local:
                                    ``[batch, seq/ws, hidden]``), else ``Replicate()``
OverlapMoE                          ``Shard(0)`` or ``Shard(1)``: tokens split across the group
                                    (batch or sequence); the local tensor is the rank's own tokens,
                                    which is what the layer routes (uneven splits are fine). Not
                                    ``Replicate()``: every rank would route the same tokens, and
                                    the expert and router gradients would count them ws times
                                    (take ``x.to_local()`` of a shard of the batch instead).
==================================  ==============================================================

Anything else (another placement, ``Partial``, a DTensor on another mesh or on a 2-D mesh, or any
DTensor given to a layer built with ``group=``) raises ValueError naming ``x`` and the expected
placement. Placements and meshes are global metadata, identical on every rank by DTensor's
contract, so this rank-local check raises on every rank alike, before any collective: no hang.
Whether ``x`` is a DTensor at all is rank-local, so it is one more column of the call's agreement
gather (:func:`~.call_agreement.agree`, told by the layer's planner: ``LayerPlanner.dtensor_input``):
a DTensor on some ranks and a plain tensor on others is a ValueError on every rank. Other
arguments (attention's ``position_ids``, ``position_embeddings``) stay plain tensors.

With ``group=`` the parameters stay plain tensors. :class:`UlyssesAttention`'s parameters are
whole on every rank: with ``mesh=`` every one is a Replicate DTensor, and a DTensor ``x`` must be
Shard(1) (its sequence shard).

Limits: ``reset_parameters()`` writes the ``group=`` layout and is run before the conversion;
calling it again on a DTensor layer raises (build a new layer, or load a state dict).
``torch.optim.AdamW`` (and other foreach / fused optimizers) and ``clip_grad_norm_`` fail on a
parameter group mixing DTensors and plain tensors: make the other parameters DTensors too
(:func:`overlap_layers.distribute_params`, which ``swap`` applies), or build the optimizer on
:func:`overlap_layers.param_groups` (one group each).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard


@dataclass(frozen=True)
class Layout:
    """How one parameter's DTensor relates to the ``group=`` layer's flat local tensor.

    ``placement`` on the layer's mesh axis; ``local_shape``: the DTensor's local shape where it
    re-views the flat local tensor (swiglu ``(2, F/ws, H)``), None if the same; ``rows``: for a
    Replicate of a dense tensor of which the rank computes with only these rows (replicated KV
    heads), None otherwise."""

    placement: Placement
    local_shape: Optional[tuple] = None
    rows: Optional[slice] = None


def local(p: Optional[torch.Tensor], flat_shape: Optional[tuple] = None,
          rows: Optional[slice] = None, reduce: Optional[Callable] = None) -> Optional[torch.Tensor]:
    """The flat local tensor the layers compute with ([Note: DTensor parameters]): for a DTensor
    parameter its differentiable ``to_local()`` (for a plain one, itself: a layer's own plain
    parameters, or the local tensors a compiled call substitutes for its DTensors), sliced to
    ``rows`` or viewed as ``flat_shape``; None stays None. A view: no copy, and gradients flow back
    to ``p`` (as DTensors for a DTensor). ``reduce`` (an identity whose backward sums the gradient,
    [Note: gradients complete in backward] in ``layers/common/grads.py``) wraps the whole local
    tensor, before ``rows`` are taken. Without grad mode the DTensor's local tensor itself, and no
    ``reduce`` (nothing records a gradient): no autograd node, no new tensor but the view."""
    if p is None:
        return p
    if not torch.is_grad_enabled():
        t = p._local_tensor if isinstance(p, DTensor) else p
    else:
        t = p.to_local() if isinstance(p, DTensor) else p
        if reduce is not None:
            t = reduce(t)
    if rows is not None:
        return t[rows]
    if flat_shape is not None and tuple(t.shape) != flat_shape:
        return t.view(flat_shape)
    return t


def axis_mesh(mesh, axis):
    """The 1-D mesh of the layer's axis: ``mesh`` itself if 1-D, else ``mesh[axis]`` (a name, or
    an index of a mesh with named dims)."""
    if mesh.ndim == 1:
        return mesh
    if isinstance(axis, int) and not isinstance(axis, bool):
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError(f"axis={axis!r}: DTensor parameters need a mesh with named dims "
                             f"(init_device_mesh(..., mesh_dim_names=...)); or pass axis by name")
        axis = names[axis]
    return mesh[axis]


def _layouts(layer: nn.Module) -> Dict[str, Layout]:
    """Every parameter's :class:`Layout` (the table of [Note: DTensor parameters]): the layer's
    ``_dtensor_layouts()``."""
    layouts = getattr(layer, "_dtensor_layouts", None)
    if layouts is None:
        raise ValueError(f"{type(layer).__name__} has no DTensor form; build it with group= (a ProcessGroup)")
    return layouts()


@torch.no_grad()
def as_dtensor_params(layer: nn.Module, mesh, axis=None) -> None:
    """Replace ``layer``'s plain ``group=``-layout parameters by DTensors on ``mesh``'s ``axis``
    ([Note: DTensor parameters]) and record how the forward views them. Called by the layers at
    the end of ``__init__`` / ``from_dense`` when ``mesh=`` was given; a collective (every rank of
    the group) when KV heads are replicated on a real device (their dense tensor is gathered)."""
    layouts = _layouts(layer)
    tp_mesh = axis_mesh(mesh, axis)
    params = {n: getattr(layer, n) for n in layouts if getattr(layer, n, None) is not None}
    if any(isinstance(p, DTensor) for p in params.values()):
        raise ValueError(f"{type(layer).__name__}: parameters are DTensors already")
    needs_dense = any(layouts[n].rows is not None for n in params)
    dense = layer.to_dense() if needs_dense and next(iter(params.values())).device.type != "meta" else None
    views = {}
    for name, p in params.items():
        lay = layouts[name]
        if lay.rows is not None:  # a Replicate of the dense tensor; this rank computes with `rows`
            n_dense = getattr(layer, "num_kv_heads") * layer.head_dim
            local_t = dense[name] if dense is not None else p.new_empty((n_dense, *p.shape[1:]))
        else:
            local_t = p.data.view(lay.local_shape) if lay.local_shape is not None else p.data
        dt = DTensor.from_local(local_t, tp_mesh, [lay.placement], run_check=False)
        setattr(layer, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        views[name] = partial(local, flat_shape=tuple(p.shape), rows=lay.rows)
    layer._local_views = views
    layer._input_mesh = tp_mesh  # where a DTensor input must live ([Note: DTensor inputs])


# ---------------------------------------------------------------------- DTensor inputs
def _input_placements(layer: nn.Module) -> tuple:
    """The placements (on the layer's mesh axis) a DTensor ``x`` may have ([Note: DTensor inputs]):
    the layer's ``_dtensor_input_placements()``."""
    placements = getattr(layer, "_dtensor_input_placements", None)
    if placements is None:
        raise ValueError(f"x: {type(layer).__name__} takes no DTensor input; pass a plain tensor (x.to_local())")
    return placements()


def _normalized(p: Placement, ndim: int) -> Placement:
    if isinstance(p, Shard) and type(p) is Shard and p.dim < 0:
        return Shard(p.dim + ndim)
    return p


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def dtensor_forward(layer: nn.Module, forward, x: DTensor, *args, **kwargs) -> DTensor:
    """``forward(x.to_local(), *args, **kwargs)`` as a DTensor with ``x``'s placements and global shape,
    after checking ``x``'s mesh and placement ([Note: DTensor inputs]; ValueError on every rank
    alike: the check reads global metadata only). Differentiable both ways."""
    expected = _input_placements(layer)
    want = " or ".join(repr(p) for p in expected)
    mesh = layer._input_mesh
    name = type(layer).__name__
    if mesh is None:
        raise ValueError(f"x: a DTensor, but this {name} was built with group= (no mesh); build it with "
                         f"mesh= (x must be {want} on its mesh axis), or pass x.to_local()")
    if x.device_mesh != mesh:
        raise ValueError(f"x: a DTensor on {x.device_mesh}, not on this {name}'s mesh axis {mesh}; "
                         f"x must be {want} on {mesh} (redistribute it, or pass the local tensor)")
    placement = _normalized(x.placements[0], x.ndim)
    if not any(type(placement) is type(e) and placement == e for e in expected):
        sp = f" (sequence_parallel={layer.sequence_parallel})" if hasattr(layer, "sequence_parallel") else ""
        raise ValueError(f"x: placement {tuple(x.placements)} on the mesh axis; this {name}{sp} takes {want} "
                         f"(x.redistribute(x.device_mesh, [{expected[0]!r}]))")
    y = forward(x.to_local(), *args, **kwargs)
    return DTensor.from_local(y, mesh, x.placements, run_check=False, shape=x.shape,
                              stride=_contiguous_stride(x.shape))
