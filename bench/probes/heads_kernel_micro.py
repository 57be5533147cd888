"""Device time of the attention's heads step (``kernels/heads.py``) by CUDA-graph replay.

A loop of launches measures the host when each launch costs more host time than the kernel runs
(on the H200 machine a Triton launch costs 60-100 us of host, the kernel of one rank's chunk
40), so the launches are captured into a graph and replayed. For the llama3-8b shape at TP 2
(``g, b, s = 2, 2, 4096``; 16 query and 4 KV heads of 128 on a rank): the whole tile and one
rank's chunk, forward (rows to heads, RoPE) and backward. With an old copy of the package
(``git archive OLD overlap_layers | tar x -C .ab_old``) it times the old kernel beside the current
one and checks that both write the same bits.

    python bench/probes/heads_kernel_micro.py [.ab_old/overlap_layers]
"""
import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/probes/../..
sys.path.insert(0, ROOT)  # the repo's package
from overlap_layers.kernels import heads as heads_kernel  # noqa: E402

G, B, S, NQ, NKV, D = 2, 2, 4096, 16, 4, 128


def load(path: str):
    """The heads kernel module of the package at ``path``, imported as ``ol_old`` (its imports are
    relative, as :func:`inproc_ab.load_old` does it)."""
    from inproc_ab import load_old, submodule
    load_old(path)
    return submodule("ol_old", "kernels.heads", "layers.heads_kernel")


def graphed_us(fn, n: int = 50, replays: int = 5) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of ``n`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * n) * 1e3


def main() -> None:
    if not torch.cuda.is_available() or heads_kernel.triton is None:
        raise SystemExit("needs CUDA and Triton")
    sides = {"current": heads_kernel}
    if len(sys.argv) > 1:
        sides = {"old": load(sys.argv[1]), **sides}
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = torch.randn(G, B, S, (NQ + 2 * NKV) * D, device=dev, dtype=dt)
    tables = tuple(torch.randn(1, G, S, D, device=dev, dtype=dt) for _ in range(2))
    print(torch.cuda.get_device_name(), torch.__version__)
    for case, sl in (("tile", slice(None)), ("chunk", slice(1, 2))):
        outs, times = {}, {}
        for name, mod in sides.items():
            heads = [torch.full((B, n, G * S, D), float("nan"), device=dev, dtype=dt).view(B, n, G, S, D)[:, :, sl]
                     for n in (NQ, NKV, NKV)]
            tabs = tuple(t[:, sl] for t in tables)
            d_rows = torch.full_like(rows[sl], float("nan"))
            for backward, r in ((False, rows[sl]), (True, d_rows)):
                def fn(mod=mod, r=r, heads=heads, tabs=tabs, backward=backward):
                    assert mod.move_heads(r, heads, tabs, NQ, NKV, D, backward)
                fn()
                times[name, backward] = graphed_us(fn)
            outs[name] = [*heads, d_rows]
        same = "" if len(outs) < 2 else "  bitwise equal: " + str(
            all(torch.equal(a, b) for a, b in zip(*outs.values())))
        for backward in (False, True):
            print(f"{case:5s} {'bwd' if backward else 'fwd'}  " + "  ".join(
                f"{name} {times[name, backward]:6.1f} us" for name in sides) + same)


if __name__ == "__main__":
    main()
