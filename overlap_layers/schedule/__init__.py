"""Tile programs, segments, segmented round-robin and bucketing (pure Python)."""
from .program import COLLECTIVES, Op, TileProgram, comm, compute, segments, wait
from .roundrobin import Launch, Schedule, round_robin, singleton_buckets

__all__ = ["COLLECTIVES", "Op", "TileProgram", "comm", "compute", "wait", "segments",
           "Launch", "Schedule", "round_robin", "singleton_buckets"]
