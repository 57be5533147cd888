"""Two kernels of the MoE's training calls timed alone on one GPU (session 41):

* ``weigh_rows`` ([Note: MoE weighted combine] in ``layers/moe_combine.py``): its forward and
  backward kernels for a grid of columns per step and warps, against ``torch.bmm`` (what the
  layer ran before) and the bandwidth floor at 3.5 TB/s, at qwen3-30b-a3b's and mixtral-8x7b's
  rows (8192 tokens; k 8, H 2048 and k 2, H 4096);
* the device path's weight gradients at qwen3-30b-a3b, EP 4 ([Note: expert weight gradients in
  one pass] in ``layers/expert_wgrad.py``): 32 local experts, four sources of 16384 rows (random
  experts), the own and the last source in two parts as the exchange has them; one pass over the
  parts (``grouped_wgrad_parts``), one accumulating ``grouped_wgrad`` per part after a zero fill
  (session 40's backward), and ``torch._grouped_mm`` over the same rows made contiguous (what the
  compute-only reference runs).

    python bench/moe_backward_probe.py [--out FILE.json]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from expert_wgrad_probe import _ms  # noqa: E402
from overlap_layers.layers import moe_combine  # noqa: E402
from overlap_layers.layers.expert_wgrad import WgradParts, grouped_wgrad, grouped_wgrad_parts  # noqa: E402


def _us(fn, reps=20):
    return _ms(fn, reps) * 1e3


def weigh(name, T, k, H):
    import triton
    dev, dt = "cuda", torch.bfloat16
    rows, w = torch.randn(T, k, H, device=dev, dtype=dt), torch.rand(T, k, device=dev, dtype=dt)
    dy, y = torch.randn(T, H, device=dev, dtype=dt), torch.empty(T, H, device=dev, dtype=dt)
    d_rows, d_w = torch.empty_like(rows), torch.empty_like(w)
    rg, wg = rows.clone().requires_grad_(), w.clone().requires_grad_()
    bmm_fwd = _us(lambda: torch.bmm(w.unsqueeze(1), rows))
    bmm_bwd = _us(lambda: torch.autograd.grad(torch.bmm(wg.unsqueeze(1), rg).squeeze(1), (rg, wg), dy)) - bmm_fwd
    floor = rows.numel() * rows.element_size() / 3.5e12 * 1e6
    out = dict(shape=name, T=T, k=k, H=H, bmm_fwd_us=bmm_fwd, bmm_bwd_us=bmm_bwd, floor_fwd_us=floor,
               floor_bwd_us=2 * floor, variants=[])
    print(f"{name}: bmm fwd {bmm_fwd:.0f} us, bwd {bmm_bwd:.0f} us; floor fwd {floor:.0f}, bwd {2 * floor:.0f} us")
    KP = triton.next_power_of_2(k)
    for block in (256, 512, 1024, 2048):
        for warps in (2, 4, 8):
            if block * KP > 16384:
                continue
            meta = dict(H=H, K=k, KP=KP, BLOCK_H=block, WIDE=False, num_warps=warps)
            fwd = _us(lambda: moe_combine._weigh_kernel[(T,)](rows, w, y, **meta))
            bwd = _us(lambda: moe_combine._weigh_backward_kernel[(T,)](rows, w, dy, d_rows, d_w, **meta))
            chosen = block == moe_combine._block(H, k) and warps == 4
            out["variants"].append(dict(block_h=block, warps=warps, fwd_us=fwd, bwd_us=bwd, chosen=chosen))
            mark = " (chosen)" if chosen else ""
            print(f"  {block:5d} columns, {warps} warps: fwd {fwd:6.1f} us, bwd {bwd:6.1f} us{mark}")
    return out


def wgrad(name, M, N, G=32, sources=4, per=16384):
    dev, dt = "cuda", torch.bfloat16
    parts = [(0, 0, G // 2), (0, G // 2, G), *[(s, 0, G) for s in range(1, sources - 1)],
             (sources - 1, 0, G // 2), (sources - 1, G // 2, G)]
    g = torch.Generator().manual_seed(0)
    counts = torch.stack([torch.bincount(torch.randint(0, G, (per,), generator=g), minlength=G)
                          for _ in range(sources)]).int().to(dev)  # [source, G]
    ends = counts.cumsum(1).int()
    a = [torch.randn(per, M, device=dev, dtype=dt) for _ in parts]
    b = [torch.randn(per, N, device=dev, dtype=dt) for _ in parts]
    held = torch.zeros(2, sources, G, dtype=torch.int64, device=dev)
    for p, (src, lo, hi) in enumerate(parts):
        held[0, src, lo:hi] = p
        held[1, src, lo:hi] = lo
    starts = ends - counts
    base = starts.gather(1, held[1])
    table, out = WgradParts(a, b), torch.empty(G, M, N, device=dev, dtype=dt)
    one = _us(lambda: grouped_wgrad_parts(table, held[0], starts - base, ends - base, out), 10)

    def per_part():
        out.zero_()
        for p, (src, lo, hi) in enumerate(parts):
            grouped_wgrad(a[p], b[p], ends[src, lo:hi] - (ends[src, lo - 1] if lo else 0), out[lo:hi])
    each = _us(per_part, 10)
    total = int(counts.sum())
    a_all, b_all = torch.randn(total, M, device=dev, dtype=dt), torch.randn(total, N, device=dev, dtype=dt)
    offs = counts.sum(0).cumsum(0).int()
    dense = _us(lambda: torch._grouped_mm(a_all.t(), b_all, offs=offs), 10)
    print(f"{name} [{G}, {M}, {N}], {total} rows: one pass {one:.0f} us, per part ({len(parts)}) {each:.0f} us, "
          f"torch grouped_mm on contiguous rows {dense:.0f} us")
    return dict(weight=name, G=G, M=M, N=N, rows=total, parts=len(parts), one_pass_us=one, per_part_us=each,
                torch_grouped_mm_us=dense)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               weigh_rows=[weigh("qwen3-30b-a3b", 8192, 8, 2048), weigh("mixtral-8x7b", 8192, 2, 4096)],
               wgrad=[wgrad("w_in", 1536, 2048), wgrad("w_out", 2048, 768)])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
