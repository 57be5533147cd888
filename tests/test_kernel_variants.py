"""Each Triton kernel compiles one variant per shape, whatever varies from call to call of that
shape: where the caching allocator put the tensors (the heads kernel's q, k and v), and counts that
follow the routing (the MoE combine's). A variant that first appears in a later call compiles, or
loads its module, inside that call, and stalls first-call verification's timed trials for
hundreds of milliseconds ([Note: one heads launch] in ``kernels/heads.py``). CUDA only: the
interpreter compiles nothing, and the kernel tests' interpreted run must not skip, so these live
apart from them. Each case's results are also checked against the kernel's float64 definition."""
import pytest
import torch

from kernel_device import DEVICE
from overlap_layers.kernels import heads as heads_kernel
from overlap_layers.kernels import moe_combine
from overlap_layers.layers.attention.core import heads_backward_into, heads_into
from overlap_layers.layers.moe.combine import combine_rows
from test_heads_kernel import reference_heads
from test_moe_combine import _want

pytestmark = pytest.mark.skipif(DEVICE is None or DEVICE.type != "cuda",
                                reason="needs a CUDA device with Triton (it counts compiled CUDA kernels, which "
                                       "Triton's interpreter does not make: it runs nowhere else)")


def test_heads_kernel_compiles_one_variant_wherever_its_heads_are():
    """One shape is one compiled kernel wherever the caching allocator put q, k and v: a variant
    chosen by their placement compiles (or loads a module) inside a call long after the first,
    which stalled first-call verification's timed trials ([Note: one heads launch]). Here k and v
    sit first next to q, then more than 2**31 elements from it (an offset beyond int32), forward
    and backward; both placements must equal the formula."""
    if torch.cuda.mem_get_info()[0] < 5 * 2**30:
        pytest.skip("needs 5 GiB of free CUDA device memory")
    g, b, s, nq, nkv, d, dtype = 2, 1, 64, 4, 2, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    rows64 = torch.randn(g, b, s, (nq + 2 * nkv) * d, generator=gen, dtype=torch.float64).to(dtype).double()
    tables64 = tuple(torch.randn(1, g * s, d, generator=gen, dtype=torch.float64).to(dtype).double() for _ in range(2))
    leaf = rows64.clone().requires_grad_()
    want = reference_heads(leaf, *(t.unflatten(1, (g, s)) for t in tables64), nq, nkv, d)
    grads64 = [torch.randn(b, n, g, s, d, generator=gen, dtype=torch.float64).to(dtype).double()
               for n in (nq, nkv, nkv)]
    want_grad = torch.autograd.grad(want, leaf, grads64)[0]
    rows, tables = rows64.to(DEVICE, dtype), tuple(t.to(DEVICE, dtype) for t in tables64)
    sizes = [b * n * g * s * d for n in (nq, nkv, nkv)]
    far = 2**31 + 1024  # elements from q to k: k's and v's offsets from q beyond int32
    store = torch.empty(far + sizes[1] + sizes[2], device=DEVICE, dtype=dtype)  # 4 GiB
    cache = heads_kernel._heads_kernel.device_caches[torch.cuda.current_device()][0]
    variants = []
    for starts in ((0, sizes[0], sizes[0] + sizes[1]), (0, far, far + sizes[1])):
        views = [store[o:o + n].view(b, m, g, s, d) for o, n, m in zip(starts, sizes, (nq, nkv, nkv))]
        for v in views:
            v.fill_(float("nan"))
        heads_into(rows, *views, tables, nq, nkv, d)
        for got, ref in zip(views, want):
            torch.testing.assert_close(got.double().cpu(), ref.detach(), rtol=1e-2, atol=1e-2)
        for v, grad in zip(views, grads64):
            v.copy_(grad)
        drows = torch.full_like(rows, float("nan"))
        heads_backward_into(drows, *views, tables, nq, nkv, d)
        torch.testing.assert_close(drows.double().cpu(), want_grad, rtol=1e-2, atol=1e-2)
        variants.append(len(cache))
    del store
    assert variants[1] == variants[0], f"compiled variants after each placement: {variants}"


def test_combine_compiles_one_variant_whatever_the_counts():
    """The host counts change with routing from call to call; each must reuse the first call's
    compiled kernel (a variant per count's divisibility would compile inside some later call),
    and each must equal the definition."""
    T, k, H, dtype = 8, 2, 64, torch.bfloat16
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(T * k, H, generator=g).to(dtype)
    pos, weights = torch.randperm(T * k, generator=g), torch.rand(T, k, generator=g)
    cache = moe_combine._combine_kernel.device_caches[torch.cuda.current_device()][0]
    variants = []
    for n_own, kept in ((5, 15), (16, 16), (1, 1), (0, 7)):  # not divisible by 16, divisible, one, none own
        own, back = rows.clone(), rows.clone() * 2
        want, _ = _want(own, back, pos, weights, n_own, kept)
        got = combine_rows(own[:n_own].to(DEVICE), back[:kept].to(DEVICE), pos.to(DEVICE),
                           weights.to(DEVICE), n_own, kept)
        assert torch.allclose(got.double().cpu(), want, rtol=1e-2, atol=1e-2), (n_own, kept)
        variants.append(len(cache))
    assert variants[1:] == variants[:1] * 3, f"compiled variants after each call: {variants}"
