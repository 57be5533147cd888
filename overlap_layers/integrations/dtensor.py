"""DTensors for users of the layers: a whole model's parameters as DTensors on the tensor-parallel
mesh (:func:`distribute_params`, what ``swap`` does by default), optimizer parameter groups
(:func:`param_groups`), and the layers' DTensor parameters and inputs ([Note: DTensor
parameters], [Note: DTensor inputs]), which live in :mod:`overlap_layers.planning.dtensor` and are
re-exported here.

Reference: after ``distribute_params(model, group)`` (or ``mesh=``, ``axis=``) every parameter of
``model`` is a DTensor on the tensor-parallel mesh axis whose ``full_tensor()`` is the dense
model's parameter, the model computes what it computed before, and after ``loss.backward()``
every gradient is a DTensor with its parameter's placements whose ``full_tensor()`` is the dense
model's gradient. So the ordinary training loop gives the dense model's result:
``torch.nn.utils.clip_grad_norm_`` computes the norm of the whole model (a sharded gradient's
norm is reduced over the mesh, a replicated one counted once), every optimizer (foreach and fused
included) sees one kind of tensor, and FSDP2 (over another axis of the same mesh) and DCP
(checkpoints that reshard to another tensor-parallel size) are correct by construction.

[Note: DTensor models]
Why every parameter, and not only the sharded ones: a model mixing DTensor and plain parameters
cannot be clipped (``clip_grad_norm_`` stacks the per-tensor norms: "mixed torch.Tensor and
DTensor") nor stepped by foreach / fused optimizers; and a sharded parameter held as a plain
tensor makes ``clip_grad_norm_`` add only this rank's shards to the norm, with no hook to make it
global. So:

===========================================  ===============================================
parameter                                    DTensor on the tensor-parallel mesh axis
===========================================  ===============================================
the overlap layers' (built with ``group=``   the layers' placements ([Note: DTensor
or ``mesh=``)                                parameters] in ``planning/dtensor.py``)
every other parameter (embeddings, norms,    ``placement(module, name, p)``; default
the LM head, HF's router weights tied to     ``Replicate()`` (the model runs these modules
the MoE's router)                            replicated on every rank of the group)
===========================================  ===============================================

The modules outside the overlap layers compute on plain tensors: each module holding such a
parameter gets a class of its own class's name (a subclass, one per class) whose ``forward`` puts
the parameter's local tensor (``p.to_local()``, differentiable, so its gradient reaches the
DTensor parameter as a DTensor with the parameter's placements; without grad mode the local tensor
itself) in its place, runs the original ``forward``, and puts the DTensor back (also when it
raises). Inside a module's call ``module.weight`` is therefore the plain local tensor, as the
module's code expects; outside it, the DTensor parameter. A parameter whose gradient the module
computes from this rank's share of the work only (``complete=True`` from ``placement``:
Megatron's norms under sequence parallelism) reads its local tensor through an identity that sums
the gradient over the mesh axis' group inside backward ([Note: gradients complete in backward] in
``layers/common/grads.py``). Each call reads the parameters as they are then (an optimizer step
that replaced or changed them in place is seen at the next call). The swapped-out DTensors live in
the call's frame (a deep copy of the model gets its own modules), and this composes with FSDP2
(its pre-forward hook, which puts the unsharded DTensor parameter in place, runs before the
``forward``; its post-forward hook after), with activation checkpointing (a recomputed module's call
runs the ``forward`` again) and with ``torch.compile(fullgraph=True)``. Forward hooks did the same
before; a module with hooks takes ``nn.Module.__call__``'s slow path, about 10 us per call on the
CPU, which was the whole host-time gap of a swapped Llama's decoding step (docs/measurements.md,
Decode).

State dicts: each such module's ``state_dict()`` holds its DTensors as they are (a sharded one
by its global shape, as DCP saves it), and ``load_state_dict`` takes, per parameter, the dense
tensor (this rank keeps its part, without a collective) or a DTensor of the same global shape on a
mesh over the same ranks, made on this rank ([Note: state dicts of DTensor models]).

Limits: a module's forward must use its own parameters (or those of modules it calls); code that
reads another module's parameter outside that module's call sees the DTensor. Tied parameters
stay tied (converted once). Buffers stay plain. Parameters that are DTensors already (on another
mesh) are left as they are, unhooked.

[Note: state dicts of DTensor models]
A state dict's DTensor carries its mesh, and a pickled mesh keeps the coordinate of the rank that
made it: ``torch.load`` of a state dict rank 0 saved gives rank 1 DTensors whose local tensors are
rank 0's parts, and ``load_state_dict`` would copy them without complaint (a DTensor's copy reads
local tensors). So a DTensor entry is checked before it is loaded (:func:`dtensor_like`): its global
shape must be the parameter's, its mesh must span the same ranks (another world size or group
raises), and its coordinate must be this rank's (another rank's state dict raises). Then it is
redistributed to the parameter's placements (a DTensor on another mesh object over the same ranks,
e.g. one without dim names, is taken as on the parameter's mesh). A plain tensor is the dense (global) tensor: this rank takes its part
of it locally (``distribute_tensor(..., src_data_rank=None)``: no collective), so the unswapped
model's state dict loads into a model of DTensors. Anything else raises ValueError naming the key.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from ..layers import OverlapTransformerBlock
from ..layers.block.layer import replicate_norms
from ..layers.common.grads import sum_grad_over_group
from ..planning.dtensor import Layout, as_dtensor_params, axis_mesh, dtensor_forward, local
from ..planning.layer_spec import TiledLayer
from ..runtime import resolve_group

__all__ = ["Layout", "as_dtensor_params", "axis_mesh", "compute_on_locals", "distribute_params", "dtensor_forward",
           "dtensor_like", "local", "local_arguments", "param_groups", "tp_mesh"]


def param_groups(params, **options) -> list:
    """``params`` (an iterable of parameters, or a module's) as optimizer parameter groups: the
    DTensors in one group, the plain tensors in another, each with ``options``. Foreach and fused
    optimizers (``torch.optim.AdamW(..., foreach=True)`` or ``fused=True``, the CUDA defaults) run
    one kernel over a group and fail on a group mixing DTensors and plain tensors (a ``mesh=``
    layer inside a model whose other parameters stay plain); DTensors of different meshes or
    placements may share a group. Order is kept within each group; empty groups are left out.
    (A model converted by :func:`distribute_params`, or swapped by ``swap``, holds DTensors only.)"""
    if isinstance(params, nn.Module):
        params = params.parameters()
    dts, plain = [], []
    for p in params:
        (dts if isinstance(p, DTensor) else plain).append(p)
    return [dict(options, params=g) for g in (dts, plain) if g]


# ---------------------------------------------------------------------------- the mesh
def _device_type(group, model: Optional[nn.Module]) -> str:
    """The device type of a mesh over ``group``: the model's parameters' (where not on the meta
    device), else the backend's (NCCL: cuda; otherwise cpu)."""
    if model is not None:
        for t in model.parameters():
            if t.device.type != "meta":
                return t.device.type
    return "cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu"


def tp_mesh(group=None, mesh=None, axis=None, model: Optional[nn.Module] = None) -> DeviceMesh:
    """The 1-D mesh of the tensor-parallel axis: ``mesh``'s ``axis`` (:func:`axis_mesh`), or, for
    ``group``, a mesh over the group's ranks (``DeviceMesh.from_group``; no collective), on the
    device type of ``model``'s parameters (or the group's backend)."""
    resolve_group(group, mesh, axis)  # exactly one of them, valid
    if mesh is not None:
        return axis_mesh(mesh, axis)
    return DeviceMesh.from_group(group, _device_type(group, model))


# ---------------------------------------------------------------------------- the forward on local tensors
def _locals_in(module: nn.Module) -> dict:
    """The local tensors of the module's DTensor parameters put in their place for a call
    ([Note: DTensor models]); returns the DTensors taken out, by name. Without grad mode the local
    tensor itself: nothing records a gradient to route back or sum."""
    saved, grad, params = {}, torch.is_grad_enabled(), module._parameters
    for name, complete in module._dtensor_locals.items():
        p = params.get(name)
        if isinstance(p, DTensor):
            if grad:
                t = p.to_local()
                if complete:
                    t = sum_grad_over_group(t, p.device_mesh.get_group())
            else:
                t = p._local_tensor
            saved[name] = p
            params[name] = t
    return saved


@functools.lru_cache(maxsize=None)
def _on_locals(base: type) -> type:
    """``base`` with a ``forward`` that runs ``base.forward`` on the local tensors of the instance's
    DTensor parameters and puts the DTensors back after (also when it raises). One class per
    ``base``, of its name and module: ``isinstance`` holds, and compiled code made for one instance
    fits every instance of ``base`` (dynamo guards on the class)."""
    def forward(self, *args, **kwargs):
        saved = _locals_in(self)
        try:
            return base.forward(self, *args, **kwargs)
        finally:
            for name, p in saved.items():
                self._parameters[name] = p
    forward.__doc__ = base.forward.__doc__
    return type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__, "__doc__": base.__doc__})


