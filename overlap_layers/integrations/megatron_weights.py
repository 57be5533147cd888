"""The dense weights of megatron-core modules, gathered over Megatron's tensor-parallel group
(:func:`megatron_dense`), and Megatron's tensor-parallel attributes carried onto the layers built
from them.

[Note: Megatron weights]
Megatron's TP weights are shards over *its* tensor-parallel group (``linear.tp_group``). ``swap``
gathers them over that group into dense ``nn.Linear``-layout weights (:func:`megatron_dense`; a
collective over Megatron's TP group, which every rank runs as it walks the same model) and builds
our layers with ``from_dense`` over ``group``. Two set-ups are supported:

* Megatron TP = tp > 1: ``group`` must hold exactly the ranks of Megatron's TP group, in the same
  order (else ``ValueError``); each rank then holds the same rows as before (no weight moves
  between ranks; the gather is only how ``from_dense`` is fed). Our parameters get Megatron's
  tensor-parallel attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``)
  copied from the parameters they replace, so Megatron's grad-norm clipping treats them like the
  originals; ``sequence_parallel`` is false on them ([Note: Megatron gradients]).
* Megatron TP = 1 (full weights on every rank) and ``group`` any group: the replicated weights are
  sharded over ``group``; the ranks of ``group`` must be fed the same batch (the hidden states are
  replicated over ``group``, as in the Hugging Face swap). Megatron knows nothing of ``group``:
  its data-parallel wrapper must not average over ranks of ``group`` (they hold different
  shards), and its grad-norm clipping sees only local shards (use the DTensor parameters and
  ``torch.nn.utils.clip_grad_norm_``). No Megatron attributes are set.

Layouts: the gathered ``linear_fc1`` is ``[gate_0; up_0; gate_1; up_1; ..]`` (per Megatron rank,
``stride=2``), de-interleaved into gate rows then up rows; the gathered ``linear_qkv`` is, per
query group g, ``[q heads of g (np/ng of them); k_g; v_g]``, split into ``wq``, ``wk``, ``wv``.

[Note: Megatron gradients]
The swapped parameters whose rank computes only part of the gradient -- the output biases under
sequence parallelism (``b_out``, ``bo``: the rank's own rows) and a swapped block's norms under
sequence parallelism, like Megatron's own row-parallel biases and norms -- are summed over the
group inside backward ([Note: gradients complete in backward] in ``layers/common/grads.py``):
their gradients are complete when backward returns, and they carry ``sequence_parallel=False``,
so Megatron's ``finalize_model_grads`` (which sums parameters tagged ``sequence_parallel``) does
not sum them again. (q/k norms and KV heads replicated over the group are refused at swap.)
Megatron's own parameters keep their tags with ``dtensor=False``: its ``finalize_model_grads``
sums its norms as before. With DTensor parameters (the default) they are summed inside backward
too ([Note: Megatron DTensor parameters] in :mod:`.megatron`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel")


def megatron_classes():
    """The megatron-core classes swap recognises (imported on use)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer
    return dict(ColumnParallelLinear=ColumnParallelLinear, RowParallelLinear=RowParallelLinear, MLP=MLP,
                SelfAttention=SelfAttention, DotProductAttention=DotProductAttention, AttnMaskType=AttnMaskType,
                IdentityOp=IdentityOp, TransformerLayer=TransformerLayer)


