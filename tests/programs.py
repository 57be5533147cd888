"""Synthetic tile programs shared by the schedule and simulator tests (no tensors involved)."""
from overlap_layers.schedule import TileProgram, comm, compute, wait


def noop(env):
    pass


def mlp_like():
    """ag -> wait -> fc1 -> fc2 -> rs -> wait, the sequence-parallel MLP's shape."""
    return TileProgram("mlp", (comm("ag", "all_gather", src="x"), wait("ag", dst="xg"),
                               compute("fc1", noop), compute("fc2", noop),
                               comm("rs", "reduce_scatter", src="y"), wait("rs", dst="out")))
