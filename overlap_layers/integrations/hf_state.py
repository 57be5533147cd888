"""The state dict of a swapped Hugging Face module in the layout of the module it replaced.

Reference: for a model swapped by :func:`overlap_layers.swap`, ``model.state_dict()`` has the keys of
the unswapped model's ``state_dict()``, in its order, with its (global) shapes, and every entry's
global value is the unswapped model's tensor (a DTensor's ``full_tensor()``, a plain part gathered:
:func:`full_state_dict`); ``model.load_state_dict(sd)`` loads what the unswapped model's
``load_state_dict(sd)`` loads.

[Note: swapped state dicts]
A swapped module (an ``OverlapMLP`` in place of an MLP, ``HFAttention``, ``HFMoE``, ``HFBlock``) keeps
the layers' parameters under their own names (``w_in``, ``layer.wq``, ...: the layers' API) and shows
them in the replaced module's layout through two hooks :func:`keep_hf_state` registers on it: a
state-dict post-hook puts the replaced module's entries (``gate_proj.weight``, ``q_proj.weight``,
``experts.gate_up_proj``, ...) in place of its own, in the replaced module's order, and a
load-state-dict pre-hook turns them back into its parameters' values. Each entry of the replaced
module is one :class:`Entry`: its key, the swapped module's parameter (or buffer: DeepSeek-V3's
``e_score_correction_bias``) holding it (more than one when tied: HF's router weight is the MoE's
``router_weight``), and an index where it is one slice of that parameter's global form along dim 0
(a gated ``w_in`` or a shared expert's ``shared_w_in``, ``[2, F, H]``: the gate rows ``[0]``, the up
rows ``[1]``; [Note: DTensor parameters] in ``planning/dtensor.py``). ``keep_hf_state`` checks, when
the module is built, that the two layouts correspond one to one, with equal shapes. A fused entry
(Phi-3's ``qkv_proj``: ``wq``, ``wk``, ``wv`` one after the other; ``gate_up_proj``: the whole
``w_in``) lists its parameters and their rows (``Entry.rows``): their shardings differ, so it is
whole -- a ``Replicate()`` DTensor gathered in ``state_dict()`` (a collective over the group; with
plain parameters a whole plain tensor), not a view -- and loads only from the whole tensor (or a
DTensor of its global shape): ``dcp.load`` into ``state_dict()`` fills it but not the parameters
until that state dict is loaded (``set_model_state_dict``), and ``load_pretrained_shards`` reads it whole.

What an entry holds:

=========================  =========================================================================
parameters                 the entry
=========================  =========================================================================
DTensors (swap's default)  a DTensor on the tensor-parallel mesh whose global value is the unswapped
                           tensor: the parameter, or ``p[index]``, a view of its local tensor (where
                           FSDP2 shards dim 0 over another mesh axis, gathered over that axis). No
                           copy, no collective: DCP writes each rank's part and reshards on load;
                           ``dcp.load`` into ``model.state_dict()`` writes the parameters in place.
plain (``dtensor=False``)  this rank's part of the unswapped tensor (a view), tagged
                           ``_overlap_shard = (rank, world size, dense shape, box)``: the part's
                           ``(start, stop)`` per dim. ``torch.save`` keeps the tag; copies drop it.
=========================  =========================================================================

What loads, per entry (else ValueError naming the key): the dense (unswapped) tensor, of which this
rank keeps its part; with DTensor parameters a DTensor of the same global shape on a mesh over the
same ranks, made on this rank ([Note: state dicts of DTensor models] in ``integrations/dtensor.py``:
a state dict rank 0 saved raises on rank 1, one saved at another world size raises); with plain
parameters, a tensor of this rank's part's shape whose tag, where it has one, is this rank's (an
untagged part is taken by its shape alone: a part of another rank of the same world size is not
detected). An entry missing from the state dict keeps its value and is reported missing under the
unswapped name (strict loading raises); a state dict in the swapped layout (the layers' names, as
before this layout) loads as it is.

Names: ``getattr`` along an entry's key resolves on the swapped module (``mlp.gate_proj.weight``,
``self_attn.q_proj``, ...) to a :class:`KeyPath` (names only, no tensor), where the module has no
attribute of that name: DCP's ``get_state_dict`` / ``set_state_dict`` walk every state-dict key so.
"""
from __future__ import annotations

from itertools import groupby
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..planning.layer_spec import TiledLayer
from .dtensor import dtensor_like
from .replace import Unswappable

