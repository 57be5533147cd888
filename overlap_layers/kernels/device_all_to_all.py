"""The Triton kernels of the sync-free device all-to-all (``runtime/device_all_to_all.py``, [Note:
sync-free exchange] there), each sized from counts on the device so that a CUDA graph can replay
it with new counts.

The copy by table (the runtime's ``copy_rows_by_table``; :func:`copy_rows_fused`), whose
reference is :func:`copy_rows_reference`, for the segments ``segs [4, n]`` (per column: the
remote rank ``s``, where its rows begin in that rank's buffer, where in ``local``, how many) and
rows ``[*, W]``::

    pull  local[l + i] = remotes[s][r + i]        for i < n, within both buffers' rows
    push  remotes[s][r + i] = local[l + i]

The region layout's tables (:func:`key_places_fused`, :func:`own_tail_fused`, :func:`rests_fused`)
equal ``RegionLayout``'s torch paths there, which are their references; :func:`write_table_rows`
writes this rank's counts into every rank's table row (the reference: one copy per row).
"""
from __future__ import annotations

from typing import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch paths
    triton = None

_ROWS = 8  # rows a program copies at a time
# programs of a copy beside the experts' GEMMs: the pulls set the MoE's pace there, and 64 programs pull
# faster than 32 for little more GEMM time (measured: see docs/measurements.md, MoE device path)
CTAS = 64
_BITS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}  # rows move as raw bits of the element size


