"""The attention core by query chunks: SDPA pieces that return their log-sum-exp, merged, so that
the rank-chunk attention can project and push one destination rank's rows while the core of the
next rank's rows runs ([Note: query-chunk core]).

Reference (what :func:`query_chunk` must equal), for ``q [b, nq, S, d]``, ``k, v [b, nkv, S, d]``
(query head h reads KV head ``h // (nq/nkv)``) and chunk ``c`` of ``s`` rows::

    o, lse = rows c*s .. (c+1)*s of  softmax(q k^T * scale + causal mask) v,
                                     logsumexp(q k^T * scale + causal mask, -1)

Causal, chunk c is two pieces: its keys ``[c*s, (c+1)*s)`` under the square causal mask (a
diagonal block, top-left aligned as SDPA's mask is) and keys ``[0, c*s)`` unmasked; two pieces
``(o1, l1)``, ``(o2, l2)`` of one row merge exactly into ``l = logaddexp(l1, l2)``,
``o = o1 * exp(l1 - l) + o2 * exp(l2 - l)``. Not causal, a chunk is one piece over every key.

:func:`core_backward` is the backward of the whole core from ``o`` and ``lse`` (the merged
chunks): one flash backward, which needs nothing else of the forward.

[Note: query-chunk core]
With one batch tile, a rank-chunk forward that runs the whole core first then has a projection
per rank left, and the pushes after them take longer than the projections (comm-bound). By
query chunks, destination rank q's rows are complete after chunk q, so its projection and push
start while the next chunk's core runs. A causal sequence split in one call would need a
lower-right mask, which only the slower flash-2 kernel takes (about twice the cuDNN core); the two
pieces each use the cuDNN kernel, and the four chunks with their merges into rank-major rows cost
about what the whole core and its copy to those rows cost (measured: see docs/measurements.md,
Attention).

A causal chunk's diagonal piece reads only its own rows (:func:`diagonal`), so the layer runs it
as soon as those rows arrive, beside the pulls of the next rank's rows, where those pulls outlast
the QKV projections they hide under (llama3-8b at TP 4); the projection pieces keep the rest.
Where the projections outlast the pulls (llama3-70b: 64 MiB pulls against 8192-wide projections)
it only holds the diagonal pieces' outputs (50 MiB more in the graph's pool there), so the layer
runs it where its cost model finds the pull longer (``AttentionCostModel.diagonal_first``). The
pushes may then meet at a destination (two copies into one rank at half speed each); making them
take turns costs as much as it saves, so they do not.

The projections stay on the core's stream. Between the chunks' kernels the slowest rank's forward
idles a few microseconds at a time, mostly around a memset that cuDNN or cuBLAS puts before its
kernel, slower while a peer copy is in flight. Running the peers' projections and pushes on a
second stream, so that the next chunk's core fills those gaps, is slower: beside the next chunk's
core a projection ends later, and so does its push, and the last push is then not hidden under
the own rows' work (measured: see docs/measurements.md, Attention).

Kernels: cuDNN's SDPA (CUDA, half types; :func:`supported`) and the CPU flash kernel (CPU, any
float type), both called as the ATen ops that return the log-sum-exp; the merge is one Triton
kernel on CUDA (reads both pieces, writes the output in any layout: ``kernels/query_chunks.py``),
else torch formulas.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...kernels.query_chunks import merge_fused, merge_reference
from ...kernels.triton_gate import runs_triton

_aten = torch.ops.aten


def supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether :func:`query_chunk` and :func:`core_backward` run here: CPU (the flash kernel takes
    any float type), or CUDA with cuDNN's SDPA enabled, half types and head_dim a multiple of 8
    up to 128 (the cuDNN kernel's range) on compute capability 8.0 or newer."""
    if device.type == "cpu":
        return dtype.is_floating_point
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (head_dim % 8 == 0 and head_dim <= 128 and torch.backends.cuda.cudnn_sdp_enabled()):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype: float32 for half types, the input's otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _piece(q, k, v, causal: bool, scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(o [b, nq, n, d], lse [b, nq, n])`` of SDPA over these keys (causal: top-left square)."""
    if q.is_cuda:
        out = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out[0], out[1].view(out[1].shape[:3])
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def merge_into(o_out, lse_out, o1, l1, o2=None, l2=None) -> None:
    """Write ``(o, lse)`` of one piece, or of two merged (module docstring), into ``o_out [b, n,
    s, d]`` and ``lse_out [b, n, s]`` (any strides); one Triton pass where it runs, but for float64
    (the kernel merges in float32), else torch ops."""
    if runs_triton(o1) and o1.dtype != torch.float64:
        merge_fused(o_out, lse_out, o1, l1, o2, l2)
    else:
        merge_reference(o_out, lse_out, o1, l1, o2, l2)


def diagonal(q, k, v, c: int, s: int, *, scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal chunk c's diagonal piece ``(o1 [b, nq, s, d], l1 [b, nq, s])`` (module docstring):
    it reads only rows ``c*s .. (c+1)*s`` of q, k and v, so it can run as soon as they arrive."""
    rows = slice(c * s, (c + 1) * s)
    return _piece(q[:, :, rows], k[:, :, rows], v[:, :, rows], True, scale)


def query_chunk(q, k, v, c: int, s: int, *, causal: bool, scale: Optional[float], o_out: torch.Tensor,
                lse_out: torch.Tensor, diag: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """Rows ``c*s .. (c+1)*s`` of the core (module docstring) into ``o_out [b, nq, s, d]`` (any
    strides: the rank-major rows' view) and ``lse_out [b, nq, s]`` (:func:`lse_dtype`). Causal,
    ``diag`` is the chunk's :func:`diagonal` piece if it ran already."""
    qc = q[:, :, c * s:(c + 1) * s]
    if not causal:
        merge_into(o_out, lse_out, *_piece(qc, k, v, False, scale))
        return
    diag = diagonal(q, k, v, c, s, scale=scale) if diag is None else diag
    rect = _piece(qc, k[:, :, :c * s], v[:, :, :c * s], False, scale) if c else (None, None)
    merge_into(o_out, lse_out, *diag, *rect)


def core_backward(do, q, k, v, o, lse, *, causal: bool, scale: Optional[float]):
    """``(dq, dk, dv)`` of the core over whole sequences, ``do, o [b, nq, S, d]`` (contiguous, or
    copied) and ``lse [b, nq, S]`` from :func:`query_chunk` (merged: the flash backward needs only
    the final output and log-sum-exp per row)."""
    if q.is_cuda:
        S, Sk = q.shape[2], k.shape[2]
        seed = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: unread (no fill kernel)
        # cuDNN's backward reads o and do as contiguous [b, nq, S, d]: other strides gave wrong
        # gradients (a [b, S, nq, d] storage, call G), so copy them where they differ
        do, o = do.contiguous(), o.contiguous()
        return _aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse.unsqueeze(-1), seed, seed, None, None, None, S, Sk, 0.0, causal, scale=scale)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, causal,
                                                                     scale=scale)
