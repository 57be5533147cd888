"""The whole-model benchmark's models and shape presets.

Reference: each preset holds the published dimensions of its model (hidden size, MLP width,
heads, KV heads, head size, layers, vocabulary, RoPE base, norm epsilon; experts, top-k and expert
width for MoE models); ``tiny`` is a shape small enough for two CPU ranks in a few seconds. A run
may cut the layer count (``--layers``); nothing else changes.

Models: ``titan`` is the torchtitan-style decoder of :mod:`.titan` (dense presets); ``llama`` and
``qwen3`` are transformers' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (dense presets);
``mixtral`` and ``qwen3_moe`` are ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` (MoE presets).
``tiny`` fits every model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional


@dataclass(frozen=True)
class Preset:
    """One model shape. ``experts == 0``: a dense model (``ffn`` is the MLP width); else an MoE
    model whose experts have width ``moe_ffn`` and route ``top_k`` of ``experts``."""

    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    rope_theta: float
    norm_eps: float
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    norm_topk: bool = True

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def cut(self, layers: Optional[int]) -> "Preset":
        """The same shape with ``layers`` decoder layers (None: unchanged)."""
        return self if layers is None else replace(self, layers=layers)


PRESETS: Dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=128,
           rope_theta=10000.0, norm_eps=1e-6),
    Preset("tiny-moe", hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=128,
           rope_theta=10000.0, norm_eps=1e-6, experts=4, top_k=2, moe_ffn=64),
    Preset("llama3-8b", hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, layers=32, vocab=128256,
           rope_theta=500000.0, norm_eps=1e-5),
    Preset("llama3-70b", hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128, layers=80, vocab=128256,
           rope_theta=500000.0, norm_eps=1e-5),
    Preset("qwen3-8b", hidden=4096, ffn=12288, heads=32, kv_heads=8, head_dim=128, layers=36, vocab=151936,
           rope_theta=1000000.0, norm_eps=1e-6),
    Preset("qwen3-30b-a3b", hidden=2048, ffn=6144, heads=32, kv_heads=4, head_dim=128, layers=48, vocab=151936,
           rope_theta=1000000.0, norm_eps=1e-6, experts=128, top_k=8, moe_ffn=768, norm_topk=True),
    Preset("mixtral-8x7b", hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, layers=32, vocab=32000,
           rope_theta=1000000.0, norm_eps=1e-5, experts=8, top_k=2, moe_ffn=14336),
)}

# model -> (is MoE, default preset on GPUs)
MODELS: Dict[str, tuple] = {
    "titan": (False, "llama3-8b"),
    "llama": (False, "llama3-8b"),
    "qwen3": (False, "qwen3-8b"),
    "mixtral": (True, "mixtral-8x7b"),
    "qwen3_moe": (True, "qwen3-30b-a3b"),
}
HF_MODELS = ("llama", "qwen3", "mixtral", "qwen3_moe")
DEFAULT_GPU_LAYERS = 4  # the cut of a full-size preset when --layers is not given


def preset_for(model: str, name: str, layers: Optional[int], cuda: bool) -> Preset:
    """The preset ``name`` for ``model`` ("default": the model's own on GPUs, ``tiny`` / ``tiny-moe``
    on CPU; ``tiny`` also means ``tiny-moe`` for an MoE model), cut to ``layers`` (None: the
    preset's own for ``tiny``, :data:`DEFAULT_GPU_LAYERS` for a full-size preset). ValueError
    naming ``--preset`` for a preset of the other kind."""
    is_moe, gpu_default = MODELS[model]
    if name == "default":
        name = gpu_default if cuda else "tiny"
    if name == "tiny" and is_moe:
        name = "tiny-moe"
    if name not in PRESETS:
        raise ValueError(f"--preset: unknown preset {name!r}; valid: default, {', '.join(PRESETS)}")
    p = PRESETS[name]
    if p.moe != is_moe:
        fits = [n for n, q in PRESETS.items() if q.moe == is_moe]
        raise ValueError(f"--preset {name} is a{'n MoE' if p.moe else ' dense'} shape; model {model} takes "
                         f"{', '.join(fits)} (or default)")
    if layers is None and not name.startswith("tiny"):
        layers = min(DEFAULT_GPU_LAYERS, p.layers)
    return p.cut(layers)
