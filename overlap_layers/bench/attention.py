"""Per-layer benchmark of the attention layers (OverlapAttention, ``--layer attention``; and
UlyssesAttention, ``--layer ulysses``): every mode of one shape, on every rank of one group.

Modes as for the MLP (:mod:`overlap_layers.bench.mlp`):

* ``serial``  - OverlapAttention with K=1 (the plain TP layer);
* ``naive``   - a fixed K (``--naive-k``, capped by the batch: the layer tiles the batch), no planner;
* ``auto``    - ``num_tiles="auto"`` (planned and verified first where the layer can, as for the MLP);
* ``asynctp`` - not available for attention (no record);
* ``compute`` - the layer's math on the pre-gathered input without communication: fused qkv
  projection, the core, output projection; on CUDA the faster of two cores, timed once: plain
  PyTorch (:func:`~overlap_layers.layers.attention.core.attention`: permute, RoPE, SDPA) and the
  layer's own (rank-major rows through ``Heads``, the Triton heads kernel, SDPA; the same pick on
  every rank), so that the limit never credits the layer with a kernel the baseline lacks;
* ``comm``    - the layer's collectives alone: all-gather of x and reduce-scatter of the output
  with sequence parallelism, an all-reduce of the output without (twice for forward+backward).

Ulysses (always sequence parallel, every weight whole on every rank): ``naive`` K is capped by the
batch (by the local heads for batch 1); ``compute`` is the qkv projection of the local tokens
(every head), the core over the whole sequence for this rank's heads, and the output projection
of the local tokens, each on inputs of its own (no all-to-all between them); ``comm`` the layer's
two all-to-alls at K=1 (qkv, output; twice for forward+backward).

Every call passes ``position_embeddings`` (cos, sin of the global sequence, built once, as a
model shares them across layers). limit = max(compute, comm); each time is the median over
repeats of the max over ranks (:func:`~overlap_layers.bench.mlp.time_fn`).

:func:`run_modes` is the mode loop itself, for any bench object with the :class:`MLPBench`
interface (``layer_fn``, ``compute_fn``, ``comm_fn``, ``asynctp_fn``, ``host_overhead_us``,
``layer``, ``ws``, ``planning_ms``) and a dict of the shape's record fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..config import OverlapConfig
from ..layers.attention.core import Heads, attention, rope_cos_sin, sdpa
from ..layers.attention.layer import OverlapAttention
from .mlp import MLPBench
from .references import PlainAttention
from .runner import Profile, Progress, pass_fn, run_modes, time_fn

# Batches: every one runs (``--batch`` overrides); seq is the global sequence.
PRESETS = {
    "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, seq=64, batch=(2,)),
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, seq=8192, batch=(2, 4)),
    "llama3-70b": dict(hidden=8192, heads=64, kv_heads=8, head_dim=128, seq=8192, batch=(2, 4)),
}
ROPE_THETA = 500000.0  # Llama 3


@dataclass
class AttentionShape:
    preset: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    seq: int  # global sequence (split over ranks with sequence parallelism)
    sequence_parallel: bool = True
    layer: str = "attention"  # or "ulysses", "block"
    transport: str = "auto"  # the layers' config.transport
    cuda_graphs: bool = False  # time CUDA-graph replays; the layers' config.cuda_graphs
    graph_calls: bool = False  # the layers' config.graph_calls (no-grad calls replay graphs they capture)
    sm_carveout: Optional[int] = None  # the layers' config.sm_carveout

    def record_fields(self) -> dict:
        """The shape's fields of every record (the MLP's fields, plus heads, kv_heads, head_dim)."""
        return dict(layer=self.layer, preset=self.preset, hidden=self.hidden, ffn=None, heads=self.heads,
                    kv_heads=self.kv_heads, head_dim=self.head_dim, batch=self.batch, seq=self.seq,
                    tokens=self.batch * self.seq, sequence_parallel=self.sequence_parallel, activation=None,
                    cuda_graphs=self.cuda_graphs, graph_calls=self.graph_calls, config_sm_carveout=self.sm_carveout)


class AttentionBench(MLPBench):
    """Inputs of one attention shape and a callable per (mode, pass). ``comm_fn`` (and the
    all-gather of x for ``compute``) are the MLP bench's: the two layers run the same collectives
    on the same ``[batch, seq_local, hidden]`` activations."""

    def __init__(self, shape: AttentionShape, group, device, dtype, naive_k):
        self.s, self.group, self.device, self.dtype, self.naive_k = shape, group, device, dtype, naive_k
        ws = self.ws = dist.get_world_size(group)
        if shape.sequence_parallel and shape.seq % ws:
            raise ValueError(f"seq={shape.seq} must divide by the group size {ws} (sequence parallelism)")
        torch.manual_seed(0)
        self.layer = self._make_layer(shape, group, dtype, device)
        seq_local = shape.seq // ws if shape.sequence_parallel else shape.seq
        self.x = torch.randn(shape.batch, seq_local, shape.hidden, device=device, dtype=dtype)
        self.dy = torch.randn_like(self.x)
        self.tokens_local = shape.batch * seq_local
        pos = torch.arange(shape.seq, device=device)[None]
        self.cos_sin = tuple(t.to(dtype) for t in rope_cos_sin(pos, shape.head_dim, ROPE_THETA, dtype))
        self.planning_ms: Optional[float] = None

    def _make_layer(self, shape: AttentionShape, group, dtype, device):
        return OverlapAttention(shape.hidden, shape.heads, shape.kv_heads, group=group, head_dim=shape.head_dim,
                                sequence_parallel=shape.sequence_parallel, rope_theta=ROPE_THETA, num_tiles=1,
                                config=OverlapConfig(transport=shape.transport, cuda_graphs=shape.cuda_graphs,
                                                     graph_calls=shape.graph_calls, sm_carveout=shape.sm_carveout),
                                dtype=dtype, device=device)

    def cap_k(self, k: int) -> int:
        """The K the layer runs for a fixed ``k`` (it tiles the batch)."""
        return max(1, min(k, self.s.batch))

    # ------------------------------------------------------------ our layer
    def call_layer(self, x):
        return self.layer(x, position_embeddings=self.cos_sin)

    # ------------------------------------------------------------ references
    def reference_fn(self, backward: bool):
        """The plain reference (``bench/references.PlainAttention``: q, k, v, o ``nn.Linear``,
        rotate-half RoPE, causal SDPA) on this rank's input; None where the layer has no such
        counterpart (a head dim other than hidden / heads)."""
        sh = self.s
        if sh.head_dim * sh.heads != sh.hidden:
            return None
        ref = PlainAttention(sh.hidden, sh.heads, sh.kv_heads, group=self.group,
                             sequence_parallel=sh.sequence_parallel, dtype=self.dtype, device=self.device)
        x = self.x.detach().requires_grad_(backward)
        return pass_fn(lambda: ref(x), backward, [self.dy], [x, *ref.parameters()])

    def flops(self, backward: bool) -> float:
        """The pass's FLOPs on this rank: the q, k, v and o projections over the rows it multiplies
        and the causal core (half of ``4 * B * S^2 * heads * d``), three times that with backward."""
        sh, ws = self.s, self.ws
        B, s, H = self.x.shape
        S = s * (ws if sh.sequence_parallel else 1)
        nq, nkv, d = sh.heads // ws, max(sh.kv_heads // ws, 1), sh.head_dim
        proj = 2.0 * B * S * H * ((nq + 2 * nkv) * d + nq * d)
        core = 2.0 * B * S * S * nq * d
        return (proj + core) * (3 if backward else 1)

    def compute_fn(self, backward: bool):
        """Dense math of this rank's heads on the gathered sequence: qkv = x @ wqkv.T, SDPA
        (GQA, causal, RoPE), y = o @ wo.T; weights concatenated once, outside the timing."""
        sh, ws, L = self.s, self.ws, self.layer
        B, s, H = self.x.shape
        g = ws if sh.sequence_parallel else 1
        # rank-major gathered rows [g, B, s, H] -> whole sequences [B, g*s, H]
        xg = self._gathered().view(g, B, s, H).transpose(0, 1).reshape(B, g * s, H)
        xg = xg.detach().requires_grad_(backward)
        w_qkv = torch.cat([L.wq, L.wk, L.wv]).detach().requires_grad_(backward)
        w_o = L.wo.detach().requires_grad_(backward)
        nq, nkv, d = L.num_heads_local, L.num_kv_heads_local, L.head_dim
        dyg = torch.randn(B, g * s, H, device=self.device, dtype=self.dtype)
        cs = self.cos_sin

        def forward():
            q, k, v = torch.nn.functional.linear(xg, w_qkv).split([nq * d, nkv * d, nkv * d], dim=-1)
            o = attention(q.reshape(B, g * s, nq, d), k.reshape(B, g * s, nkv, d), v.reshape(B, g * s, nkv, d),
                          cos_sin=cs, q_norm=None, k_norm=None, causal=True, scale=None)
            return o.reshape(B, g * s, nq * d) @ w_o.t()

        xr = self._gathered().reshape(g * B * s, H).detach().requires_grad_(backward)  # rank-major rows
        dyr = dyg.view(B, g, s, H).transpose(0, 1).reshape(g * B * s, H)

        def forward_heads():  # the layer's own core (layers/attention/call.py, AttentionCall.core)
            q, k, v = Heads.apply(xr @ w_qkv.t(), (g, B, s, nq, nkv, d), cs, None)
            o = sdpa(q, k, v, causal=True, scale=None).transpose(1, 2)
            return o.unflatten(1, (g, s)).transpose(0, 1).reshape(g * B * s, nq * d) @ w_o.t()

        def runner(fwd, x, dy):
            def run():
                if backward:
                    fwd().backward(dy)
                    x.grad = w_qkv.grad = w_o.grad = None
                else:
                    with torch.no_grad():
                        fwd()
            return run
        plain, own = runner(forward, xg, dyg), runner(forward_heads, xr, dyr)
        if self.device.type != "cuda":
            return plain

        def ms(run):  # max over ranks: every rank picks the same core
            return time_fn(run, self.device, self.group, warmup=1, iters=1, repeats=5)
        return plain if ms(plain) <= ms(own) else own

    def asynctp_fn(self, backward: bool):
        return None  # no fused symmetric-memory attention op to compare with


class UlyssesBench(AttentionBench):
    """Inputs of one shape for UlyssesAttention; the reference modes follow its all-to-all layout."""

    def _make_layer(self, shape: AttentionShape, group, dtype, device):
        from ..layers.attention.ulysses import UlyssesAttention  # imported on use: the attention bench needs none of it
        if not shape.sequence_parallel:
            raise ValueError("ulysses is always sequence parallel (no --no-sp)")
        return UlyssesAttention(shape.hidden, shape.heads, shape.kv_heads, group=group, head_dim=shape.head_dim,
                                rope_theta=ROPE_THETA, num_tiles=1,
                                config=OverlapConfig(cuda_graphs=shape.cuda_graphs, graph_calls=shape.graph_calls),
                                dtype=dtype, device=device)

    def cap_k(self, k: int) -> int:
        """Batch tiles for batch > 1, head groups (of the local query heads) for batch 1."""
        units = self.s.batch if self.s.batch > 1 else self.s.heads // self.ws
        return max(1, min(k, units))

    def _route(self):
        L = self.layer
        return L._route_of(0, L.num_heads // L.world_size)  # the K=1 route: every local head

    def compute_fn(self, backward: bool):
        L, r = self.layer, self._route()
        B, s, H = self.x.shape
        S, d, dev, dt = s * self.ws, L.head_dim, self.device, self.dtype
        x = self.x.detach().requires_grad_(backward)
        w_send = torch.cat([L.wq, L.wk, L.wv]).index_select(
            0, torch.tensor(r.send_rows, device=dev)).detach().requires_grad_(backward)
        w_o = L.wo.detach().requires_grad_(backward)
        hk = r.hk if r.kv_index is None else r.nh  # KV heads as the core sees them (expanded if not plain GQA)
        q = torch.randn(B, S, r.nh, d, device=dev, dtype=dt, requires_grad=backward)
        k, v = (torch.randn(B, S, hk, d, device=dev, dtype=dt, requires_grad=backward) for _ in range(2))
        o_loc = torch.randn(B, s, L.num_heads * d, device=dev, dtype=dt, requires_grad=backward)
        cs = self.cos_sin
        grads = [torch.randn(B, s, w_send.shape[0], device=dev, dtype=dt), torch.randn_like(q), self.dy]

        def forward():
            return (torch.nn.functional.linear(x, w_send),
                    attention(q, k, v, cos_sin=cs, q_norm=None, k_norm=None, causal=True, scale=None),
                    o_loc @ w_o.t())

        return pass_fn(forward, backward, grads, (x, w_send, w_o, q, k, v, o_loc))

    def comm_fn(self, backward: bool):
        r, g, ws = self._route(), self.group, self.ws
        t = self.tokens_local
        send = self.x.new_empty((sum(r.in_splits), t))
        recv = self.x.new_empty((ws * r.recv_rows, t))
        o = self.x.new_empty((ws * r.nh * self.layer.head_dim, t))
        o_out = torch.empty_like(o)

        def run():
            for _ in range(2 if backward else 1):
                dist.all_to_all_single(recv, send, output_split_sizes=[r.recv_rows] * ws,
                                       input_split_sizes=list(r.in_splits), group=g)
                dist.all_to_all_single(o_out, o, group=g)
        return run


def bench_shape(shape: AttentionShape, group, device, dtype, modes, passes, naive_k, warmup, iters, repeats,
                progress: Optional[Progress] = None, profile: Optional[Profile] = None,
                warm_ms: float = 0.0, peak: Optional[float] = None) -> List[dict]:
    b = (UlyssesBench if shape.layer == "ulysses" else AttentionBench)(shape, group, device, dtype, naive_k)
    ks = list(dict.fromkeys(b.cap_k(k) for k in naive_k))
    return run_modes(b, shape.record_fields(), modes, passes, ks, warmup, iters, repeats, progress, profile, warm_ms,
                     peak)
