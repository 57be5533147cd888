"""Hugging Face checkpoints of swapped models: ``save_pretrained`` writes the unswapped model's
checkpoint, and :func:`load_pretrained_shards` loads a safetensors checkpoint reading only this
rank's part of each tensor.

Reference: ``swapped.save_pretrained(path)`` (on every rank) writes what
``unswapped.save_pretrained(path)`` writes, so ``from_pretrained(path)`` gives the unswapped model
exactly; ``load_pretrained_shards(swapped, path)`` leaves ``swapped`` as ``swap`` of
``from_pretrained(path)`` leaves it (its state dict's values are the checkpoint's), having read per
rank only its part of each tensor: ``1/ws`` of every sharded tensor, and the whole of every
replicated one (embeddings, norms, the LM head, routers, replicated KV heads).

Checkpoints on disk may hold some tensors in transformers' original layout, which ``from_pretrained``
converts (``transformers/conversion_mapping.py``: ``"mixtral"`` and ``"qwen2_moe"``, which Qwen3-MoE
uses), and which ``save_pretrained`` writes back. :func:`load_pretrained_shards` reads a model entry
from the checkpoint's entry of the same key or, failing that, from these:

===============================================  ================================================
the model's entry (transformers 5)               in the checkpoint
===============================================  ================================================
``...mlp.X`` (Mixtral's MoE block)               ``...block_sparse_moe.X``
``...mlp.experts.gate_up_proj`` ``[E, 2F, H]``   per expert ``e``: ``experts.e.gate_proj.weight``
                                                 then ``experts.e.up_proj.weight`` ``[F, H]``
                                                 (Mixtral: ``w1``, ``w3``), rows concatenated
``...mlp.experts.down_proj`` ``[E, H, F]``       per expert: ``experts.e.down_proj.weight`` (``w2``)
===============================================  ================================================
"""
from __future__ import annotations

import json
import os
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .dtensor import dtensor_like
from .hf_state import SHARD_TAG, full_state_dict, load_entries

_INDEX, _SINGLE = "model.safetensors.index.json", "model.safetensors"
# transformers' renaming of Mixtral's MoE block (conversion_mapping.py): in memory, on disk
_MODULE_ALIASES = ((".mlp.", ".block_sparse_moe."),)
# per-expert tensors of the stacked experts: the model's entry -> the name styles, each one name per
# row block of an expert's tensor (Qwen2/3-MoE's, then Mixtral's)
_PER_EXPERT = {"experts.gate_up_proj": (("gate_proj.weight", "up_proj.weight"), ("w1.weight", "w3.weight")),
               "experts.down_proj": (("down_proj.weight",), ("w2.weight",))}


# ---------------------------------------------------------------------------- save_pretrained
def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict: Optional[dict] = None,
                    **kwargs):
    """``PreTrainedModel.save_pretrained`` of a swapped model (``swap`` puts it on the model): the
    model's class's ``save_pretrained`` with :func:`~.hf_state.full_state_dict` (the unswapped
    model's tensors, whole, on the CPU), written by the rank transformers writes from (the main
    process of rank 0). A collective, one tensor at a time: call it on every rank. Ranks that do not
    write keep no tensors; every rank returns once the checkpoint is written (a barrier), so any rank
    may read it next. The config written is the swapped model's (with ``swap(block=True)``,
    ``use_cache=False`` included: ``from_pretrained(path, use_cache=True)`` generates with a cache
    again)."""
    writes = bool(is_main_process) and (not dist.is_initialized() or dist.get_rank() == 0)
    full = full_state_dict(self, state_dict, keep=writes)
    out = type(self).save_pretrained(self, save_directory, is_main_process=writes, state_dict=full, **kwargs)
    if dist.is_initialized():
        dist.barrier()
    return out


def keep_save_pretrained(model: nn.Module) -> None:
    """Give a swapped transformers model the ``save_pretrained`` above (an attribute of the
    instance, so ``copy.deepcopy`` rebinds it to the copy)."""
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(save_pretrained, model)