def remote_pointers(remotes: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``[ws]`` int64 addresses of ``remotes`` on their device, for :func:`copy_rows_fused`
    (made once, outside a capture: a host-to-device copy cannot be captured)."""
    return torch.tensor([t.data_ptr() for t in remotes], dtype=torch.int64).to(remotes[0].device)


def copy_rows_reference(segs: torch.Tensor, remotes: Sequence[torch.Tensor], local: torch.Tensor,
                        push: bool) -> None:
    """The copy by table in torch ops: a host copy per segment (the segments read on the host)."""
    for s, remote_start, local_start, n in segs.t().tolist():
        a, b = (local_start, remote_start) if push else (remote_start, local_start)
        src, dst = (local, remotes[s]) if push else (remotes[s], local)
        k = max(0, min(n, src.shape[0] - a, dst.shape[0] - b))
        dst[b:b + k].copy_(src[a:a + k])


def copy_rows_fused(segs: torch.Tensor, pointers: torch.Tensor, local: torch.Tensor, remote_rows: int, push: bool,
                    programs: int = CTAS) -> None:
    """The copy by table by one kernel of ``programs`` programs: the remotes given by their
    :func:`remote_pointers` and their rows (``remote_rows`` each); no host read of the segments."""
    W, nseg = local.shape[1], segs.shape[1]
    _segments_kernel[(programs,)](segs, pointers, local, remote_rows, local.shape[0], W, NSEG=nseg,
                                  NSEG_P2=triton.next_power_of_2(nseg), PUSH=push,
                                  BITS=getattr(tl, _BITS[local.element_size()]), ROWS=_ROWS,
                                  BLOCK_W=min(1024, triton.next_power_of_2(W)), num_warps=8)


def key_places_fused(counts: torch.Tensor, send_order: torch.Tensor, segment: torch.Tensor, caps: torch.Tensor,
                     starts: torch.Tensor) -> torch.Tensor:
    """``RegionLayout.key_places``' ``[3, E]`` int64 from one source's flat counts ``[E]`` and the
    layout's tables (its send order, segment of each send-order index, capacities and starts of
    the segments), in one program."""
    E, S = counts.numel(), caps.numel()
    out = torch.empty(3, E, dtype=torch.int64, device=counts.device)
    _key_places_kernel[(1,)](counts.contiguous(), send_order, segment, caps, starts, out, E=E, S=S,
                             E_P2=triton.next_power_of_2(E), S_P2=triton.next_power_of_2(S), num_warps=4)
    return out


def own_tail_fused(counts: torch.Tensor, source: int, first: int, groups: int) -> torch.Tensor:
    """``RegionLayout.own_tail``' ``[4, 1]`` segment from the flat counts ``[ws * groups]``, in one
    program."""
    out = torch.empty(4, 1, dtype=torch.int64, device=counts.device)
    _own_tail_kernel[(1,)](counts.contiguous(), out, source, first, G=groups, G_P2=triton.next_power_of_2(groups),
                           num_warps=1)
    return out


def rests_fused(table: torch.Tensor, send_order: torch.Tensor, segment: torch.Tensor, caps: torch.Tensor, ws: int,
                groups: int) -> torch.Tensor:
    """``RegionLayout.rests``' ``[ws, S, 4]`` int64 from the flat count table ``[ws * ws * groups]``,
    one program per source."""
    E, S = ws * groups, caps.numel()
    out = torch.empty(ws, S, 4, dtype=torch.int64, device=table.device)
    _rests_kernel[(ws,)](table.contiguous(), send_order, segment, caps, out, E=E, S=S,
                         E_P2=triton.next_power_of_2(E), S_P2=triton.next_power_of_2(S), num_warps=4)
    return out


def write_table_rows(counts: torch.Tensor, row_pointers: torch.Tensor, ws: int) -> None:
    """This rank's ``counts`` (int32) into each of the ``ws`` table rows at ``row_pointers``, one
    program per rank (stores to peers' memory)."""
    n = counts.numel()
    _table_rows_kernel[(ws,)](counts.contiguous(), row_pointers, N=n, BLOCK=triton.next_power_of_2(n), num_warps=1)


if triton is not None:
    @triton.jit(do_not_specialize=["remote_rows", "local_rows"])  # bounds; they change when the slot grows
    def _segments_kernel(seg_ptr, remote_ptrs, local_ptr, remote_rows, local_rows, W: tl.constexpr, NSEG: tl.constexpr,
                         NSEG_P2: tl.constexpr, PUSH: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_W: tl.constexpr):
        """Rows of the segments laid end to end, ``ROWS`` at a time per program: each row finds
        its segment (the columns of ``seg_ptr``) and so its source pointer and
        offsets, so small segments do not leave programs idle."""
        q = tl.arange(0, NSEG_P2)
        n = tl.load(seg_ptr + 3 * NSEG + q, mask=q < NSEG, other=0)
        ends = tl.cumsum(n, 0)
        total = tl.sum(n, 0)
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        r_off = tl.arange(0, ROWS)
        c_off = tl.arange(0, BLOCK_W)
        local = local_ptr.to(tl.pointer_type(BITS), bitcast=True)
        r0 = pid * ROWS
        while r0 < total:  # a loop bound from the device (a while: Triton's interpreter takes it too)
            r = r0 + r_off
            live = r < total
            seg = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), 1)  # [ROWS]: the segment of each row
            seg = tl.where(live, seg, 0)
            before = tl.sum(tl.where(q[None, :] < seg[:, None], n[None, :], 0), 1)  # rows of earlier segments
            i = r - before
            src_rank = tl.load(seg_ptr + seg, mask=live, other=0)
            rem = tl.load(seg_ptr + NSEG + seg, mask=live, other=0) + i
            loc = tl.load(seg_ptr + 2 * NSEG + seg, mask=live, other=0) + i
            ok = live & (rem < remote_rows) & (loc < local_rows)
            remote = tl.load(remote_ptrs + src_rank, mask=ok, other=0).to(tl.pointer_type(BITS))
            if PUSH:
                src, dst = local + loc * W, remote + rem * W
            else:
                src, dst = remote + rem * W, local + loc * W
            for c0 in tl.static_range(0, W, BLOCK_W):
                c = c0 + c_off
                m = ok[:, None] & (c < W)[None, :]
                v = tl.load(src[:, None] + c[None, :], mask=m)
                tl.store(dst[:, None] + c[None, :], v, mask=m)
            r0 += nprog * ROWS

    @triton.jit
    def _segment_rows(counts_ptr, order_ptr, segment_ptr, caps_ptr, E: tl.constexpr, S: tl.constexpr,
                      E_P2: tl.constexpr, S_P2: tl.constexpr):
        """One source's counts (``counts_ptr``: ``[ws * groups]`` by destination rank, then group)
        in its send order (``order_ptr``), the segment of each (``[E_P2]`` each), and each
        segment's rows, capacity, rows past it and where those begin (``[S_P2]`` each)."""
        e = tl.arange(0, E_P2)
        me = e < E
        flat = tl.load(counts_ptr + tl.load(order_ptr + e, mask=me, other=0), mask=me, other=0).to(tl.int64)
        seg = tl.load(segment_ptr + e, mask=me, other=S_P2)
        s = tl.arange(0, S_P2)
        n = tl.sum(tl.where(seg[None, :] == s[:, None], flat[None, :], 0), 1)
        cap = tl.load(caps_ptr + s, mask=s < S, other=0)
        over = tl.maximum(n - cap, 0)
        return flat, seg, n, cap, over, tl.cumsum(over, 0) - over

    @triton.jit
    def _rests_kernel(table_ptr, order_ptr, segment_ptr, caps_ptr, out_ptr, E: tl.constexpr, S: tl.constexpr,
                      E_P2: tl.constexpr, S_P2: tl.constexpr):
        """``RegionLayout.rests`` of the source ``program_id``."""
        src = tl.program_id(0)
        _, _, _, cap, over, over_start = _segment_rows(table_ptr + src * E, order_ptr + src * E, segment_ptr,
                                                       caps_ptr, E, S, E_P2, S_P2)
        s = tl.arange(0, S_P2)
        row = out_ptr + (src * S + s) * 4
        m = s < S
        tl.store(row, tl.zeros_like(cap) + src, mask=m)
        tl.store(row + 1, over_start, mask=m)
        tl.store(row + 2, cap, mask=m)
        tl.store(row + 3, over, mask=m)

    @triton.jit
    def _own_tail_kernel(counts_ptr, out_ptr, source, first, G: tl.constexpr, G_P2: tl.constexpr):
        """``RegionLayout.own_tail``: (source, its rows of the groups before ``first``, 0,
        its rows of the groups from ``first``)."""
        g = tl.arange(0, G_P2)
        mine = tl.load(counts_ptr + source * G + g, mask=g < G, other=0).to(tl.int64)
        zero = tl.sum(mine, 0) * 0  # an int64 scalar (a source of 1 comes as a constant)
        tl.store(out_ptr, zero + source)
        tl.store(out_ptr + 1, tl.sum(tl.where(g < first, mine, 0), 0))
        tl.store(out_ptr + 2, zero)
        tl.store(out_ptr + 3, tl.sum(tl.where(g >= first, mine, 0), 0))

    @triton.jit
    def _key_places_kernel(counts_ptr, order_ptr, segment_ptr, caps_ptr, starts_ptr, out_ptr, E: tl.constexpr,
                           S: tl.constexpr, E_P2: tl.constexpr, S_P2: tl.constexpr):
        """``RegionLayout.key_places`` in one program: the counts in send order, each
        segment's rows and overflow, each send-order index's offset in its segment."""
        flat, seg, n, cap, over, over_start = _segment_rows(counts_ptr, order_ptr, segment_ptr, caps_ptr, E, S,
                                                            E_P2, S_P2)
        e = tl.arange(0, E_P2)
        me = e < E
        s = tl.arange(0, S_P2)
        member = seg[None, :] == s[:, None]  # [S_P2, E_P2]
        seg_before = tl.cumsum(n, 0) - n
        off = tl.cumsum(flat, 0) - flat - tl.sum(tl.where(member, seg_before[:, None], 0), 0)
        cap_e = tl.sum(tl.where(member, cap[:, None], 0), 0)
        start_e = tl.sum(tl.where(member, tl.load(starts_ptr + s, mask=s < S, other=0)[:, None], 0), 0)
        over_e = tl.sum(tl.where(member, over_start[:, None], 0), 0)
        tl.store(out_ptr + e, start_e + off, mask=me)
        tl.store(out_ptr + E + e, cap_e - off, mask=me)
        tl.store(out_ptr + 2 * E + e, over_e + off - cap_e, mask=me)

    @triton.jit
    def _table_rows_kernel(counts_ptr, row_ptrs, N: tl.constexpr, BLOCK: tl.constexpr):
        """This rank's counts into rank ``program_id``'s table (a store to a peer's memory: one
        launch for every rank, where a peer-to-peer copy per rank costs tens of microseconds each)."""
        dst = tl.load(row_ptrs + tl.program_id(0)).to(tl.pointer_type(tl.int32))
        i = tl.arange(0, BLOCK)
        m = i < N
        tl.store(dst + i, tl.load(counts_ptr + i, mask=m), mask=m)
