"""A torchtitan-style decoder, and its tensor- plus sequence-parallel forms (PyTorch's and ours).

Reference (what :class:`Transformer` computes, ``tokens [b, S]`` -> ``logits [b, S, vocab]``)::

    h = tok_embeddings(tokens)
    for each block:  h = h + attention(attention_norm(h), cos, sin)
                     h = h + feed_forward(ffn_norm(h))
    logits = output(norm(h))

with ``nn.RMSNorm`` norms, attention = ``wo(SDPA_causal(rope(wq x), rope(wk x), wv x))`` over
``heads`` query heads of ``head_dim`` sharing ``kv_heads`` KV heads (GQA: query head i reads KV head
``i // (heads / kv_heads)``), RoPE in the rotate-half form with Hugging Face Llama's tables
(``cos, sin [1, S, head_dim]`` in float32, cast to the activations' dtype: the form
``OverlapAttention`` takes as ``position_embeddings``), and the SwiGLU MLP
``w2(silu(w1 x) * w3 x)``. No biases, no dropout. torchtitan's Llama 3 differs only in RoPE's
pair layout (interleaved pairs); the FLOPs and the communication are the same.

Parallel forms over a 1-D tensor-parallel mesh (or the ``tp`` axis of a 2-D one):

* :func:`parallelize_torch_tp`: ``parallelize_module`` as torchtitan's ``parallelize_llama`` does
  with sequence parallelism and loss parallelism: embedding RowwiseParallel (output Shard(1)),
  every norm SequenceParallel, attention / feed_forward PrepareModuleInput (Shard(1) ->
  Replicate), wq / wk / wv / w1 / w3 ColwiseParallel, wo / w2 RowwiseParallel (output Shard(1)),
  the LM head ColwiseParallel (input Shard(1), output Shard(-1), DTensor logits for
  ``loss_parallel``).
* :func:`parallelize_overlap`: the same plan for the embedding, norms and LM head, with each
  block's attention and MLP replaced by ``OverlapAttention.from_dense`` / ``OverlapMLP.from_dense``
  (``sequence_parallel=True`` over the mesh axis' group, fed the local ``[b, S/tp, hidden]`` rows
  of the norms' Shard(1) outputs; or, with ``dtensor_inputs``, built on the mesh and fed the
  DTensors themselves).

Both take each rank's slices of the (identical) dense weights: ``parallelize_module``'s
``distribute_tensor`` scatters rank 0's tensor (equal to every rank's), ``from_dense`` slices
locally.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .presets import Preset


def rope_tables(seq: int, head_dim: int, theta: float, device, dtype) -> tuple:
    """``(cos, sin)`` ``[1, seq, head_dim]``: Hugging Face Llama's default RoPE tables for positions
    ``0 .. seq-1``, computed in float32 and cast to ``dtype``."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    freqs = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [b, S, heads, d]`` and tables ``[1, S, d]``."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """GQA attention with RoPE and causal SDPA; the head count is read from the projections'
    outputs (``view(..., -1, head_dim)``), so a column-sharded rank runs its own heads."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.head_dim, self.n_rep = head_dim, heads // kv_heads
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.n_rep > 1:  # torchtitan's repeat_kv: query head i reads KV head i // n_rep
            k, v = (t.repeat_interleave(self.n_rep, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); h + feed_forward(ffn_norm(h))``."""

    def __init__(self, p: Preset):
        super().__init__()
        self.attention_norm = nn.RMSNorm(p.hidden, eps=p.norm_eps)
        self.attention = Attention(p.hidden, p.heads, p.kv_heads, p.head_dim)
        self.ffn_norm = nn.RMSNorm(p.hidden, eps=p.norm_eps)
        self.feed_forward = FeedForward(p.hidden, p.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder of the module docstring; ``forward(tokens) -> logits``."""

    def __init__(self, p: Preset):
        super().__init__()
        if p.moe:
            raise ValueError(f"the titan model is dense; preset {p.name} is an MoE shape")
        self.preset = p
        self.tok_embeddings = nn.Embedding(p.vocab, p.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(p) for i in range(p.layers)})
        self.norm = nn.RMSNorm(p.hidden, eps=p.norm_eps)
        self.output = nn.Linear(p.hidden, p.vocab, bias=False)
        self._tables = {}
        self._fresh_input = False

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) weights (the output projections scaled by 1/sqrt(2 * layers)); norms to one."""
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                scale = (2 * self.preset.layers) ** -0.5 if name.endswith(("wo", "w2")) else 1.0
                nn.init.normal_(m.weight, std=std * scale)
            elif isinstance(m, nn.RMSNorm):
                m.reset_parameters()

    def tables(self, seq: int, device, dtype) -> tuple:
        """The RoPE tables of the whole sequence, cached per (seq, device, dtype)."""
        key = (seq, str(device), dtype)
        if key not in self._tables:
            self._tables[key] = rope_tables(seq, self.preset.head_dim, self.preset.rope_theta, device, dtype)
        return self._tables[key]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = self.tables(tokens.shape[1], tokens.device, self.output.weight.dtype)
        h = self.tok_embeddings(tokens)
        if self._fresh_input:
            # A parallel form's embedding returns to_local()'s output; a torch.compile'd block fed that
            # tensor itself fails in backward on torch 2.13 (AttributeError: 'Tensor' object has no
            # attribute '_local_tensor', in DTensor's redistribute backward). A copy (b x S/tp x H) avoids it.
            h = h.clone()
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.output(self.norm(h))


# ---------------------------------------------------------------------------- parallel forms
def _outer_plan(loss_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }


def check_heads(p: Preset, tp: int) -> None:
    """ValueError unless ``tp`` divides the query heads, the KV heads and the MLP width (what a
    column split of wq / wk / wv / w1 / w3 needs) and the vocabulary (the LM head's split)."""
    for what, n in (("heads", p.heads), ("KV heads", p.kv_heads), ("MLP width", p.ffn), ("vocabulary", p.vocab)):
        if n % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks needs {what} ({n}) divisible by {tp}")


def parallelize_torch_tp(model: Transformer, tp_mesh, loss_parallel: bool = True) -> Transformer:
    """torchtitan's ``apply_tp`` on this model (module docstring), in place; returns ``model``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    check_heads(model.preset, tp_mesh.size())
    parallelize_module(model, tp_mesh, _outer_plan(loss_parallel))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    model._fresh_input = True  # the blocks' input is not to_local()'s output itself (see forward)
    return model


def _plain(x):
    """``x``'s local tensor if it is a DTensor (``isinstance``: under ``torch.compile`` a
    ``hasattr(x, "to_local")`` test of a DTensor reads False), else ``x``."""
    from torch.distributed.tensor import DTensor
    return x.to_local() if isinstance(x, DTensor) else x


class _OverlapAttentionAdapter(nn.Module):
    """A block's ``attention(x, cos, sin)`` run by an ``OverlapAttention`` (sequence parallel):
    ``x`` the norm's Shard(1) DTensor (or its local rows), ``(cos, sin)`` the whole sequence's
    tables; returns the rank's ``[b, S/tp, hidden]`` rows as a plain tensor (the residual stream's
    form, as under ``parallelize_torch_tp``). ``dtensor_inputs``: hand the layer the DTensor
    itself (a layer built with ``mesh=``), else its local tensor (a layer built with ``group=``)."""

    def __init__(self, layer: nn.Module, dtensor_inputs: bool):
        super().__init__()
        self.layer, self.dtensor_inputs = layer, dtensor_inputs

    def forward(self, x, cos, sin):
        return _plain(self.layer(x if self.dtensor_inputs else _plain(x), position_embeddings=(cos, sin)))


class _OverlapMLPAdapter(nn.Module):
    """A block's ``feed_forward(x)`` run by an ``OverlapMLP`` (sequence parallel); as above."""

    def __init__(self, layer: nn.Module, dtensor_inputs: bool):
        super().__init__()
        self.layer, self.dtensor_inputs = layer, dtensor_inputs

    def forward(self, x):
        return _plain(self.layer(x if self.dtensor_inputs else _plain(x)))


