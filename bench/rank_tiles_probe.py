"""Probe: the per-layer benchmark (same arguments as ``python -m overlap_layers.bench``) with the
``rank`` / ``rank_ce`` modes pinned at ``PROBE_RANK_TILES`` batch tiles (the attention's rank
chunks run inside batch tiles; the bench's modes pin one). Used to compare rank chunks over NCCL
send/recv with batch tiles where the planner does not offer them (``--transport nccl``).

    NCCL_P2P_DISABLE=1 PROBE_RANK_TILES=2 torchrun --nproc-per-node 2 bench/rank_tiles_probe.py \\
        --layer attention --preset llama3-8b --batch 2 --tp 2 --transport nccl --modes serial,auto,rank
"""
import os

from overlap_layers.bench.cli import main
from overlap_layers.bench.mlp import MLPBench, pass_fn
from overlap_layers.planning.plan import TilePlan


def rank_fn(self, transport: str, backward: bool):
    """``MLPBench.rank_fn`` with the pinned plan's batch tiles from ``PROBE_RANK_TILES``."""
    layer = self.layer
    layer.plan = None
    layer.pin_plan(TilePlan(int(os.environ.get("PROBE_RANK_TILES", "1")), decomposition="rank", transport=transport))
    x = self.x.detach().requires_grad_(backward)
    return pass_fn(lambda: self.call_layer(x), backward, [self.dy], [x, *layer.parameters()])


MLPBench.rank_fn = rank_fn
main()