# ---------------------------------------------------------------------------- the checkpoint
def _weight_files(path) -> Dict[str, str]:
    """Checkpoint key -> its safetensors file, for ``path``: a directory holding
    ``model.safetensors.index.json`` or ``model.safetensors``, or one of those files."""
    from safetensors import safe_open
    path = os.fspath(path)
    if os.path.isdir(path):
        index, single = os.path.join(path, _INDEX), os.path.join(path, _SINGLE)
        path = index if os.path.isfile(index) else single
    if path.endswith(".json") and os.path.isfile(path):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"path={path!r}: an index without a weight_map (expected {_INDEX} as save_pretrained "
                             f"writes it)")
        return {k: os.path.join(os.path.dirname(path), v) for k, v in weight_map.items()}
    if path.endswith(".safetensors") and os.path.isfile(path):
        with safe_open(path, framework="pt") as f:
            return {k: path for k in f.keys()}
    raise ValueError(f"path={path!r}: not a safetensors checkpoint; expected a directory holding {_INDEX} (and "
                     f"its shards) or {_SINGLE}, or one of those files")


Box = Tuple[Tuple[int, int], ...]


class _Reader:
    """The checkpoint's files, opened once each; reads boxes of tensors and counts their bytes.
    ``used``: the entries some model entry is read from (by any rank)."""

    def __init__(self, files: Dict[str, str]):
        self.files, self.handles, self.bytes_read, self.used = files, {}, 0, set()

    def shape(self, name: str) -> tuple:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        from safetensors import safe_open
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = safe_open(file, framework="pt")
        return self.handles[file].get_slice(name)

    def read(self, name: str, box: Box) -> torch.Tensor:
        t = self._slice(name)[tuple(slice(a, b) for a, b in box)]
        self.bytes_read += t.nbytes
        return t


def _aliases(key: str) -> List[str]:
    return [key] + [key.replace(ours, theirs, 1) for ours, theirs in _MODULE_ALIASES if ours in key]


def _source(key: str, shape: tuple, reader: _Reader) -> Optional[Callable[[Box], torch.Tensor]]:
    """How to read a box of the model's entry ``key`` (of ``shape``) from the checkpoint (the
    module docstring's table), or None where the checkpoint lacks it."""
    for name in _aliases(key):
        if name in reader.files:
            if reader.shape(name) != shape:
                raise ValueError(f"{name} in {reader.files[name]}: shape {reader.shape(name)}; the model's {key} "
                                 f"has shape {shape}")
            reader.used.add(name)
            return lambda box: reader.read(name, box)
    for suffix, styles in _PER_EXPERT.items():
        if not key.endswith("." + suffix):
            continue
        for module in _aliases(key[:-len(suffix)]):
            for style in styles:
                names = [[f"{module}experts.{e}.{n}" for n in style] for e in range(shape[0])]
                if all(n in reader.files for ns in names for n in ns):
                    return _per_expert(key, shape, names, reader)
    return None


def _per_expert(key: str, shape: tuple, names: List[List[str]], reader: _Reader) -> Callable[[Box], torch.Tensor]:
    """Reads a box of a stacked expert tensor ``[E, rows, cols]`` from each expert's tensors, whose
    rows are one after the other (gate then up)."""
    rows = shape[1] // len(names[0])
    for n in (n for ns in names for n in ns):
        if reader.shape(n) != (rows, *shape[2:]):
            raise ValueError(f"{n} in {reader.files[n]}: shape {reader.shape(n)}; the model's {key} {shape} needs "
                             f"{(rows, *shape[2:])} per expert")
        reader.used.add(n)

    def read(box: Box) -> torch.Tensor:
        (e0, e1), (r0, r1), rest = box[0], box[1], tuple(box[2:])
        experts = []
        for e in range(e0, e1):
            pieces = [reader.read(n, ((max(r0, i * rows) - i * rows, min(r1, (i + 1) * rows) - i * rows), *rest))
                      for i, n in enumerate(names[e]) if max(r0, i * rows) < min(r1, (i + 1) * rows)]
            experts.append(torch.cat(pieces))
        return torch.stack(experts)
    return read


