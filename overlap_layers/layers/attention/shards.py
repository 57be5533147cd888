"""How :class:`~overlap_layers.layers.attention.layer.OverlapAttention` shards the dense weights:
the heads a rank holds, its rows of the dense weights (:func:`load_shards_`), and the dense
weights gathered back (:func:`dense_weights`, the layer's ``to_dense``).

Reference: rank r holds query heads ``r*nq/ws ..`` (rows of wq, bq, columns of wo) and the KV
heads they read (rows of wk, wv, bk, bv: ``r*nkv/ws ..``, or the single head its query heads
share when nkv < ws); ``bo`` and the qk-norm weights whole.
"""
from __future__ import annotations

import torch

from ...runtime.collectives import gathered_rows
from .common import PARAMS


def q_heads(num_heads: int, world_size: int, rank: int) -> range:
    """The dense query heads ``rank`` holds."""
    n = num_heads // world_size
    return range(rank * n, (rank + 1) * n)


def kv_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> range:
    """The dense KV heads ``rank`` holds: its share, or the one its query heads read when there
    are fewer KV heads than ranks."""
    if num_kv_heads >= world_size:
        n = num_kv_heads // world_size
        return range(rank * n, (rank + 1) * n)
    group, local = num_heads // num_kv_heads, num_heads // world_size
    return range(rank * local // group, rank * local // group + 1)


@torch.no_grad()
def load_shards_(layer, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm) -> None:
    """Copy ``layer``'s rows of the dense weights into its parameters (the ``group=`` layout)."""
    d = layer.head_dim
    qh = q_heads(layer.num_heads, layer.world_size, layer.rank)
    kvh = layer._kv_heads()

    def rows(dense: torch.Tensor, heads: range) -> torch.Tensor:
        return dense[heads.start * d:heads.stop * d]

    layer.wq.copy_(rows(wq, qh))
    layer.wk.copy_(rows(wk, kvh))
    layer.wv.copy_(rows(wv, kvh))
    layer.wo.copy_(wo[:, qh.start * d:qh.stop * d])
    if layer.bias:
        layer.bq.copy_(rows(bq, qh))
        layer.bk.copy_(rows(bk, kvh))
        layer.bv.copy_(rows(bv, kvh))
    if bo is not None:
        layer.bo.copy_(bo)
    if q_norm is not None:
        layer.q_norm.copy_(q_norm)
        layer.k_norm.copy_(k_norm)


@torch.no_grad()
def dense_weights(layer) -> dict:
    """The dense weights of ``layer`` (the keys of ``from_dense``; None where absent). A
    collective: every rank of the group must call it."""
    ws, d, group = layer.world_size, layer.head_dim, layer.group

    def kv(t):
        g = gathered_rows(t, group)
        if layer.num_kv_heads >= ws:
            return g
        per = ws // layer.num_kv_heads  # ranks sharing one KV head hold copies: keep the first
        return g.view(ws, *t.shape)[::per].reshape(-1, *t.shape[1:])

    p = {n: layer._local(n) for n in PARAMS}
    out = {"wq": gathered_rows(p["wq"], group), "wk": kv(p["wk"]), "wv": kv(p["wv"]),
           "wo": gathered_rows(p["wo"].t(), group).t().contiguous(),
           "bq": gathered_rows(p["bq"], group) if layer.bias else None, "bk": kv(p["bk"]) if layer.bias else None,
           "bv": kv(p["bv"]) if layer.bias else None, "bo": p["bo"].detach().clone() if p["bo"] is not None else None,
           "q_norm": p["q_norm"].detach().clone() if layer.qk_norm else None,
           "k_norm": p["k_norm"].detach().clone() if layer.qk_norm else None}
    assert out["wq"].shape[0] == layer.num_heads * d
    return out
