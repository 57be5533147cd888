"""What an OverlapMoE with ``config.graph_calls`` holds at each training call: the group's
symmetric workspaces by purpose ("exchange": the eager copy-engine calls'; "device_counts": the
device path's, [Note: sync-free exchange] in ``runtime/device_all_to_all.py``), the device's free
memory (``mem_get_info``: what the process really holds, symmetric memory included), the
allocator's reserved bytes, the bytes the last call's graph kept, and the race's choices
([Note: MoE graph calls: the race] in ``layers/moe/device_path.py``). One line per call on rank 0, and
the rows as JSON. Run from the repo root on a GPU machine with symmetric memory (EP = the ranks):

    PYTHONPATH=. torchrun --nproc-per-node 4 bench/probes/moe_memory_probe.py --preset qwen3-30b-a3b --out OUT.json

(``PYTHONPATH`` set to a copy of an older package probes that one instead.) Its ranks start by
``overlap_layers.launch.run_ranks``.
"""
import argparse
import gc
import json

import torch
import torch.distributed as dist

from overlap_layers import OverlapConfig, OverlapMoE
from overlap_layers.bench.moe import PRESETS
from overlap_layers.launch import run_ranks
from overlap_layers.runtime.symmetric import held_workspace_bytes

MIB = 2 ** 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=None, help="per rank (default: the preset's)")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--out", default=None)
    run_ranks(probe, p.parse_args())


def probe(dev: torch.device, a) -> None:
    """The probe on this rank (``run_ranks``: under torchrun, NCCL on this rank's GPU)."""
    group, rank = dist.group.WORLD, dist.get_rank()
    s = PRESETS[a.preset]
    torch.manual_seed(0)
    layer = OverlapMoE(s["hidden"], s["ffn"], s["experts"], s["top_k"], group=group, num_tiles=1,
                       dtype=torch.bfloat16, device=dev, config=OverlapConfig(graph_calls=True))
    torch.manual_seed(1 + rank)  # every rank its own tokens
    x = torch.randn(1, a.tokens or s["tokens"], s["hidden"], device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    rows = []
    for call in range(a.calls):
        layer(x.clone().requires_grad_()).backward(dy)
        layer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        gc.collect()  # what no layer holds any more is gone before it is counted
        graphs = layer._call_graphs
        rows.append(dict(call=call, exchange=held_workspace_bytes(group, dev) / MIB,
                         device_counts=held_workspace_bytes(group, dev, "device_counts") / MIB,
                         free=torch.cuda.mem_get_info(dev)[0] / MIB, reserved=torch.cuda.memory_reserved(dev) / MIB,
                         graph=(graphs.last_nbytes if graphs is not None else 0) / MIB,
                         races=[race["choice"] for race in layer._device_path.race._races.values()]))
    if rank == 0:
        for r in rows:
            print("{call:3d} exchange {exchange:7.0f} device_counts {device_counts:7.0f} free {free:9.0f} "
                  "reserved {reserved:7.0f} graph {graph:6.0f} races {races}".format(**r))
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"preset": a.preset, "world_size": dist.get_world_size(), "torch": torch.__version__,
                           "device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