def parallelize_overlap(model: Transformer, mesh, axis: Optional[str] = None, config=None,
                        loss_parallel: bool = True, dtensor_inputs: bool = False) -> Transformer:
    """The overlap layers in each block (module docstring), in place; returns ``model``. ``mesh``:
    the tensor-parallel mesh (1-D), or a 2-D mesh with its ``axis``; ``config``: the layers'
    ``OverlapConfig`` (None: the defaults).

    The norms are SequenceParallel, as under :func:`parallelize_torch_tp`. Default: the layers are
    built with ``group=`` (the mesh axis' group, plain parameters) and fed the local
    ``[b, S/tp, hidden]`` rows of the norms' Shard(1) outputs; ``dtensor_inputs``: built on the mesh
    (DTensor parameters) and fed the DTensors themselves."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from overlap_layers import OverlapAttention, OverlapMLP
    tp_mesh = mesh if axis is None else mesh[axis]
    where = dict(mesh=mesh, axis=axis) if dtensor_inputs else dict(group=tp_mesh.get_group())
    p = model.preset
    check_heads(p, tp_mesh.size())
    parallelize_module(model, tp_mesh, _outer_plan(loss_parallel))
    for block in model.layers.values():
        a, f = block.attention, block.feed_forward
        w = lambda lin: lin.weight.detach()  # noqa: E731
        attn = OverlapAttention.from_dense(w(a.wq), w(a.wk), w(a.wv), w(a.wo), num_heads=p.heads,
                                           num_kv_heads=p.kv_heads, sequence_parallel=True, rope_theta=None,
                                           causal=True, config=config, **where)
        mlp = OverlapMLP.from_dense(torch.cat([w(f.w1), w(f.w3)]), w(f.w2), sequence_parallel=True,
                                    activation="swiglu", config=config, **where)
        block.attention = _OverlapAttentionAdapter(attn, dtensor_inputs)
        block.feed_forward = _OverlapMLPAdapter(mlp, dtensor_inputs)
        parallelize_module(block, tp_mesh, {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    model._fresh_input = True
    return model
