"""Two kernels of the MoE's training calls timed alone on one GPU (session 41):

* ``weigh_rows`` ([Note: MoE weighted combine] in ``kernels/moe_combine.py``): its forward and
  backward kernels for a grid of columns per step and warps, against ``torch.bmm`` (what the
  layer ran before) and the bandwidth floor at 3.5 TB/s, at qwen3-30b-a3b's and mixtral-8x7b's
  rows (8192 tokens; k 8, H 2048 and k 2, H 4096);
* the device path's weight gradients at qwen3-30b-a3b, EP 4 and 2 ([Note: expert weight
  gradients in one pass] in ``kernels/expert_wgrad.py``): 128 / EP local experts, EP sources of
  65536 / EP rows (random experts), the own rows in two parts and each peer's whole, as the
  backward has them; one pass over the parts (``grouped_wgrad_parts``; ``--old PKG``: another
  copy's too, ``--configs``: with a few tile configurations), one accumulating ``grouped_wgrad``
  per part after a zero fill (session 40's backward), and the same rows made contiguous, by
  ``grouped_wgrad`` and by ``torch._grouped_mm`` (what the compute-only reference runs).

    python bench/moe_backward_probe.py [--wgrad] [--old .ab_old/X/overlap_layers] [--configs] [--out FILE.json]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from expert_wgrad_probe import CONFIGS, _ms  # noqa: E402
from overlap_layers.kernels import expert_wgrad  # noqa: E402
from overlap_layers.kernels import moe_combine  # noqa: E402
from overlap_layers.kernels.expert_wgrad import grouped_wgrad  # noqa: E402


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


def wgrad(name, M, N, ep, old=None, configs=()):
    """One weight's gradient over the device path's parts at qwen3-30b-a3b, EP ``ep`` (module
    docstring), in us: one pass over the parts (and the ``old`` package's, where given; and this
    package's with each of ``configs``), one accumulating ``grouped_wgrad`` per part, the same
    rows contiguous by ``grouped_wgrad`` (one segment per group) and by ``torch._grouped_mm``."""
    dev, dt = "cuda", torch.bfloat16
    G, sources, per = 128 // ep, ep, 8192 * 8 // ep
    # as the backward has them: the own rows in two parts (first and last), each peer whole
    parts = [(0, 0, G // 2), *[(s, 0, G) for s in range(1, sources)], (0, G // 2, G)]
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
    tables = (held[0], starts - base, ends - base)
    out = torch.empty(G, M, N, device=dev, dtype=dt)
    want = torch.zeros(G, M, N, device=dev, dtype=torch.float32)
    for p, (src, lo, hi) in enumerate(parts):
        offs = ends[src, lo:hi] - (ends[src, lo - 1] if lo else 0)
        want[lo:hi] += torch._grouped_mm(a[p].t(), b[p], offs=offs).float()

    def one_pass(module):
        parts_ = module.WgradParts(a, b)
        module.grouped_wgrad_parts(parts_, *tables, out)
        err = ((out.float() - want).norm() / want.norm()).item()
        return _us(lambda: module.grouped_wgrad_parts(parts_, *tables, out), 10), err

    res = dict(weight=name, ep=ep, G=G, M=M, N=N, rows=int(counts.sum()), parts=len(parts))
    res["one_pass_us"], res["one_pass_err"] = one_pass(expert_wgrad)
    if old is not None:
        from inproc_ab import submodule
        res["old_one_pass_us"], res["old_one_pass_err"] = one_pass(submodule(old.__name__, "kernels.expert_wgrad",
                                                                                  "layers.expert_wgrad"))
    kept = (expert_wgrad._BM, expert_wgrad._BN, expert_wgrad._BK, expert_wgrad._WARPS, expert_wgrad._STAGES)
    for cfg in configs:
        expert_wgrad._BM, expert_wgrad._BN, expert_wgrad._BK, expert_wgrad._WARPS, expert_wgrad._STAGES = cfg
        try:
            res["one_pass_" + "x".join(map(str, cfg))] = one_pass(expert_wgrad)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile here
            res["one_pass_" + "x".join(map(str, cfg))] = repr(e)[:80]
    expert_wgrad._BM, expert_wgrad._BN, expert_wgrad._BK, expert_wgrad._WARPS, expert_wgrad._STAGES = kept

    def per_part():
        out.zero_()
        for p, (src, lo, hi) in enumerate(parts):
            grouped_wgrad(a[p], b[p], ends[src, lo:hi] - (ends[src, lo - 1] if lo else 0), out[lo:hi])
    res["per_part_us"] = _us(per_part, 10)
    total = int(counts.sum())
    a_all, b_all = torch.randn(total, M, device=dev, dtype=dt), torch.randn(total, N, device=dev, dtype=dt)
    offs = counts.sum(0).cumsum(0).int()
    res["contiguous_triton_us"] = _us(lambda: grouped_wgrad(a_all, b_all, offs, out, False), 10)
    res["torch_grouped_mm_us"] = _us(lambda: torch._grouped_mm(a_all.t(), b_all, offs=offs), 10)
    print(f"{name} EP {ep} [{G}, {M}, {N}], {total} rows in {len(parts)} parts: one pass {res['one_pass_us']:.0f} us"
          + (f" (old {res['old_one_pass_us']:.0f})" if old is not None else "")
          + f", per part {res['per_part_us']:.0f}; contiguous: Triton {res['contiguous_triton_us']:.0f}, "
          f"torch grouped_mm {res['torch_grouped_mm_us']:.0f} us", flush=True)
    for cfg in configs:
        print(f"  {'x'.join(map(str, cfg))}: {res['one_pass_' + 'x'.join(map(str, cfg))]}", flush=True)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wgrad", action="store_true", help="the weight gradients only")
    p.add_argument("--old", default=None, help="another copy of the package, whose one pass is timed beside")
    p.add_argument("--configs", action="store_true", help="the one pass with each of a few tile configurations")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    old = None
    if args.old:
        from inproc_ab import load_old
        old = load_old(args.old)
    configs = CONFIGS if args.configs else ()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               wgrad=[wgrad(name, M, N, ep, old, configs) for ep in (4, 2)
                      for name, M, N in (("w_in", 1536, 2048), ("w_out", 2048, 768))])
    if not args.wgrad:
        res["weigh_rows"] = [weigh("qwen3-30b-a3b", 8192, 8, 2048), weigh("mixtral-8x7b", 8192, 2, 4096)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
