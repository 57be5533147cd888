"""The MoE planner on synthetic hardware: tiling pays when the all-to-alls are slow and the
experts are heavy, and loses when NCCL slows the expert GEMMs (no process group needed)."""
from types import SimpleNamespace

import pytest

from overlap_layers.layers.moe import _backward_program, _Call, _forward_program
from overlap_layers.layers.moe_cost import MoECostModel
from overlap_layers.layers.mlp_cost import mlp_candidates
from overlap_layers.layers.planned import TilePlan
from overlap_layers.layers.tp_program import Accumulator
from overlap_layers.sim import COMM_KINDS, HardwareModel, choose


def programs(k, save, regather):
    layer = SimpleNamespace(group=None, activation="swiglu", launch_log=None)
    call = _Call(layer, TilePlan(k), save, None, [], [], [])
    return _forward_program(call, None, None), _backward_program(call, None, None, Accumulator({}))


def mixtral_ep4(interference, gbps):
    hw = HardwareModel(gemm_tflops=600.0, gemm_fixed_ms=0.01, mem_gbps=3000.0, launch_ms=0.005,
                       interference=interference, comm={k: (0.02, gbps) for k in COMM_KINDS})
    return MoECostModel(tokens=8192, world_size=4, hidden=4096, n_in=2 * 14336, ffn=14336, experts=8, top_k=2,
                        elt=2, model=hw)


@pytest.mark.parametrize("training", [False, True])
def test_slow_all_to_all_makes_tiling_pay(training):
    choice = choose(mlp_candidates(mixtral_ep4(1.0, 20.0), programs, training=training))
    assert choice.candidate.num_tiles > 1, choice.reason


@pytest.mark.parametrize("training", [False, True])
def test_interference_keeps_the_serial_layer(training):
    choice = choose(mlp_candidates(mixtral_ep4(3.0, 400.0), programs, training=training))
    assert choice.candidate.num_tiles == 1, choice.reason


def test_candidates_count_every_assignment_row():
    cm = mixtral_ep4(1.0, 100.0)
    (one,) = [c for c in mlp_candidates(cm, programs, training=False) if c.num_tiles == 1]
    a = 8192 * 2  # assignment rows
    comm_ms = 2 * cm.model.comm_ms("all_to_all", a * 4096 * 2)
    assert one.predicted_ms > comm_ms  # serial: both exchanges plus the experts, nothing hidden
