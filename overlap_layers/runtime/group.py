"""Process groups from ``group=`` / ``mesh=`` / ``axis=`` and cross-rank agreement.

[Note: agreement]
Every decision that changes which collectives a layer issues must be identical on every rank
by construction (DESIGN.md, conventions). A layer therefore starts *every* call with
:func:`agree`: one tiny all-gather of the numbers its plan depends on (input shape, dtype,
tile count, grad mode, plan hash). Every rank issues it unconditionally, so it cannot hang, and
every rank sees the same gathered table, so either every rank proceeds or every rank raises the
same ValueError. A per-rank "new shape" branch that issued its own collective could hang.
On CUDA the gather runs on a side stream that does not wait for the caller's pending kernels, so
the host waits only for the tiny collective itself, not for the GPU queue to drain.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .collectives import _all_gather


def resolve_group(group=None, mesh=None, axis=None):
    """The ProcessGroup named by exactly one of ``group`` or ``mesh`` (+ ``axis``)."""
    if (group is None) == (mesh is None):
        raise ValueError("pass exactly one of group= (a ProcessGroup) or mesh= (a DeviceMesh); "
                         f"got group={group!r}, mesh={mesh!r}")
    if group is not None:
        if axis is not None:
            raise ValueError(f"axis={axis!r} is only valid with mesh=; with group= leave it None")
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group={group!r} is not a torch.distributed.ProcessGroup")
        return group
    if mesh.ndim == 1:
        if axis not in (None, 0) and axis not in (mesh.mesh_dim_names or ()):
            raise ValueError(f"axis={axis!r} is not a dim of the 1-D mesh {mesh}")
        return mesh.get_group()
    if axis is None:
        raise ValueError(f"mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; pass axis= naming "
                         "the tensor-parallel dim")
    return mesh.get_group(axis)


def agree(group, values: Sequence[int], device: torch.device) -> List[Tuple[int, ...]]:
    """All-gather ``values`` (ints) from every rank; see [Note: agreement]."""
    ws = dist.get_world_size(group)
    side = torch.cuda.Stream(device=device) if device.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        out = mine.new_empty(ws * len(values))
        _all_gather(out, mine, group=group)
        table = out.view(ws, len(values)).tolist()
    return [tuple(r) for r in table]


def first_disagreement(table: Sequence[Tuple[int, ...]], names: Sequence[str]) -> Optional[str]:
    """A readable description of the first field that differs across ranks, or None."""
    for j, name in enumerate(names):
        col = [row[j] for row in table]
        if len(set(col)) > 1:
            return f"{name} differs across ranks: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(col))
    return None
