"""Probe for a sync-free MoE exchange: rows pulled from the peers' symmetric buffers by a Triton
kernel that reads its row counts and offsets on the device (so a CUDA graph could replay it, where
a copy-engine copy needs its size on the host), against copy-engine pulls of the same bytes; each
alone and beside a GEMM on another stream (the kernel takes SMs, the copy engine none).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 4 \\
        bench/peer_pull_probe.py [--rows 4096] [--width 2048] [--ctas 8 16 32 64 132] [--out FILE]

Every rank pulls ``rows`` rows of ``width`` bf16 from each peer (rank r starts at peer r+1, so the
ranks' reads form permutations) into a local buffer. Printed per transport and CTA count (medians
over the iterations, us): the pull alone, its GB/s (bytes pulled per rank), five GEMMs
([8192, 4096] x [4096, 4096]) alone and beside the pull, and the pull beside them. The copy engine
also runs with a stream per peer (``streams``), and with pushes of the same bytes into every peer's
buffer at the same time (``+ push``: one stream for the pulls and one for the pushes, as the MoE's
device path runs them, or a stream per peer for each), its GB/s still counting the pulled bytes
only. (Until session 38 a last row timed the library's exchange, whose layout has changed since.)
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import triton
import triton.language as tl


@triton.jit
def _pull_rows(ptrs_ptr, counts_ptr, src_starts_ptr, dst_starts_ptr, dst_ptr, W,
               NPEERS: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
    """For each peer p: rows [src_starts[p], + counts[p]) of the bf16 [*, W] buffer at address
    ptrs[p] into rows [dst_starts[p], ...) of ``dst``; programs take ROWS rows at a time in turn."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_W)
    for p in range(NPEERS):
        src = tl.load(ptrs_ptr + p).to(tl.pointer_type(tl.bfloat16))
        n = tl.load(counts_ptr + p)
        s0 = tl.load(src_starts_ptr + p)
        d0 = tl.load(dst_starts_ptr + p)
        for r0 in range(pid * ROWS, n, nprog * ROWS):
            r = r0 + rows
            for c0 in range(0, W, BLOCK_W):
                c = c0 + cols
                m = (r < n)[:, None] & (c < W)[None, :]
                v = tl.load(src + (s0 + r).to(tl.int64)[:, None] * W + c[None, :], mask=m)
                tl.store(dst_ptr + (d0 + r).to(tl.int64)[:, None] * W + c[None, :], v, mask=m)


def _timed(fn, iters, group):
    """Median us of ``fn`` over ``iters`` runs, every rank starting together."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4096, help="rows pulled from each peer")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--ctas", type=int, nargs="+", default=[8, 16, 32, 64, 132])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    from torch.distributed import _symmetric_memory as symm_mem
    group = dist.group.WORLD
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(group.group_name)
    R, W = args.rows, args.width
    buf = symm_mem.empty((2 * ws * R, W), dtype=torch.bfloat16, device=dev)  # rows to pull, then rows pushed to
    buf.copy_(torch.randn(2 * ws * R, W, device=dev).to(torch.bfloat16) + rank)
    handle = symm_mem.rendezvous(buf, group)
    torch.cuda.synchronize()
    dist.barrier(group=group)  # every buffer written before any pull
    peers = [(rank + j) % ws for j in range(1, ws)]
    views = [handle.get_buffer(q, (2 * ws * R, W), torch.bfloat16, 0) for q in peers]
    ptrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=dev)
    counts = torch.full((ws - 1,), R, dtype=torch.int32, device=dev)
    src_starts = torch.full((ws - 1,), rank * R, dtype=torch.int32, device=dev)  # q's rows for r
    dst_starts = torch.arange(ws - 1, dtype=torch.int32, device=dev) * R
    dst = torch.empty(((ws - 1) * R, W), dtype=torch.bfloat16, device=dev)
    want = torch.cat([v[rank * R:(rank + 1) * R] for v in views])
    side = torch.cuda.Stream(device=dev)
    a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    nbytes = (ws - 1) * R * W * 2

    def gemms():
        for _ in range(5):
            torch.mm(a, b)

    def kernel(ctas):
        return lambda: _pull_rows[(ctas,)](ptrs, counts, src_starts, dst_starts, dst, W, NPEERS=ws - 1,
                                           ROWS=8, BLOCK_W=min(1024, triton.next_power_of_2(W)), num_warps=8)

    def engine():
        for j, v in enumerate(views):
            dst[j * R:(j + 1) * R].copy_(v[rank * R:(rank + 1) * R])

    streams = [torch.cuda.Stream(device=dev) for _ in range(2 * (ws - 1))]

    def engines(per_peer: bool, push: bool):
        def run():
            main = torch.cuda.current_stream()
            for j, v in enumerate(views):
                pull_s = streams[j if per_peer else 0]
                pull_s.wait_stream(main)
                with torch.cuda.stream(pull_s):
                    dst[j * R:(j + 1) * R].copy_(v[rank * R:(rank + 1) * R])
                if push:  # this rank's rows for peer j into its second half
                    push_s = streams[ws - 1 + (j if per_peer else 0)]
                    push_s.wait_stream(main)
                    with torch.cuda.stream(push_s):
                        v[(ws + rank) * R:(ws + rank + 1) * R].copy_(buf[j * R:(j + 1) * R])
            for s in streams:
                main.wait_stream(s)
        return run

    def beside(pull):
        """(gemm us, pull us) with the pull on a side stream beside the GEMMs."""
        ga, gb, pa, pb = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        gt, pt = [], []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            dist.barrier(group=group)
            side.wait_stream(torch.cuda.current_stream())
            ga.record()
            with torch.cuda.stream(side):
                pa.record(side)
                pull()
                pb.record(side)
            gemms()
            gb.record()
            torch.cuda.synchronize()
            gt.append(ga.elapsed_time(gb) * 1e3)
            pt.append(pa.elapsed_time(pb) * 1e3)
        return statistics.median(gt), statistics.median(pt)

    gemm_alone = _timed(gemms, args.iters, group)
    rows = []
    variants = [("copy_engine", engine), ("streams", engines(True, False)), ("1 stream + push", engines(False, True)),
                ("streams + push", engines(True, True))]
    for name, pull in variants + [(f"triton {c} CTAs", kernel(c)) for c in args.ctas]:
        dst.zero_()
        pull()
        torch.cuda.synchronize()
        ok = torch.equal(dst, want)
        alone = _timed(pull, args.iters, group)
        g, pb = beside(pull)
        rows.append(dict(pull=name, correct=ok, pull_us=alone, gbps=nbytes / alone / 1e3, gemm_us=gemm_alone,
                         gemm_beside_us=g, pull_beside_us=pb))
    if rank == 0:
        print(f"{ws} ranks, {R} rows x {W} bf16 from each peer ({nbytes / 2**20:.0f} MiB per rank), "
              f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
        print(f"{'pull':>18} {'ok':>3} {'us':>7} {'GB/s':>6} {'gemm us':>8} {'beside':>8} {'pull beside':>11}")
        for r in rows:
            print(f"{r['pull']:>18} {int(r['correct']):>3} {r['pull_us']:7.0f} {r['gbps']:6.0f} {r['gemm_us']:8.0f} "
                  f"{r['gemm_beside_us']:8.0f} {r['pull_beside_us']:11.0f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(ranks=ws, rows=R, width=W, device=torch.cuda.get_device_name(dev),
                               torch=torch.__version__, results=rows), f, indent=1)
    dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
