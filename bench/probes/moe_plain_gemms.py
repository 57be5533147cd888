"""The MoE plain call's six GEMMs (``layers/moe/plain.py``, one GPU) as one grouped GEMM each
(``torch._grouped_mm``, what the layer runs) against a ``torch.mm`` per expert (sizes on the host),
and the layer's fwd+bwd with its kernels by device time.

Per preset, on rows routed at random over the experts (``routed_ends``, as the planner times them):
forward gate/up ``rows @ w_in[e].T`` and down ``act @ w_out[e].T``, the data gradients ``dy @
w_out[e]`` and ``d_pre @ w_in[e]``, the weight gradients ``dy.T @ act`` and ``d_pre.T @ rows``
(in the weights' own layouts). Median of CUDA-event timings (ms) and TFLOP/s of each; then an
``OverlapMoE`` (world size 1) fwd+bwd and its kernels. Prints a table and writes JSON (``--out``).

    PYTHONPATH=. torchrun --nproc-per-node 1 bench/probes/moe_plain_gemms.py [--preset mixtral-8x7b ...]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.distributed as dist

from overlap_layers import OverlapMoE
from overlap_layers.bench.moe import PRESETS
from overlap_layers.layers.moe.experts import routed_ends
from moe_gemm_micro import device_ms  # this folder's probe: the median of event-timed calls


def _kernels(fn, calls: int = 3, top: int = 16) -> list:
    """``[name, us per call, launches per call]`` of the kernels of ``fn``, by device time."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = defaultdict(lambda: [0.0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            rows[ev.name[:100]][0] += ev.time_range.elapsed_us() / calls
            rows[ev.name[:100]][1] += 1 / calls
    return sorted(([name, us, n] for name, (us, n) in rows.items()), key=lambda r: -r[1])[:top]


def gemms(T: int, H: int, F: int, E: int, k: int, dev, dt) -> dict:
    """``{name: (grouped, per expert, flops)}`` for the six GEMMs on random operands."""
    N = T * k
    offs = routed_ends(N, E).to(dev)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    rows, act, pre = (torch.randn(N, n, device=dev, dtype=dt) for n in (H, F, 2 * F))
    w_in = torch.randn(E, 2 * F, H, device=dev, dtype=dt)
    w_out = torch.randn(E, H, F, device=dev, dtype=dt)

    def loop(a, b, transpose_a=False):  # b: per-expert weights, or (transpose_a) rows split as a's
        def run():
            seconds = b.split(sizes) if transpose_a else b
            return [torch.mm(p.t(), q) if transpose_a else torch.mm(p, q) for p, q in zip(a.split(sizes), seconds)]
        return run
    return {
        "fwd gate/up": (lambda: torch._grouped_mm(rows, w_in.transpose(-2, -1), offs=offs),
                        loop(rows, w_in.transpose(-2, -1)), 4 * N * H * F),
        "fwd down": (lambda: torch._grouped_mm(act, w_out.transpose(-2, -1), offs=offs),
                     loop(act, w_out.transpose(-2, -1)), 2 * N * F * H),
        "dgrad down": (lambda: torch._grouped_mm(rows, w_out, offs=offs), loop(rows, w_out), 2 * N * F * H),
        "dgrad gate/up": (lambda: torch._grouped_mm(pre, w_in, offs=offs), loop(pre, w_in), 4 * N * F * H),
        "wgrad down": (lambda: torch._grouped_mm(rows.t(), act, offs=offs), loop(rows, act, True), 2 * N * F * H),
        "wgrad gate/up": (lambda: torch._grouped_mm(pre.t(), rows, offs=offs), loop(pre, rows, True), 4 * N * F * H),
    }


def layer_step(T: int, H: int, F: int, E: int, k: int, dev, dt) -> tuple:
    """``(ms, kernels)`` of an ``OverlapMoE`` fwd+bwd (world size 1) on ``T`` random tokens."""
    layer = OverlapMoE(H, F, E, k, group=dist.group.WORLD, device=dev, dtype=dt)
    x = torch.randn(1, T, H, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        for q in layer.parameters():
            q.grad = None
        layer(x).backward(dy)
    return device_ms(step), _kernels(step)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"],
                   choices=sorted(set(PRESETS) - {"tiny"}))
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = {"command": "bench/probes/moe_plain_gemms.py " + " ".join(argv or []), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(dev), "presets": {}}
    for name in args.preset:
        s = PRESETS[name]
        T, H, F, E, k = s["tokens"], s["hidden"], s["ffn"], s["experts"], s["top_k"]
        res = {}
        for g, (grouped, per_expert, flops) in gemms(T, H, F, E, k, dev, dt).items():
            tg, tl = device_ms(grouped), device_ms(per_expert)
            res[g] = dict(grouped_ms=tg, per_expert_ms=tl, grouped_tflops=flops / tg / 1e9,
                          per_expert_tflops=flops / tl / 1e9)
        torch.cuda.empty_cache()
        res["layer_fwdbwd_ms"], res["kernels"] = layer_step(T, H, F, E, k, dev, dt)
        out["presets"][name] = res
        torch.cuda.empty_cache()
    for name, res in out["presets"].items():
        print(f"{name}: layer fwd+bwd {res['layer_fwdbwd_ms']:.3f} ms")
        for g, r in res.items():
            if isinstance(r, dict):
                print(f"  {g:14s} grouped {r['grouped_ms']:7.3f} ms ({r['grouped_tflops']:4.0f} TF/s)   per expert "
                      f"{r['per_expert_ms']:7.3f} ms ({r['per_expert_tflops']:4.0f} TF/s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