# ---------------------------------------------------------------------------- dense weights
def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``t`` of ``group`` along ``dim`` (a collective when ws > 1)."""
    t = t.detach()
    if group is None or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _opt(t, get):
    """``get(t)`` detached, or None where ``t`` (a parameter) or ``get(t)`` (e.g. its grad) is None."""
    v = get(t) if t is not None else None
    return v.detach() if v is not None else None


def _mlp_dense(module, get) -> dict:
    fc1, fc2 = module.linear_fc1, module.linear_fc2
    g, ws = fc1.tp_group, dist.get_world_size(fc1.tp_group)

    def fc1_rows(t):
        full = _gather(t, g, 0)
        if not module.config.gated_linear_unit:
            return full
        per = full.view(ws, 2, -1, *full.shape[1:])  # [gate_r; up_r] per Megatron rank (stride 2)
        return torch.cat([per[:, 0].reshape(-1, *full.shape[1:]), per[:, 1].reshape(-1, *full.shape[1:])])

    b_in = _opt(fc1.bias, get)
    return {"w_in": fc1_rows(get(fc1.weight)), "w_out": _gather(get(fc2.weight), fc2.tp_group, 1),
            "b_in": fc1_rows(b_in) if b_in is not None else None,
            "b_out": _opt(fc2.bias, get)}


def _attention_dense(module, get) -> dict:
    cfg, qkv, proj = module.config, module.linear_qkv, module.linear_proj
    nq, ng, d = cfg.num_attention_heads, cfg.num_query_groups, module.hidden_size_per_attention_head
    per = nq // ng

    def split(t):  # per query group [q (per heads); k; v] -> wq, wk, wv
        full = _gather(t, qkv.tp_group, 0)
        v = full.view(ng, per + 2, d, *full.shape[1:])
        rest = full.shape[1:]
        return (v[:, :per].reshape(nq * d, *rest), v[:, per].reshape(ng * d, *rest),
                v[:, per + 1].reshape(ng * d, *rest))

    wq, wk, wv = split(get(qkv.weight))
    bq = bk = bv = None
    if qkv.bias is not None:
        bq, bk, bv = split(get(qkv.bias))
    return {"wq": wq, "wk": wk, "wv": wv, "wo": _gather(get(proj.weight), proj.tp_group, 1),
            "bq": bq, "bk": bk, "bv": bv, "bo": _opt(proj.bias, get),
            "q_norm": None, "k_norm": None}


def megatron_dense(module, get=None) -> dict:
    """The dense weights of a megatron-core ``MLP`` or ``SelfAttention`` under the names
    :meth:`OverlapMLP.from_dense` / :meth:`OverlapAttention.from_dense` take (``w_in`` = gate rows
    then up rows; ``wq``, ``wk``, ``wv`` de-interleaved; None where absent), gathered over
    Megatron's tensor-parallel group: a collective, every rank of that group must call it.
    ``get(param)`` picks the tensor of each parameter (default: the parameter; e.g.
    ``lambda p: p.grad`` gives the dense gradients)."""
    get = get or (lambda p: p)
    M = megatron_classes()
    if type(module) is M["MLP"]:
        return _mlp_dense(module, get)
    if type(module) is M["SelfAttention"]:
        return _attention_dense(module, get)
    raise ValueError(f"module={type(module).__name__}: must be a megatron-core MLP or SelfAttention")


def copy_tp_attrs(src: Optional[torch.Tensor], dst: Optional[torch.Tensor]) -> None:
    """Megatron's tensor-parallel attributes of ``src`` onto ``dst``, but ``sequence_parallel``
    false: our parameters' gradients are complete when backward returns ([Note: Megatron
    gradients]), so Megatron's ``finalize_model_grads`` must not sum them again."""
    if src is None or dst is None:
        return
    for a in _TP_ATTRS:
        if hasattr(src, a):
            setattr(dst, a, False if a == "sequence_parallel" else getattr(src, a))



def check_group(module, kind, group) -> None:
    """[Note: Megatron weights]: with Megatron TP > 1, ``group`` must be Megatron's TP group."""
    lin = module.linear_fc1 if kind == "mlp" else module.linear_qkv
    meg = getattr(lin, "tp_group", None)
    if meg is None or dist.get_world_size(meg) == 1:
        return
    want, got = dist.get_process_group_ranks(meg), dist.get_process_group_ranks(group)
    if list(want) != list(got):
        raise ValueError(f"group= has global ranks {list(got)}, but Megatron's tensor-parallel group of "
                         f"{type(module).__name__} has {list(want)}: with Megatron's tensor parallelism > 1, pass "
                         f"its tensor-parallel group (megatron.core.parallel_state.get_tensor_model_parallel_group()),"
                         f" or build the Megatron model with tensor_model_parallel_size=1")

