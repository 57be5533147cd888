"""Tile programs, segments, segmented round-robin and bucketing (pure Python)."""
from .program import COLLECTIVES, Op, Scope, TileProgram, comm, compute, scoped, segments, wait
from .roundrobin import Launch, Schedule, round_robin, singleton_buckets

__all__ = ["COLLECTIVES", "Op", "Scope", "TileProgram", "comm", "compute", "wait", "segments", "scoped",
           "Launch", "Schedule", "round_robin", "singleton_buckets"]
