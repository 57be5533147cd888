"""At world size 1 the serial plan's prediction is the plain call's measured time ([Note: one
rank's prediction] in ``planning/plan_maker.py``). Off CUDA nothing is measured, so the measuring
functions are replaced by stand-ins that run every timed callable once (forward, and backward when
the call saves) and return a known time per op."""
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from overlap_layers import OverlapAttention, OverlapConfig, OverlapMLP, OverlapMoE
from overlap_layers.planning import plan_maker
from overlap_layers.planning.planner import DIRECT_ROWS
from overlap_layers.sim import analytic_model

PLAIN_MS = 7.25


def _fake_measure_ops(setups, agreement):
    out = {}
    for key, setup in setups.items():
        fn = setup()
        fn()  # the timed callable runs here as it would on the device
        out[key] = PLAIN_MS if key.startswith("plain:") else 0.5
    return out


def _run(rank, ws, kind, save, cache_dir):
    g = dist.group.WORLD
    cfg = OverlapConfig(cache_dir=str(cache_dir))
    seq = DIRECT_ROWS  # two sequences: more rows than a direct call takes, so the call is planned
    layer, shape = {
        "mlp": lambda: (OverlapMLP(32, 64, group=g, config=cfg), (2, seq, 32)),
        "attention": lambda: (OverlapAttention(32, 4, 2, group=g, config=cfg), (2, seq, 32)),
        "moe": lambda: (OverlapMoE(32, 16, 4, 2, group=g, config=cfg), (1, seq, 32)),
    }[kind]()
    seen_grads = []
    with mock.patch.object(plan_maker.PlanMaker, "measuring", lambda self: True), \
            mock.patch.object(plan_maker, "calibrate", lambda *a: analytic_model("cpu")), \
            mock.patch.object(plan_maker, "measure_gemms", lambda shapes, *a: {s: 1.0 for s in shapes}), \
            mock.patch.object(plan_maker, "measure_ops", _fake_measure_ops):
        x = torch.randn(*shape, requires_grad=save)
        with torch.set_grad_enabled(save):
            y = layer(x)
        if save:
            y.sum().backward()
            seen_grads = [p.grad is not None for p in layer.parameters()]
    return layer.plan.predicted_ms, [c.predicted_ms for c in layer.plan.candidates], seen_grads


@pytest.mark.parametrize("save", [True, False], ids=["fwdbwd", "fwd"])
@pytest.mark.parametrize("kind", ["mlp", "attention", "moe"])
def test_serial_prediction_is_the_plain_call_measured(pools, tmp_path, kind, save):
    predicted, candidates, grads = pools(1).run(_run, kind, save, tmp_path)[0]
    assert predicted == PLAIN_MS
    assert candidates == [PLAIN_MS]
    assert all(grads)  # the call after the measurement still fills every gradient
