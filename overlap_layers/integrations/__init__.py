"""Integrations of the overlap layers into other model code (integrations import
the layers, never the reverse: docs/architecture.md, Integrations).

``swap`` replaces, in place, the MLP / attention / MoE modules of Hugging Face transformers
(>= 5) models (:mod:`.hf`) and the MLP / self-attention modules of megatron-core GPT models
(:mod:`.megatron`). It dispatches on the model: one containing a megatron-core module goes to
:func:`.megatron.swap`, anything else to :func:`.hf.swap`. Neither transformers nor megatron is
imported until ``swap`` needs it.

A swapped Hugging Face model keeps the unswapped model's state-dict layout (:mod:`.hf_state`);
``load_pretrained_shards`` loads a safetensors checkpoint into it reading only each rank's part of
each tensor, and ``full_state_dict`` gathers its state dict into whole plain tensors
(:mod:`.hf_checkpoint`).
"""
import functools

from . import hf as _hf
from .hf_adapters import HFAttention, HFBlock, HFMoE
from .hf_checkpoint import load_pretrained_shards
from .hf_state import full_state_dict
from .megatron import MegatronAttention, MegatronBlock, MegatronMLP, is_megatron_model
from .megatron import swap as megatron_swap


@functools.wraps(_hf.swap)
def swap(model, group=None, **kwargs):
    if is_megatron_model(model):
        return megatron_swap(model, group, **kwargs)
    return _hf.swap(model, group, **kwargs)


swap.__doc__ = (_hf.swap.__doc__ or "") + """
    megatron-core models (any model containing a ``MegatronModule``) are swapped by
    :func:`overlap_layers.integrations.megatron.swap` instead: same arguments, ``group`` being
    Megatron's tensor-parallel group when its tensor parallelism is > 1; see that module for the
    adapters' contract (``[seq, batch, hidden]`` in, ``(output, None)`` out, RoPE from
    ``rotary_pos_emb``, sequence parallelism from Megatron's config).
"""

__all__ = ["swap", "full_state_dict", "load_pretrained_shards", "HFAttention", "HFBlock", "HFMoE", "MegatronAttention",
           "MegatronBlock", "MegatronMLP"]
