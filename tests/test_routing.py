"""The MoE's routing (``layers/moe/routing.py``) on the CPU, its eager path: against the independent
routing of ``moe_reference.py`` (the logits given as tokens through an identity router), and its
sort keys and counts against their definitions; and the Triton kernel against this path (CUDA, or
Triton's interpreter on the CPU)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernel_device import DEVICE, needs_triton
from moe_reference import route as reference_route
from overlap_layers.kernels.routing import fused_available, route_topk_reference as route_topk_eager
from overlap_layers.layers.moe.routing import route_topk


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.data(), st.booleans(), st.booleans())
def test_routing_matches_the_reference(T, E, data, normalize, ties):
    """probs, experts (ties to the lower index: integer logits tie often), weights and the
    gradient of the logits through probs and weights equal the reference's (float64); the keys
    are (expert - shift) mod E in the flattened token-major order, the counts each expert's
    assignments."""
    k = data.draw(st.integers(1, E))
    shift = data.draw(st.integers(0, E - 1))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    logits = torch.randint(0, 3, (T, E), generator=g).double() if ties else torch.randn(T, E, generator=g,
                                                                                         dtype=torch.float64)
    leaf = logits.clone().requires_grad_()
    probs, top_p, experts, weights, keys, counts = route_topk(leaf, k, normalize, shift)
    ref_x = logits.clone().requires_grad_()
    ref = reference_route(ref_x, torch.eye(E, dtype=torch.float64), k, normalize_topk=normalize)
    assert torch.equal(experts, ref["experts"])
    torch.testing.assert_close(probs, ref["probs"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, ref["weights"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(top_p, ref["probs"].gather(1, ref["experts"]), rtol=1e-12, atol=1e-12)
    want_keys = [(int(e) - shift) % E for e in ref["experts"].reshape(-1)]
    assert keys.dtype == torch.int16 and keys.tolist() == want_keys
    assert counts.tolist() == [int((ref["experts"] == e).sum()) for e in range(E)]
    gp = torch.randn(T, E, generator=g, dtype=torch.float64)
    gw = torch.randn(T, k, generator=g, dtype=torch.float64)
    ((probs * gp).sum() + (weights * gw).sum()).backward()
    ((ref["probs"] * gp).sum() + (ref["weights"] * gw).sum()).backward()
    torch.testing.assert_close(leaf.grad, ref_x.grad, rtol=1e-10, atol=1e-12)


@needs_triton
@pytest.mark.parametrize("T,E,k,normalize,ties", [(300, 128, 8, True, False), (37, 60, 2, False, False),
                                                  (513, 8, 2, True, True), (64, 128, 8, True, True),
                                                  (1, 16, 1, True, False), (0, 8, 2, True, False)])
def test_fused_routing_matches_the_eager_path(T, E, k, normalize, ties):
    """The Triton routing kernel (CUDA, or Triton's interpreter on the CPU) against the eager
    path on the same float32 logits: the same experts, keys and counts exactly (ties included:
    integer logits), probabilities and weights to rounding; its gradient through probs and
    weights against the eager path's autograd in float64. Empty, partial-block and
    non-power-of-two shapes."""
    g = torch.Generator().manual_seed(5 + T + E)
    shift = E // 2
    logits = (torch.randint(0, 3, (T, E), generator=g).float() if ties else torch.randn(T, E, generator=g) * 3).to(DEVICE)
    assert fused_available(logits)
    leaf = logits.clone().requires_grad_()
    got = route_topk(leaf, k, normalize, shift)
    lg = logits.double().requires_grad_()
    ref = route_topk_eager(lg, k, normalize, shift)
    for a, b in ((got[2], ref[2]), (got[4], ref[4]), (got[5], ref[5])):  # experts, keys, counts
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if T == 0:
        return
    for a, b in ((got[0], ref[0]), (got[1], ref[1]), (got[3], ref[3])):  # probs, top_p, weights
        torch.testing.assert_close(a.double().cpu(), b.detach().cpu(), rtol=1e-5, atol=1e-5)
    gp, gw = torch.randn(T, E, generator=g).to(DEVICE), torch.randn(T, k, generator=g).to(DEVICE)
    ((got[0] * gp).sum() + (got[3] * gw).sum()).backward()
    ((ref[0] * gp.double()).sum() + (ref[3] * gw.double()).sum()).backward()
    torch.testing.assert_close(leaf.grad.double().cpu(), lg.grad.cpu(), rtol=1e-5, atol=1e-5)
