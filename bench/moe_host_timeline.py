"""Where an eager OverlapMoE call spends its host time: host timestamps around the layer's internal
steps (wrapped by name, so this diagnostic follows the code it wraps), per call, unprofiled.

For each plan (serial: K=1 over NCCL; rank_ce: rank chunks over the copy engine), forward under
no_grad, from an idle device ("idle") and back to back ("back2back"): the loop's ms per call, the
host's time per call, each wrapped step's host us per call, and the marks of the middle call (us
from the call's start). "read" is the host's wait for the all-to-all split sizes ([Note: MoE host
syncs]); the host ops at the end time single launches of the copy-engine exchange's pieces. From
the repo root, on a 4-GPU machine:

    torchrun --nproc-per-node 4 bench/moe_host_timeline.py --out OUT/moe_host_timeline.json
"""
import argparse
import collections
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from overlap_layers import OverlapMoE  # noqa: E402
from overlap_layers.bench.moe import PRESETS  # noqa: E402
from overlap_layers.layers.moe import layer as moe_mod, ranks as moe_ranks  # noqa: E402
from overlap_layers.launch import run_ranks  # noqa: E402
from overlap_layers.planning.plan import TilePlan  # noqa: E402
from overlap_layers.runtime import exchange, rank_all_to_all as ra  # noqa: E402

CALLS = 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--out", default=None)
    run_ranks(run, p.parse_args())


def run(dev: torch.device, args) -> None:
    """The timeline on this rank (under torchrun, through ``run_ranks``)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    s = PRESETS[args.preset]
    layer = OverlapMoE(s["hidden"], s["ffn"], s["experts"], s["top_k"], group=dist.group.WORLD, num_tiles=1,
                       dtype=torch.bfloat16, device=dev)
    total, marks = collections.defaultdict(float), []

    def wrap(obj, attr, name):
        f = getattr(obj, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            marks.append((name + ">", t))
            try:
                return f(*a, **k)
            finally:
                e = time.perf_counter()
                total[name] += e - t
                marks.append((name + "<", e))
        setattr(obj, attr, timed)

    for obj, attr, name in [(layer, "_agree", "agree"), (layer, "_route_and_count", "route"),
                            (moe_mod, "all_gather_rows", "gather_counts"), (moe_mod.HostReader, "start", "read_start"),
                            (moe_ranks.RankCall, "__init__", "RankCall"), (moe_ranks, "forward", "ranks.forward"),
                            (moe_ranks, "experts_forward", "experts"), (moe_mod, "piece_offsets", "piece_offsets"),
                            (moe_mod, "launch_first", "launch_first"),
                            (ra.CopyEngineAllToAll, "__init__", "ce.init"), (ra.CopyEngineAllToAll, "ready", "ce.ready"),
                            (ra.CopyEngineAllToAll, "start", "ce.start"), (ra.CopyEngineAllToAll, "pull", "ce.pull"),
                            (ra.CopyEngineAllToAll, "push", "ce.push"), (ra.CopyEngineAllToAll, "finish", "ce.finish"),
                            (moe_ranks, "gather_back", "gather_back"), (moe_mod, "_tile_tensors", "tile_tensors"),
                            (moe_mod, "_tiles", "tiles"), (moe_mod._ExpertExchange, "forward", "exchange.forward")]:
        wrap(obj, attr, name)
    start = moe_mod.HostReader.start

    def read_timed(self, t):
        read = start(self, t)

        def timed():
            a = time.perf_counter()
            out = read()
            e = time.perf_counter()
            total["read"] += e - a
            marks.extend([("read>", a), ("read<", e)])
            return out
        return timed
    moe_mod.HostReader.start = read_timed

    torch.manual_seed(1 + rank)
    x = torch.randn(1, s["tokens"], s["hidden"], device=dev, dtype=torch.bfloat16)
    res = {}
    for plan in ("serial", "rank_ce"):
        layer.pin_plan(TilePlan(1) if plan == "serial" else TilePlan(1, decomposition="rank", transport="copy_engine"))
        with torch.no_grad():
            for _ in range(5):
                layer(x)
            for mode in ("idle", "back2back"):
                torch.cuda.synchronize()
                dist.barrier()
                total.clear()
                calls = []
                for _ in range(CALLS):
                    if mode == "idle":
                        torch.cuda.synchronize()
                    marks.clear()
                    t0 = time.perf_counter()
                    layer(x)
                    calls.append([(n, (t - t0) * 1e6) for n, t in marks] + [("end", (time.perf_counter() - t0) * 1e6)])
                per_fn = {k: v / CALLS * 1e6 for k, v in total.items()}
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    layer(x)
                torch.cuda.synchronize()
                loop = (time.perf_counter() - t0) / CALLS * 1e3
                host = sorted(c[-1][1] for c in calls)[CALLS // 2]
                res[f"{plan}/{mode}"] = dict(loop_ms=loop, host_us=host, per_step_us=per_fn, marks_us=calls[CALLS // 2])
                if rank == 0:
                    print(f"{plan} {mode}: loop {loop:.3f} ms/call, host {host:.0f} us/call", flush=True)
                    print("  steps us/call: " + " ".join(f"{k}={v:.0f}" for k, v in
                                                        sorted(per_fn.items(), key=lambda kv: -kv[1])), flush=True)
                    print("  marks us: " + " ".join(f"{n}={t:.0f}" for n, t in calls[CALLS // 2]), flush=True)
    w = exchange.shared_workspace(dist.group.WORLD, dev)  # the layer's, grown by its calls
    mine = w.view(rank, (1024, s["hidden"]), torch.bfloat16, 0)
    peer = w.view((rank + 1) % ws, (1024, s["hidden"]), torch.bfloat16, 0)
    local = torch.empty_like(mine)
    side = w.pull_stream

    def signal_pair():  # every rank puts and waits alike, so every flag is consumed
        w.handle.put_signal((rank + 1) % ws, 0)
        w.handle.wait_signal((rank - 1) % ws, 0)

    def stream_switch():
        with torch.cuda.stream(side):
            pass
    ops = {"put+wait signal": signal_pair, "peer copy_": lambda: local.copy_(peer),
           "local copy_": lambda: local.copy_(mine),
           "wait_stream": lambda: side.wait_stream(torch.cuda.current_stream()), "stream switch": stream_switch,
           "record_stream": lambda: local.record_stream(side), "slice": lambda: mine[3:700]}
    host_ops = {}
    for name, f in ops.items():
        for _ in range(10):
            f()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(100):
            f()
        host_ops[name] = (time.perf_counter() - t0) / 100 * 1e6
        torch.cuda.synchronize()
        dist.barrier()
    res["host_op_us"] = host_ops
    if rank == 0:
        print("host us per op: " + " ".join(f"{k}={v:.1f}" for k, v in host_ops.items()), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=dict(preset=args.preset, world_size=ws, torch=torch.__version__,
                                         device=torch.cuda.get_device_name(dev)), results=res), f, indent=1)


if __name__ == "__main__":
    main()