SHARD_TAG = "_overlap_shard"


class Entry(NamedTuple):
    """One state-dict entry of the replaced module ([Note: swapped state dicts])."""

    key: str  # its key, relative to the module
    sources: Tuple[str, ...]  # the swapped module's parameter(s) holding it (the tied ones after the first)
    index: Optional[int] = None  # the slice [index] of the parameter's global form along dim 0, or the whole
    shape: tuple = ()  # the replaced module's tensor's shape (keep_hf_state fills it in)
    # a fused entry (Phi-3's qkv_proj, gate_up_proj): the rows of each of ``sources`` (then distinct
    # parameters, not tied ones), whose global values, each viewed as ``[rows, *shape[1:]]``, are
    # concatenated along dim 0; () for the others
    rows: tuple = ()


class KeyPath:
    """A prefix of the replaced module's state-dict keys, as an attribute path on the swapped module:
    ``getattr`` of the next name gives the longer prefix, or raises AttributeError where no key
    continues so. Names only: the tensors are in ``state_dict()``."""

    def __init__(self, owner: nn.Module, path: str):
        self._owner, self._path = owner, path

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copy / pickle probes, and the attributes above before they are set
            raise AttributeError(name)
        path = f"{self._path}.{name}"
        if not any(e.key == path or e.key.startswith(path + ".") for e in self._owner._hf_entries):
            raise AttributeError(f"{type(self._owner).__name__} has no state-dict entry {path!r}")
        return KeyPath(self._owner, path)

    def __repr__(self) -> str:
        return f"KeyPath({self._path!r}: a name of the replaced module's state dict; see state_dict())"


# ---------------------------------------------------------------------------- one entry
def _holder(owner: nn.Module, source: str) -> Tuple[nn.Module, str]:
    """The module holding the parameter ``source`` (a key relative to ``owner``), and its name there."""
    path, _, name = source.rpartition(".")
    return (owner.get_submodule(path) if path else owner), name


def _tensor(owner: nn.Module, source: str) -> torch.Tensor:
    """The parameter or buffer ``source`` (a key relative to ``owner``)."""
    layer, name = _holder(owner, source)
    return layer._buffers[name] if name in layer._buffers else owner.get_parameter(source)


def _part(owner: nn.Module, entry: Entry) -> Optional[tuple]:
    """``(rank, world size, box)`` of this rank's part of ``entry``'s tensor with plain parameters,
    ``box`` a ``(start, stop)`` per dim; None where the tensor is whole on every rank (not a
    layer's parameter: a buffer, or another module's)."""
    layer, name = _holder(owner, entry.sources[0])
    if not isinstance(layer, TiledLayer) or name in layer._buffers:
        return None
    lay = layer._dtensor_layouts()[name]
    box = [(0, n) for n in entry.shape]
    if lay.rows is not None:  # replicated KV heads: the rows of this rank's head
        box[0] = (lay.rows.start, lay.rows.stop)
    elif isinstance(lay.placement, Shard):
        dim = lay.placement.dim - (entry.index is not None)
        n = entry.shape[dim] // layer.world_size
        box[dim] = (layer.rank * n, (layer.rank + 1) * n)
    return layer.rank, layer.world_size, tuple(box)


def _local_form(owner: nn.Module, entry: Entry, p: torch.Tensor) -> torch.Tensor:
    """A plain parameter viewed as the local part of its global form (swiglu ``w_in``: ``[2, F/ws, H]``)."""
    layer, name = _holder(owner, entry.sources[0])
    shape = layer._dtensor_layouts()[name].local_shape if isinstance(layer, TiledLayer) else None
    return p if shape is None else p.view(shape)


