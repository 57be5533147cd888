"""Same-process A/B of the MoE's device path ([Note: MoE graph calls] in ``layers/moe/device.py``)
between two versions of the library: training calls (forward and backward) replayed from the
graphs ``config.graph_calls`` captures, with the race ([Note: MoE graph calls: the race]) replaced
by one that always picks the device path (``--eager``: never), interleaved rounds of ``--calls``
calls (old, new, then new, old, ...; the first round warms up), the median over rounds of the
slowest rank's time per call (``--forward``: calls without autograd). Also the relative difference
of the two sides' gradients (``x``'s, then each parameter's; ``--forward``: of their outputs) after
one call on the same weights and tokens, and each side's graph bytes.

The old version is a copy of the package (``git archive OLD overlap_layers | tar x -C .ab_old``).
From the repo root, on a GPU machine with symmetric memory:

    torchrun --nproc-per-node 4 bench/probes/device_path_ab.py .ab_old/overlap_layers --out OUT.json

(``bench/probes/inproc_ab.py`` does the same for the layers' eager plans.)
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/probes/../..
sys.path.insert(0, ROOT)  # the repo's package, as "new"
import overlap_layers as new  # noqa: E402
from inproc_ab import load_old  # noqa: E402
from overlap_layers.bench.moe import PRESETS  # noqa: E402


class Fixed:
    """A race that has decided: every call runs the device path (or none does) and none is timed."""

    timing = False

    def __init__(self, device: bool) -> None:
        self.device = device

    def choose(self, signature) -> bool:
        return self.device

    def finish(self, *args, **kwargs):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the old package folder")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=8192, help="per rank")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--eager", action="store_true", help="both sides eager (the race never picks the device path)")
    p.add_argument("--forward", action="store_true", help="calls without autograd (compares the outputs)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, ws = dist.get_rank(), dist.get_world_size()
    old = load_old(os.path.abspath(a.old))
    s = PRESETS[a.preset]
    H, F, E, k = s["hidden"], s["ffn"], s["experts"], s["top_k"]
    torch.manual_seed(0)
    dt = torch.bfloat16

    def randn(*shape, fan_in):
        return torch.randn(*shape, device=dev, dtype=dt) * fan_in ** -0.5
    dense = (randn(E, H, fan_in=H), randn(E, 2 * F, H, fan_in=H), randn(E, H, F, fan_in=F))
    torch.manual_seed(1 + rank)  # every rank its own tokens
    x = torch.randn(1, a.tokens, H, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    layers = {}
    for name, pkg in (("old", old), ("new", new)):
        layers[name] = pkg.OverlapMoE.from_dense(*dense, top_k=k, group=dist.group.WORLD, num_tiles=1,
                                                 config=pkg.OverlapConfig(graph_calls=True))
        path = getattr(layers[name], "_device_path", None)  # the old version's layer holds its race itself
        if path is not None:
            path.race = Fixed(not a.eager)
        else:
            layers[name]._device_race = Fixed(not a.eager)
    def call(layer):  # one call; returns what the two sides compare
        if a.forward:
            with torch.no_grad():
                return [layer(x)]
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)
        return [x.grad.clone()] + [q.grad.clone() for q in layer.parameters() if q.grad is not None]

    grads, peak = {}, {}
    for name, layer in layers.items():
        for _ in range(3):  # the first captures
            call(layer)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads[name] = call(layer)
        torch.cuda.synchronize()
        peak[name] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    diff = [((g1.float() - g0.float()).norm() / g0.float().norm().clamp_min(1e-30)).item()
            for g0, g1 in zip(grads["old"], grads["new"])]
    times = {"old": [], "new": []}
    for rd in range(a.rounds):
        for name in (("old", "new") if rd % 2 == 0 else ("new", "old")):
            layer = layers[name]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.calls):
                if a.forward:
                    with torch.no_grad():
                        layer(x)
                else:
                    layer(x).backward(dy)
            torch.cuda.synchronize()
            ms = torch.tensor([(time.perf_counter() - t) / a.calls * 1e3], device=dev)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            if rd:
                times[name].append(ms.item())
    res = {n: statistics.median(v) for n, v in times.items()}
    pool = {n: getattr(m._call_graphs, "last_nbytes", None) for n, m in layers.items() if m._call_graphs is not None}
    if rank == 0:
        kind = ("eager" if a.eager else "device") + (" fwd" if a.forward else "")
        print(f"{a.preset} ep{ws} {kind}: old {res['old']:.3f} new {res['new']:.3f} ms "
              f"(new/old {res['new'] / res['old']:.3f}); rounds old {[round(t, 3) for t in times['old']]} new "
              f"{[round(t, 3) for t in times['new']]}; grad rel diff {[f'{d:.1e}' for d in diff]}; "
              f"peak MiB {peak}; graph bytes {pool}", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(dict(preset=a.preset, ep=ws, tokens=a.tokens, forward=a.forward, times=times, median=res,
                               grad_rel_diff=diff, peak_mib=peak, graph_bytes=pool), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
