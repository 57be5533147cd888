"""The MoE's routing (``layers/routing.py``) on the CPU, its eager path: against the independent
routing of ``moe_reference.py`` (the logits given as tokens through an identity router), and its
sort keys and counts against their definitions. The Triton kernel is checked against this path on
CUDA (``cuda_worker.check_fused_routing``)."""
import torch
from hypothesis import given, settings, strategies as st

from moe_reference import route as reference_route
from overlap_layers.layers.routing import route_topk


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
