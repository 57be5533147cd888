"""Costs of the MLP's tile programs, and the candidate plans the planner compares.

Per tile with M gathered rows (ws * local rows with sequence parallelism, else local rows),
H hidden, I local fc1 width, F local ffn width, e bytes per element:

=========  ===================================  ====================================
op         time                                 memory allocated (freed after)
=========  ===================================  ====================================
ag / ag_x  collective over M*H*e                xg, M*H*e (fc1 / wgrad1; kept if saved)
fc1        GEMM (M, I, H)                       pre, M*I*e (act; kept for backward)
act        memory M*(I+F)*e                     h, M*F*e (fc2)
fc2        GEMM (M, H, F)                       partial out, M*H*e (wait_rs)
rs / ar    collective over M*H*e
ag_dy      collective over M*H*e                dy gathered, M*H*e (wgrad2)
dgrad2     memory M*(I+F)*e + GEMM (M, F, H)    h and dh, 2*M*F*e (wgrad2)
act_bwd    memory M*(2I+F)*e                    dpre, M*I*e (wgrad1)
dgrad1     GEMM (M, H, I)                       dx gathered, M*H*e (wait_rs_dx)
wgrad2     GEMM (H, F, M);  wgrad1 GEMM (I, H, M)
=========  ===================================  ====================================
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Set, Tuple

from ..schedule import TileProgram, round_robin
from ..sim import Candidate, Costs, HardwareModel, simulate
from .tiling import effective_num_tiles, tile_bounds

TILE_CHOICES = (1, 2, 3, 4, 6, 8)


def _pairs(k: int) -> tuple:
    return tuple(tuple(range(i, min(i + 2, k))) for i in range(0, k, 2))


def _bucket_options(program: TileProgram, k: int):
    """Per collective: unbucketed, or adjacent pairs (a small slice of the DP's space)."""
    handles = [op.handle for op in program.comm_ops()]
    if k < 3:
        return [()]
    opts = []
    for mask in itertools.product((False, True), repeat=len(handles)):
        opts.append(tuple((h, _pairs(k)) for h, on in zip(handles, mask) if on))
    return opts


class MLPCostModel:
    """Maps the MLP's ops to times and bytes for one input shape."""

    def __init__(self, *, rows: int, world_size: int, hidden: int, n_in: int, f_local: int, elt: int,
                 sequence_parallel: bool, model: HardwareModel):
        self.rows, self.ws, self.H, self.I, self.F, self.e = rows, world_size, hidden, n_in, f_local, elt
        self.sp, self.model = sequence_parallel, model

    def gathered(self, local_rows: int) -> int:
        return local_rows * (self.ws if self.sp else 1)

    def gemms(self, m: int) -> List[Tuple[int, int, int]]:
        H, I, F = self.H, self.I, self.F
        return [(m, I, H), (m, H, F), (m, F, H), (m, H, I), (H, F, m), (I, H, m)]

    def op_ms(self, m: int, name: str) -> float:
        md, H, I, F, e = self.model, self.H, self.I, self.F, self.e
        table: Dict[str, Callable[[], float]] = {
            "fc1": lambda: md.gemm_ms(m, I, H),
            "act": lambda: md.mem_ms(m * (I + F) * e),
            "fc2": lambda: md.gemm_ms(m, H, F),
            "dgrad2": lambda: md.mem_ms(m * (I + F) * e) + md.gemm_ms(m, F, H),
            "act_bwd": lambda: md.mem_ms(m * (2 * I + F) * e),
            "dgrad1": lambda: md.gemm_ms(m, H, I),
            "wgrad2": lambda: md.gemm_ms(H, F, m),
            "wgrad1": lambda: md.gemm_ms(I, H, m),
        }
        return table[name]()

    def costs(self, program: TileProgram, bounds, *, num_streams: int, save: bool, keep_xg: bool,
              backward: bool) -> Costs:
        ms = [self.gathered(b - a) for a, b in bounds]
        H, I, F, e = self.H, self.I, self.F, self.e

        def compute(tile, op):
            return self.op_ms(ms[tile], op.name)

        def comm(tile, op):
            return self.model.comm_ms(op.collective, ms[tile] * H * e)

        sizes = {"ag": H, "ag_x": H, "fc1": I, "act": F, "fc2": H if self.sp else 0, "ag_dy": H,
                 "dgrad2": 2 * F, "act_bwd": I, "dgrad1": H if self.sp else 0}

        def nbytes(tile, op):
            return ms[tile] * sizes.get(op.name, 0) * e

        frees = {"ag": None if keep_xg else "fc1", "fc1": None if save and not backward else "act",
                 "act": "fc2", "fc2": "wait_rs", "ag_dy": "wgrad2", "ag_x": "wgrad1", "dgrad2": "wgrad2",
                 "act_bwd": "wgrad1", "dgrad1": "wait_rs_dx"}
        names = {op.name for op in program.ops}
        frees = {p: c for p, c in frees.items() if p in names and (c is None or c in names)}
        local = self.rows * H * e
        if backward:  # saved activations, dx and the weight-gradient accumulators
            saved = sum(m * I * e + (m * H * e if keep_xg else 0) for m in ms)
            base = saved + local + (2 * I * H + F * H) * e
        else:
            base = local
        return Costs(compute_ms=compute, comm_ms=comm, comm_alpha_ms=self.model.comm["all_gather"][0],
                     interference=self.model.interference, num_streams=num_streams,
                     launch_ms=self.model.launch_ms, bytes=nbytes, frees=frees, base_bytes=base)

    def gemm_shapes(self, tile_choices=TILE_CHOICES) -> Set[Tuple[int, int, int]]:
        shapes = set()
        for k in tile_choices:
            for a, b in tile_bounds(self.rows, k):
                shapes.update(self.gemms(self.gathered(b - a)))
        return shapes


def mlp_candidates(cm: MLPCostModel, programs: Callable[[int, bool, bool], Tuple[TileProgram, TileProgram]], *,
                   training: bool, tile_choices=TILE_CHOICES) -> List[Candidate]:
    """Simulate every candidate: K x (save or re-gather x) x bucket options, fwd and bwd apart.

    ``programs(k, save, regather)`` returns the forward and backward tile programs."""
    out: List[Candidate] = []
    seen = set()
    for k_req in tile_choices:
        k = effective_num_tiles(cm.rows, k_req)
        if k in seen:
            continue
        seen.add(k)
        bounds = tile_bounds(cm.rows, k)
        streams = 1  # the GPU is one compute resource: extra streams fill gaps, add no throughput
        for regather in ((False, True) if training and cm.sp else (False,)):
            fwd_prog, bwd_prog = programs(k, training, regather)
            keep_xg = training and cm.sp and not regather
            fwd_costs = cm.costs(fwd_prog, bounds, num_streams=streams, save=training, keep_xg=keep_xg, backward=False)
            fwd = min(((simulate(round_robin(fwd_prog, k, buckets=dict(b)), fwd_costs), b)
                       for b in _bucket_options(fwd_prog, k)), key=lambda x: (x[0].makespan_ms, len(x[1])))
            ms, exposed, peak, bb = fwd[0].makespan_ms, fwd[0].exposed_comm_ms, fwd[0].peak_bytes, ()
            if training:
                bwd_costs = cm.costs(bwd_prog, bounds, num_streams=streams, save=True, keep_xg=keep_xg, backward=True)
                bwd = min(((simulate(round_robin(bwd_prog, k, buckets=dict(b)), bwd_costs), b)
                           for b in _bucket_options(bwd_prog, k)), key=lambda x: (x[0].makespan_ms, len(x[1])))
                ms += bwd[0].makespan_ms
                exposed += bwd[0].exposed_comm_ms
                peak = max(peak, bwd[0].peak_bytes)
                bb = bwd[1]
            out.append(Candidate(k, regather, fwd[1], bb, ms, exposed, peak))
    return out

