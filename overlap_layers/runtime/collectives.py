"""Collectives behind one handle type.

Every collective here is started asynchronously and returns a :class:`Handle`; ``result(i)``
waits for it and returns member ``i``'s output. On CUDA the wait makes the *current stream*
wait for the collective (c10d's ``Work.wait`` is stream-ordered for NCCL); on CPU (gloo) it
blocks the host until gloo's thread is done. One wait path serves both (docs/architecture.md, Executor and streams).

A collective may carry several members (a *bucket* of adjacent tiles: docs/architecture.md, Tile programs and schedules): their
inputs are sent as one message and split again at the wait. Along the leading dim:

=================  =======================  ===============================================
collective         member input (per rank)  member output (per rank)
=================  =======================  ===============================================
all_gather         ``[n, ...]``             ``[ws*n, ...]``, rank-major (rank 0's rows first)
reduce_scatter     ``[ws*n, ...]``          ``[n, ...]``: sum over ranks of block ``rank``
all_reduce         ``[n, ...]``             ``[n, ...]`` (in place), sum over ranks
all_to_all         ``(x, in_splits, out_splits)``  rows ``sum(out_splits)``, uneven splits
=================  =======================  ===============================================
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

# torch >= 2.13 names these *_single and deprecates the *_tensor names; 2.11 has only the latter.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """A started collective: ``work`` (a c10d Work, or None once complete) plus unpacking.

    ``finish(i)`` returns member ``i``'s output; it runs after the wait, on the waiting stream.
    ``buffers`` are kept alive until the handle is dropped; for a bucket (several members, whose
    waits may sit on other streams than the issuing one) they are also recorded on each waiting
    stream, which a single member issued and waited on its own stream does not need.
    """

    def __init__(self, work, finish: Callable[[int], torch.Tensor], buffers: Sequence[torch.Tensor] = (),
                 bucketed: bool = False):
        self._work = work
        self._finish = finish
        self._buffers = list(buffers)
        self._cross_stream = bucketed

    def result(self, i: int = 0) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        if self._cross_stream and self._buffers and self._buffers[0].is_cuda:
            # The buffers were allocated on the issuing stream and are read on this one.
            cur = torch.cuda.current_stream(self._buffers[0].device)
            for b in self._buffers:
                b.record_stream(cur)
        return self._finish(i)


def gathered_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``t`` stacked along dim 0, ``[ws * rows, ...]``: one blocking all-gather (the
    layers' ``to_dense``)."""
    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    all_gather_single(out, t.contiguous(), group=group)
    return out


def scattered_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Block ``rank`` of ``t``'s ``ws`` row blocks summed over the ranks, ``[rows / ws, ...]``: one
    blocking reduce-scatter (the inverse of :func:`gathered_rows` in backward)."""
    out = t.new_empty((t.shape[0] // dist.get_world_size(group), *t.shape[1:]))
    reduce_scatter_single(out, t.contiguous(), group=group)
    return out


def merged_rows(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One view over row blocks that sit back to back in one storage, or None."""
    first = tensors[0]
    if len(tensors) == 1:
        return first if first.is_contiguous() else None
    rest = first.shape[1:]
    pos = first.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.shape[1:] != rest or t.dtype != first.dtype
                or t.data_ptr() != pos
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        pos += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *rest), first.stride(), first.storage_offset())


def _rows_of(tensors: Sequence[torch.Tensor]) -> List[int]:
    return [t.shape[0] for t in tensors]


