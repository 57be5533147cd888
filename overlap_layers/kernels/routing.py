"""Top-k routing of the MoE as one kernel on CUDA (Triton), eager elsewhere.

Reference (what the layer's ``route_topk`` (``layers/moe/routing.py``) must equal, in torch ops
:func:`route_topk_reference`; ``logits [T, E]``, probabilities in the logits'
dtype, float32 or float64)::

    probs            = softmax(logits)
    (top_p, experts) = the k largest probs per row, descending, ties to the lower expert index
    weights          = top_p / sum(top_p)           (normalize; else top_p)
    keys[t*k + j]    = (experts[t, j] - shift) mod E    (the send order's sort keys)
    counts[e]        = #{(t, j) : experts[t, j] == e}

Gradients flow to ``logits`` through ``probs``, ``top_p`` and ``weights``.

The eager path runs about ten kernels, each its own host launch (softmax, a stable sort of every
row, a gather, the normalisation, the keys, the counts); the MoE's forward is host-bound on some
machines (20-50 us of host time per launch inside a call on the H200 machines: docs/measurements.md,
MoE), and these launches sit
at its start. The kernel does it all in one launch: a block of rows per program, the softmax in
registers, then k passes of an argmax whose ties go to the lower index (the stable sort's order),
each pass storing its expert, probability and key and adding to the counts (atomic adds on
integers: exact, in any order). The exponential is Triton's, so the probabilities may differ from
``torch.softmax``'s in the last bits (the reference holds up to rounding). The backward is plain
torch: the weights' normalisation, the selected probabilities scattered back to their rows, and
softmax's backward.
"""
from __future__ import annotations

import torch

from .triton_gate import runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the eager path
    triton = None

_ELEMENTS = 4096  # logits per program (rows of next_power_of_2(E))


def fused_available(logits: torch.Tensor) -> bool:
    return runs_triton(logits) and logits.dtype == torch.float32 and logits.is_contiguous()


if triton is not None:
    @triton.jit
    def _route_kernel(logits_ptr, probs_ptr, top_p_ptr, experts_ptr, weights_ptr, keys_ptr, counts_ptr, T, E, shift,
                      K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                      NORMALIZE: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_E)
        ks = tl.arange(0, BLOCK_K)
        live = rows < T
        mask = live[:, None] & (cols[None, :] < E)
        x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=-float("inf"))
        e = tl.exp(x - tl.max(x, 1)[:, None])
        p = e / tl.sum(e, 1)[:, None]
        tl.store(probs_ptr + rows[:, None] * E + cols[None, :], p, mask=mask)
        left = tl.where(mask, p, -1.0)  # probabilities are >= 0: -1 marks padding and the chosen
        top = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        chosen = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(K):
            best, idx = tl.max(left, 1, return_indices=True, return_indices_tie_break_left=True)
            top = tl.where(ks[None, :] == j, best[:, None], top)
            chosen = tl.where(ks[None, :] == j, idx[:, None], chosen)
            tl.atomic_add(counts_ptr + idx, tl.full([ROWS], 1, tl.int64), mask=live)
            left = tl.where(cols[None, :] == idx[:, None], -1.0, left)
        out = rows[:, None] * K + ks[None, :]
        kmask = live[:, None] & (ks[None, :] < K)
        tl.store(top_p_ptr + out, top, mask=kmask)
        tl.store(experts_ptr + out, chosen.to(tl.int64), mask=kmask)
        key = chosen - shift
        tl.store(keys_ptr + out, tl.where(key < 0, key + E, key).to(keys_ptr.dtype.element_ty), mask=kmask)
        if NORMALIZE:
            top = top / tl.sum(top, 1)[:, None]  # the padding columns hold 0
        tl.store(weights_ptr + out, top, mask=kmask)


def count(values: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of ``0..n-1`` occurs in ``values`` (``bincount`` without its device sync: on
    CUDA ``bincount`` reads the maximum on the host)."""
    return torch.zeros(n, dtype=torch.long, device=values.device).scatter_add_(0, values, torch.ones_like(values))


def key_dtype(n: int) -> torch.dtype:
    """The dtype of sort keys ``0..n``: int16 where it fits (CUDA's radix sort then takes 2 passes
    instead of 8, each a memset and launches), else int64."""
    return torch.int16 if n < 2 ** 15 else torch.int64


def route_topk_reference(logits: torch.Tensor, k: int, normalize: bool, shift: int):
    """The module reference in torch ops (the CPU's and float64's path, and what the kernel is
    checked against)."""
    probs = torch.softmax(logits, dim=-1)
    experts = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    top_p = probs.gather(1, experts)
    weights = top_p / top_p.sum(-1, keepdim=True) if normalize else top_p
    E = logits.shape[1]
    flat = experts.reshape(-1)
    keys = torch.remainder(flat - shift, E).to(key_dtype(E))
    return probs, top_p, experts, weights, keys, count(flat, E)


def route_fused(logits: torch.Tensor, k: int, normalize: bool, shift: int):
    """The module reference's outputs by one kernel launch, without autograd (where
    :func:`fused_available`)."""
    T, E = logits.shape
    probs = torch.empty_like(logits)
    top_p, weights = logits.new_empty((T, k)), logits.new_empty((T, k))
    experts = torch.empty((T, k), dtype=torch.long, device=logits.device)
    keys = torch.empty(T * k, dtype=key_dtype(E), device=logits.device)
    counts = torch.zeros(E, dtype=torch.long, device=logits.device)
    if T:
        block_e = triton.next_power_of_2(E)
        rows = max(1, _ELEMENTS // block_e)
        _route_kernel[(triton.cdiv(T, rows),)](logits, probs, top_p, experts, weights, keys, counts, T, E, shift,
                                               K=k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k), ROWS=rows,
                                               NORMALIZE=normalize)
    return probs, top_p, experts, weights, keys, counts
