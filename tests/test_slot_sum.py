"""Tier 1 (CUDA where present): ``runtime.slot_sum.sum_slots`` against the float64 sum of the
slots, whole and as row blocks (the exchange's early and late sums), in half and float types; on
the CPU its torch path, or its kernel under Triton's interpreter."""
import pytest
import torch

from kernel_device import DEVICE, needs_triton
from overlap_layers.kernels import slot_sum
from overlap_layers.kernels.slot_sum import sum_slots

devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("n", [2, 4, 7])
def test_sum_slots_matches_float64_sum(device, dtype, tol, n):
    g = torch.Generator().manual_seed(n)
    R, C = 37, 300  # R*C not a multiple of the kernel's block
    slots64 = torch.randn(n, R, C, generator=g, dtype=torch.float64)
    slots = slots64.to(device, dtype)
    want = slots.double().sum(0).cpu()
    out = torch.empty(R, C, device=device, dtype=dtype)
    assert sum_slots(slots, out) is out
    torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)
    h = R // 3  # row blocks of a [n, R, C] buffer (row stride C, slot stride R*C)
    out2 = torch.full((R, C), float("nan"), device=device, dtype=dtype)
    sum_slots(slots[:, :h], out2[:h])
    sum_slots(slots[:, h:], out2[h:])
    torch.testing.assert_close(out2.double().cpu(), want, rtol=tol, atol=tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_slots_takes_the_kernel_for_half_and_float_types(dtype):
    """Where Triton runs, the sums above of these types go through the kernel (float64 keeps
    torch's sum), also for row blocks of a slot buffer."""
    slots = torch.zeros(3, 6, 5, device=DEVICE, dtype=dtype)
    assert slot_sum._fused(slots, torch.empty(6, 5, device=DEVICE, dtype=dtype))
    assert slot_sum._fused(slots[:, 2:], torch.empty(4, 5, device=DEVICE, dtype=dtype))
    assert not slot_sum._fused(slots.double(), torch.empty(6, 5, device=DEVICE, dtype=torch.float64))