def _packed(inputs: Sequence[torch.Tensor], parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(parts, dim)`` (``parts``: views of ``inputs``), on the issuing stream. A
    bucket's members come from their tiles' streams, and the executor drops them once issued: each
    is recorded on this stream, so that the allocator gives its memory to its own stream's next
    tensor only after this copy ran (without it, tile 2's input on stream 0 could be written
    before stream 1 had packed tile 0's: a wrong first tile)."""
    out = torch.cat(list(parts), dim)
    if out.is_cuda:
        here = torch.cuda.current_stream(out.device)
        for t in inputs:
            t.record_stream(here)
    return out


def all_gather(inputs: Sequence[torch.Tensor], group) -> Handle:
    ws = dist.get_world_size(group)
    src = merged_rows(inputs)
    if src is None:
        src = _packed(inputs, [t.contiguous() for t in inputs])
    out = src.new_empty((ws * src.shape[0], *src.shape[1:]))
    work = all_gather_single(out, src, group=group, async_op=True)
    if len(inputs) == 1:
        return Handle(work, lambda i: out)
    rows, rest = _rows_of(inputs), src.shape[1:]
    offs = [sum(rows[:i]) for i in range(len(rows))]
    by_rank = out.view(ws, src.shape[0], *rest)

    def finish(i: int) -> torch.Tensor:
        return by_rank[:, offs[i]:offs[i] + rows[i]].reshape(ws * rows[i], *rest)

    return Handle(work, finish, [out], bucketed=True)


def reduce_scatter(inputs: Sequence[torch.Tensor], outs: Sequence[Optional[torch.Tensor]], group) -> Handle:
    ws = dist.get_world_size(group)
    rows = [t.shape[0] // ws for t in inputs]
    for t, n in zip(inputs, rows):
        assert t.shape[0] == ws * n, (t.shape, ws)
    rest = inputs[0].shape[1:]
    if len(inputs) == 1:
        src = inputs[0].contiguous()
    else:
        src = _packed(inputs, [t.reshape(ws, n, *rest) for t, n in zip(inputs, rows)], 1)
        src = src.reshape(ws * sum(rows), *rest)
    given = merged_rows(outs) if all(o is not None for o in outs) else None
    dst = given if given is not None else src.new_empty((sum(rows), *rest))
    work = reduce_scatter_single(dst, src, group=group, async_op=True)
    offs = [sum(rows[:i]) for i in range(len(rows))]

    def finish(i: int) -> torch.Tensor:
        part = dst[offs[i]:offs[i] + rows[i]]
        if given is None and outs[i] is not None:
            outs[i].copy_(part)
            return outs[i]
        return part

    return Handle(work, finish, [src, dst] if given is None else [src], bucketed=len(inputs) > 1)


def all_reduce(inputs: Sequence[torch.Tensor], group) -> Handle:
    buf = merged_rows(inputs)
    packed = buf is None
    if packed:
        buf = _packed(inputs, [t.reshape(t.shape[0], -1) for t in inputs])
    work = dist.all_reduce(buf, group=group, async_op=True)
    if not packed:
        return Handle(work, lambda i: inputs[i])
    rows = _rows_of(inputs)
    offs = [sum(rows[:i]) for i in range(len(rows))]

    def finish(i: int) -> torch.Tensor:
        inputs[i].copy_(buf[offs[i]:offs[i] + rows[i]].view_as(inputs[i]))
        return inputs[i]

    return Handle(work, finish, [buf], bucketed=True)


def all_to_all(x: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int], group) -> Handle:
    """Rows ``in_splits[j]`` of ``x`` go to rank j; ``out_splits[j]`` rows arrive from rank j."""
    ws = dist.get_world_size(group)
    if len(in_splits) != ws or len(out_splits) != ws:
        raise ValueError(f"in_splits/out_splits need {ws} entries (the group size); got "
                         f"{len(in_splits)} and {len(out_splits)}")
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"in_splits sum to {sum(in_splits)} but x has {x.shape[0]} rows")
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=list(out_splits),
                                  input_split_sizes=list(in_splits), group=group, async_op=True)
    return Handle(work, lambda i: out, [x])


def issue(collective: str, srcs: Sequence, outs: Sequence[Optional[torch.Tensor]], group) -> Handle:
    """Start ``collective`` for the members ``srcs`` (one per bucketed tile)."""
    if collective == "all_gather":
        return all_gather(srcs, group)
    if collective == "reduce_scatter":
        return reduce_scatter(srcs, outs, group)
    if collective == "all_reduce":
        return all_reduce(srcs, group)
    if collective == "all_to_all":
        if len(srcs) != 1:
            raise ValueError("all_to_all cannot be bucketed (uneven splits differ per tile)")
        x, in_splits, out_splits = srcs[0]
        return all_to_all(x, in_splits, out_splits, group)
    raise ValueError(f"collective={collective!r}")
