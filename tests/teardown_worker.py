"""Teardown check, one process per rank under torchrun on gloo (run by test_runtime.py).

Every layer kind runs a forward and backward with two batch tiles inside ``run_ranks``, which
destroys the process group when the function returns. Afterwards this process must hold neither
the group (it was freed, not kept by a layer or the shared Agreement) nor any of gloo's worker
threads: left alive until interpreter exit, a worker that releases a finished collective's
tensors there needs the GIL and aborts the process. Each rank writes ``rank<r>.json`` into the
folder given as the argument.
"""
import json
import os
import sys
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from overlap_layers import OverlapAttention, OverlapMLP, OverlapMoE  # noqa: E402
from overlap_layers.launch import run_ranks  # noqa: E402

REFS = []


def run(dev: torch.device) -> None:
    world = dist.group.WORLD
    ws = dist.get_world_size()
    REFS.append(weakref.ref(world))
    torch.manual_seed(0)
    layers = [OverlapMLP(16, 8 * ws, group=world, num_tiles=2),
              OverlapAttention(16, 2 * ws, ws, group=world, head_dim=4, num_tiles=2),
              OverlapMoE(16, 8, 2 * ws, 2, group=world, num_tiles=2)]
    x = torch.randn(2, 4, 16, requires_grad=True)
    for layer in layers:
        layer(x).sum().backward()


def gloo_threads() -> list:
    """Names of this process's threads that belong to gloo (Linux)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return [n for n in names if "gloo" in n]


if __name__ == "__main__":
    run_ranks(run)
    rank = int(os.environ["RANK"])
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, group_freed=REFS[0]() is None, gloo_threads=gloo_threads()), f)
