"""Per-layer benchmark of OverlapMLP: every mode of one shape, on every rank of one group.

Modes (README.md, Benchmarks):

* ``serial``  - OverlapMLP with K=1 (the plain TP layer);
* ``naive``   - a fixed K (``--naive-k``), no planner;
* ``auto``    - ``num_tiles="auto"``;
* ``rank`` / ``rank_ce`` - the layer split by source rank (``layers/common/rank_chunks.py``), pinned, over
  NCCL send/recv / over the copy engine (CUDA symmetric memory; NCCL where unavailable);
* ``asynctp`` - CUDA only: forward with ``torch.ops.symm_mem.fused_all_gather_matmul`` +
  ``fused_matmul_reduce_scatter``; forward+backward as torchtitan enables it
  (``torch.compile`` of the serial functional layer with ``_micro_pipeline_tp``);
* ``reference`` - a plain torch TP MLP written apart from the library (``bench/references.py``:
  two ``nn.Linear``, SwiGLU, the collectives issued directly), what a user would otherwise run;
  swiglu only. Graph-replayed where the layers replay their calls (``--graph-calls``);
* ``compute`` - the library's own compute bound: dense math on the pre-gathered input;
* ``comm``    - the layer's collectives alone.

limit = max(compute, comm); each time is the median over repeats of the max over ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..config import OverlapConfig
from ..layers.common.activations import act  # plain PyTorch ops of the dense activation
from ..layers.mlp.layer import OverlapMLP
from ..planning.plan import TilePlan
from ..planning.rank_plans import RankChunkPlans
from ..runtime.collectives import all_gather_single, reduce_scatter_single
from .references import PlainMLP
from .runner import Profile, Progress, pass_fn, run_modes

PRESETS = {
    "tiny": dict(hidden=64, ffn=256, batch=2, seq=64),
    "llama3-8b": dict(hidden=4096, ffn=14336, batch=4, seq=4096),
    "llama3-70b": dict(hidden=8192, ffn=28672, batch=4, seq=4096),
}
MODES = ("serial", "naive", "auto", "rank", "rank_ce", "asynctp", "reference", "compute", "comm")


@dataclass
class Shape:
    preset: str
    hidden: int
    ffn: int
    batch: int
    seq: int  # global sequence (split over ranks with sequence parallelism)
    sequence_parallel: bool = True
    activation: str = "swiglu"
    transport: str = "auto"  # the layer's config.transport
    cuda_graphs: bool = False  # time CUDA-graph replays; the layer's config.cuda_graphs
    graph_calls: bool = False  # the layer's config.graph_calls (no-grad calls replay graphs it captures)
    sm_carveout: Optional[int] = None  # the layer's config.sm_carveout


class MLPBench:
    """Builds the inputs for one shape and hands out a callable per (mode, pass)."""

    def __init__(self, shape: Shape, group, device, dtype, naive_k):
        self.s, self.group, self.device, self.dtype, self.naive_k = shape, group, device, dtype, naive_k
        ws = dist.get_world_size(group)
        self.ws = ws
        if shape.seq % ws or shape.ffn % ws:
            raise ValueError(f"seq={shape.seq} and ffn={shape.ffn} must divide by the group size {ws}")
        torch.manual_seed(0)
        self.layer = OverlapMLP(shape.hidden, shape.ffn, group=group, sequence_parallel=shape.sequence_parallel,
                                activation=shape.activation, num_tiles=1, dtype=dtype, device=device,
                                config=OverlapConfig(transport=shape.transport, cuda_graphs=shape.cuda_graphs,
                                                     graph_calls=shape.graph_calls, sm_carveout=shape.sm_carveout))
        seq_local = shape.seq // ws if shape.sequence_parallel else shape.seq
        self.x = torch.randn(shape.batch, seq_local, shape.hidden, device=device, dtype=dtype)
        self.dy = torch.randn_like(self.x)
        self.tokens_local = shape.batch * seq_local
        self.planning_ms: Optional[float] = None  # the last auto layer_fn's warmup (planning) time

    # ------------------------------------------------------------ our layer
    def call_layer(self, x):
        """One call of the layer on ``x`` (layers with more inputs override this)."""
        return self.layer(x)

    def layer_fn(self, k, backward: bool):
        """A callable running the layer at K=``k`` (or "auto": planned first, timed alone as
        ``planning_ms``, then run until first-call verification settles)."""
        layer = self.layer
        layer.num_tiles = k
        layer.plan = None
        layer.pin_plan(None)
        x = self.x.detach().requires_grad_(backward)

        run = pass_fn(lambda: self.call_layer(x), backward, [self.dy], [x, *layer.parameters()])
        self.planning_ms = None
        if k == "auto":
            t0 = time.perf_counter()
            layer.warmup([tuple(self.x.shape[:2])], dtype=self.dtype, training=backward)
            self.planning_ms = (time.perf_counter() - t0) * 1e3
            run()  # the first calls time the plan against K=1: measure the settled layer
            for _ in range(128):  # 2 calls per contender and trial, twice where a trial was disturbed
                if not layer.verifying:
                    break
                run()
        return run

    def plan_info(self) -> dict:
        """The record fields of the plan the layer ran last."""
        plan = self.layer.plan
        return dict(k=plan.num_tiles, decomposition=plan.decomposition, transport=plan.transport,
                    sm_carveout=[plan.carved_sms(False), plan.carved_sms(True)])

    @property
    def has_rank_chunks(self) -> bool:
        """Whether the layer has the rank-chunk plan for this shape (rows split by source rank:
        sequence parallel, or the MoE's exchange; 2+ ranks)."""
        return isinstance(self.layer, RankChunkPlans) and self.layer._source_split and self.ws > 1

    def rank_fn(self, transport: str, backward: bool):
        """A callable running the layer split by source rank over ``transport``."""
        layer = self.layer
        layer.plan = None
        layer.pin_plan(TilePlan(1, decomposition="rank", transport=transport))
        x = self.x.detach().requires_grad_(backward)
        return pass_fn(lambda: self.call_layer(x), backward, [self.dy], [x, *layer.parameters()])

    def host_overhead_us(self, backward: bool, n: int = 200) -> dict:
        """Host time of a cached auto call's bookkeeping: the plan-cache lookup, and the
        per-call agreement gather ([Note: agreement]); microseconds, mean of ``n``, max over ranks."""
        layer = self.layer
        key = (0, *self.x.shape, 0, 0, int(backward), 0)  # an agreement row of the layers' length
        t0 = time.perf_counter()
        for _ in range(n):
            layer.planner.auto_plan(tuple(self.x.shape[:2]), self.dtype, backward, call=False)
        lookup = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(n):
            layer.planner.agreement.gather(key)
        gather = (time.perf_counter() - t0) / n * 1e6
        worst = layer.planner.agreement.max([lookup, gather])
        return {"host_plan_lookup_us": worst[0], "host_agreement_us": worst[1]}

    # ------------------------------------------------------------ references
    def reference_fn(self, backward: bool):
        """The plain reference (``bench/references.PlainMLP``) on this rank's input; None where it
        has no counterpart (activations other than SwiGLU)."""
        if self.s.activation != "swiglu":
            return None
        ref = PlainMLP(self.s.hidden, self.s.ffn, group=self.group, sequence_parallel=self.s.sequence_parallel,
                       dtype=self.dtype, device=self.device)
        x = self.x.detach().requires_grad_(backward)
        return pass_fn(lambda: ref(x), backward, [self.dy], [x, *ref.parameters()])

    def flops(self, backward: bool) -> float:
        """The pass's GEMM FLOPs on this rank: ``2 * rows * H * (I + F)`` forward over the rows it
        multiplies (gathered with sequence parallelism), three times that with backward."""
        rows = self.tokens_local * (self.ws if self.s.sequence_parallel else 1)
        f_local = self.s.ffn // self.ws
        i_local = 2 * f_local if self.s.activation == "swiglu" else f_local
        return 2.0 * rows * self.s.hidden * (i_local + f_local) * (3 if backward else 1)

    def _gathered(self):
        x2 = self.x.reshape(-1, self.s.hidden)
        if not self.s.sequence_parallel:
            return x2
        xg = x2.new_empty((self.ws * x2.shape[0], x2.shape[1]))
        all_gather_single(xg, x2, group=self.group)
        return xg

    def compute_fn(self, backward: bool):
        xg = self._gathered().detach().requires_grad_(backward)
        w_in = self.layer.w_in.detach().requires_grad_(backward)
        w_out = self.layer.w_out.detach().requires_grad_(backward)
        dyg = torch.randn(xg.shape, device=self.device, dtype=self.dtype)

        return pass_fn(lambda: act(self.s.activation, xg @ w_in.t()) @ w_out.t(), backward, [dyg],
                       [xg, w_in, w_out])

    def comm_fn(self, backward: bool):
        x2 = self.x.reshape(-1, self.s.hidden)
        g = self.group
        if self.s.sequence_parallel:
            xg = x2.new_empty((self.ws * x2.shape[0], x2.shape[1]))
            out = torch.empty_like(x2)

            def once():
                all_gather_single(xg, x2, group=g)
                reduce_scatter_single(out, xg, group=g)
        else:
            buf = x2.clone()

            def once():
                dist.all_reduce(buf, group=g)

        def run():
            once()
            if backward:
                once()
        return run

    # ------------------------------------------------------------ AsyncTP
    def asynctp_fn(self, backward: bool):
        if self.device.type != "cuda" or not self.s.sequence_parallel:
            return None
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        name = self.group.group_name
        enable_symm_mem_for_group(name)
        w_in, w_out = self.layer.w_in, self.layer.w_out
        x2 = self.x.reshape(-1, self.s.hidden)
        kind = self.s.activation
        if not backward:
            def run():
                with torch.no_grad():
                    _, (pre,) = torch.ops.symm_mem.fused_all_gather_matmul(x2, [w_in.t()], gather_dim=0,
                                                                             group_name=name)
                    torch.ops.symm_mem.fused_matmul_reduce_scatter(act(kind, pre), w_out.t(), "sum",
                                                                   scatter_dim=0, group_name=name)
            return run
        import torch._inductor.config as inductor_config
        import torch.distributed._functional_collectives as funcol
        inductor_config._micro_pipeline_tp = True
        group = self.group

        def serial(x, wi, wo):
            xg = funcol.all_gather_tensor(x, gather_dim=0, group=group)
            y = act(kind, xg @ wi.t()) @ wo.t()
            return funcol.reduce_scatter_tensor(y, "sum", scatter_dim=0, group=group)

        compiled = torch.compile(serial, fullgraph=True)
        xr = x2.detach().requires_grad_()
        dy2 = self.dy.reshape(-1, self.s.hidden)

        def run():
            compiled(xr, w_in, w_out).backward(dy2)
            xr.grad = None
            w_in.grad = w_out.grad = None
        return run


def bench_shape(shape: Shape, group, device, dtype, modes, passes, naive_k, warmup, iters, repeats,
                progress: Optional[Progress] = None, profile: Optional[Profile] = None,
                warm_ms: float = 0.0, peak: Optional[float] = None) -> List[dict]:
    fields = dict(layer="mlp", preset=shape.preset, hidden=shape.hidden, ffn=shape.ffn, batch=shape.batch,
                  seq=shape.seq, tokens=shape.batch * shape.seq, sequence_parallel=shape.sequence_parallel,
                  activation=shape.activation, config_transport=shape.transport, cuda_graphs=shape.cuda_graphs,
                  graph_calls=shape.graph_calls, config_sm_carveout=shape.sm_carveout)
    return run_modes(MLPBench(shape, group, device, dtype, naive_k), fields, modes, passes, naive_k, warmup, iters,
                     repeats, progress, profile, warm_ms, peak)
