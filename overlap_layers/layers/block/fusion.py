"""Whether and how a block call runs its sublayers as one fused program ([Note: fused block] in
``layers/block/fused.py``): :class:`BlockFusion`, the block's component holding its own plans (fused
or in turn, per shape), and the fused call itself.

Reference: a call runs the fused program only where both sublayers have settled batch-tile plans
over NCCL that fuse (:func:`~.fused.fused_plans`) and the block's first-call verification kept it;
else the sublayers run in turn. Every decision comes from agreed values and the plan caches, so
every rank takes the same branch.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.nn.modules import module as _module_hooks

from ...planning.calls import apply_saving, in_backward_pass, saved_tensor_hooks_active
from ...planning.checks import X_ERRORS, x_error
from ...planning.plan_cache import PlanCache
from ...planning.trace import TraceJob
from ..mlp.layer import MLPCall, OverlapMLP
from .fused import BlockPlan, FusedBlock, FusedCall, fused_plans


class BlockFusion:
    """An ``OverlapTransformerBlock``'s fusion: ``plans`` (its :class:`PlanCache`, made at the first
    call that may fuse, with the attention's agreement ``plans_agreement``), ``plan`` (the last
    call's :class:`BlockPlan`, where it asked; None: sublayers in turn) and ``last_fusing`` (the
    agreement and the MLP's save of the last call that may fuse, for :attr:`verifying`)."""

    def __init__(self, block) -> None:
        self._block = weakref.ref(block)  # the block owns this
        self.plans: Optional[PlanCache] = None
        self.plans_agreement = None
        self.plan: Optional[BlockPlan] = None
        self.last_fusing = None

    @property
    def block(self):
        return self._block()

    @property
    def verifying(self) -> bool:
        """Whether the block still times the fused program against the sublayers in turn for the
        last call's shape (once the sublayers have settled)."""
        fusable = self.last_fusing and self.fusable(*self.last_fusing)  # sublayers settled since?
        return bool(fusable) and (self.plans is None or self.plans.settled(fusable[0]) is None)

    def may_fuse(self, x) -> bool:
        """Whether this call may run the fused program (then the block makes the attention's
        agreement itself and decides after it): sequence parallel with a dense MLP, both planned
        (no fixed K, nothing pinned) and verified, plain tensors outside ``torch.compile`` and
        autocast, no module hooks on the sublayers or global ones (FSDP2's unsharding: the fused
        program calls no sublayer as a module), not a checkpointed region or its recomputation ([Note: recompute])."""
        block = self.block
        attn, mlp = block.attention, block.mlp
        if not (block.sequence_parallel and isinstance(mlp, OverlapMLP) and attn.config.verify_first_calls):
            return False
        if any(m.num_tiles != "auto" or m.planner.pinned is not None or m._input_mesh is not None
               or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in (attn, mlp)):
            return False
        if (_module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks
                or _module_hooks._global_backward_hooks or _module_hooks._global_backward_pre_hooks):
            return False
        return not (torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type) or in_backward_pass()
                    or (torch.is_grad_enabled() and saved_tensor_hooks_active()))

    def plan_call(self, x, agreed, mlp_saves: bool):
        """``(BlockPlan, trial, the sublayers' plans at its K)`` of this call, or Nones where the block runs its
        sublayers in turn without asking ([Note: fused block] in ``layers/block/fused.py``). Decided from
        agreed values and the sublayers' plan caches, so equal on every rank."""
        fusable = self.fusable(agreed, mlp_saves)
        if fusable is None:
            return None, None, None
        key, both = fusable
        k = both[0].num_tiles
        plan, trial = self.cache().get(
            key, lambda key: BlockPlan(True, k, reason=f"the sublayers' batch tiles fused at K={k}"),
            lambda p: [p, BlockPlan(False, reason=p.reason)], x.device)
        self.plan = plan
        return plan, trial, both

    def cache(self) -> PlanCache:
        """``plans``, made anew for new sublayers (their agreement: the attention's)."""
        attn = self.block.attention
        agreement = attn.planner.agreement
        if self.plans is None or self.plans_agreement is not agreement:
            self.plans_agreement = agreement
            self.plans = PlanCache(agreement, margin=attn.config.margin)
        return self.plans

    def fusable(self, agreed, mlp_saves: bool):
        """``(the block's plan key, the sublayers' plans for the fused program)`` where the
        sublayers have settled plans that fuse for this call, else None."""
        attn, mlp = self.block.attention, self.block.mlp
        shape, dtype, save, fixed = agreed
        if fixed is not None or attn.planner.capturing or mlp_saves != save:  # else: one sublayer trains, one not
            return None
        plans = (attn.settled_plan(shape[:2], dtype, save), mlp.settled_plan(shape[:2], dtype, save))
        both = None if None in plans else fused_plans(*plans, tile_rows=shape[0] // plans[0].num_tiles * shape[1])
        return None if both is None else ((shape, dtype, save, both[0].digest(), both[1].digest()), both)

    def run(self, x, n1, save: bool, plans, position_ids, position_embeddings) -> torch.Tensor:
        """One call of :class:`~overlap_layers.layers.block.fused.FusedBlock` with the sublayers'
        ``plans`` (:func:`~overlap_layers.layers.block.fused.fused_plans`)."""
        attn, mlp, norm = self.block.attention, self.block.mlp, self.block.mlp_norm
        probe = n1.detach().requires_grad_(save)  # the MLP's agreement, as its own call would make it
        mlp.planner.agree(probe, x_error(probe, mlp.hidden_size, mlp.w_in), X_ERRORS, "x")
        _, (w_in, b_in, w_out, b_out) = mlp._call_tensors(n1, ("w_in", "b_in", "w_out", "b_out"))
        B, s, H = n1.shape
        pa, pm = plans
        # the MLP's streams (two, faster than one here: [Note: fused block]); the attention's planned plans run on one
        streams = attn.planner.streams.get(n1.device, min(pa.num_tiles, pm.num_streams))
        _, ca, w_qkv, b_qkv, wo, bo = attn._prepare(n1, pa, save, streams, position_ids, position_embeddings)
        cm = MLPCall(group=mlp.group, activation=mlp.activation, sequence_parallel=True, plan=pm, save=save,
                     streams=streams, launch_log=mlp.launch_log)
        call = FusedCall(ca, cm, norm.kind, norm.eps)
        asked = [p for p in (attn.planner.take_trace_request(), mlp.planner.take_trace_request()) if p]
        if asked:  # rank-local, like the request: the fused program's ops (a., m0., ...) are recorded
            call.trace = TraceJob(asked, n1.device)
        weights = (w_qkv, b_qkv, wo, ca.q_norm, ca.k_norm, bo, *norm.local_params(), w_in, b_in,
                   w_out, b_out)
        y = apply_saving(FusedBlock, save, x.reshape(B * s, H), n1.reshape(B * s, H).contiguous(), *weights, call)
        if call.trace is not None:
            call.trace.write()  # the forward's; the backward writes again with both passes
        return y.view(B, s, H)