# ---------------------------------------------------------------------------- this rank's part
def _box(key: str, like: torch.Tensor) -> Box:
    """This rank's part of the model's entry ``key`` (``like``, its value in ``model.state_dict()``):
    a DTensor's from its placements (torch.chunk along each sharded dim, mesh dim by mesh dim, as
    DTensor lays out Shard), a tagged plain part's from its tag, else the whole tensor."""
    if not isinstance(like, DTensor):
        tag = getattr(like, SHARD_TAG, None)
        return tuple(tag[3]) if tag is not None else tuple((0, n) for n in like.shape)
    box = [(0, n) for n in like.shape]
    mesh, here = like.device_mesh, like.device_mesh.get_coordinate()
    for i, pl in enumerate(like.placements):
        if type(pl) is Shard:
            a, b = box[pl.dim]
            step = -(-(b - a) // mesh.size(i))
            lo = min(a + here[i] * step, b)
            box[pl.dim] = (lo, min(lo + step, b))
        elif not isinstance(pl, Replicate):
            raise ValueError(f"{key}: placements {like.placements}; load_pretrained_shards reads Shard and Replicate "
                             f"parameters: load before fully_shard (FSDP2)")
    return tuple(box)


def _dense_shape(like: torch.Tensor) -> tuple:
    """The whole tensor's shape of a model entry: a DTensor's global shape, a tagged part's tag's."""
    tag = None if isinstance(like, DTensor) else getattr(like, SHARD_TAG, None)
    return tuple(like.shape) if tag is None else tuple(tag[2])


def _value(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The entry to load from this rank's part ``local``: a DTensor like ``like``, or a plain part
    tagged as ``like`` is."""
    if isinstance(like, DTensor):
        local = local.to(like.to_local().device)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
    if hasattr(like, SHARD_TAG):
        setattr(local, SHARD_TAG, getattr(like, SHARD_TAG))
    return local


@torch.no_grad()
def _load(modules: Dict[str, nn.Module], key: str, value: torch.Tensor) -> None:
    """Load the model's entry ``key`` into the module holding it: a swapped module's entry through
    its layout ([Note: swapped state dicts]), any other a parameter or buffer (a DTensor parameter
    by :func:`~.dtensor.dtensor_like`)."""
    path, _, name = key.rpartition(".")
    while path not in modules:
        path, _, head = path.rpartition(".")
        name = f"{head}.{name}"
    module = modules[path]
    if "_hf_entries" in module.__dict__ and any(e.key == name for e in module._hf_entries):
        load_entries(module, {name: value}, prefix=f"{path}." if path else "")
        return
    t = module._parameters.get(name, module._buffers.get(name))
    t.copy_(dtensor_like(value, t, key) if isinstance(t, DTensor) else value)


def load_pretrained_shards(model: nn.Module, path, *, strict: bool = True) -> dict:
    """Load the Hugging Face safetensors checkpoint at ``path`` (a directory holding
    ``model.safetensors.index.json`` and its shards, as ``save_pretrained`` writes them, or
    ``model.safetensors``; or one of those files) into ``model``, a model swapped by ``swap`` (or any
    model whose parameters are plain or Shard / Replicate DTensors), reading only this rank's part of
    each tensor: ``safe_open(...).get_slice(name)[box]``, one tensor at a time, each loaded into its
    parameter before the next is read. Reference: the module docstring.

    ``model``'s entries are its ``state_dict()`` keys (for a swapped model, the unswapped model's);
    each is read from the checkpoint's entry of that key or from transformers' original layout
    (the module docstring's table). A model built on the meta device must be materialised first
    (``model.to_empty(device=...)``, then its non-persistent buffers, e.g. rotary tables, rebuilt: they
    are not in a checkpoint). Call it on every rank of the model's groups; it makes no collective.

    ``strict``: a model entry the checkpoint lacks raises ValueError (an entry tied to one that was
    loaded, such as a tied LM head, is not missing). Returns ``{"bytes_read": this rank's bytes read
    from the checkpoint, "missing": [model entries not loaded], "unused": [checkpoint entries no
    model entry is read from]}``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__}: must be a torch.nn.Module")
    held = model.state_dict(keep_vars=True)  # the tensors themselves: ties are one object
    meta = [n for n, t in held.items() if t.is_meta]
    if meta:
        raise ValueError(f"model: {len(meta)} entries are on the meta device ({meta[0]}, ...); materialise the model "
                         f"first (model.to_empty(device=...), then rebuild its non-persistent buffers)")
    reader = _Reader(_weight_files(path))
    modules = dict(model.named_modules())
    loaded, missing = set(), []
    for key, like in model.state_dict().items():
        source = _source(key, _dense_shape(like), reader)
        if source is None:
            if id(held[key]) not in loaded:
                missing.append(key)
            continue
        _load(modules, key, _value(like, source(_box(key, like))))
        loaded.add(id(held[key]))
    if strict and missing:
        raise ValueError(f"path={os.fspath(path)!r}: the checkpoint lacks {len(missing)} of the model's entries "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); pass strict=False to "
                         f"load the others")
    return {"bytes_read": reader.bytes_read, "missing": missing, "unused": sorted(set(reader.files) - reader.used)}
