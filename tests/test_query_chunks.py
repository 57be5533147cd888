"""Tier 1 (and CUDA where present): the attention core by query chunks
(``layers/attention/query_chunks.py``) against the dense formula under float64 autograd: every chunk's
output and log-sum-exp, and the whole core's gradients from the merged chunks, causal and not,
with grouped KV heads and chunks written into a strided (rank-major) output."""
import math

import pytest
import torch

from kernel_device import DEVICE, needs_triton
from overlap_layers.layers.attention import query_chunks


def reference(q, k, v, causal, scale):
    """``(o, lse)`` of softmax attention in float64 autograd, KV head ``h // (nq/nkv)`` per query head."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        S = q.shape[2]
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def run_chunks(q, k, v, chunks, causal, scale):
    """Every query chunk into a rank-major output ``[g, b, s, nq, d]`` (as the layer writes it),
    returned as ``[b, nq, S, d]``, and the log-sum-exp ``[b, nq, S]``. Causal, the odd chunks'
    diagonal pieces run first, as the layer runs them when the chunk's rows arrive."""
    b, nq, S, d = q.shape
    s = S // chunks
    o_gbsnd = q.new_empty((chunks, b, s, nq, d))
    lse = q.new_empty((b, nq, S), dtype=query_chunks.lse_dtype(q.dtype))
    diags = {c: query_chunks.diagonal(q, k, v, c, s, scale=scale) for c in range(1, chunks, 2) if causal}
    for c in reversed(range(chunks)):  # any order: each chunk stands alone
        query_chunks.query_chunk(q, k, v, c, s, causal=causal, scale=scale, o_out=o_gbsnd[c].permute(0, 2, 1, 3),
                                 lse_out=lse[:, :, c * s:(c + 1) * s], diag=diags.get(c))
    return o_gbsnd.permute(1, 3, 0, 2, 4).reshape(b, nq, S, d), lse


def check(device, dtype, causal, chunks, nq, nkv, tol_o, tol_g, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, S, d = 2, 8 * chunks, 16
    scale = 0.7 / math.sqrt(d)
    q64, k64, v64 = (torch.randn(b, n, S, d, generator=g, dtype=torch.float64) for n in (nq, nkv, nkv))
    do64 = torch.randn(b, nq, S, d, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    o_ref, lse_ref = reference(*leaves, causal, scale)
    grads_ref = torch.autograd.grad(o_ref, leaves, do64)

    q, k, v = (t.to(device, dtype) for t in (q64, k64, v64))
    o, lse = run_chunks(q, k, v, chunks, causal, scale)
    torch.testing.assert_close(o.double().cpu(), o_ref.detach(), rtol=tol_o, atol=tol_o)
    torch.testing.assert_close(lse.double().cpu(), lse_ref.detach(), rtol=tol_o, atol=tol_o)
    do = do64.to(device, dtype)
    for layout in ("bhsd", "bshd"):  # any storage order (cuDNN's backward needs [b, nq, S, d]: copied)
        if layout == "bshd":
            o, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (o, do))
        grads = query_chunks.core_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
        for got, want in zip(grads, grads_ref):
            assert got.shape == want.shape
            torch.testing.assert_close(got.double().cpu(), want, rtol=tol_g, atol=tol_g)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunks,nq,nkv", [(4, 4, 2), (2, 2, 2), (3, 6, 1)])
def test_query_chunks_match_formula_cpu(dtype, causal, chunks, nq, nkv):
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    check("cpu", dtype, causal, chunks, nq, nkv, tol, tol, seed=chunks + 3 * nq + causal)


def test_merge_of_two_pieces_is_exact_cpu():
    """The merge alone: the keys split in two anywhere, each piece's (o, lse) merged, equal the
    whole (float64): ``o = o1 e^(l1-l) + o2 e^(l2-l)``, ``l = logaddexp(l1, l2)``."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (6, 10, 10))
    o_ref, l_ref = reference(q, k, v, False, 0.5)
    pieces = [reference(q, k[:, :, a:b], v[:, :, a:b], False, 0.5) for a, b in ((0, 3), (3, 10))]
    o, lse = torch.empty_like(o_ref), torch.empty_like(l_ref)
    query_chunks.merge_into(o, lse, *pieces[0], *pieces[1])
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, l_ref, rtol=1e-12, atol=1e-12)


cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device (cuDNN's pieces; the CPU flash pieces run in "
                                 "test_query_chunks_match_formula_cpu)")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunks,nq,nkv", [(4, 8, 2), (2, 4, 4)])
def test_query_chunks_match_formula_cuda(dtype, causal, chunks, nq, nkv):
    """cuDNN's pieces and the Triton merge; tolerances of half types over 8-32 keys."""
    dev = torch.device("cuda")
    if not query_chunks.supported(dtype, dev, 16):
        pytest.skip("needs cuDNN's SDPA for this dtype (not available on this CUDA device)")
    check(dev, dtype, causal, chunks, nq, nkv, 2e-2, 5e-2, seed=chunks + nq + causal)


@needs_triton
def test_triton_merge_equals_torch_merge():
    """The Triton merge (CUDA, or Triton's interpreter on the CPU) against the torch formulas on
    the same half-type pieces, into a strided output, head_dim not a power of two (masked
    columns)."""
    g = torch.Generator().manual_seed(11)
    dev = DEVICE
    b, n, s, d = 2, 3, 70, 24
    o1, o2 = (torch.randn(b, n, s, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    l1, l2 = (torch.randn(b, n, s, generator=g).to(dev) * 4 for _ in range(2))
    want_o = (o1.double() * (l1 - torch.logaddexp(l1, l2)).exp().double()[..., None]
              + o2.double() * (l2 - torch.logaddexp(l1, l2)).exp().double()[..., None])
    out = torch.empty(b, s, n, d, device=dev, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    lse = torch.empty(b, n, s, device=dev)
    assert query_chunks.runs_triton(o1)  # the Triton merge, not the torch formulas
    query_chunks.merge_into(out, lse, o1, l1, o2, l2)
    torch.testing.assert_close(out.double(), want_o, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, torch.logaddexp(l1, l2), rtol=1e-5, atol=1e-5)
    query_chunks.merge_into(out, lse, o1, l1)  # one piece: a copy into the layout
    assert torch.equal(out, o1) and torch.equal(lse, l1)
    # float64 pieces keep float64 (the kernel merges in float32: the torch formulas run)
    o1, o2, l1, l2 = (t.double() for t in (o1, o2, l1, l2))
    out, lse = torch.empty_like(o1), torch.empty_like(l1)
    query_chunks.merge_into(out, lse, o1, l1, o2, l2)
    lse64 = torch.logaddexp(l1, l2)
    want64 = o1 * (l1 - lse64).exp()[..., None] + o2 * (l2 - lse64).exp()[..., None]
    torch.testing.assert_close(out, want64, rtol=1e-12, atol=1e-12)
