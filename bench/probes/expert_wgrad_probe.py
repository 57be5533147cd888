"""The experts' weight gradients of one piece of rows added into an accumulator, timed three ways on
one GPU: ``torch._grouped_mm`` alone (what the first piece costs), the same and then ``add_`` into
the accumulator (what each later piece cost before the fused kernel), and ``grouped_wgrad``'s Triton
kernel accumulating in its epilogue, for a few tile configurations ([Note: expert weight gradients
in the GEMM] in ``kernels/expert_wgrad.py``). Shapes: qwen3-30b-a3b's experts (hidden 2048, ffn 768,
SwiGLU) with the rows one source sends a rank at EP 2 and 4 (8192 tokens, top-8, balanced).

    python bench/probes/expert_wgrad_probe.py [--out FILE.json]
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/probes/../..
sys.path.insert(0, ROOT)
from overlap_layers.kernels import expert_wgrad  # noqa: E402

CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 32, 4, 5), (64, 128, 64, 4, 4),
           (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 256, 32, 8, 5), (256, 128, 32, 8, 4)]


def _ms(fn, reps=20):
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for ep in (2, 4):
        El, R = 128 // ep, 8192 * 8 // ep
        ends = torch.full((El,), R // El, device=dev).cumsum(0).to(torch.int32)
        for name, M, N in (("w_in", 1536, 2048), ("w_out", 2048, 768)):
            a = torch.randn(R, M, device=dev, dtype=dt)
            b = torch.randn(R, N, device=dev, dtype=dt)
            out = torch.randn(El, M, N, device=dev, dtype=dt)
            want = torch._grouped_mm(a.t(), b, offs=ends).float()
            row = dict(ep=ep, weight=name, experts=El, rows=R, M=M, N=N)
            row["grouped_ms"] = _ms(lambda: torch._grouped_mm(a.t(), b, offs=ends))
            row["grouped_add_ms"] = _ms(lambda: out.add_(torch._grouped_mm(a.t(), b, offs=ends)))
            for cfg in CONFIGS:
                expert_wgrad._BM, expert_wgrad._BN, expert_wgrad._BK, expert_wgrad._WARPS, expert_wgrad._STAGES = cfg
                o = out.clone()
                try:
                    expert_wgrad.grouped_wgrad(a, b, ends, o, False)
                    err = ((o.float() - want).norm() / want.norm()).item()
                    row["triton_" + "x".join(map(str, cfg))] = (_ms(lambda: expert_wgrad.grouped_wgrad(a, b, ends, o)),
                                                               round(err, 5))
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile here
                    row["triton_" + "x".join(map(str, cfg))] = repr(e)[:80]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'EP':>3} {'weight':>6} {'grouped':>8} {'+add':>8}  " + "  ".join("x".join(map(str, c)) for c in CONFIGS))
    for r in rows:
        cells = [r["triton_" + "x".join(map(str, c))] for c in CONFIGS]
        print(f"{r['ep']:>3} {r['weight']:>6} {r['grouped_ms']:8.3f} {r['grouped_add_ms']:8.3f}  "
              + "  ".join(f"{c[0]:.3f} ({c[1]:.0e})" if isinstance(c, tuple) else "fail" for c in cells))
    if args.out:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), open(args.out, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
