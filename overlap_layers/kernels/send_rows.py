"""The MoE device path's send rows into their places in the exchange's send buffer, straight from
the routing's keys: no sort of the assignments (``layers/moe/device.py``).

Reference (:func:`place_reference`), for the assignments ``a = 0 .. N-1`` (token-major: assignment a
is row ``a // top_k`` of ``src``) with ``keys[a]`` in ``0 .. E-1`` (the send-order index of its
destination rank and group, :class:`~overlap_layers.runtime.device_all_to_all.RegionLayout`) or
``E`` and above (dropped), and the layout's
:meth:`~overlap_layers.runtime.device_all_to_all.RegionLayout.key_places` ``(A, C, D)`` of the
source's counts::

    i          = the number of assignments before a with the same key
    place      = A[key] + i  if i < C[key]  else  D[key] + i      (the region, then past it)
    dst[place] = src[a // top_k]
    pos[a]     = place, or -1 where a is dropped

so the kept rows lie in send order (by key, each key's rows in assignment order), each part's
first rows in its region, exactly where the layout puts a source's rows in send order. A divert
``(lo, hi, out)`` (keys with no region: the source's own rows) takes the rows of keys ``lo ..
hi-1`` out of ``dst``: they go to ``out[place - D[lo]]`` instead (from its row 0), ``pos`` still
giving their places in ``dst``'s terms ([Note: own rows kept apart] in ``layers/moe/device.py``).

[Note: placing without a sort]
Sorting the assignments by key (CUB's radix sort, about ten launches), computing each row's place
from its index in send order (about a dozen more) and scattering the places back to the
assignments costs about 25 small kernels between the router and the placing. Here a kernel counts
each block of assignments per key, a cumulative sum over the blocks gives each block's rows before
it per key, and the placing kernel finds each row's index from those and the earlier rows of its
own block: three launches, and the places stay those of the stable order. The block counts are
stored by key, then block, so the cumulative sum over the blocks runs along the contiguous last
dimension (along a strided first dimension that scan alone costs more than the sort it replaces).
Measured: see docs/measurements.md (MoE, small kernels).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from .triton_gate import runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path
    triton = None

_BLOCK = 32  # assignments per program: its rows are copied as one [_BLOCK, BLOCK_W] tile per step
_DIVERTS = 2  # key ranges a placing may take out of dst (the MoE's own rows of its two halves)


def place_by_key(src: torch.Tensor, keys: torch.Tensor, top_k: int, key_places: torch.Tensor,
                 dst: torch.Tensor, diverts: Sequence[Tuple[int, int, torch.Tensor]] = ()) -> torch.Tensor:
    """Place the assignments' rows (module docstring) into ``dst`` (``[rows, W]``, contiguous) and
    return ``pos`` (``[N]`` int64). ``src`` is ``[T, W]`` of ``dst``'s dtype with ``N = T *
    top_k``, ``keys`` ``[N]`` integers, ``key_places`` ``[3, E]`` int64; ``diverts``: at most two
    ``(lo, hi, out)``, disjoint key ranges of keys without a region whose rows go to ``out``
    (contiguous, ``dst``'s width and dtype) instead. Three kernels where Triton runs (no host
    read: a graph captures them), else torch ops (with a host read). A place outside its buffer
    is not written (a safety net for keys that disagree with the counts, and for counts past a
    divert's rows: [Note: MoE slot rows] in ``layers/moe/device_path.py``)."""
    if key_places.dim() != 2:
        raise ValueError(f"place_by_key: key places {tuple(key_places.shape)}; valid: [3, E]")
    E = key_places.shape[1]
    spans = sorted((lo, hi) for lo, hi, _ in diverts)
    if len(diverts) > _DIVERTS or any(not 0 <= lo < hi <= E for lo, hi in spans) \
            or any(a[1] > b[0] for a, b in zip(spans, spans[1:])) \
            or any(not out.is_contiguous() or out.shape[1:] != dst.shape[1:] or out.dtype != dst.dtype
                   or out.device != dst.device for _, _, out in diverts):
        raise ValueError(f"place_by_key: diverts {[(lo, hi, tuple(o.shape), o.dtype) for lo, hi, o in diverts]}; "
                         f"valid: at most {_DIVERTS} disjoint key ranges 0 <= lo < hi <= {E}, each to a contiguous "
                         f"buffer of dst's width, dtype and device {tuple(dst.shape[1:])} {dst.dtype} {dst.device}")
    return _place(src, keys, top_k, E, key_places, dst, list(diverts))


def place_in_key_order(src: torch.Tensor, keys: torch.Tensor, top_k: int, num_keys: int,
                       dst: torch.Tensor) -> torch.Tensor:
    """:func:`place_by_key` with every key's rows after the earlier keys' from row 0 (``A[e] =
    D[e]`` = the kept assignments of keys before e, no region; keys ``num_keys`` and above
    dropped), the places made inside the placing kernel: the eager MoE's send rows in the rank
    exchange's step order (``layers/moe/routing.py``), and its backward's rows in the same places."""
    return _place(src, keys, top_k, num_keys, None, dst, [])


def _place(src, keys, top_k, E, key_places, dst, diverts) -> torch.Tensor:
    N = keys.numel()
    shown = "in key order" if key_places is None else tuple(key_places.shape)
    if (src.dim() != 2 or src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype or top_k < 1 or E < 1
            or N != src.shape[0] * top_k or (key_places is not None and key_places.shape != (3, E))
            or not dst.is_contiguous()
            or len({t.device for t in (src, keys, dst) + (() if key_places is None else (key_places,))}) > 1):
        raise ValueError(f"place_by_key: src {tuple(src.shape)} {src.dtype}, {N} keys of {E}, top_k={top_k}, key "
                         f"places {shown}, dst {tuple(dst.shape)} {dst.dtype}, devices "
                         f"{sorted({str(t.device) for t in (src, keys, dst)})}; valid: rows of one width "
                         "and dtype, top_k >= 1 keys per src row, E >= 1 keys, key places [3, E], a contiguous dst, "
                         "one device")
    if N == 0:
        return torch.empty(N, dtype=torch.int64, device=keys.device)
    if runs_triton(dst):
        pos = torch.empty(N, dtype=torch.int64, device=keys.device)
        keys = keys.contiguous()
        in_order = key_places is None
        key_places = keys if in_order else key_places.contiguous()  # (unread in key order)
        nb = triton.cdiv(N, _BLOCK)
        e_p2 = triton.next_power_of_2(E)
        hist = torch.empty(E, nb, dtype=torch.int32, device=keys.device)  # by key, then block
        _key_blocks_kernel[(nb,)](keys, hist, N, nb, E=E, E_P2=e_p2, BLOCK=_BLOCK, num_warps=4)
        # [e, b]: key e in blocks 0 .. b, summed along the last dim ([Note: placing without a sort])
        before = torch.cumsum(hist, 1, dtype=torch.int32)
        W = src.shape[1]
        (lo1, hi1, out1), (lo2, hi2, out2) = (diverts + [(0, 0, dst)] * _DIVERTS)[:_DIVERTS]
        _place_by_key_kernel[(nb,)](src.contiguous(), keys, before, key_places, dst, pos, N, nb, dst.shape[0],
                                    out1, out1.shape[0], out2, out2.shape[0],
                                    TOP_K=top_k, E=E, E_P2=e_p2, IN_ORDER=in_order, W=W, BLOCK=_BLOCK,
                                    BLOCK_W=min(256, triton.next_power_of_2(W)), LO1=lo1, HI1=hi1, LO2=lo2, HI2=hi2,
                                    num_warps=8)
        return pos
    return place_reference(src, keys, top_k, E, key_places, dst, diverts)


def place_reference(src: torch.Tensor, keys: torch.Tensor, top_k: int, E: int, key_places, dst: torch.Tensor,
                    diverts: Sequence[Tuple[int, int, torch.Tensor]] = ()) -> torch.Tensor:
    """The module reference in torch ops (a stable sort of the keys; the masked copies read their
    sizes on the host): ``pos``, the rows placed into ``dst`` and the diverts' buffers (``E``
    keys; ``key_places`` None: :func:`place_in_key_order`'s places)."""
    N = keys.numel()
    pos = torch.empty(N, dtype=torch.int64, device=keys.device)
    k = keys.to(torch.int64)
    order = torch.sort(k, stable=True).indices
    sk = k[order]
    kept = sk < E
    kc = sk.clamp(max=E - 1)
    per_key = torch.bincount(kc[kept], minlength=E)
    before = torch.cumsum(per_key, 0) - per_key
    i = torch.arange(N, device=keys.device) - before[kc]
    A, C, D = (before, per_key, before) if key_places is None else key_places
    place = torch.where(kept, torch.where(i < C[kc], A[kc] + i, D[kc] + i), -1)
    pos[order] = place
    rows = torch.div(torch.arange(N, device=keys.device), top_k, rounding_mode="floor")
    main = pos >= 0
    for lo, hi, out in diverts:
        mine = (k >= lo) & (k < hi) & main
        main &= ~mine
        at = pos - D[lo]
        ok = mine & (at >= 0) & (at < out.shape[0])
        out[at[ok]] = src[rows[ok]]
    ok = main & (pos < dst.shape[0])
    dst[pos[ok]] = src[rows[ok]]
    return pos


if triton is not None:
    @triton.jit
    def _key_blocks_kernel(keys_ptr, hist_ptr, N, NB, E: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr):
        """Column ``program_id`` of ``hist`` (``[E, NB]``): the assignments of that block of
        ``BLOCK`` per key."""
        b = tl.program_id(0)
        a = b * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + a, mask=a < N, other=E).to(tl.int32)
        e = tl.arange(0, E_P2)
        h = tl.sum((key[:, None] == e[None, :]).to(tl.int32), 0)
        tl.store(hist_ptr + e * NB + b, h, mask=e < E)

    @triton.jit(do_not_specialize=["dst_rows", "out1_rows", "out2_rows"])  # bounds that vary with routing
    def _place_by_key_kernel(src_ptr, keys_ptr, before_ptr, places_ptr, dst_ptr, pos_ptr, N, NB, dst_rows,
                             out1_ptr, out1_rows, out2_ptr, out2_rows,
                             TOP_K: tl.constexpr, E: tl.constexpr, E_P2: tl.constexpr, IN_ORDER: tl.constexpr,
                             W: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                             LO1: tl.constexpr, HI1: tl.constexpr, LO2: tl.constexpr, HI2: tl.constexpr):
        """One block of ``BLOCK`` assignments: each one's index among its key's (the earlier
        blocks' count from ``before``, then the earlier assignments of this block), its place,
        ``pos`` and its row; ``IN_ORDER``: the place is the kept rows of the keys before its key
        (each key's total, the last column of ``before``) plus that index. Keys ``LO1 .. HI1-1``
        (and ``LO2 .. HI2-1``) go to ``out1`` (``out2``) from the place of key LO1's first row
        (LO2's) on: the diverts (module docstring; empty ranges where none)."""
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        a = b * BLOCK + j
        live = a < N
        key = tl.load(keys_ptr + a, mask=live, other=E).to(tl.int32)
        kept = live & (key < E)
        kc = tl.where(kept, key, 0)
        same_earlier = (key[None, :] == key[:, None]) & (j[None, :] < j[:, None])
        i = tl.sum(same_earlier.to(tl.int64), 1)
        i += tl.load(before_ptr + kc * NB + b - 1, mask=kept & (b > 0), other=0).to(tl.int64)
        if IN_ORDER:
            e = tl.arange(0, E_P2)
            total = tl.load(before_ptr + e * NB + NB - 1, mask=e < E, other=0).to(tl.int64)
            place = tl.sum(tl.where(e[None, :] < kc[:, None], total[None, :], 0), 1) + i
        else:
            A = tl.load(places_ptr + kc, mask=kept, other=0)
            C = tl.load(places_ptr + E + kc, mask=kept, other=0)
            D = tl.load(places_ptr + 2 * E + kc, mask=kept, other=0)
            place = tl.where(i < C, A + i, D + i)
        tl.store(pos_ptr + a, tl.where(kept, place, -1), mask=live)
        in1 = kept & (key >= LO1) & (key < HI1)
        in2 = kept & (key >= LO2) & (key < HI2)
        at1 = place - tl.load(places_ptr + 2 * E + LO1)  # (an empty range's LO is 0: a key's D)
        at2 = place - tl.load(places_ptr + 2 * E + LO2)
        ok = kept & ~in1 & ~in2 & (place >= 0) & (place < dst_rows)
        ok1 = in1 & (at1 >= 0) & (at1 < out1_rows)
        ok2 = in2 & (at2 >= 0) & (at2 < out2_rows)
        row = (a // TOP_K).to(tl.int64)
        c_off = tl.arange(0, BLOCK_W)
        for c0 in tl.static_range(0, W, BLOCK_W):
            c = c0 + c_off
            cm = (c < W)[None, :]
            v = tl.load(src_ptr + row[:, None] * W + c[None, :], mask=(ok | ok1 | ok2)[:, None] & cm)
            tl.store(dst_ptr + place[:, None] * W + c[None, :], v, mask=ok[:, None] & cm)
            if HI1 > LO1:
                tl.store(out1_ptr + at1[:, None] * W + c[None, :], v, mask=ok1[:, None] & cm)
            if HI2 > LO2:
                tl.store(out2_ptr + at2[:, None] * W + c[None, :], v, mask=ok2[:, None] & cm)
