"""Plain PyTorch references of the layers: the modules a user would run instead of
:class:`~overlap_layers.OverlapMLP`, :class:`~overlap_layers.OverlapAttention` and
:class:`~overlap_layers.OverlapMoE`, written from torch alone (``nn.Linear``,
``F.scaled_dot_product_attention``, ``torch._grouped_mm``, ``torch.distributed``'s collectives),
nothing of this library. The host-overhead benchmark (``bench/host.py``) times them against the
layers.

What each must equal (``tests/test_bench_host.py`` checks forward and gradients against a dense
computation on one process), rank r of a group of ws ranks holding its shard:

* :class:`PlainMLP`: ``y = (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T`` on the whole
  sequence, no bias. ``fc1`` holds the rank's ``F/ws`` gate rows then its ``F/ws`` up rows,
  ``fc2`` the matching ``F/ws`` columns of ``w_down``. With sequence parallelism the input is the
  rank's ``[b, s/ws, H]`` slice of the sequence: all-gathered along the sequence before ``fc1``,
  the output reduce-scattered after ``fc2``; without it the input is the replicated ``[b, s, H]``
  and the output all-reduced.
* :class:`PlainAttention`: ``q, k, v = x @ wq.T, x @ wk.T, x @ wv.T`` in heads of
  ``d = H / heads``, RoPE on q and k (rotate-half, ``theta``, positions ``0 .. S-1`` of the whole
  sequence, angles in float32 or the input's dtype where wider), causal softmax attention with
  grouped KV heads (query head h reads KV head ``h // (heads / kv_heads)``), ``y = o @ wo.T``.
  Rank r holds query heads ``r*heads/ws ..`` and KV heads ``r*kv_heads/ws ..`` (rows of ``q``,
  ``k``, ``v``; columns of ``o``); the sequence layout and collectives are the MLP's.
* :class:`PlainMoE`: on each rank's own tokens ``x [T, H]``: ``p = softmax(x @ router.T)`` in
  float32 (or the input's dtype where wider), its top-k per token, the k weights divided by their
  sum, and ``y_t = sum_j w_tj * expert_{e_tj}(x_t)`` with ``expert_e(x) = (silu(g) * u) @
  w_down[e]``, ``g, u = x @ w_gate_up[e]`` (gate columns, then up). Rank r holds experts
  ``r*E/ws ..``; the router is replicated, and its gradient holds this rank's tokens' share (the
  data-parallel reduction sums it), as an expert's holds every rank's tokens routed to it.

The collectives run inside small autograd Functions in Megatron's manner (forward one collective,
backward its conjugate); at world size 1 none is issued.
"""
from __future__ import annotations

import enum
import math
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# torch >= 2.13 names these *_single and deprecates the *_tensor names; 2.11 has only the latter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# scaled_dot_product_attention's grouped KV heads (torch >= 2.5); without them the KV heads are expanded.
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def world_size(group=None) -> int:
    """The size of ``group`` (None: the default group), 1 without a process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


# ------------------------------------------------------------------ sequence-parallel regions
def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, s, H]`` on each rank -> ``[b, ws*s, H]``, rank r's positions at ``r*s ..``."""
    xs = x.transpose(0, 1).contiguous()  # all_gather concatenates along dim 0: the sequence leading
    out = xs.new_empty((world_size(group) * xs.shape[0], *xs.shape[1:]))
    _all_gather(out, xs, group=group)
    return out.transpose(0, 1)