def compute_on_locals(module: nn.Module, names: Dict[str, bool]) -> None:
    """Have ``module`` compute on the local tensors of its DTensor parameters ``names`` (name ->
    whether the gradient is summed over the mesh axis' group inside backward), through its class's
    ``forward`` of [Note: DTensor models], and load them from dense tensors or this rank's DTensors
    ([Note: state dicts of DTensor models]); the class and the hook are set once, later names are
    added."""
    had = "_dtensor_locals" in module.__dict__
    module._dtensor_locals = {**module.__dict__.get("_dtensor_locals", {}), **names}
    if not had:
        module.__class__ = _on_locals(type(module))
        module.register_load_state_dict_pre_hook(_dtensors_in)


# ---------------------------------------------------------------------------- state dicts
def _described(value) -> str:
    if isinstance(value, DTensor):
        return f"a DTensor of global shape {tuple(value.shape)}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _rank_at(mesh, coordinate) -> Optional[int]:
    """The global rank at ``coordinate`` of ``mesh`` (None without a coordinate)."""
    return None if coordinate is None else int(mesh.mesh[tuple(coordinate)])


@torch.no_grad()
def dtensor_like(value, like: DTensor, key: str) -> DTensor:
    """``value``, a state dict's entry ``key``, as a DTensor with ``like``'s mesh, placements and
    dtype ([Note: state dicts of DTensor models]): a plain tensor of ``like``'s global shape is the
    dense tensor (this rank takes its part, no collective); a DTensor of that global shape must be
    on a mesh over the same ranks and have been made on this rank's coordinate of it, and is
    redistributed to ``like``'s placements. ValueError otherwise, naming ``key``."""
    shape, mesh = tuple(like.shape), like.device_mesh
    if not isinstance(value, DTensor):
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            raise ValueError(f"{key}: {_described(value)}; expected the dense tensor, shape {shape} (or a DTensor "
                             f"of that global shape made by this rank on {mesh})")
        return distribute_tensor(value.detach().to(like.dtype), mesh, like.placements, src_data_rank=None)
    theirs = value.device_mesh
    if tuple(value.shape) != shape:
        raise ValueError(f"{key}: {_described(value)}; expected the global shape {shape}")
    if theirs.mesh.tolist() != mesh.mesh.tolist() or theirs.device_type != mesh.device_type:
        raise ValueError(f"{key}: a DTensor on a mesh over ranks {theirs.mesh.tolist()} ({theirs.device_type}); this "
                         f"parameter's mesh is over ranks {mesh.mesh.tolist()} ({mesh.device_type}): a state dict "
                         f"saved at another world size or on another group. Load a DCP checkpoint (it reshards) or "
                         f"the dense tensors (full_tensor(), save_pretrained)")
    made, here = theirs.get_coordinate(), mesh.get_coordinate()
    if made != here:
        raise ValueError(f"{key}: a DTensor made on rank {_rank_at(theirs, made)} (mesh coordinate {made}), loaded "
                         f"on rank {_rank_at(mesh, here)} ({here}): its local tensor is the other rank's part. Each "
                         f"rank loads the state dict it saved; or load a DCP checkpoint or the dense tensors")
    if theirs != mesh:
        value = DTensor.from_local(value.to_local(), mesh, value.placements, run_check=False, shape=value.shape,
                                   stride=value.stride())
    return value.redistribute(mesh, like.placements).to(like.dtype)


