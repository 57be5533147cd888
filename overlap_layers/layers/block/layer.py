"""A pre-norm transformer decoder block built from the overlap layers.

Reference (what :class:`OverlapTransformerBlock` must equal, up to rounding), on the dense
sequence ``x [batch, seq, hidden]``::

    h = x + attention(attn_norm(x), position_ids / position_embeddings)   # causal, RoPE
    y = h + mlp(mlp_norm(h))          # swiglu MLP, or the MoE of each token (top-k router)

with ``attn_norm`` / ``mlp_norm`` RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``) or LayerNorm.
With ``sequence_parallel=True`` each rank holds its ``seq/ws`` slice of ``x`` and of ``y``
(rank r positions ``r*seq/ws ..``); otherwise every rank holds all of ``x`` and all of ``y``.

The sublayers are the library's layers on one group: ``attention`` an :class:`OverlapAttention`,
``mlp`` an :class:`OverlapMLP`, or an :class:`OverlapMoE` (expert parallel over the same group)
when ``moe`` is given. The MoE computes each token once: under sequence parallelism every rank's
slice is its own tokens; without it the replicated tokens are split across the group before the
dispatch and gathered after (:mod:`overlap_layers.layers.moe.tokens`).

Each sublayer plans and overlaps its own collectives (its tiles, its K, or its rank chunks).
Where both run batch tiles over NCCL (sequence parallel, dense MLP), the block also times the two
as one tiled program (``layers/block/fused.py``, [Note: fused block]; which calls run it:
``layers/block/fusion.py``): the attention's tiles, each with
its share of the MLP's tiles, so the attention's last reduce-scatter runs under the MLP's first
tiles and, backward, the MLP's last dx reduce-scatter under the attention's first; it keeps that
program where it wins by more than ``config.margin``. With rank chunks (sequence parallel, copy
engine) each sublayer starts and ends on its own rows, which hides most of that fill and drain
inside the sublayer.

Gradients: the norms' weights (and LayerNorm biases) are replicated. Under sequence parallelism
each rank's work covers its own positions only, a tensor-parallel partial; the MoE router and
shared expert, used on this rank's tokens only, are partials in either mode. Both are summed over
the group inside backward ([Note: gradients complete in backward] in ``layers/common/grads.py``),
so every gradient is complete when backward returns.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...config import OverlapConfig
from ...planning.checks import check_dtype, finite_number, x_error
from ...planning.copying import copy_module
from ...planning.dtensor import axis_mesh, dtensor_forward, local
from ...runtime import resolve_group
from ..attention.common import call_with_positions
from ..attention.layer import OverlapAttention
from ..common.grads import sum_grad_over_group, sum_grads_in_backward
from ..mlp.layer import OverlapMLP
from ..moe.layer import OverlapMoE
from ..moe.tokens import gather_tokens, split_tokens
from .fused import BlockPlan, OnBackward
from .fusion import BlockFusion

NORMS = ("rmsnorm", "layernorm")
#: The OverlapMoE keywords a block's ``moe`` dict may hold (sizes, group and planning come from the block).
MOE_KEYS = ("num_experts", "top_k", "activation", "normalize_topk", "capacity_factor", "aux_loss_coef",
            "shared_expert_ffn", "routing")


class BlockNorm(nn.Module):
    """RMSNorm or LayerNorm over the last dim, as ``torch.nn.functional.rms_norm`` /
    ``layer_norm`` compute them; ``weight`` (and ``bias`` for LayerNorm) start at 1 (and 0). A
    DTensor weight (``mesh=``) takes part through its local tensor."""

    def __init__(self, kind: str, hidden_size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.kind, self.hidden_size, self.eps = kind, hidden_size, float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if kind == "layernorm" \
            else None
        self.grad_group = None  # under sequence parallelism, the group the gradients are summed over

    def local_params(self) -> tuple:
        """``(weight, bias)`` as the norm computes with them: local tensors, through an identity
        that sums their gradients over ``grad_group`` inside backward where it is set ([Note:
        gradients complete in backward] in ``layers/common/grads.py``)."""
        g = self.grad_group
        reduce = None if g is None else partial(sum_grad_over_group, group=g)
        return local(self.weight, reduce=reduce), local(self.bias, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.local_params()
        if self.kind == "rmsnorm":
            return F.rms_norm(x, (self.hidden_size,), w, self.eps)
        return F.layer_norm(x, (self.hidden_size,), w, b, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.hidden_size}, eps={self.eps}"


def _check_norm(norm, norm_eps) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r}; valid: {NORMS}")
    if not finite_number(norm_eps):
        raise ValueError(f"norm_eps={norm_eps!r}; must be a positive finite number")


def _is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


class OverlapTransformerBlock(nn.Module):
    """Drop-in pre-norm decoder block; equals the module docstring's reference.

    ``forward(x, position_ids=None, position_embeddings=None, attention_mask=None)`` (a mask only
    if it equals the causal one, as :class:`OverlapAttention` takes it): ``x [batch, seq/ws, hidden]``
    with ``sequence_parallel`` (this rank's slice of the positions), else ``[batch, seq, hidden]``
    on every rank; ``position_ids [batch or 1, seq]`` of the global sequence or HF's
    ``position_embeddings`` ``(cos, sin)``, as :class:`OverlapAttention` takes them. Returns
    ``y`` shaped like ``x`` (a DTensor ``x``, with ``mesh=``: Shard(1) under sequence parallelism,
    else Replicate, gives a DTensor ``y`` of the same placement). ``moe``: None for the swiglu MLP
    of width ``ffn_hidden_size``, or a dict of :class:`OverlapMoE` keywords (``num_experts`` and ``top_k`` required; see
    ``MOE_KEYS``), whose experts then have width ``ffn_hidden_size``. ``num_tiles`` and
    ``config`` apply to every sublayer. Gradients are complete when backward returns.
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, *, num_kv_heads: Optional[int] = None,
                 moe: Optional[dict] = None, norm: str = "rmsnorm", norm_eps: float = 1e-5, group=None, mesh=None,
                 axis=None, sequence_parallel: bool = True, rope_theta: float = 10000.0, num_tiles=None,
                 config: Optional[OverlapConfig] = None, dtype=None, device=None):
        super().__init__()
        _check_norm(norm, norm_eps)
        check_dtype(dtype)  # before the norms' parameters are made
        if moe is not None:
            if not isinstance(moe, dict):
                raise ValueError(f"moe={moe!r}; must be None (a dense MLP) or a dict of OverlapMoE keywords")
            bad = sorted(set(moe) - set(MOE_KEYS))
            missing = [k for k in ("num_experts", "top_k") if k not in moe]
            if bad or missing:
                raise ValueError(f"moe: unknown keys {bad}, missing keys {missing}; valid keys: {MOE_KEYS} "
                                 f"(num_experts and top_k required)")
        self.group = resolve_group(group, mesh, axis)
        self.sequence_parallel = bool(sequence_parallel)
        kw = dict(group=None if mesh is not None else self.group, mesh=mesh, axis=axis, num_tiles=num_tiles,
                  config=config, dtype=dtype, device=device)
        self.attn_norm = BlockNorm(norm, hidden_size, norm_eps, dtype, device)
        self.attention = OverlapAttention(hidden_size, num_heads, num_kv_heads, sequence_parallel=sequence_parallel,
                                          rope_theta=rope_theta, **kw)
        self.mlp_norm = BlockNorm(norm, hidden_size, norm_eps, dtype, device)
        if moe is None:
            self.mlp = OverlapMLP(hidden_size, ffn_hidden_size, sequence_parallel=sequence_parallel,
                                  activation="swiglu", **kw)
        else:
            moe = dict(moe)
            self.mlp = OverlapMoE(hidden_size, ffn_hidden_size, moe.pop("num_experts"), moe.pop("top_k"), **moe, **kw)
        if mesh is not None:
            replicate_norms(self, mesh, axis)
        self._sum_grads_in_backward()
        self._init_fusion()
        self._init_config_context()

    @classmethod
    def from_layers(cls, attention: OverlapAttention, mlp, *, norm: str = "rmsnorm", norm_eps: float = 1e-5,
                    attn_norm_weight: Optional[torch.Tensor] = None, mlp_norm_weight: Optional[torch.Tensor] = None,
                    attn_norm_bias: Optional[torch.Tensor] = None,
                    mlp_norm_bias: Optional[torch.Tensor] = None) -> "OverlapTransformerBlock":
        """A block around existing sublayers (no new weights are drawn): ``attention`` an
        :class:`OverlapAttention`, ``mlp`` an :class:`OverlapMLP` or :class:`OverlapMoE` on the same
        group, with the same sequence parallelism (an MoE fits either); the norms from the given
        weights (``[hidden]``; default ones and zeros), as Replicate DTensors when the sublayers
        hold DTensors (``mesh=``). Used by ``swap(..., block=True)``."""
        if not isinstance(attention, OverlapAttention) or not isinstance(mlp, (OverlapMLP, OverlapMoE)):
            raise ValueError(f"attention={type(attention).__name__}, mlp={type(mlp).__name__}: need an "
                             f"OverlapAttention and an OverlapMLP or OverlapMoE")
        _check_norm(norm, norm_eps)
        if mlp.group is not attention.group or mlp.hidden_size != attention.hidden_size or \
                getattr(mlp, "sequence_parallel", attention.sequence_parallel) != attention.sequence_parallel:
            raise ValueError("attention and mlp must share the group, hidden_size and sequence_parallel")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.group, self.sequence_parallel = attention.group, attention.sequence_parallel
        w = attention.wq
        kw = dict(dtype=w.dtype, device=w.device)
        self.attn_norm = BlockNorm(norm, attention.hidden_size, norm_eps, **kw)
        self.attention = attention
        self.mlp_norm = BlockNorm(norm, attention.hidden_size, norm_eps, **kw)
        self.mlp = mlp
        with torch.no_grad():
            for n, weight, bias in ((self.attn_norm, attn_norm_weight, attn_norm_bias),
                                    (self.mlp_norm, mlp_norm_weight, mlp_norm_bias)):
                for p, t in ((n.weight, weight), (n.bias, bias)):
                    if t is not None:
                        if p is None or tuple(t.shape) != tuple(p.shape):
                            raise ValueError(f"norm weight/bias of shape {tuple(t.shape)}: must be "
                                             f"[{attention.hidden_size}] (a bias only with norm='layernorm')")
                        p.copy_(t)
        if attention._input_mesh is not None:  # DTensor sublayers (mesh=): the norms too
            replicate_norms(self, attention._input_mesh, None)
        self._sum_grads_in_backward()
        self._init_fusion()
        self._init_config_context()
        return self

    def _init_config_context(self) -> None:
        """What the ranks' blocks must share beyond their sublayers (the norms, the MLP's kind): it
        rides in the attention's config table ([Note: layer config] in ``planning/cross_checks.py``),
        whose call comes first."""
        self._config_context = tuple((f"block.{name}", f"{n.kind} eps={n.eps}")
                                     for name, n in (("attn_norm", self.attn_norm), ("mlp_norm", self.mlp_norm))) + \
            (("block.mlp", type(self.mlp).__name__),)

    def _sum_grads_in_backward(self) -> None:
        """The block's tensor-parallel partials, summed over the group inside backward ([Note:
        gradients complete in backward]): the norms under sequence parallelism (the rank's
        positions), and an MoE's router and shared expert in either mode (the rank's tokens of
        sequences every rank of the group holds)."""
        if self.sequence_parallel and dist.get_world_size(self.group) > 1:
            for norm in (self.attn_norm, self.mlp_norm):
                if norm.grad_group is not self.group:  # set once: no mutation per call
                    norm.grad_group = self.group
        if isinstance(self.mlp, OverlapMoE):
            sum_grads_in_backward(self.mlp, self.mlp.replicated_params)

    def __deepcopy__(self, memo: dict):
        """``copy.deepcopy``: the sublayers' copies ([Note: copying a layer] in ``planning/copying.py``)
        in a block that plans its fusion afresh."""
        new = copy_module(self, memo)
        new._init_fusion()
        new._init_config_context()
        return new

    def _init_fusion(self) -> None:
        """The block's own plans: fused or in turn, per shape ([Note: fused block])."""
        self._fusion = BlockFusion(self)  # layers/block/fusion.py

    @property
    def plan(self) -> Optional[BlockPlan]:
        """The last call's plan, where it asked (None: its sublayers ran in turn with their own)."""
        return self._fusion.plan

    @property
    def hidden_size(self) -> int:
        return self.attention.hidden_size

    @property
    def _input_mesh(self):
        """With ``mesh=``: the mesh axis a DTensor ``x`` must be on (the sublayers')."""
        return self.attention._input_mesh

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None, position_embeddings=None,
                attention_mask=None) -> torch.Tensor:
        if _is_dtensor(x):  # Shard(1) with sequence parallelism, else Replicate: [Note: DTensor inputs]
            return dtensor_forward(self, self._forward, x, position_ids, position_embeddings, attention_mask)
        return self._forward(x, position_ids, position_embeddings, attention_mask)

    def _forward(self, x, position_ids, position_embeddings, attention_mask) -> torch.Tensor:
        self._sum_grads_in_backward()  # again: a sublayer may have been replaced since
        attn = self.attention
        if attn._config_context is not self._config_context:  # likewise
            attn._config_context = self._config_context
        # the norm runs on an input the attention's agreement accepts, or one of another floating
        # dtype (which it may cast); any other goes to that agreement as it is, which raises on every
        # rank, where the norm would raise on this rank alone and the others wait in the agreement
        err = x_error(x, self.hidden_size, attn.wq)
        n1 = self.attn_norm(x) if err == 0 or err == 3 and x.is_floating_point() else x
        fusion = self._fusion
        fusion.plan, fusion.last_fusing = None, None
        # a call without tokens runs the sublayers in turn (each gives the dense result of none); the
        # attention's agreement comes first on both paths, so ranks whose shapes differ all raise there
        if not isinstance(x, torch.Tensor) or x.numel() == 0 or not fusion.may_fuse(x):
            h = x + attn(n1, position_ids=position_ids, position_embeddings=position_embeddings,
                         attention_mask=attention_mask)
            return h + self._mlp(self.mlp_norm(h))
        agreed = attn._agree_input(n1, position_ids, position_embeddings, attention_mask)
        mlp_saves = self._mlp_saves(agreed.save)
        plan, trial, subplans = fusion.plan_call(x, agreed, mlp_saves)
        timed_bwd = trial is not None and torch.is_grad_enabled() and n1.requires_grad
        if timed_bwd:  # the backward's time: from y's gradient to n1's (attn_norm's backward left out)
            trial.bwd = trial.fwd.sibling()
            n1 = OnBackward.apply(n1, trial.bwd.stop)
        if trial is not None:
            trial.fwd.start()
        if plan is not None and plan.fused:
            y = fusion.run(x, n1, agreed.save, subplans, position_ids, position_embeddings)
        else:
            h = x + call_with_positions(attn, n1, agreed, position_ids, position_embeddings)
            y = h + self._mlp(self.mlp_norm(h))
        if trial is not None:
            trial.fwd.stop()
        fusion.last_fusing = (agreed, mlp_saves)
        return OnBackward.apply(y, trial.bwd.start) if timed_bwd else y

    @property
    def verifying(self) -> bool:
        """Whether the next call of the last call's shape may still run another plan: a sublayer
        verifies its plan, or the block times the fused program against the sublayers in turn."""
        return self.attention.verifying or self.mlp.verifying or self._fusion.verifying

    def _mlp_saves(self, attention_saves: bool) -> bool:
        """Whether the MLP's call saves for backward (as its own agreement would find): its input
        ``mlp_norm(h)`` needs a gradient where the attention's call saves (its input or weights
        need one) or the norm's or the MLP's weights do."""
        return attention_saves or torch.is_grad_enabled() and any(
            p.requires_grad for m in (self.mlp_norm, self.mlp) for p in m.parameters())

    def _mlp(self, z: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.mlp, OverlapMoE) or self.sequence_parallel:
            return self.mlp(z)
        B, S, H = z.shape  # replicated tokens: each rank routes its share once
        y = self.mlp(split_tokens(z.reshape(B * S, H), self.group).unsqueeze(0))
        return gather_tokens(y.squeeze(0), self.group, B * S).view(B, S, H)

    def to_dense(self) -> dict:
        """``{"attn_norm": {weight, bias}, "attention": ..., "mlp_norm": ..., "mlp": ...}``: the
        sublayers' ``to_dense()`` and the norms' full tensors. A collective."""
        def norm(n):
            return {k: None if p is None else _full(p).detach().clone() for k, p in (("weight", n.weight),
                                                                                     ("bias", n.bias))}
        return {"attn_norm": norm(self.attn_norm), "attention": self.attention.to_dense(),
                "mlp_norm": norm(self.mlp_norm), "mlp": self.mlp.to_dense()}

    def _dtensor_input_placements(self) -> tuple:
        """[Note: DTensor inputs] (``planning/dtensor.py``): the sequence shard with sequence
        parallelism, else replicated."""
        return (Shard(1),) if self.sequence_parallel else (Replicate(),)

    def extra_repr(self) -> str:
        return f"sequence_parallel={self.sequence_parallel}, moe={isinstance(self.mlp, OverlapMoE)}"


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def replicate_norms(block: OverlapTransformerBlock, mesh, axis) -> None:
    """With ``mesh=``: the norms' parameters as Replicate DTensors on the mesh axis, like every
    replicated parameter of the sublayers."""
    m = axis_mesh(mesh, axis)
    for norm in (block.attn_norm, block.mlp_norm):
        for name in ("weight", "bias"):
            p = getattr(norm, name)
            if p is not None:
                setattr(norm, name, nn.Parameter(DTensor.from_local(p.data, m, [Replicate()], run_check=False)))