def _from_its_start(t: DTensor) -> DTensor:
    """``t`` with a local tensor whose storage starts where it does: the same memory through a slice
    of its storage. torch pickles a DTensor whose local tensor starts inside its storage through
    that storage's data pointer, which a DTensor's storage does not have (``torch.save`` raises
    "invalid python storage"): so the up rows of ``w_in`` would not save."""
    local = t.to_local()
    if local.storage_offset() == 0 or local.is_meta or t.requires_grad:
        return t
    start = local.storage_offset() * local.element_size()
    rebased = local.new_empty(0).set_(local.untyped_storage()[start:], 0, local.shape, local.stride())
    return DTensor.from_local(rebased, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def _entry_value(owner: nn.Module, entry: Entry, value: torch.Tensor) -> torch.Tensor:
    """The replaced module's entry from ``value``, the swapped module's entry ``entry.sources[0]``."""
    if isinstance(value, DTensor):
        return value if entry.index is None else _from_its_start(value[entry.index])
    t = value if entry.index is None else _local_form(owner, entry, value)[entry.index]
    part = _part(owner, entry)
    if part is not None and not isinstance(t, nn.Parameter):  # keep_vars=True: the parameter itself, untagged
        setattr(t, SHARD_TAG, (part[0], part[1], entry.shape, part[2]))
    return t


def _plain_part(value, owner: nn.Module, entry: Entry, key: str) -> torch.Tensor:
    """This rank's part of ``entry`` from ``value``, for plain parameters: the dense tensor's part,
    or ``value`` itself where it is this rank's part ([Note: swapped state dicts]); ValueError otherwise."""
    if isinstance(value, DTensor):
        raise ValueError(f"{key}: a DTensor, but this model holds plain tensors (swap(..., dtensor=False)); pass "
                         f"the dense tensor (full_tensor()) or this rank's part")
    part = _part(owner, entry)
    rank, ws, box = part if part is not None else (None, None, tuple((0, n) for n in entry.shape))
    shape = tuple(getattr(value, "shape", ()))
    if shape == entry.shape:  # the dense tensor
        return value[tuple(slice(a, b) for a, b in box)]
    own = tuple(b - a for a, b in box)
    tag = getattr(value, SHARD_TAG, None)
    if shape == own and part is not None:
        if tag is not None and tuple(tag) != (rank, ws, entry.shape, box):
            raise ValueError(f"{key}: the part {tag[3]} of rank {tag[0]} of {tag[1]} (its tag); this is rank {rank} "
                             f"of {ws}, which holds {box}: each rank loads the state dict it saved (or the dense "
                             f"tensors)")
        return value
    valid = f"the dense tensor {entry.shape}" + (f" or this rank's part {own} (rank {rank} of {ws})" if part else "")
    raise ValueError(f"{key}: a tensor of shape {shape}; expected {valid}")


# ---------------------------------------------------------------------------- fused entries
def _source_dense(owner: nn.Module, source: str, v: torch.Tensor) -> torch.Tensor:
    """The global value of the parameter ``source`` (``v``): a DTensor's ``full_tensor()``, a layer's
    plain shard gathered by its ``to_dense()`` (collectives over the layer's group)."""
    if isinstance(v, DTensor):
        return v.full_tensor()
    layer, name = _holder(owner, source)
    return layer.to_dense()[name] if isinstance(layer, TiledLayer) else v


@torch.no_grad()
def _fused_value(owner: nn.Module, entry: Entry, values: Sequence[torch.Tensor]) -> torch.Tensor:
    """A fused entry from its sources' values: the dense concatenation, as a ``Replicate()`` DTensor
    where the parameters are DTensors (a collective: the parts are sharded differently, which one
    DTensor placement cannot express), a plain dense tensor otherwise."""
    full = torch.cat([_source_dense(owner, s, v).reshape(-1, *entry.shape[1:]) for s, v in zip(entry.sources, values)])
    like = next((v for v in values if isinstance(v, DTensor)), None)
    if like is None:
        return full
    mesh = like.device_mesh
    return DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _rank_part(owner: nn.Module, source: str, dense: torch.Tensor) -> torch.Tensor:
    """This rank's plain part of the parameter ``source`` from its global value ``dense``."""
    p = owner.get_parameter(source)
    layer, name = _holder(owner, source)
    if not isinstance(layer, TiledLayer):
        return dense.reshape(p.shape)
    lay = layer._dtensor_layouts()[name]
    if lay.rows is not None:
        return dense[lay.rows].reshape(p.shape)
    if not isinstance(lay.placement, Shard):
        return dense.reshape(p.shape)
    local_shape = list(lay.local_shape if lay.local_shape is not None else p.shape)
    dim, n = lay.placement.dim, local_shape[lay.placement.dim]
    whole = list(local_shape)
    whole[dim] *= layer.world_size
    return dense.reshape(whole).narrow(dim, layer.rank * n, n).reshape(p.shape)


@torch.no_grad()
def _fused_in(owner: nn.Module, entry: Entry, value, key: str) -> Dict[str, torch.Tensor]:
    """The values of a fused entry's sources from ``value``: the dense tensor (plain, or a DTensor of
    the dense global shape, gathered). This rank's part alone is not accepted for a fused entry."""
    dense = value.full_tensor() if isinstance(value, DTensor) else value
    if not isinstance(dense, torch.Tensor) or tuple(dense.shape) != entry.shape:
        raise ValueError(f"{key}: a tensor of shape {tuple(getattr(dense, 'shape', ()))}; expected the dense tensor "
                         f"{entry.shape} (a fused entry: the whole tensor, or a DTensor of that global shape)")
    out = {}
    for s, piece in zip(entry.sources, dense.split(list(entry.rows))):
        p = owner.get_parameter(s)
        if isinstance(p, DTensor):
            out[s] = dtensor_like(piece.reshape(p.shape), p, key)
        else:
            out[s] = _rank_part(owner, s, piece).to(p.dtype).to(p.device)
    return out


def _groups(entries: Sequence[Entry]):
    """The entries grouped by the parameter holding them, in index order."""
    ordered = sorted([e for e in entries if not e.rows], key=lambda e: (e.sources, -1 if e.index is None else e.index))
    return [list(g) for _, g in groupby(ordered, key=lambda e: e.sources)]


@torch.no_grad()
def _param_value(owner: nn.Module, group: Sequence[Entry], given: dict, prefix: str) -> torch.Tensor:
    """The value of the parameter holding ``group`` from the entries ``given`` (index -> tensor);
    the slices not given keep the parameter's."""
    p = _tensor(owner, group[0].sources[0])
    if isinstance(p, DTensor):
        if group[0].index is None:
            return dtensor_like(given[None], p, prefix + group[0].key)
        slices = []
        for e in group:
            now = p.detach()[e.index]  # a view of p's local tensor unless dim 0 is sharded (FSDP2)
            slices.append(dtensor_like(given[e.index], now, prefix + e.key) if e.index in given else now)
        return torch.stack(slices)
    parts = {e.index: _plain_part(given[e.index], owner, e, prefix + e.key).to(p.dtype).to(p.device)
             for e in group if e.index in given}
    if group[0].index is None:
        return parts[None]
    now = _local_form(owner, group[0], p.detach())
    return torch.stack([parts[e.index] if e.index in parts else now[e.index] for e in group]).view(p.shape)


def load_entries(owner: nn.Module, values: Dict[str, torch.Tensor], prefix: str = "") -> None:
    """Copy ``values`` (the replaced module's entries, keys relative to ``owner``) into ``owner``'s
    parameters; the slices of a parameter not given keep their values. ``prefix`` names the keys in
    errors."""
    for e in owner._hf_entries:
        if e.rows and e.key in values:
            for s, v in _fused_in(owner, e, values[e.key], prefix + e.key).items():
                with torch.no_grad():
                    owner.get_parameter(s).copy_(v)
    for group in _groups(owner._hf_entries):
        given = {e.index: values[e.key] for e in group if e.key in values}
        if given:
            value = _param_value(owner, group, given, prefix)
            with torch.no_grad():
                for p in {id(q): q for q in (_tensor(owner, s) for s in group[0].sources)}.values():
                    p.copy_(value)


# ---------------------------------------------------------------------------- the hooks
def _state_out(owner: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook: the swapped module's entries replaced by the replaced module's."""
    ours = {k[len(prefix):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    for e in owner._hf_entries:
        state_dict[prefix + e.key] = _fused_value(owner, e, [ours[s] for s in e.sources]) if e.rows else \
            _entry_value(owner, e, ours[e.sources[0]])


def _state_in(owner: nn.Module, state_dict, prefix: str, local_metadata, strict, missing_keys, unexpected_keys,
              error_msgs) -> None:
    """Load-state-dict pre-hook: the replaced module's entries turned into the swapped module's."""
    for e in owner._hf_entries:
        if not e.rows:
            continue
        if prefix + e.key in state_dict:
            for s, v in _fused_in(owner, e, state_dict.pop(prefix + e.key), prefix + e.key).items():
                state_dict[prefix + s] = v
        elif prefix + e.sources[0] not in state_dict:
            missing_keys.append(prefix + e.key)
            for s in e.sources:
                state_dict[prefix + s] = owner.get_parameter(s).detach()
    for group in _groups(owner._hf_entries):
        given = {e.index: state_dict.pop(prefix + e.key) for e in group if prefix + e.key in state_dict}
        sources = group[0].sources
        if not given and prefix + sources[0] in state_dict:
            continue  # the swapped layout: loaded as it is
        missing_keys.extend(prefix + e.key for e in group if e.index not in given)
        value = _param_value(owner, group, given, prefix) if given else _tensor(owner, sources[0]).detach()
        for s in sources:
            state_dict[prefix + s] = value


def keep_hf_state(owner: nn.Module, replaced: nn.Module, candidates: Sequence[Entry]) -> None:
    """Give ``owner``, built to replace ``replaced``, ``replaced``'s state-dict layout ([Note:
    swapped state dicts]): ``candidates`` are the entries it may have (those ``replaced`` lacks are
    dropped). Raises :class:`~.replace.Unswappable` where the layouts do not correspond one to one
    with equal shapes."""
    theirs = {k: tuple(t.shape) for k, t in replaced.state_dict(keep_vars=True).items()}
    ours = owner.state_dict(keep_vars=True)
    by_key = {e.key: e for e in candidates}
    cls = type(replaced).__name__
    lacking = [k for k in theirs if k not in by_key or any(s not in ours for s in by_key[k].sources)]
    if lacking:
        raise Unswappable(f"{cls}'s state-dict entries {lacking} have no counterpart in the swapped module")
    entries = tuple(by_key[k]._replace(shape=theirs[k]) for k in theirs)
    held = {s for e in entries for s in e.sources}
    extra = [k for k in ours if k not in held]
    if extra:
        raise Unswappable(f"the swapped module's state-dict entries {extra} have no counterpart in {cls}'s")
    owner._hf_entries = entries
    for e in entries:
        if e.rows:
            if sum(e.rows) != e.shape[0] or len(e.rows) != len(e.sources):
                raise Unswappable(f"{cls}'s {e.key} has shape {e.shape}; its parts have rows {e.rows}")
            continue
        got = tuple(_entry_value(owner, e, ours[e.sources[0]].detach()).shape)
        part = None if isinstance(ours[e.sources[0]], DTensor) else _part(owner, e)
        want = e.shape if part is None else tuple(b - a for a, b in part[2])
        if got != want:
            raise Unswappable(f"{cls}'s {e.key} has shape {e.shape}; the swapped module's {e.sources[0]} gives {got}")
    owner.register_state_dict_post_hook(_state_out)
    owner.register_load_state_dict_pre_hook(_state_in)
    for first in dict.fromkeys(e.key.split(".", 1)[0] for e in entries):
        if not hasattr(owner, first):
            object.__setattr__(owner, first, KeyPath(owner, first))


# ---------------------------------------------------------------------------- whole tensors
def _gathered(t: torch.Tensor, group, shape: tuple) -> torch.Tensor:
    """The dense tensor of ``shape`` from every rank's tagged part ``t`` over ``group`` (a collective)."""
    ws = dist.get_world_size(group)
    boxes, parts = [None] * ws, [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather_object(boxes, getattr(t, SHARD_TAG)[3], group=group)
    dist.all_gather(parts, t.contiguous(), group=group)
    dense = t.new_empty(shape)
    for box, part in zip(boxes, parts):
        dense[tuple(slice(a, b) for a, b in box)] = part
    return dense


def full_state_dict(model: nn.Module, state_dict: Optional[dict] = None, *, keep: bool = True) -> dict:
    """``model.state_dict()`` (or ``state_dict``, one of its) with every entry a whole plain tensor
    on the CPU: for a swapped model, the unswapped model's state dict ([Note: swapped state dicts]).
    DTensors are gathered (``full_tensor()``), plain parts over their layer's group: a collective
    over the model's groups, one tensor at a time (call it on every rank). Tied entries stay one
    tensor. ``keep=False`` gathers and keeps nothing (an empty dict): for the ranks that do not write."""
    groups = {f"{name}.{e.key}": _holder(m, e.sources[0])[0].group
              for name, m in model.named_modules() if "_hf_entries" in m.__dict__ for e in m._hf_entries
              if isinstance(_holder(m, e.sources[0])[0], TiledLayer)}
    out, seen = {}, {}
    for key, v in (model.state_dict() if state_dict is None else state_dict).items():
        local = v.to_local() if isinstance(v, DTensor) else v
        same = (local.device, local.data_ptr(), tuple(v.shape), v.stride()) if local.numel() else None
        if same is None or same not in seen:
            if isinstance(v, DTensor):
                full = v.full_tensor()
            elif hasattr(v, SHARD_TAG) and key in groups:
                full = _gathered(v, groups[key], getattr(v, SHARD_TAG)[2])
            else:
                full = v
            full = full.detach().cpu() if keep else None
            if same is not None:
                seen[same] = full
        else:
            full = seen[same]
        if keep:
            out[key] = full
    return out