def _dtensors_in(module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
    """Load-state-dict pre-hook: the entries of the module's DTensor parameters as DTensors like
    them (:func:`dtensor_like`), so that a dense tensor loads and another rank's DTensor raises."""
    for name in module._dtensor_locals:
        key, p = prefix + name, module._parameters.get(name)
        if key in state_dict and isinstance(p, DTensor):
            state_dict[key] = dtensor_like(state_dict[key], p, key)


def _local_kwargs(module: nn.Module, args, kwargs):
    """Forward pre-hook (with kwargs): the local tensors of DTensor keyword arguments named in
    ``module._dtensor_kwargs``."""
    names = module._dtensor_kwargs
    if any(isinstance(kwargs.get(n), DTensor) for n in names):
        kwargs = {k: v.to_local() if k in names and isinstance(v, DTensor) else v for k, v in kwargs.items()}
        return args, kwargs
    return None


def local_arguments(module: nn.Module, names) -> None:
    """Have ``module`` take the local tensors of the DTensor keyword arguments ``names`` (a
    parameter of another module handed to it, e.g. Megatron's shared embedding weight handed to
    its output layer): [Note: DTensor models]. Registered once."""
    had = "_dtensor_kwargs" in module.__dict__
    module._dtensor_kwargs = tuple(dict.fromkeys((*module.__dict__.get("_dtensor_kwargs", ()), *names)))
    if not had:
        module.register_forward_pre_hook(_local_kwargs, with_kwargs=True)


# ---------------------------------------------------------------------------- the model
Placer = Callable[[nn.Module, str, torch.Tensor], Tuple[Placement, bool]]


def _replicate(module: nn.Module, name: str, p: torch.Tensor) -> Tuple[Placement, bool]:
    return Replicate(), False


def _ranks(group) -> list:
    return list(dist.get_process_group_ranks(group))


def _overlap_layers(model: nn.Module):
    """The planned layers and blocks in ``model`` (the outermost of each nesting first)."""
    return [m for m in model.modules() if isinstance(m, (TiledLayer, OverlapTransformerBlock))]


@torch.no_grad()
def distribute_params(model: nn.Module, group=None, *, mesh=None, axis=None,
                      placement: Optional[Placer] = None) -> nn.Module:
    """Make every parameter of ``model`` a DTensor on the tensor-parallel mesh axis ([Note: DTensor
    models]); returns ``model``. The mesh is ``mesh``'s ``axis`` (1-D: the mesh itself) or one
    over ``group``'s ranks (:func:`tp_mesh`).

    The overlap layers in ``model`` built with ``group=`` get their DTensor parameters
    (:func:`as_dtensor_params`, the block's norms Replicate); ones built with ``mesh=`` must be on
    the same mesh axis (ValueError otherwise). Every other plain parameter becomes
    ``DTensor.from_local(p, mesh, [placement])`` (Python attributes kept) with
    ``placement(module, name, p) -> (Placement, complete)``, default ``(Replicate(), False)``: its
    local tensor is what this rank holds now, so a Replicate parameter must be the same on every
    rank (as after building the model from one seed, or loading one checkpoint on every rank).
    Every module outside the overlap layers that holds such a parameter computes on its local
    tensor. Idempotent; a collective where a layer's replicated KV heads are gathered (call it on
    every rank of the group). Build the optimizer (and wrap with FSDP2) after it: the parameters
    are new objects."""
    mesh1 = tp_mesh(group, mesh, axis, model)
    tp_ranks = mesh1.mesh.flatten().tolist()
    placement = placement or _replicate
    inside = set()  # modules inside an overlap layer: they handle DTensors themselves
    replaced: Dict[int, tuple] = {}  # id(an overlap layer's former plain parameter) -> (it, its DTensor)
    for layer in _overlap_layers(model):
        if id(layer) in inside:
            continue
        inside.update(id(m) for m in layer.modules())
        if _ranks(layer.group) != tp_ranks:
            raise ValueError(f"{type(layer).__name__} runs over ranks {_ranks(layer.group)}, not the mesh axis' "
                             f"{tp_ranks}: every overlap layer of a model must be on its tensor-parallel group")
        was = {(id(m), n): p for m in layer.modules() for n, p in m._parameters.items() if p is not None}
        for sub in (m for m in layer.modules() if isinstance(m, TiledLayer)):
            dts = [p for p in sub.parameters(recurse=False) if isinstance(p, DTensor)]
            if not dts:
                as_dtensor_params(sub, mesh1)
            elif any(p.device_mesh != mesh1 for p in dts):
                raise ValueError(f"{type(sub).__name__} holds DTensor parameters on another mesh than {mesh1}")
        if isinstance(layer, OverlapTransformerBlock) and not isinstance(layer.attn_norm.weight, DTensor):
            replicate_norms(layer, mesh1, None)
        for m in layer.modules():  # a plain parameter replaced: a module outside tied to it follows
            for n, p in m._parameters.items():
                old = was.get((id(m), n))
                if old is not None and old is not p:
                    replaced[id(old)] = (old, p)
    ours = {id(p) for m in model.modules() if id(m) in inside for p in m.parameters(recurse=False)}
    converted: Dict[int, tuple] = {}  # id(plain parameter) -> (it, its DTensor, complete): ties stay tied
    for module in model.modules():
        if id(module) in inside:
            continue
        names = {}
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in replaced:  # tied to an overlap layer's parameter (HF's router weight)
                p = module._parameters[name] = replaced[id(p)][1]
            if id(p) in ours:  # a tied overlap parameter (HF's router weight): computed on locally
                names[name] = False
            elif isinstance(p, DTensor):  # converted by an earlier call (kept), or not ours (left)
                done = module.__dict__.get("_dtensor_locals", {}).get(name)
                if done is not None:
                    names[name] = done
            else:
                if id(p) not in converted:
                    where, complete = placement(module, name, p)
                    new = nn.Parameter(DTensor.from_local(p.data, mesh1, [where], run_check=False),
                                       requires_grad=p.requires_grad)
                    new.__dict__.update(p.__dict__)  # e.g. Megatron's tensor-parallel attributes
                    converted[id(p)] = (p, new, bool(complete))
                _, new, complete = converted[id(p)]
                module._parameters[name] = new
                names[name] = complete
        if names:
            compute_on_locals(module, names)
    return model
