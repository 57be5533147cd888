"""Integrations of the overlap layers into other model code (DESIGN.md: integrations -> layers).

``swap`` replaces the MLP / attention / MoE modules of Hugging Face transformers (>= 5) models in
place (:mod:`.hf`; transformers is imported only when ``swap`` runs).
"""
from .hf import swap
from .hf_adapters import HFAttention, HFMoE

__all__ = ["swap", "HFAttention", "HFMoE"]
