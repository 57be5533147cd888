"""The per-layer benchmark's command line (``python -m overlap_layers.bench``).

Without torchrun it spawns ``--nprocs`` (default 2) gloo ranks on the CPU and runs tiny shapes
(well under a minute). Under torchrun on GPUs it uses NCCL and bf16, e.g.::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    torchrun --nproc-per-node 4 -m overlap_layers.bench --preset llama3-8b --tp 2 4

Prints a table (ms, ratio to limit, ratio to serial, peak memory) on rank 0 and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile

import torch
import torch.distributed as dist

from .mlp import MODES, PRESETS, Shape, bench_shape


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m overlap_layers.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="mlp", choices=["mlp"])
    p.add_argument("--preset", nargs="+", default=None, choices=sorted(PRESETS),
                   help="shape presets (default: tiny on CPU, llama3-8b on GPU)")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="tokens per TP group (batch*seq); default: the preset's")
    p.add_argument("--tp", nargs="+", type=int, default=None,
                   help="tensor-parallel sizes to run (sub-groups of the world); default: the world size")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--passes", default="fwd,fwdbwd", help="comma list of fwd, fwdbwd")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism (all-reduce MLP)")
    p.add_argument("--activation", default="swiglu", choices=["swiglu", "gelu", "relu"])
    p.add_argument("--naive-k", type=int, nargs="+", default=[2], help="fixed K values for the naive mode")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"])
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--nprocs", type=int, default=2, help="CPU ranks to spawn when not under torchrun")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/mlp_<device>_<time>.json)")
    return p.parse_args(argv)


def _main(rank: int, world: int, args, store_path=None) -> None:
    cuda = torch.cuda.is_available() and store_path is None
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        if store_path is not None:
            dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        else:
            dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    presets = args.preset or (["llama3-8b"] if cuda else ["tiny"])
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    iters = args.iters if args.iters is not None else (10 if cuda else 3)
    repeats = args.repeats if args.repeats is not None else (5 if cuda else 3)
    modes = [m for m in args.modes.split(",") if m]
    passes = [p for p in args.passes.split(",") if p]
    bad = [m for m in modes if m not in MODES] + [p for p in passes if p not in ("fwd", "fwdbwd")]
    if bad:
        raise SystemExit(f"unknown modes/passes {bad}; modes: {MODES}, passes: fwd, fwdbwd")

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    records = []
    out = args.out or os.path.join("bench", "results", f"mlp_{'cuda' if cuda else 'cpu'}_"
                                   f"{datetime.datetime.now():%Y%m%d_%H%M%S}.json")
    for tp in args.tp or [world]:
        if world % tp:
            raise SystemExit(f"--tp {tp} does not divide the world size {world}")
        # Every rank creates every sub-group (new_group is collective over the world).
        groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
        group = groups[rank // tp]
        for preset in presets:
            base = PRESETS[preset]
            for tokens in args.tokens or [base["batch"] * base["seq"]]:
                batch = base["batch"] if tokens % base["batch"] == 0 else 1
                shape = Shape(preset, base["hidden"], base["ffn"], batch, tokens // batch,
                              sequence_parallel=not args.no_sp, activation=args.activation)
                recs = bench_shape(shape, group, device, dtype, modes, passes, args.naive_k, warmup, iters,
                                   repeats, log)
                if rank == 0:  # group 0 speaks for the run; every group ran the same grid
                    records.extend(recs)
                    _write(args, cuda, world, records, out)
                if cuda:
                    torch.cuda.empty_cache()
    if rank == 0:
        print(format_table(records))
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()


def _write(args, cuda, world, records, out) -> None:
    """(Re)write the JSON after every shape, so a run cut short keeps what it measured."""
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__,
                device=torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
                world_size=world, backend="nccl" if cuda else "gloo", command=" ".join(sys.argv),
                nccl_p2p_disable=os.environ.get("NCCL_P2P_DISABLE"),
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)


def format_table(records) -> str:
    head = f"{'preset':11s} {'ws':>2s} {'tokens':>6s} {'pass':6s} {'mode':8s} {'K':>4s} {'ms':>8s} " \
           f"{'pred':>7s} {'/limit':>7s} {'/serial':>7s} {'peak MiB':>9s} {'pred MiB':>9s}"
    lines = [head, "-" * len(head)]
    for r in records:
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        rl = "-" if r["ratio_limit"] is None else f"{r['ratio_limit']:.2f}"
        rs = "-" if r["ratio_serial"] is None else f"{r['ratio_serial']:.2f}"
        pr = "-" if r.get("predicted_ms") is None else f"{r['predicted_ms']:.3f}"
        pk = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.0f}"
        ppk = "-" if r.get("predicted_peak_bytes") is None else f"{r['predicted_peak_bytes'] / 2**20:.0f}"
        lines.append(f"{r['preset']:11s} {r['world_size']:>2d} {r['tokens']:>6d} {r['pass']:6s} {r['mode']:8s} "
                     f"{str(r.get('k', '')):>4s} {ms:>8s} {pr:>7s} {rl:>7s} {rs:>7s} {pk:>9s} {ppk:>9s}"
                     + (f"  ({r['error'][:60]})" if r.get("error") else ""))
    return "\n".join(lines)


def _spawned(rank, world, args, store_path):
    _main(rank, world, args, store_path)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    import torch.multiprocessing as mp
    fd, store = tempfile.mkstemp(prefix="overlap_bench_")
    os.close(fd)
    os.unlink(store)
    mp.spawn(_spawned, args=(args.nprocs, args, store), nprocs=args.nprocs, join=True)
