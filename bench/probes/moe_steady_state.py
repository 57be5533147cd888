"""The MoE at world size 1 in steady state (one GPU): the layer's call with its experts as grouped
GEMMs (what it runs), the same call with one ``torch.mm`` per expert (host sizes, the layer's
fallback, forced here), and the plain grouped-GEMM reference (``bench/references.py``), fwd+bwd.

Why: a call that is mostly GEMMs runs at the clocks the GPU holds under sustained load, which are
lower than a single profiled call's (an H200 at its power limit). Per variant, alternating: the
mean of 10 back-to-back calls (CUDA events, no sync between calls; median and range of
``--repeats``), then a torch.profiler trace of 10 back-to-back calls: span and busy time per call
and the GEMMs' share. The forced per-expert variant is checked to give the grouped variant's
output and gradients first. Prints a table and writes JSON (``--out``).

    PYTHONPATH=. python bench/probes/moe_steady_state.py --preset mixtral-8x7b --out OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

import overlap_layers.layers.moe.plain as plain
from overlap_layers import OverlapMoE
from overlap_layers.bench.moe import PRESETS
from overlap_layers.bench.references import PlainMoE

GEMM_NAMES = ("cutlass", "gemm", "nvjet", "xmma")


def _step(module, x, dy, per_expert: bool, forced: dict):
    def run():
        forced["per_expert"] = per_expert
        module(x).backward(dy)
        for q in module.parameters():
            q.grad = None
        x.grad = None
    return run


def _profiled(fn, calls: int = 10) -> dict:
    """Span, busy (the union of kernels) and GEMM time per call, ms, over ``calls`` back-to-back calls."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spans = sorted((e.time_range.start, e.time_range.end) for e in evs)
    busy, cur = 0.0, None
    for a, b in spans:
        if cur is None or a > cur[1]:
            busy += 0 if cur is None else cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    busy += cur[1] - cur[0]
    gemm = sum(e.time_range.elapsed_us() for e in evs if any(n in e.name for n in GEMM_NAMES))
    return dict(span_ms=(spans[-1][1] - spans[0][0]) / calls / 1e3, busy_ms=busy / calls / 1e3,
                gemm_ms=gemm / calls / 1e3)


def main(argv) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mixtral-8x7b", choices=sorted(set(PRESETS) - {"tiny"}))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dev = torch.device("cuda:0")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    s, dt = PRESETS[args.preset], torch.bfloat16
    T, H, F, E, k = s["tokens"], s["hidden"], s["ffn"], s["experts"], s["top_k"]
    forced = {"per_expert": False}
    grouped_ok = plain.grouped_gemm_ok
    plain.grouped_gemm_ok = lambda *a: not forced["per_expert"] and grouped_ok(*a)
    torch.manual_seed(0)
    layer = OverlapMoE(H, F, E, k, group=dist.group.WORLD, device=dev, dtype=dt)
    ref = PlainMoE(H, F, E, k, group=dist.group.WORLD, device=dev, dtype=dt)
    for q in ref.parameters():
        torch.nn.init.normal_(q, std=0.02)
    x = torch.randn(1, T, H, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    got = []
    for per_expert in (False, True):
        forced["per_expert"] = per_expert
        y = layer(x)
        y.backward(dy)
        got.append([y.detach()] + [q.grad for q in layer.parameters()] + [x.grad])
        for q in layer.parameters():
            q.grad = None
        x.grad = None
    diff = max(float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30))
               for a, b in zip(*got))
    fns = {"layer, grouped GEMMs": _step(layer, x, dy, False, forced),
           "layer, a GEMM per expert": _step(layer, x, dy, True, forced),
           "plain grouped-GEMM reference": _step(ref, x, dy, False, forced)}
    for fn in fns.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    ms = {n: [] for n in fns}
    for _ in range(args.repeats):
        for n, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(10):
                fn()
            b.record()
            b.synchronize()
            ms[n].append(a.elapsed_time(b) / 10)
    rows = {n: dict(ms=statistics.median(v), range=(min(v), max(v)), **_profiled(fns[n])) for n, v in ms.items()}
    ref_ms = rows["plain grouped-GEMM reference"]["ms"]
    flops = 3 * 2 * T * k * H * F * 3  # gate, up and down; forward, data and weight gradients
    print(f"{args.preset}: fwd+bwd of {T} tokens; the per-expert variant's largest relative difference {diff:.1e}")
    print(f"{'variant':30s} {'ms':>7s} {'range':>15s} {'/ref':>5s} {'busy':>7s} {'gemm':>7s} {'gemm TF/s':>9s}")
    for n, r in rows.items():
        print(f"{n:30s} {r['ms']:7.2f} {r['range'][0]:7.2f}-{r['range'][1]:7.2f} {r['ms'] / ref_ms:5.2f} "
              f"{r['busy_ms']:7.2f} {r['gemm_ms']:7.2f} {flops / r['gemm_ms'] / 1e9:9.0f}")
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, preset=args.preset,
                    command="python bench/probes/moe_steady_state.py " + " ".join(argv), max_rel_diff=diff)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, records=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
