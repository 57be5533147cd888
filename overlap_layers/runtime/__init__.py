"""Collectives, handles, streams and the executor (the only place streams/events live)."""
from .collectives import Handle, all_gather, all_reduce, all_to_all, issue, reduce_scatter
from .executor import execute
from .group import Agreement, first_disagreement, resolve_group, shared_agreement
from .streams import StreamPool

__all__ = ["Handle", "all_gather", "all_reduce", "all_to_all", "reduce_scatter", "issue",
           "execute", "Agreement", "first_disagreement", "resolve_group", "shared_agreement", "StreamPool"]
