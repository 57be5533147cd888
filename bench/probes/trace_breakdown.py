"""Where a profiled call's time goes on the device, from a bench trace (``--profile DIR``).

Usage: ``python bench/trace_breakdown.py CALLS TRACE.json [TRACE.json ...]`` (CALLS: the
``--profile-calls`` of the bench run), ``python bench/trace_breakdown.py --timeline
TRACE.json`` (a trace of one call) for the order of its kernels, or ``python
bench/trace_breakdown.py --host CALLS TRACE.json`` for where the host's time goes. Per trace, per
call (us):

* ``span``: first device event to last, divided by the calls;
* ``compute``: time some kernel other than a collective runs (the union over streams);
* ``comm only``: time only copies (copy engine, "Memcpy"), NCCL kernels or symmetric-memory
  signal kernels (a wait on a peer) run;
* ``idle``: time nothing runs (the host, or a wait on another rank);
* then the kernels with the most time (name, count and us per call); ``gemm`` sums every GEMM.

``--timeline`` lists every device event of at least 20 us (start and end from the first event,
stream, name), and then the gaps in communication: where no NCCL kernel or copy runs, with the
compute that ran meanwhile. In a communication-bound call those gaps are what it loses.

``--compute-gaps`` lists where no compute kernel runs (gaps of at least 2 us, from the first
compute kernel to the last): its start, its length, the compute kernels before and after it and
the copies, signals or collectives that ran meanwhile. In a compute-bound call (rank chunks over
the copy engine) these gaps, the sums and the copies outside the graphs are what it loses against
the compute-only reference (session 33: the MLP's fwd+bwd, 140 us of gaps per call on a slow
rank).

``--host`` sums, per call, the host time of each ``bench::call`` range, of the executor's
``overlap::<program>::<op>`` ranges by op (the time to launch that op: its Python, its torch ops'
dispatch and its kernel launches), the rest of the call outside them (agreement, planning lookup,
building programs, autograd), and lists the torch ops with the most host time (inclusive, so
nested ops count in their callers too). An eager call whose host time reaches its device time is
host-bound, and this says which ops cost it. The profiler's own cost per op inflates these host
times 2-5x (H200 machine, session 25): they rank the ops, but ``bench/host_phases.py`` times the
host without a profiler.

A call whose ``compute`` is close to the compute-only reference's and whose ``idle`` is large is
host-bound; ``comm only`` is exposed communication; ``compute`` above the reference's is
compute that got slower (smaller GEMMs, extra passes, or memory traffic beside the copies).
"""
import json
import sys
from collections import defaultdict


def _union(intervals):
    total, cur = 0.0, None
    for s, f in sorted(intervals):
        if cur and s <= cur[1]:
            cur[1] = max(cur[1], f)
        else:
            if cur:
                total += cur[1] - cur[0]
            cur = [s, f]
    return total + (cur[1] - cur[0] if cur else 0.0)


def _is_comm(e) -> bool:
    n = e["name"].lower()
    return e.get("cat") in ("gpu_memcpy", "gpu_memset") or "nccl" in n or "symmetric_memory" in n


def _is_gemm(name: str) -> bool:
    n = name.lower()
    return any(s in n for s in ("gemm", "nvjet", "cutlass", "sm90_xmma", "grouped_mm", "matmul"))


