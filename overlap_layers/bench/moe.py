"""Per-layer benchmark of OverlapMoE (``--layer moe``): every mode of one shape, on every rank of
one expert-parallel group (``--tp`` sizes it; the experts must divide by it).

Each rank holds its own ``[1, tokens, hidden]`` tokens (``tokens`` per rank: 8192 for the real
presets, 128 for ``tiny``; ``--tokens`` overrides). Modes as for the MLP
(:mod:`overlap_layers.bench.mlp`):

* ``serial``  - OverlapMoE with K=1 (one dispatch, the experts, one combine), eager also with
  ``--graph-calls`` (whose device path, a split by source, runs in ``auto`` only);
* ``naive``   - a fixed K (``--naive-k``: tiles of the local tokens), no planner;
* ``auto``    - ``num_tiles="auto"`` (planned, and run until ``layer.verifying`` is False, where
  the layer has a planner; else the layer's own fallback plan);
* ``asynctp`` - not available for MoE (no record);
* ``compute`` - a fixed plain-PyTorch reference with no collectives: the routing as the layer
  runs it (``moe.route``: the router GEMM, softmax, top-k, the sort keys; one kernel on CUDA) on
  the local tokens, the permutation by expert (a stable sort of the keys, the gather of the
  assignment rows, and the combine as the layer runs it: each token's k rows gathered back and
  weighed by ``weigh_rows``; both gathers backpropagate by gathers, as the layer's do), and the
  local experts on already-dispatched rows: as many as this rank's experts would receive under
  balanced routing (``tokens*top_k/experts`` from each rank per expert; with ``--skew`` the counts
  of the benchmark's own routing instead, so the limit still bounds the skewed run). The experts
  run as ``torch._grouped_mm`` on CUDA where it works (checked once, forward and backward), else
  one GEMM pair per expert; the record's ``expert_impl`` says which;
* ``comm``    - the layer's two all-to-alls alone (dispatch, then combine; twice for
  forward+backward) with the split sizes of one routing of the benchmark input.

``--skew`` skews the routing towards expert 0 (on rank 0): the inputs get a shared component along
router row 0 and that row is scaled up, so nearly every token picks expert 0 (a row scale alone
would only send the tokens whose projection on it is positive, half of them). Records carry
``skewed``, ``busiest_expert_share`` (share of the group's assignments routed to the busiest
expert; ``1/experts`` when balanced) and ``recv_imbalance`` (max over ranks of the rows received
for its experts / the mean).

limit = max(compute, comm); each time is the median over repeats of the max over ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..config import OverlapConfig
from ..layers.common.activations import act
from ..layers.moe.combine import weigh_rows
from ..layers.moe.layer import OverlapMoE
from ..layers.moe.routing import route
from ..layers.moe.tiles import Dispatch, PermuteRows
from ..runtime.collectives import all_gather_single as all_gather_rows
from .mlp import MLPBench
from .references import PlainMoE
from .runner import Profile, Progress, pass_fn, run_modes

# tokens: per rank (each rank's own batch 1 x seq tokens)
PRESETS = {
    "tiny": dict(experts=4, top_k=2, hidden=64, ffn=32, tokens=128),
    "mixtral-8x7b": dict(experts=8, top_k=2, hidden=4096, ffn=14336, tokens=8192),
    "qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, ffn=768, tokens=8192),
    "deepseek-v2-lite": dict(experts=64, top_k=6, hidden=2048, ffn=1408, tokens=8192),  # its routed experts
}
SKEW_SHIFT = 2.0   # the inputs' shared component along router row 0, in units of its projection's std
SKEW_SCALE = 8.0   # router row 0 is multiplied by this


@dataclass
class MoEShape:
    preset: str
    hidden: int
    ffn: int
    experts: int
    top_k: int
    batch: int
    seq: int  # per rank: every rank holds batch x seq tokens of its own
    skewed: bool = False
    activation: str = "swiglu"
    transport: str = "auto"  # the layer's config.transport
    sm_carveout: Optional[int] = None  # the layer's config.sm_carveout
    graph_calls: bool = False  # the layer's config.graph_calls (no-grad calls by the device path, replayed)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def record_fields(self) -> dict:
        """The MLP's record fields (``sequence_parallel`` None: no such notion) plus experts,
        top_k, skewed; ``tokens`` per rank."""
        return dict(layer="moe", preset=self.preset, hidden=self.hidden, ffn=self.ffn, experts=self.experts,
                    top_k=self.top_k, batch=self.batch, seq=self.seq, tokens=self.tokens, sequence_parallel=None,
                    activation=self.activation, skewed=self.skewed, config_transport=self.transport,
                    config_sm_carveout=self.sm_carveout, graph_calls=self.graph_calls)


class MoEBench(MLPBench):
    """Inputs of one MoE shape and a callable per (mode, pass)."""

    def __init__(self, shape: MoEShape, group, device, dtype, naive_k):
        self.s, self.group, self.device, self.dtype, self.naive_k = shape, group, device, dtype, naive_k
        ws = self.ws = dist.get_world_size(group)
        if shape.experts % ws:
            raise ValueError(f"experts={shape.experts} must divide by the group size {ws}")
        torch.manual_seed(0)
        L = self.layer = OverlapMoE(shape.hidden, shape.ffn, shape.experts, shape.top_k, group=group,
                                    activation=shape.activation, num_tiles=1, dtype=dtype, device=device,
                                    config=OverlapConfig(transport=shape.transport, sm_carveout=shape.sm_carveout,
                                                         graph_calls=shape.graph_calls))
        torch.manual_seed(1 + dist.get_rank())  # every rank its own tokens
        x = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=torch.float32)
        if shape.skewed:
            with torch.no_grad():
                w0 = L.router_weight[0].float()
                x += SKEW_SHIFT * w0 / w0.norm()
                L.router_weight[0] *= SKEW_SCALE
        self.x = x.to(dtype)
        self.dy = torch.randn_like(self.x)
        self.tokens_local = shape.tokens
        self._graphs = L.planner.call_graphs  # the device path's graphs (graph_calls): auto's only, :meth:`layer_fn`
        self.planning_ms: Optional[float] = None
        self._routing_counts()
        self.expert_impl = "loop"
        self._compute_inputs = self._make_compute_inputs()

    # ------------------------------------------------------------ our layer
    def layer_fn(self, k, backward: bool):
        """As the MLP's, with the device path ([Note: MoE graph calls]), which ignores the plan, in
        ``auto`` only: with ``graph_calls`` the serial and naive modes run their K eagerly, so that
        ``serial`` stays the serial layer (the device path has no serial form)."""
        self.layer.planner.call_graphs = self._graphs if k == "auto" else None
        return super().layer_fn(k, backward)

    def rank_fn(self, transport: str, backward: bool):
        """As the MLP's: the eager rank-chunk plan over ``transport`` (not the device path)."""
        self.layer.planner.call_graphs = None
        return super().rank_fn(transport, backward)

    # ------------------------------------------------------------ routing of the benchmark input
    def _routing_counts(self) -> None:
        """Split sizes of one K=1 routing of ``x`` on every rank: what ``comm`` sends, and the
        load statistics of the records."""
        L, ws, rank = self.layer, self.ws, dist.get_rank(self.group)
        El = L.num_local_experts
        with torch.no_grad():
            counts = L._route_keys(self.x.reshape(-1, self.s.hidden), 1)[2]  # [1, ws, El]
        table = torch.tensor(L.planner.agreement.gather(counts.reshape(-1).tolist())).view(ws, ws, El)  # [src, dst, El]
        self.send = table[rank].sum(-1).tolist()
        self.recv = table[:, rank].sum(-1).tolist()
        self.real_expert_rows = table[:, rank].sum(0).tolist()  # per local expert, from every source
        per_expert = table.sum(0).reshape(-1).double()
        per_rank = table.sum((0, 2)).double()
        total = float(per_expert.sum())
        self.busiest_expert_share = float(per_expert.max()) / total if total else None
        self.recv_imbalance = float(per_rank.max() / per_rank.mean()) if total else None

    def balanced_expert_rows(self) -> List[int]:
        """Rows per local expert under balanced routing: ``tokens*top_k/experts`` from each rank
        (the remainder to the lowest experts)."""
        s, L = self.s, self.layer
        n, rem = divmod(s.tokens * s.top_k, s.experts)
        first = dist.get_rank(self.group) * L.num_local_experts
        return [self.ws * (n + (first + e < rem)) for e in range(L.num_local_experts)]

    # ------------------------------------------------------------ our layer
    def host_overhead_us(self, backward: bool, n: int = 200) -> dict:
        """The shared host times, plus the MoE's counts exchange ([Note: MoE host syncs]; K=1's
        size): one device all-gather and the host read of its result, which waits for it; us,
        mean of ``n``, max over ranks."""
        layer, out = self.layer, super().host_overhead_us(backward, n)
        counts = torch.zeros(self.s.experts, dtype=torch.long, device=self.device)
        gathered = counts.new_empty(self.ws * counts.numel())
        t0 = time.perf_counter()
        for _ in range(n):
            all_gather_rows(gathered, counts, group=self.group)
            layer._host_reader.start(gathered)()
        out["host_counts_exchange_us"] = layer.planner.agreement.max([(time.perf_counter() - t0) / n * 1e6])[0]
        return out

    # ------------------------------------------------------------ references
    def _experts_loop(self, x_g, sizes, offs, w_in, w_out):
        kind = self.s.activation
        outs = [act(kind, rows @ w_in[e].t()) @ w_out[e].t() for e, rows in enumerate(x_g.split(sizes)) if sizes[e]]
        return torch.cat(outs) if outs else x_g.new_zeros((0, w_out.shape[1]))

    def _experts_grouped(self, x_g, sizes, offs, w_in, w_out):
        h = torch._grouped_mm(x_g, w_in.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(act(self.s.activation, h), w_out.transpose(-2, -1), offs=offs)

    def _make_compute_inputs(self) -> dict:
        """The dispatched rows (grouped by local expert) and their gradients, built once; on CUDA,
        picks ``torch._grouped_mm`` if one forward+backward of it runs here."""
        sizes = self.real_expert_rows if self.s.skewed else self.balanced_expert_rows()
        n, H, dev, dt = sum(sizes), self.s.hidden, self.device, self.dtype
        inp = dict(sizes=sizes, offs=torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32),
                   xr=torch.randn(n, H, device=dev, dtype=dt), dyr=torch.randn(n, H, device=dev, dtype=dt))
        self._experts = self._experts_loop
        if dev.type == "cuda" and hasattr(torch, "_grouped_mm"):
            try:
                xr = inp["xr"].detach().requires_grad_()
                w_in = self.layer.w_in.detach().requires_grad_()
                w_out = self.layer.w_out.detach().requires_grad_()
                self._experts_grouped(xr, sizes, inp["offs"], w_in, w_out).backward(inp["dyr"])
                torch.cuda.synchronize(dev)
                ok = True
            except Exception:  # noqa: BLE001 - no grouped GEMM for this device/dtype/shape: the loop
                ok = False
            # every rank must run the same reference (the receive counts, and so the shapes, differ)
            if all(self.layer.planner.agreement.min([float(ok)])):
                self._experts, self.expert_impl = self._experts_grouped, "grouped_mm"
        return inp

    def reference_fn(self, backward: bool):
        """The plain grouped-GEMM MoE (``bench/references.PlainMoE``: softmax top-k routing, an
        argsort by expert, ``torch._grouped_mm``, weighted ``index_add_``; expert parallel over the
        group with its split sizes read on the host) on this rank's tokens; None where the layer
        has parts it lacks (a shared expert, a capacity, another activation)."""
        L = self.layer
        if L.shared_w_in is not None or L.capacity_factor is not None or L.activation != "swiglu":
            return None
        sh = self.s
        ref = PlainMoE(sh.hidden, sh.ffn, sh.experts, sh.top_k, group=self.group, dtype=self.dtype, device=self.device)
        x = self.x.detach().requires_grad_(backward)
        return pass_fn(lambda: ref(x), backward, [self.dy], [x, *ref.parameters()])

    def flops(self, backward: bool) -> float:
        """The pass's expert FLOPs on this rank, balanced routing: ``6 * tokens * top_k * H * F``
        forward (gate, up and down GEMMs of every assignment), plus the router's ``2 * tokens * H
        * E``; three times that with backward."""
        sh = self.s
        tokens = sh.batch * sh.seq
        return (6.0 * tokens * sh.top_k * sh.hidden * sh.ffn + 2.0 * tokens * sh.hidden * sh.experts) * \
            (3 if backward else 1)

    def compute_fn(self, backward: bool):
        L, s, inp = self.layer, self.s, self._compute_inputs
        k, H = s.top_k, s.hidden
        x = self.x.reshape(-1, H).detach().requires_grad_(backward)
        router = L.router_weight.detach().requires_grad_(backward)
        w_in = L.w_in.detach().requires_grad_(backward)
        w_out = L.w_out.detach().requires_grad_(backward)
        xr = inp["xr"].detach().requires_grad_(backward)
        sizes, offs = inp["sizes"], inp["offs"]
        dy = self.dy.reshape(-1, H)
        experts = self._experts

        def forward():
            weights, keys = route(x, router, k, L.normalize_topk)[3:5]  # the layer's routing
            order = torch.sort(keys, stable=True).indices  # assignments grouped by expert
            pos = torch.empty_like(order)
            pos[order] = torch.arange(order.numel(), device=order.device)  # the inverse permutation
            # what the dispatch sends (its stand-in on return), and the combine as the layer does it: each
            # token's k rows gathered back and weighted (weigh_rows); both with the layer's gather-based
            # backwards (plain index_select would backpropagate by atomic index_add, 2.2 ms of a 7 ms qwen3
            # EP 4 forward+backward on H200, which the layer never runs)
            x_perm = Dispatch.apply(x, order, pos, k)
            back = PermuteRows.apply(x_perm, pos, order).view(-1, k, H)
            y = weigh_rows(back, weights.to(x.dtype))
            return experts(xr, sizes, offs, w_in, w_out), y

        return pass_fn(forward, backward, [inp["dyr"], dy], (x, router, w_in, w_out, xr))

    def comm_fn(self, backward: bool):
        H, g, send, recv = self.s.hidden, self.group, self.send, self.recv
        xs = self.x.new_empty((sum(send), H))
        xr = self.x.new_empty((sum(recv), H))
        ys = self.x.new_empty((sum(recv), H))
        yr = self.x.new_empty((sum(send), H))

        def run():
            for _ in range(2 if backward else 1):
                dist.all_to_all_single(xr, xs, output_split_sizes=recv, input_split_sizes=send, group=g)
                dist.all_to_all_single(yr, ys, output_split_sizes=send, input_split_sizes=recv, group=g)
        return run

    def asynctp_fn(self, backward: bool):
        return None  # no fused symmetric-memory MoE op to compare with


def shapes(preset: str, tokens: Optional[List[int]], skewed: bool, activation: str = "swiglu",
           transport: str = "auto", sm_carveout: Optional[int] = None, graph_calls: bool = False):
    """The MoE shapes of ``preset``: one per tokens-per-rank value (batch 1)."""
    base = PRESETS[preset]
    for t in tokens or [base["tokens"]]:
        yield MoEShape(preset, base["hidden"], base["ffn"], base["experts"], base["top_k"], 1, t, skewed=skewed,
                       activation=activation, transport=transport, sm_carveout=sm_carveout, graph_calls=graph_calls)


def bench_shape(shape: MoEShape, group, device, dtype, modes, passes, naive_k, warmup, iters, repeats,
                progress: Optional[Progress] = None, profile: Optional[Profile] = None,
                warm_ms: float = 0.0, peak: Optional[float] = None) -> List[dict]:
    b = MoEBench(shape, group, device, dtype, naive_k)
    fields = dict(shape.record_fields(), expert_impl=b.expert_impl, busiest_expert_share=b.busiest_expert_share,
                  recv_imbalance=b.recv_imbalance)
    return run_modes(b, fields, modes, passes, naive_k, warmup, iters, repeats, progress, profile, warm_ms, peak)