def _scatter_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """``[b, S, H]`` partial sums -> rank r's ``[b, S/ws, H]`` slice of their sum over the group."""
    ys = y.transpose(0, 1).contiguous()
    out = ys.new_empty((ys.shape[0] // world_size(group), *ys.shape[1:]))
    _reduce_scatter(out, ys, group=group)
    return out.transpose(0, 1)


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    out = t.contiguous()
    dist.all_reduce(out, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather along the sequence; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _scatter_sequence(dy, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence; backward: all-gather."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _scatter_sequence(y, group)

    @staticmethod
    def backward(ctx, dx):
        return _gather_sequence(dx, ctx.group), None


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity (the input is replicated); backward: all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _sum_over(dy, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: all-reduce of the partial outputs; backward: identity."""

    @staticmethod
    def forward(ctx, y, group):
        return _sum_over(y, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _TensorParallel(nn.Module):
    """The input and output of a column-parallel-in, row-parallel-out pair of projections: with
    sequence parallelism gather the sequence in and reduce-scatter it out, else copy in and
    all-reduce out; nothing at world size 1."""

    def __init__(self, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel, self.world_size = group, bool(sequence_parallel), world_size(group)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        return (_GatherSequence if self.sequence_parallel else _CopyToGroup).apply(x, self.group)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return y
        return (_ScatterSequence if self.sequence_parallel else _ReduceFromGroup).apply(y, self.group)


def _local(n: int, ws: int, what: str) -> int:
    if n % ws:
        raise ValueError(f"{what}={n} must be divisible by the group size {ws}")
    return n // ws


# ------------------------------------------------------------------ MLP
class PlainMLP(_TensorParallel):
    """The tensor-parallel SwiGLU MLP (module docstring): ``fc1`` ``nn.Linear(H, 2*F/ws)`` (gate
    rows, then up rows), ``fc2`` ``nn.Linear(F/ws, H)``, no biases."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, group=None, sequence_parallel: bool = True,
                 dtype=None, device=None):
        super().__init__(group, sequence_parallel)
        f_local = _local(ffn_hidden_size, self.world_size, "ffn_hidden_size")
        kw = dict(bias=False, dtype=dtype, device=device)
        self.fc1 = nn.Linear(hidden_size, 2 * f_local, **kw)
        self.fc2 = nn.Linear(f_local, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(self.enter(x)).chunk(2, dim=-1)
        return self.leave(self.fc2(F.silu(gate) * up))


# ------------------------------------------------------------------ attention
def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class PlainAttention(_TensorParallel):
    """Tensor-parallel causal attention with grouped KV heads and RoPE (module docstring):
    ``q`` ``nn.Linear(H, heads/ws*d)``, ``k``, ``v`` ``nn.Linear(H, kv_heads/ws*d)``, ``o``
    ``nn.Linear(heads/ws*d, H)``, no biases; the core is ``F.scaled_dot_product_attention``. The
    RoPE tables of the last sequence length are kept."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None, *, group=None,
                 sequence_parallel: bool = True, rope_theta: float = 10000.0, dtype=None, device=None):
        super().__init__(group, sequence_parallel)
        num_kv_heads = num_kv_heads or num_heads
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}: "
                             f"heads must divide hidden_size and kv heads must divide heads")
        self.head_dim = d = hidden_size // num_heads
        self.heads = _local(num_heads, self.world_size, "num_heads")
        self.kv_heads = _local(num_kv_heads, self.world_size, "num_kv_heads")
        self.rope_theta = float(rope_theta)
        kw = dict(bias=False, dtype=dtype, device=device)
        self.q = nn.Linear(hidden_size, self.heads * d, **kw)
        self.k = nn.Linear(hidden_size, self.kv_heads * d, **kw)
        self.v = nn.Linear(hidden_size, self.kv_heads * d, **kw)
        self.o = nn.Linear(self.heads * d, hidden_size, **kw)
        self._rope: Optional[tuple] = None  # (seq, device, dtype, cos, sin)

    def _cos_sin(self, seq: int, like: torch.Tensor):
        if self._rope is None or self._rope[:3] != (seq, like.device, like.dtype):
            d, wide = self.head_dim, torch.promote_types(like.dtype, torch.float32)
            inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, device=like.device, dtype=wide) / d)
            angles = torch.outer(torch.arange(seq, device=like.device, dtype=wide), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            self._rope = (seq, like.device, like.dtype, angles.cos().to(like.dtype), angles.sin().to(like.dtype))
        return self._rope[3:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        b, seq, _ = x.shape
        d = self.head_dim
        q = self.q(x).view(b, seq, self.heads, d).transpose(1, 2)
        k = self.k(x).view(b, seq, self.kv_heads, d).transpose(1, 2)
        v = self.v(x).view(b, seq, self.kv_heads, d).transpose(1, 2)
        cos, sin = self._cos_sin(seq, q)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if _SDPA_GQA:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        else:
            group = self.heads // self.kv_heads
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                               is_causal=True)
        return self.leave(self.o(o.transpose(1, 2).reshape(b, seq, self.heads * d)))


# ------------------------------------------------------------------ MoE
class ExpertImpl(enum.Enum):
    """How :class:`PlainMoE` runs its experts: one ``torch._grouped_mm`` per projection, or a
    loop of ``torch.mm`` per expert (where grouped GEMMs are missing, or refuse the dtype or the
    strides: on CPU they take float32 / bfloat16 / float16 with 16-byte aligned strides)."""
    GROUPED_MM = "grouped_mm"
    LOOP = "loop"


def _grouped_experts(rows, w_gate_up, w_down, counts):
    offs = counts.cumsum(0).to(torch.int32)  # on the device: no host sync
    gate, up = torch._grouped_mm(rows, w_gate_up, offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w_down, offs=offs)


def _looped_experts(rows, w_gate_up, w_down, counts):
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):  # the counts read on the host
        gate, up = torch.mm(rows[start:start + n], w_gate_up[e]).chunk(2, dim=-1)
        outs.append(torch.mm(F.silu(gate) * up, w_down[e]))
        start += n
    return torch.cat(outs) if outs else rows.new_empty((0, w_down.shape[-1]))


def _grouped_mm_runs(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on weights of these shapes,
    dtype and device (rows of their strides; an empty expert included)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    n_experts, hidden = w_gate_up.shape[:2]
    try:
        rows = torch.randn(2 * n_experts, hidden, dtype=w_gate_up.dtype, device=w_gate_up.device,
                           requires_grad=True)
        wi, wo = (w.detach().clone().requires_grad_() for w in (w_gate_up, w_down))
        counts = torch.full((n_experts,), 2, dtype=torch.long, device=rows.device)
        counts[0] = 0
        counts[-1] += 2
        out = _grouped_experts(rows, wi, wo, counts)
        out.backward(torch.randn_like(out))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class _AllToAll(torch.autograd.Function):
    """Forward: ``all_to_all_single`` of rows with split sizes (send ``in_splits[r]`` rows to rank
    r, receive ``out_splits[r]`` from it); backward: the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, out_splits: List[int], in_splits: List[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        out_splits, in_splits = ctx.splits
        dx = dy.new_empty((sum(in_splits), *dy.shape[1:]))
        dist.all_to_all_single(dx, dy.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


class PlainMoE(nn.Module):
    """The grouped-GEMM MoE, expert parallel over ``group`` (module docstring): ``router``
    ``nn.Linear(H, E)`` (replicated), ``w_gate_up [E/ws, H, 2F]`` (gate columns, then up),
    ``w_down [E/ws, F, H]``.

    A call routes its tokens (softmax, top-k, renormalised weights), sorts the assignments by
    expert (a stable argsort) and gathers their rows. At world size 1 the experts run at once,
    their offsets a device cumsum of the per-expert counts (a scatter-add: ``bincount`` would read
    its maximum on the host), with no host sync. Above it the counts are exchanged with
    ``all_to_all_single`` and read on the host, as a plain expert-parallel MoE does, the rows are
    exchanged by an uneven ``all_to_all_single``, regrouped by local expert, run, and sent back
    the same way. Each row's output is weighted and summed into its token with ``index_add_``.

    The experts run as ``torch._grouped_mm`` where it runs forward and backward for this
    module's dtype, device and shapes (checked once per dtype and device at the first call), else
    as a loop of ``torch.mm`` per expert; ``expert_impl`` says which ran last (an
    :class:`ExpertImpl`, None before the first call).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *, group=None,
                 dtype=None, device=None):
        super().__init__()
        self.group, self.world_size = group, world_size(group)
        self.num_experts, self.top_k = num_experts, top_k
        self.local_experts = _local(num_experts, self.world_size, "num_experts")
        kw = dict(dtype=dtype, device=device)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **kw)
        self.w_gate_up = nn.Parameter(torch.empty(self.local_experts, hidden_size, 2 * ffn_hidden_size, **kw))
        self.w_down = nn.Parameter(torch.empty(self.local_experts, ffn_hidden_size, hidden_size, **kw))
        nn.init.uniform_(self.w_gate_up, -1 / math.sqrt(hidden_size), 1 / math.sqrt(hidden_size))
        nn.init.uniform_(self.w_down, -1 / math.sqrt(ffn_hidden_size), 1 / math.sqrt(ffn_hidden_size))
        self._impl: Optional[tuple] = None  # ((device, dtype), ExpertImpl) of the last check

    @property
    def expert_impl(self) -> Optional[ExpertImpl]:
        return None if self._impl is None else self._impl[1]

    def _experts_fn(self):
        key = (self.w_gate_up.device, self.w_gate_up.dtype)
        if self._impl is None or self._impl[0] != key:
            runs = _grouped_mm_runs(self.w_gate_up, self.w_down)
            self._impl = (key, ExpertImpl.GROUPED_MM if runs else ExpertImpl.LOOP)
        return _grouped_experts if self._impl[1] is ExpertImpl.GROUPED_MM else _looped_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self._experts_fn()
        x2 = x.reshape(-1, x.shape[-1])
        logits = self.router(x2)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        rows = x2[token]
        if self.world_size == 1:
            out = experts(rows, self.w_gate_up, self.w_down, counts)
        else:
            out = self._exchanged(rows, counts, experts)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x2).index_add_(0, token, out).view_as(x)

    def _exchanged(self, rows, counts, experts):
        """The experts on ``rows`` (sorted by global expert, ``counts`` per expert) across the
        group: dispatch, local experts, combine back into the same order."""
        ws, el, group = self.world_size, self.local_experts, self.group
        got = torch.empty_like(counts)  # [source rank, local expert]: rows each rank sends here
        dist.all_to_all_single(got, counts, group=group)
        send = counts.view(ws, el).sum(dim=1).tolist()
        recv_by = got.view(ws, el)
        recv = recv_by.sum(dim=1).tolist()
        received = _AllToAll.apply(rows, recv, send, group)  # blocks of (source rank, local expert)
        expert_of = torch.arange(el, device=rows.device).repeat(ws).repeat_interleave(got, output_size=sum(recv))
        by_expert = expert_of.argsort(stable=True)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=rows.device)
        out = experts(received[by_expert], self.w_gate_up, self.w_down, recv_by.sum(dim=0))
        return _AllToAll.apply(out[back], send, recv, group)