def breakdown(path: str, calls: int, top: int = 16) -> str:
    ev = json.load(open(path))["traceEvents"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not gpu:
        return f"{path}: no device events"
    a = min(e["ts"] for e in gpu)
    b = max(e["ts"] + e["dur"] for e in gpu)
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if not _is_comm(e)]
    every = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    c, busy = _union(comp), _union(every)
    tot, cnt = defaultdict(float), defaultdict(int)
    gemm = 0.0
    for e in gpu:
        n = e["name"][:80]
        tot[n] += e["dur"]
        cnt[n] += 1
        if not _is_comm(e) and _is_gemm(n):
            gemm += e["dur"]
    lines = [f"== {path}",
             f"span {(b - a) / calls:8.1f}  compute {c / calls:8.1f}  comm only {(busy - c) / calls:8.1f}  "
             f"idle {(b - a - busy) / calls:8.1f}  gemm (sum) {gemm / calls:8.1f}  us/call"]
    for n, t in sorted(tot.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {t / calls:8.1f} us  x{cnt[n] / calls:5.1f}  {n}")
    return "\n".join(lines)


def timeline(path: str, min_us: float = 20.0, min_gap: float = 30.0) -> str:
    ev = json.load(open(path))["traceEvents"]
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    if not gpu:
        return f"{path}: no device events"
    a = gpu[0]["ts"]
    lines = [f"== {path}", "   start      end     dur  stream  name"]
    small = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        if e["dur"] < min_us:
            small[e.get("args", {}).get("stream")][0] += 1
            small[e.get("args", {}).get("stream")][1] += e["dur"]
            continue
        lines.append(f"{e['ts'] - a:8.0f} {e['ts'] + e['dur'] - a:8.0f} {e['dur']:7.0f}  "
                     f"{str(e.get('args', {}).get('stream')):>6}  {e['name'][:70]}")
    for st, (n, t) in sorted(small.items(), key=lambda kv: str(kv[0])):
        lines.append(f"  stream {st}: {n} events under {min_us:.0f} us, {t:.0f} us in all")
    comm = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu if _is_comm(e))
    lines.append(f"gaps in communication of at least {min_gap:.0f} us (start, length, compute meanwhile):")
    end = a
    for s, f in comm + [(max(e["ts"] + e["dur"] for e in gpu), None)]:
        if s - end >= min_gap:
            busy = _union([(max(e["ts"], end), min(e["ts"] + e["dur"], s)) for e in gpu
                           if not _is_comm(e) and e["ts"] < s and e["ts"] + e["dur"] > end])
            lines.append(f"  {end - a:8.0f} {s - end:7.0f}  compute {busy:7.0f}")
        if f is not None:
            end = max(end, f)
    return "\n".join(lines)


def compute_gaps(path: str, min_gap: float = 2.0) -> str:
    ev = json.load(open(path))["traceEvents"]
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    comp = [e for e in gpu if not _is_comm(e)]
    if not comp:
        return f"{path}: no compute kernels"
    a = gpu[0]["ts"]
    gaps, cur = [], [comp[0]["ts"], comp[0]["ts"] + comp[0]["dur"], comp[0]["name"]]
    for e in comp[1:]:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > cur[1]:
            gaps.append((cur[1], s, cur[2], e["name"]))
            cur = [s, f, e["name"]]
        elif f > cur[1]:
            cur[1], cur[2] = f, e["name"]
    shown = [g for g in gaps if g[1] - g[0] >= min_gap]
    lines = [f"== {path}", f"compute idle {sum(f - s for s, f, _, _ in gaps):.0f} us in {len(gaps)} gaps; "
             f"those of at least {min_gap:g} us (start, length, after, before | other work meanwhile):"]
    for s, f, before, after in shown:
        other = [f"{e['name'][:28]}({e['dur']:.0f})" for e in gpu if _is_comm(e) and e["ts"] < f and e["ts"] + e["dur"] > s]
        lines.append(f"  {s - a:8.0f} {f - s:6.0f}  after {before[:30]:30s} before {after[:30]:30s} | {' '.join(other)}")
    return "\n".join(lines)


def host(path: str, calls: int, top: int = 12) -> str:
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    per_call = sum(e["dur"] for e in ev if e["name"] == "bench::call") / calls
    ranges, ops = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for e in ev:
        if e.get("cat") == "user_annotation" and e["name"].startswith("overlap::"):
            r = ranges[e["name"].split("[")[0]]
        elif e.get("cat") == "cpu_op":
            r = ops[e["name"]]
        else:
            continue
        r[0] += e["dur"]
        r[1] += 1
    inside = sum(t for t, _ in ranges.values()) / calls
    lines = [f"== {path}", f"host per call {per_call:8.1f} us: in the executor's ops {inside:8.1f}, "
             f"outside them {per_call - inside:8.1f}", "  executor ops (us per call, count per call):"]
    for name, (t, n) in sorted(ranges.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {t / calls:8.1f} us  x{n / calls:5.1f}  {name}")
    lines.append(f"  torch ops with the most host time (inclusive), top {top}:")
    for name, (t, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / calls:8.1f} us  x{n / calls:5.1f}  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--host":
        for p in sys.argv[3:]:
            print(host(p, int(sys.argv[2])))
        sys.exit(0)
    if len(sys.argv) >= 3 and sys.argv[1] == "--timeline":
        for p in sys.argv[2:]:
            print(timeline(p))
        sys.exit(0)
    if len(sys.argv) >= 3 and sys.argv[1] == "--compute-gaps":
        for p in sys.argv[2:]:
            print(compute_gaps(p))
        sys.exit(0)
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    n = int(sys.argv[1])
    for p in sys.argv[2:]:
        print(breakdown(p, n))
