"""The graph memory of a stack of layers replaying no-grad calls ([Note: shared no-grad pool]):
four OverlapAttention and four OverlapMLP layers of llama3-8b (bf16), 16384 tokens, rank chunks
over the copy engine, ``config.graph_calls``; the residual stream ``h = layer(h) * 0.5 + h``.
Prints (rank 0, one JSON line per step of three) the growth of reserved memory and each layer's
graph bytes, then the time per stack over ten replayed stacks.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD \
        torchrun --nproc-per-node 4 bench/graph_pool_stack.py [TAG]
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from overlap_layers import OverlapAttention, OverlapConfig, OverlapMLP
from overlap_layers.layers.mlp.layer import MLPPlan

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dev = torch.device("cuda", local)
dist.init_process_group("nccl", device_id=dev)
ws, rank = dist.get_world_size(), dist.get_rank()
cfg = OverlapConfig(graph_calls=True, num_tiles=1)
plan = MLPPlan(1, decomposition="rank", transport="copy_engine")
layers = []
for _ in range(4):
    layers.append(OverlapAttention(4096, 32, 8, group=dist.group.WORLD, device=dev, dtype=torch.bfloat16, config=cfg))
    layers.append(OverlapMLP(4096, 14336, group=dist.group.WORLD, device=dev, dtype=torch.bfloat16, config=cfg))
for layer in layers:
    layer.pin_plan(plan)
x = torch.randn(2, 8192 // ws, 4096, device=dev, dtype=torch.bfloat16)
torch.cuda.synchronize()
base = torch.cuda.memory_reserved(dev)
rows = []
for step in range(3):
    with torch.no_grad():
        h = x
        for layer in layers:
            h = layer(h) * 0.5 + h
    torch.cuda.synchronize()
    rows.append(dict(step=step, reserved_mib=(torch.cuda.memory_reserved(dev) - base) / 2**20,
                     graph_mib=sum(layer._call_graphs.last_nbytes for layer in layers) / 2**20,
                     per_layer_mib=[round(layer._call_graphs.last_nbytes / 2**20) for layer in layers]))
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
ev[0].record()
for _ in range(10):
    with torch.no_grad():
        h = x
        for layer in layers:
            h = layer(h) * 0.5 + h
ev[1].record()
torch.cuda.synchronize()
if rank == 0:
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(dict(ms_per_stack=ev[0].elapsed_time(ev[1]) / 10, out=sys.argv[1] if len(sys.argv) > 1 else "")))
dist.destroy_process_group()
