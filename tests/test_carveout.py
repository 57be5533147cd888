"""The SM carveout's decisions ([Note: SM carveout]): which passes carve SMs out, which plans apply
it, and the config check. The carveout itself (cuBLASLt's SM target) needs CUDA: cuda_worker.py."""
import pytest
import torch

from overlap_layers import OverlapConfig
from overlap_layers.layers.mlp.layer import MLPPlan
from overlap_layers.planning.plan import contenders
from overlap_layers.runtime.carveout import carve_passes
from overlap_layers.sim import Candidate
from overlap_layers.sim.simulator import Timeline
from test_planner import _Programs, hw, llama8b_tp4


def timeline(comm_ms, *compute_ms):
    busy = {"comm": comm_ms, **{f"compute{i}": ms for i, ms in enumerate(compute_ms)}}
    return Timeline(makespan_ms=comm_ms + sum(compute_ms), exposed_comm_ms=0.0, peak_bytes=0, stream_busy_ms=busy,
                    events=[])


@pytest.mark.parametrize("fwd, bwd, want", [
    ((5.0, 4.0), (4.0, 9.0), (16, 0)),        # forward communication-bound; backward 4 < 9 / 2
    ((3.0, 5.0), None, (16, 0)),              # 3 >= 5 / 2; inference: no backward timeline
    ((1.0, 4.0), (6.0, 2.0, 2.0), (0, 16)),   # 1 < 4 / 2; 6 >= (2 + 2) / 2
    ((5.0, 4.0), (3.0, 4.0, 4.0), (16, 0)),   # compute streams add up: 3 < 8 / 2, though 3 >= 4 / 2
    ((2.0, 4.0), (0.5, 9.0), (16, 0)),        # exactly half carves
    ((1.0, 4.0), (1.0, 9.0), ()),             # compute-bound everywhere: nothing
    ((3.0,), None, ()),                       # no compute at all: nothing to slow down
])
def test_carve_passes_where_communication_is_at_least_half_the_compute(fwd, bwd, want):
    tls = {"forward": timeline(*fwd)}
    if bwd is not None:
        tls["backward"] = timeline(*bwd)
    assert carve_passes(tls, 16) == want


def test_carve_passes_on_the_mlp_cost_model():
    # llama3-8b MLP at TP 4: a host-memory-class link (5 GB/s) makes both passes communication-bound,
    # NVLink-class bandwidth (1000 GB/s) neither
    for gbps, want in ((5.0, (24, 24)), (1000.0, ())):
        cm = llama8b_tp4(hw(1.0, gbps))
        assert carve_passes(cm.timelines(_Programs(), 1, False, (), (), True), 24) == want, gbps


def test_carved_sms_only_where_batch_tiles_overlap_nccl():
    assert MLPPlan(4, carveout=(16, 8)).carved_sms(False) == 16
    assert MLPPlan(4, carveout=(16, 8)).carved_sms(True) == 8
    assert MLPPlan(4, carveout=(0, 8)).carved_sms(False) == 0
    assert MLPPlan(4).carved_sms(False) == 0  # no carveout planned
    assert MLPPlan(1, carveout=(16, 8)).carved_sms(False) == 0  # nothing overlaps
    for plan in (MLPPlan(1, decomposition="rank", carveout=(16, 8)),
                 MLPPlan(1, decomposition="rank", transport="copy_engine", carveout=(16, 8))):
        assert plan.carved_sms(False) == 0 and plan.carved_sms(True) == 0, plan


def test_contenders_carry_the_plans_carveout():
    cands = (Candidate(1, False, (), (), 10.0, 1.0, 500), Candidate(2, False, (), (), 8.0, 0.5, 400),
             Candidate(4, False, (), (), 8.5, 0.4, 300))
    plan = MLPPlan(2, predicted_ms=8.0, reason="r", candidates=cands, carveout=(16, 0))
    got = contenders(plan)
    assert [p.num_tiles for p in got] == [2, 4, 1]
    assert all(p.carveout == (16, 0) for p in got)
    assert [p.carved_sms(False) for p in got] == [16, 16, 0]  # K=1 runs as it always did
    assert plan.digest() == MLPPlan(2).digest()  # the same collectives


@pytest.mark.parametrize("bad", [-1, True, 1.5, "16"])
def test_config_rejects_a_bad_carveout(bad):
    with pytest.raises(ValueError, match="sm_carveout"):
        OverlapConfig(sm_carveout=bad)


def test_config_takes_a_carveout():
    assert OverlapConfig().sm_carveout is None
    assert OverlapConfig(sm_carveout=0).sm_carveout == 0
    assert OverlapConfig(sm_carveout=20).sm_carveout == 20


def _carve_every_layer(rank, ws):
    """carve_passes of each planned layer's serial timelines (what ``_carveout`` decides by) under a
    link so slow that every pass is communication-bound, and one so fast that none is."""
    import torch.distributed as dist
    from overlap_layers import OverlapAttention, OverlapMLP, OverlapMoE, UlyssesAttention
    from overlap_layers.sim import COMM_KINDS, HardwareModel
    g = dist.group.WORLD
    layers = {"mlp": OverlapMLP(32, 16 * ws, group=g), "attention": OverlapAttention(32, 4, 2, group=g),
              "ulysses": UlyssesAttention(32, 4, 2, group=g), "moe": OverlapMoE(32, 16, 4, 2, group=g)}
    out = {}
    for name, layer in layers.items():
        got = []
        for gbps in (1e-3, 1e6):
            hw = HardwareModel(gemm_tflops=100.0, gemm_fixed_ms=0.01, mem_gbps=1000.0, launch_ms=0.0,
                               interference=1.0, comm={k: (0.0, gbps) for k in COMM_KINDS})
            cm = layer._cost_model(layer._plan_key((2, 16 * ws), torch.float32, True), hw)
            got.append(carve_passes(layer.planner.maker.serial_timelines(cm, True), 16))
        out[name] = got
    return out


def test_every_planned_layer_has_the_timelines_the_carveout_reads(pool2):
    for got in pool2.run(_carve_every_layer):
        assert got == {name: [(16, 16), ()] for name in ("mlp", "attention", "ulysses", "moe")}, got


def test_no_carveout_touches_nothing():
    from overlap_layers.runtime.carveout import default_carveout, gemm_sm_carveout
    before = (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental())
    with gemm_sm_carveout(0):
        assert (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()) == before
    assert default_carveout(132) == 16
