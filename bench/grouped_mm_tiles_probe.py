"""Would a grouped GEMM with smaller row tiles run the MoE device path's parts faster?

The device path runs each source's rows as they arrive: at qwen3-30b-a3b, EP 4, a part holds
about 512 rows per expert, and ``torch._grouped_mm`` runs it about 35% slower per row than one
GEMM over every source's rows (``bench/moe_gemm_micro.py --counts``, session 43; [Note: MoE
training graphs] in ``layers/moe/device.py``). Part of that is each group's last row tile: a
routing's counts rarely fill it. This times, on one GPU, the experts' two forward projections
(``x [R, H] @ w_in^T``, ``h [R, F] @ w_out^T``, per expert) over one part and over the whole rows,
by ``torch._grouped_mm`` and by a Triton grouped GEMM with a few tile shapes, 64-row tiles among
them (the last tile's waste halves, each weight tile is read by twice as many programs); and the
backward's two data-gradient GEMMs (``dy @ w_out``, ``dh @ w_in``) alike.

Reference: ``y[rows of g] = x[rows of g] @ w[g]`` for each group ``g`` (rows by ``offs``, the
groups' ends); the script prints each kernel's relative error against ``torch._grouped_mm``.

``--spread``: instead of Triton, ``torch._grouped_mm`` on its smaller tiles. On Hopper it takes
CUTLASS's 128x256 tiles unless the input's rows per group (its rows over the groups) or N is at
most 128, where it takes 64x128 ping-pong tiles (``aten/src/ATen/native/cuda/GroupMM.cu``). Each
group spread over ``s`` slots (the first holds its rows, the others none; the weights a strided
view whose slot ``s*g`` is ``w[g]``; the last group has one slot, the view ending where ``w``
ends) brings the rows per group to 128 or fewer.

    python bench/grouped_mm_tiles_probe.py [--ep 4] [--spread] [--out FILE.json]
    TRITON_INTERPRET=1 python bench/grouped_mm_tiles_probe.py --tiny     # CPU: the kernel's numerics
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from expert_wgrad_probe import _ms  # noqa: E402

CONFIGS = [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (64, 256, 64, 4, 4),
           (64, 256, 64, 8, 3), (64, 128, 64, 4, 4)]  # (BM, BN, BK, warps, stages)


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, y_ptr, ends_ptr, tile_ends_ptr, G, N, sxm, swg, swk, swn, sym, K: tl.constexpr,
                    GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One [BM, BN] tile of one group's output per program, found on the device as a captured
    call would (no count read on the host): the grid covers a bound of row tiles, the program's
    group is the count of groups whose row tiles end at or before its tile (``tile_ends``, the
    running sum of each group's tiles), and tiles past the last do nothing. The row tiles of a
    group are adjacent (its weight stays in L2 while they run), the column tiles of a row tile
    too (its rows)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    t = pid // tiles_n
    gi = tl.arange(0, GP)
    tile_ends = tl.load(tile_ends_ptr + gi, mask=gi < G, other=2 ** 30)
    g = tl.sum((tile_ends <= t).to(tl.int32), 0)
    real = g < G
    g = tl.minimum(g, G - 1)
    first_tile = tl.where(g > 0, tl.load(tile_ends_ptr + tl.maximum(g - 1, 0)), 0)
    start = tl.where(g > 0, tl.load(ends_ptr + tl.maximum(g - 1, 0)), 0)
    end = tl.load(ends_ptr + g)
    rm = start + (t - first_tile) * BM + tl.arange(0, BM)
    rn = (pid % tiles_n) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    live = (rm < end) & real
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + (k0 + rk)[None, :],
                    mask=live[:, None] & ((k0 + rk)[None, :] < K), other=0.0)
        b = tl.load(w_ptr + g.to(tl.int64) * swg + (k0 + rk)[:, None] * swk + rn[None, :] * swn,
                    mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & (rn[None, :] < N))


def triton_grouped(x, w, offs, cfg, out):
    """``out`` = the module reference for ``x [R, K]`` (rows past ``offs[-1]`` are not read or
    written), ``w [G, K, N]`` (any strides), ``offs [G]`` int32 on the device. Two small ops on
    the device (each group's row tiles, summed) and the kernel over a bound of ``R / BM + G`` row
    tiles: nothing read on the host."""
    BM, BN, BK, warps, stages = cfg
    G, K, N = w.shape
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    tile_ends = torch.cumsum(torch.div(counts + BM - 1, BM, rounding_mode="floor"), 0, dtype=torch.int32)
    grid = ((triton.cdiv(x.shape[0], BM) + G) * triton.cdiv(N, BN),)
    _grouped_kernel[grid](x, w, out, offs, tile_ends, G, N, x.stride(0), w.stride(0), w.stride(1), w.stride(2),
                          out.stride(0), K=K, GP=triton.next_power_of_2(G), BM=BM, BN=BN, BK=BK, num_warps=warps,
                          num_stages=stages)
    return out


def spread_operands(w, offs, spread: int):
    """``(weights, offs)`` for ``torch._grouped_mm`` that give ``torch._grouped_mm(x, w,
    offs=offs)`` with each group spread over ``spread`` slots (module docstring): the weights a
    strided view of ``w`` (no copy), each group's end repeated."""
    G, K, N = w.shape
    if w.stride(0) % spread:
        raise ValueError(f"spread={spread}: must divide the weights' group stride {w.stride(0)}")
    slots = spread * (G - 1) + 1
    view = w.as_strided((slots, K, N), (w.stride(0) // spread, w.stride(1), w.stride(2)))
    repeats = torch.full((G,), spread, device=offs.device)
    repeats[-1] = 1
    return view, offs.repeat_interleave(repeats, output_size=slots)


def tiny() -> None:
    """The kernel against a float64 loop on the CPU (under Triton's interpreter)."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([70, 0, 131, 1, 64])
    G, K, N = len(counts), 48, 40
    x = torch.randn(int(counts.sum()) + 3, K, generator=g)
    w_t = torch.randn(G, N, K, generator=g).transpose(1, 2)  # [G, K, N], as the forward's w_in.transpose(-2, -1)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    for cfg, w in (((32, 32, 16, 4, 2), w_t), ((16, 64, 16, 4, 2), w_t.contiguous())):  # and as the dgrad's w
        out = torch.full((x.shape[0], N), float("nan"))
        triton_grouped(x, w, offs, cfg, out)
        want = torch.cat([x[int(offs[i] - counts[i]):int(offs[i])].double() @ w[i].double() for i in range(G)])
        err = ((out[:len(want)].double() - want).norm() / want.norm()).item()
        print(f"tiny {cfg}: relative error {err:.1e}, rows past the groups untouched: "
              f"{bool(out[len(want):].isnan().all())}")
        assert err < 1e-5 and out[len(want):].isnan().all()
        if hasattr(torch, "_grouped_mm") and cfg[1] == 64:  # the contiguous weights: a 16-byte aligned layout
            xs = x[:, :32].contiguous()
            ws = w[:, :32, :].contiguous()
            view, offs_s = spread_operands(ws, offs, 4)
            spread = torch._grouped_mm(xs, view, offs=offs_s)[:len(want)].double()
            want_s = torch.cat([xs[int(offs[i] - counts[i]):int(offs[i])].double() @ ws[i].double() for i in range(G)])
            err = ((spread - want_s).norm() / want_s.norm()).item()
            print(f"tiny spread over 4 slots: relative error {err:.1e}")
            assert err < 1e-5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="check the kernel on the CPU under the interpreter")
    p.add_argument("--spread", action="store_true", help="torch._grouped_mm's smaller tiles instead of Triton")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tiny:
        return tiny()
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, F, E, k, T = 2048, 768, 128, 8, 8192  # qwen3-30b-a3b, tokens per rank
    El, per = E // args.ep, T * k // args.ep
    g = torch.Generator().manual_seed(0)
    part = torch.bincount(torch.randint(0, El, (per,), generator=g), minlength=El)  # one source's part
    whole = sum(torch.bincount(torch.randint(0, El, (per,), generator=g), minlength=El)
                for _ in range(args.ep - 1)) + part
    w_in = torch.randn(El, 2 * F, H, device=dev, dtype=dt) * 0.02
    w_out = torch.randn(El, H, F, device=dev, dtype=dt) * 0.02
    rows = []
    even = torch.full((El,), per // El)  # a part of balanced routing: every group whole row tiles at EP 4
    for rows_name, counts in (("part", part), ("whole", whole)) + ((("even", even),) if args.spread else ()):
        R = int(counts.sum())
        offs = torch.cumsum(counts, 0).to(dev, torch.int32)
        for proj, w in (("gate/up", w_in.transpose(1, 2)), ("down", w_out.transpose(1, 2)),  # the forward
                        ("dgrad down", w_out), ("dgrad gate/up", w_in)):  # the backward's data gradients
            x = torch.randn(R, w.shape[1], device=dev, dtype=dt)
            want = torch._grouped_mm(x, w, offs=offs)
            row = dict(rows=rows_name, projection=proj, R=R, groups=El,
                       grouped_mm_ms=_ms(lambda: torch._grouped_mm(x, w, offs=offs)))
            if args.spread:
                spread = 1
                while R // (spread * (El - 1) + 1) > 128:  # torch's rows per group (integer division)
                    spread *= 2
                view, offs_s = spread_operands(w, offs, spread)
                got = torch._grouped_mm(x, view, offs=offs_s)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                row.update(spread=spread, spread_ms=_ms(lambda: torch._grouped_mm(x, view, offs=offs_s)),
                           spread_err=err)
                rows.append(row)
                print(f"EP {args.ep} {rows_name:5s} {proj:13s} {R:6d} rows: grouped_mm "
                      f"{row['grouped_mm_ms'] * 1e3:6.0f} us, spread over {spread} {row['spread_ms'] * 1e3:6.0f} us "
                      f"(error {err:.1e})", flush=True)
                continue
            for cfg in CONFIGS:
                out, name = torch.empty_like(want), "triton_" + "x".join(map(str, cfg))
                try:
                    triton_grouped(x, w, offs, cfg, out)
                    err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                    row[name] = (_ms(lambda: triton_grouped(x, w, offs, cfg, out)), err)
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile here
                    row[name] = repr(e)[:80]
            rows.append(row)
            best = min(((v[0], n) for n, v in row.items() if n.startswith("triton_") and isinstance(v, tuple)),
                       default=(float("nan"), "triton_none compiled"))
            print(f"EP {args.ep} {rows_name:5s} {proj:7s} {R:6d} rows: grouped_mm {row['grouped_mm_ms'] * 1e3:6.0f} us,"
                  f" best Triton {best[0] * 1e3:6.0f} us ({best[1][7:]})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, ep=args.ep, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
