"""Decode latency per token of a swapped Hugging Face Llama against the unswapped model, one
process per rank (TP = the world size; the unswapped model runs on every rank alike).

What it measures: for each batch size, greedy ``generate`` from the same random prompt with a
KV cache, ``--new`` tokens after a warm-up generate; the time of the decoding steps alone, per
token: (time of a generate of ``--new`` tokens - time of one of 1 token) / (``--new`` - 1), the
median of ``--repeats``, each the slowest rank's. Both models run in the same process, alternating
repeat by repeat. Times are wall-clock, or with ``--clock process`` each process's CPU time (the
host work alone, steadier on a CPU machine that other jobs share). Prints a table and writes JSON
(``--out``) with the versions and the command.

    python bench/probes/decode_latency.py --layers 4 --batch 1 16     # one GPU, no torchrun; llama3-8b dims
    python bench/probes/decode_latency.py --tiny --batch 1 2 --nprocs 2      # CPU, 2 gloo ranks
    python bench/probes/decode_latency.py --tiny --batch 1 2 --clock process --repeats 15   # CPU, shared
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes (default 1 16)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new", type=int, default=32, help="new tokens per timed generate (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    p.add_argument("--tiny", action="store_true", help="tiny dims (CPU checks) instead of llama3-8b's")
    p.add_argument("--nprocs", type=int, default=1, help="CPU ranks to start when not under torchrun")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="wall (default), or process: this process's CPU time (time.process_time), the host "
                        "work alone, for a CPU machine shared with other jobs")
    p.add_argument("--out", default=None, help="JSON path")
    return p.parse_args(argv)


def _models(args, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from overlap_layers import swap
    dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=256) if args.tiny else dict(hidden_size=4096, intermediate_size=14336,
                                                        num_attention_heads=32, num_key_value_heads=8,
                                                        vocab_size=128256)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=4096, **dims))
    dense = dense.to(device=device, dtype=dtype).eval()
    swapped = swap(copy.deepcopy(dense), group=dist.group.WORLD).eval()
    return dense, swapped


def _timed(model, prompt, new: int, device, clock) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = torch.tensor([clock() - t0], dtype=torch.float64, device=prompt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main(device, args):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dense, swapped = _models(args, device, dtype)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    rows = []
    with torch.no_grad():
        for b in args.batch:
            g = torch.Generator().manual_seed(b)
            prompt = torch.randint(0, dense.config.vocab_size, (b, args.prompt), generator=g).to(device)
            per = {"unswapped": [], "swapped": []}
            for m in (dense, swapped):  # warm-up: planning, caches, kernels
                _timed(m, prompt, args.new, device, clock)
            for _ in range(args.repeats):
                for name, m in (("unswapped", dense), ("swapped", swapped)):
                    per[name].append((_timed(m, prompt, args.new, device, clock) - _timed(m, prompt, 1, device, clock))
                                     / (args.new - 1) * 1e3)
            med = {k: statistics.median(v) for k, v in per.items()}
            rows.append(dict(batch=b, ms_per_token=med, spread={k: (min(v), max(v)) for k, v in per.items()},
                             ratio=med["swapped"] / med["unswapped"]))
    if dist.get_rank() == 0:
        import transformers
        meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    world_size=dist.get_world_size(), torch=torch.__version__, transformers=transformers.__version__,
                    date=time.strftime("%Y-%m-%d"), command="python " + " ".join(sys.argv), layers=args.layers,
                    prompt=args.prompt, new=args.new, dtype=str(dtype).replace("torch.", ""), clock=args.clock)
        print(f"{'batch':>5}  {'unswapped ms/token':>18}  {'swapped ms/token':>16}  {'ratio':>6}")
        for r in rows:
            print(f"{r['batch']:5d}  {r['ms_per_token']['unswapped']:18.3f}  {r['ms_per_token']['swapped']:16.3f}  "
                  f"{r['ratio']:6.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, records=rows), f, indent=1)


def _one_gpu_rank() -> None:
    """Outside torchrun on a CUDA machine with ``--nprocs 1``: this process as the one rank of a
    group on its GPU (``run_ranks``' torchrun branch: NCCL on cuda:0), so that the plain command
    measures the GPU and not local CPU ranks."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


if __name__ == "__main__":
    from overlap_layers.launch import run_ranks
    ns = parse(sys.argv[1:])
    if torch.cuda.is_available() and ns.nprocs == 1 and "RANK" not in os.environ:
        _one_gpu_rank()
    run_ranks(main, ns, nprocs=ns.nprocs)
