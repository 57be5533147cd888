"""The benchmark's CPU default runs end to end (so the README's main job cannot rot)."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from pool import torchrun


def test_bench_cpu_default(tmp_path):
    out = tmp_path / "mlp.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "overlap_layers.bench", "--out", str(out), "--iters", "1",
                           "--repeats", "3", "--warmup", "1"], cwd=root, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    recs = data["records"]
    _check_modes_and_limits(recs, ("fwd", "fwdbwd"))
    for r in recs:  # each repeat's time is kept; the row's time is their median, spread their range
        if r["ms"] is not None:
            assert len(r["repeat_ms"]) == 3 and r["ms"] == sorted(r["repeat_ms"])[1]
            assert r["spread"] == dict(min_ms=min(r["repeat_ms"]), max_ms=max(r["repeat_ms"]), n=3)
            gcs = r["gc_full_ms"]  # each rank's full collections, by rank
            assert set(gcs) == {"setup", "timed"} and all(len(by_rank) == 2 for by_rank in gcs.values())
            assert all(ms >= 1.0 for by_rank in gcs.values() for got in by_rank for ms in got)
    assert [r["k"] for r in recs if r["mode"] == "naive"] == [2, 2]
    assert "serial" in proc.stdout and "/limit" in proc.stdout
    # CPU: gloo, and no copy-engine probe (rank_ce needs CUDA, so it does not run)
    assert "copy-engine" not in proc.stderr and "NVLink" not in proc.stdout + proc.stderr
    auto = [r for r in recs if r["mode"] == "auto"]
    assert all(r["host_plan_lookup_us"] > 0 and r["host_agreement_us"] > 0 and r["planning_ms"] > 0 for r in auto)
    for r in auto:  # the verification's numbers: this rank's trials, and what the decision compared
        if "verified on the first calls" not in r["reason"]:
            assert r["verification"] is None
            continue
        assert [v["plan"] for v in r["verification"]][-1] == "K=1"
        for v in r["verification"]:
            assert f"{v['plan']} {v['ms']:.3f} ms" in r["reason"] and v["trials"]
            assert min(max(t["device_ms"], t["host_ms"]) for t in v["trials"]) <= v["ms"] * (1 + 1e-9)
            # each trial's slowest rank: the decision's number is the best of those
            assert len(v["slowest"]) == len(v["trials"]) and {s["rank"] for s in v["slowest"]} <= {0, 1}
            assert abs(min(s["ms"] for s in v["slowest"]) - v["ms"]) <= 1e-9 * v["ms"]
    # The report reads the run back (fixed K=1 and K=2 rows and auto for both passes).
    from overlap_layers.bench.report import report
    text = report(recs)
    assert text.count("| tiny | 2 |") == 2 and "Auto within 3% of the best measured plan on" in text


def test_full_collections_are_timed_while_the_block_runs():
    """The bench's record of Python's full collections: each one of at least ``min_ms`` while
    the block runs, none of generations 0 and 1, none after it (the callback goes)."""
    import gc

    from overlap_layers.bench.runner import full_collections
    before = list(gc.callbacks)
    junk = [[i] for i in range(200000)]  # something for the collector to walk
    with full_collections(min_ms=0.0) as got:
        gc.collect(0)
        gc.collect(1)
        assert got == []
        gc.collect()
        gc.collect(2)
    assert len(got) == 2 and all(ms >= 0.0 for ms in got) and gc.callbacks == before
    with full_collections(min_ms=1e6) as none:
        gc.collect()
    assert none == [] and junk


def _check_reference(recs):
    """Each pass has a reference record (the plain torch module); every record's ratio to it is its
    time over the reference's, its TFLOP/s the pass's FLOPs over its time (off CUDA: no peak, no
    efficiency); the FLOPs are the layer's per rank, independent of the mode."""
    for p in {r["pass"] for r in recs}:
        rows = [r for r in recs if r["pass"] == p]
        ref = [r for r in rows if r["mode"] == "reference"]
        assert len(ref) == 1 and ref[0]["ms"] > 0, rows
        assert len({r["flops"] for r in rows}) == 1 and rows[0]["flops"] > 0
        for r in rows:
            assert abs(r["ratio_reference"] - r["ms"] / ref[0]["ms"]) <= 1e-9 * r["ratio_reference"]
            if r["mode"] != "comm":
                assert abs(r["tflops"] - r["flops"] / r["ms"] / 1e9) <= 1e-9 * r["tflops"]
            assert r["efficiency"] is None


def test_bench_reference_mode_for_each_layer_kind(tmp_path):
    """The ``reference`` mode (bench/references.py) runs beside the layer for MLP, attention and
    MoE, and gives the FLOPs the tables' rates use: ``2*rows*H*(I+F)`` for the MLP (tiny preset:
    hidden 64, ffn 256, batch 2 x seq 64 gathered with SP), tripled with backward."""
    out = tmp_path / "ref.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "overlap_layers.bench", "--layer", "mlp", "attention", "moe",
                           "--preset", "tiny", "--modes", "serial", "reference", "--out", str(out), "--iters", "1",
                           "--repeats", "1", "--warmup", "1"], cwd=root, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = json.loads(out.read_text())["records"]
    for layer in ("mlp", "attention", "moe"):
        _check_reference([r for r in recs if r["layer"] == layer])
    mlp = {r["pass"]: r["flops"] for r in recs if r["layer"] == "mlp"}
    want = 2.0 * (2 * 64) * 64 * (2 * 128 + 128)  # rows gathered over 2 ranks; I = 2F/ws, F/ws = 128
    assert mlp == {"fwd": want, "fwdbwd": 3 * want}, mlp
    assert "/ref" in proc.stdout and "reference: a plain torch module" in proc.stdout


def _check_modes_and_limits(recs, passes, modes=("serial", "naive", "auto", "compute", "comm")):
    """Every pass ran every mode; each record is timed and positive and its limit is max(compute,
    comm) of its pass or more; no record of the CUDA-only modes (asynctp, rank_ce) on the CPU."""
    have = {(r["pass"], r["mode"]) for r in recs}
    for p in passes:
        for m in modes:
            assert (p, m) in have, (p, m)
    assert not {m for _, m in have} & {"asynctp", "rank_ce"}, have
    for r in recs:
        lim = max(x["ms"] for x in recs if x["pass"] == r["pass"] and x["mode"] in ("compute", "comm"))
        assert r["ms"] > 0 and r["limit_ms"] >= lim - 1e-9


def _rec(pass_, mode, k, ms, pred, peak=None, ppeak=None):
    return dict(layer="mlp", preset="p", world_size=4, tokens=8, mode=mode, k=k, ms=ms, predicted_ms=pred,
                peak_bytes=peak, predicted_peak_bytes=ppeak, **{"pass": pass_})


def test_report_summary_numbers():
    from overlap_layers.bench.report import report
    recs = [_rec("fwd", "serial", 1, 10.0, 9.0, 100 * 2**20, 90 * 2**20),
            _rec("fwd", "naive", 2, 8.0, 8.8, 60 * 2**20, 66 * 2**20),
            _rec("fwd", "naive", 4, 9.0, 9.0),
            _rec("fwd", "auto", 2, 8.1, 8.8),
            _rec("fwdbwd", "serial", 1, 20.0, 20.0),
            _rec("fwdbwd", "naive", 2, 18.0, 18.0),
            _rec("fwdbwd", "auto", 1, 20.0, 20.0)]
    text = report(recs)
    # time errors: 10%, 10%, 0%, 0%, 0% -> median 0%, max 10%; memory: 10%, 10%
    assert "median |pred - meas| / meas 0.0% (max 10.0%) over 5 fixed-plan cells" in text
    assert "Peak memory: median |pred - meas| / meas 10.0% (max 10.0%) over 2 cells" in text
    assert "Auto within 3% of the best measured plan on 1 of 2 rows" in text
    assert "| 2 (8.10) | K=2 | 1.01 | 0.81 |" in text


def test_report_rank_chunk_columns():
    from overlap_layers.bench.report import report
    rank = dict(_rec("fwd", "rank", 1, 7.5, 7.0), decomposition="rank", transport="nccl")
    ce = dict(_rec("fwd", "rank_ce", 1, 6.0, 6.0), decomposition="rank", transport="copy_engine")
    auto = dict(_rec("fwd", "auto", 1, 6.3, 6.0), decomposition="rank", transport="copy_engine")
    text = report([_rec("fwd", "serial", 1, 10.0, 9.0), rank, ce, auto])
    assert "| K=1 meas / pred ms | rank meas / pred ms | rank_ce meas / pred ms | auto plan (ms) |" in text
    assert "| 10.00 / 9.00 | 7.50 / 7.00 | 6.00 / 6.00 | rank_ce (6.30) | rank_ce | 1.05 | 0.63 |" in text


def _run_bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "overlap_layers.bench", "--out", str(out), "--iters", "1",
                           "--repeats", "1", "--warmup", "1", *args], cwd=root, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())["records"]


def test_bench_cpu_attention(tmp_path):
    # OverlapAttention, and UlyssesAttention in the same run (one spawn: the tests stay fast)
    proc, recs = _run_bench(tmp_path, "--layer", "attention,ulysses")
    assert {r["layer"] for r in recs} == {"attention", "ulysses"}
    for layer in ("attention", "ulysses"):
        mine = [r for r in recs if r["layer"] == layer]
        _check_modes_and_limits(mine, ("fwd", "fwdbwd"))
        for r in mine:
            assert (r["preset"], r["hidden"], r["heads"], r["kv_heads"], r["batch"], r["seq"], r["world_size"]) == \
                ("tiny", 64, 4, 2, 2, 64, 2)
        assert [r["k"] for r in mine if r["mode"] == "naive"] == [2, 2]
        assert all(r["k"] == 1 for r in mine if r["mode"] == "serial")
        assert all(r["host_agreement_us"] > 0 for r in mine if r["mode"] == "auto")
    assert "attention" in proc.stdout and "ulysses" in proc.stdout and "/limit" in proc.stdout
    from overlap_layers.bench.report import report
    text = report(recs)
    for layer in ("attention", "ulysses"):
        assert text.count(f"| {layer} | tiny | 2 | 2 | 128 |") == 2
        assert f"{layer}: Auto within 3% of the best measured plan on" in text


def test_bench_cpu_block(tmp_path):
    """The block: both sublayers' plans per record, the most tiles either cuts a call into (2
    batch tiles; rank chunks at 2 ranks: 2), the limit from both sublayers' references."""
    proc, recs = _run_bench(tmp_path, "--layer", "block", "--modes", "serial,naive,auto,rank,compute,comm")
    by = {(r["pass"], r["mode"]): r for r in recs}
    for p in ("fwd", "fwdbwd"):
        lim = max(by[(p, "compute")]["ms"], by[(p, "comm")]["ms"])
        assert by[(p, "serial")]["k"] == "K=1 + K=1" and by[(p, "naive")]["k"] == "K=2 + K=2"
        assert by[(p, "rank")]["attention_plan"] == by[(p, "rank")]["mlp_plan"] == "rank chunks over nccl"
        assert (by[(p, "serial")]["tiles"], by[(p, "naive")]["tiles"], by[(p, "rank")]["tiles"]) == (1, 2, 2)
        assert all(by[(p, m)]["limit_ms"] == lim and by[(p, m)]["ffn"] == 256 for m in ("serial", "auto", "rank"))
    assert {r["layer"] for r in recs} == {"block"} and "K=1 + K=1" in proc.stdout


def _block_reference_runs_the_norms(rank, ws):
    import torch
    import torch.distributed as dist
    from overlap_layers.bench import attention as attn_bench
    from overlap_layers.bench.block import BlockBench
    base = attn_bench.PRESETS["tiny"]
    shape = attn_bench.AttentionShape("tiny", base["hidden"], base["heads"], base["kv_heads"], base["head_dim"], 2,
                                      base["seq"], layer="block")
    b = BlockBench(shape, dist.group.WORLD, torch.device("cpu"), torch.float32, [2])
    L, got = b.layer, []
    for name in ("attn_norm", "mlp_norm"):
        norm = getattr(L, name)
        norm.register_forward_hook(lambda m, i, o, name=name: got.append((name, "fwd", tuple(i[0].shape))))
        norm.weight.register_post_accumulate_grad_hook(
            lambda p, name=name: got.append((name, "grad", tuple(p.grad.shape))))
    out = []
    for backward in (False, True):
        got.clear()
        b.compute_fn(backward)()
        out.append((sorted(got), [n.weight.grad for n in (L.attn_norm, L.mlp_norm)]))
    return tuple(b.x.shape), out


def test_bench_block_reference_runs_the_norms(pool2):
    """The block's compute-only reference runs both norms of the block on this rank's rows, and
    backward their weights' gradients ([Note: the block's compute-only reference]); the grads are
    cleared after each call, as every reference's are."""
    for x_shape, ((fwd, fwd_grads), (fwdbwd, fwdbwd_grads)) in pool2.run(_block_reference_runs_the_norms):
        h = x_shape[-1]
        assert fwd == [("attn_norm", "fwd", x_shape), ("mlp_norm", "fwd", x_shape)]
        assert fwdbwd == [("attn_norm", "fwd", x_shape), ("attn_norm", "grad", (h,)),
                          ("mlp_norm", "fwd", x_shape), ("mlp_norm", "grad", (h,))]
        assert fwd_grads == fwdbwd_grads == [None, None]


def _warm_calls(rank, ws):
    import time
    import torch
    import torch.distributed as dist
    from overlap_layers.bench.runner import time_samples
    calls = []

    def fn():  # rank 0 is the slow one: the warm-up must follow its times on every rank
        calls.append(1)
        time.sleep(0.004 if rank == 0 else 0.0)
    out = []
    for warm_ms in (0.0, 30.0):
        calls.clear()
        samples = time_samples(fn, torch.device("cpu"), dist.group.WORLD, warmup=1, iters=2, repeats=2,
                               warm_ms=warm_ms)
        out.append((len(calls), samples))
    return out


def test_bench_warm_up_runs_for_its_time_alike_on_every_rank(pool2):
    """[Note: warm device]: untimed repeats until their times (max over ranks) add up to
    ``warm_ms``, the same number on every rank though one rank's calls take 4 ms and the other's
    none; no extra call without it."""
    (cold, warm), (cold1, warm1) = pool2.run(_warm_calls)
    assert cold[0] == cold1[0] == 1 + 2 * 2
    assert warm[0] == warm1[0]
    extra = warm[0] - cold[0]  # repeats of 2 calls, each repeat >= 8 ms: at most 4 reach 30 ms
    assert 2 <= extra <= 8 and extra % 2 == 0, extra
    assert all(s >= 4.0 for s in warm[1] + warm1[1]) and warm[1] == warm1[1]


def test_bench_warm_up_of_a_callable_that_takes_no_time_ends(monkeypatch):
    """[Note: warm device]: the untimed repeats stop at ``MAX_WARM_REPEATS`` when the callable's
    times never add up to ``warm_ms`` (no hang)."""
    import torch
    from overlap_layers.bench import runner
    taken = []
    monkeypatch.setattr(runner, "MAX_WARM_REPEATS", 7)
    monkeypatch.setattr(runner, "_sample", lambda fn, device, group, iters: taken.append(1) or 0.0)
    assert runner.time_samples(lambda: None, torch.device("cpu"), None, 0, 3, 2, warm_ms=1.0) == [0.0, 0.0]
    assert len(taken) == 7 + 2


def test_bench_layer_list_and_args():
    from overlap_layers.bench.cli import _shapes, parse_args
    args = parse_args(["--layer", "mlp,attention", "--preset", "llama3-8b", "llama3-70b"])
    shapes = [(layer, p, s.batch, s.seq) for layer, p, s in _shapes(args, args.preset)]
    assert shapes == [("mlp", "llama3-8b", 4, 4096), ("mlp", "llama3-70b", 4, 4096),
                      ("attention", "llama3-8b", 2, 8192), ("attention", "llama3-8b", 4, 8192),
                      ("attention", "llama3-70b", 2, 8192), ("attention", "llama3-70b", 4, 8192)]
    a = [s for layer, _, s in _shapes(args, args.preset) if layer == "attention"]
    assert [(s.hidden, s.heads, s.kv_heads, s.head_dim) for s in a[::2]] == [(4096, 32, 8, 128), (8192, 64, 8, 128)]
    args = parse_args(["--layer", "attention", "--batch", "1", "--seq", "128", "--no-sp"])
    ((_, _, s),) = _shapes(args, ["tiny"])
    assert (s.batch, s.seq, s.sequence_parallel) == (1, 128, False)
    assert parse_args([]).layers == ["mlp"]
    args = parse_args(["--layer", "mlp,attention,block", "--graphs"])
    assert all(s.cuda_graphs for _, _, s in _shapes(args, ["tiny"]))
    assert not any(s.cuda_graphs for _, _, s in _shapes(parse_args(["--layer", "mlp,attention"]), ["tiny"]))
    import pytest
    for bad in (["--layer", "mlp,nope"], ["--layer", "ulysses", "--no-sp"], ["--layer", "mlp,moe", "--graphs"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_report_groups_layers():
    from overlap_layers.bench.report import report
    attn = [dict(_rec("fwd", mode, k, ms, None), layer="attention", batch=2)
            for mode, k, ms in (("serial", 1, 5.0), ("naive", 2, 4.0), ("auto", 1, 5.0))]
    mlp = [dict(_rec("fwd", "serial", 1, 10.0, 10.0), batch=2), dict(_rec("fwd", "naive", 2, 8.0, 8.0), batch=2),
           dict(_rec("fwd", "auto", 2, 8.0, 8.0), batch=2)]
    attn4 = [dict(r, batch=4, tokens=16) for r in attn]
    text = report(attn[:1] + mlp + attn[1:] + attn4)
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    # grouped by layer in order of first appearance; one row per (layer, batch, tokens)
    assert [ln.split(" | ")[0:4] for ln in lines] == [["| attention", "p", "4", "2"], ["| attention", "p", "4", "4"],
                                                      ["| mlp", "p", "4", "2"]]
    assert "| 1 (5.00) | K=2 | 1.25 | 1.00 |" in text  # attention: auto stayed serial, K=2 measured faster
    assert "mlp: Time: median |pred - meas| / meas 0.0% (max 0.0%) over 2 fixed-plan cells." in text
    assert "attention: Auto within 3% of the best measured plan on 0 of 2 rows." in text
    assert "mlp: Auto within 3% of the best measured plan on 1 of 1 rows." in text
    assert "attention: Time" not in text  # no predictions for attention yet


def _check_moe_run(recs, passes, skewed):
    _check_modes_and_limits(recs, passes)
    for r in recs:
        assert r["layer"] == "moe" and r["skewed"] is skewed
        assert (r["preset"], r["experts"], r["top_k"], r["hidden"], r["ffn"], r["tokens"], r["world_size"]) == \
            ("tiny", 4, 2, 64, 32, 128, 2)
    assert [r["k"] for r in recs if r["mode"] == "naive"] == [2] * len(passes)
    assert all(r["k"] == 1 for r in recs if r["mode"] == "serial")
    assert all(r["host_agreement_us"] > 0 and r["host_counts_exchange_us"] > 0 for r in recs if r["mode"] == "auto")
    assert all(r["expert_impl"] == "loop" for r in recs)  # CPU: one GEMM pair per expert


def test_bench_cpu_moe(tmp_path):
    proc, recs = _run_bench(tmp_path, "--layer", "moe")
    _check_moe_run(recs, ("fwd", "fwdbwd"), skewed=False)
    assert all(r["busiest_expert_share"] < 0.35 for r in recs)  # random routing: ~1/4 each
    assert "moe" in proc.stdout and "/limit" in proc.stdout
    from overlap_layers.bench.report import report
    text = report(recs)
    assert text.count("| moe | tiny | 2 | 1 | 128 |") == 2 and "Auto within 3% of the best measured plan on" in text


def test_bench_cpu_moe_skew(tmp_path):
    proc, recs = _run_bench(tmp_path, "--layer", "moe", "--skew", "--passes", "fwdbwd")
    _check_moe_run(recs, ("fwdbwd",), skewed=True)
    # nearly every token picks expert 0 among its top 2: about half of all assignments
    assert all(r["busiest_expert_share"] > 0.45 and r["recv_imbalance"] > 1.1 for r in recs)
    assert "moe-skew" in proc.stdout
    from overlap_layers.bench.report import report
    text = report(recs + [dict(r, skewed=False) for r in recs])
    assert text.count("| moe skewed | tiny | 2 | 1 | 128 | fwdbwd |") == 1
    assert text.count("| moe | tiny | 2 | 1 | 128 | fwdbwd |") == 1  # skewed and balanced rows kept apart


def test_bench_moe_args():
    import pytest
    from overlap_layers.bench.cli import _shapes, parse_args
    args = parse_args(["--layer", "moe", "--preset", "mixtral-8x7b", "qwen3-30b-a3b"])
    got = [(p, s.experts, s.top_k, s.hidden, s.ffn, s.batch, s.seq, s.skewed) for _, p, s in _shapes(args, args.preset)]
    assert got == [("mixtral-8x7b", 8, 2, 4096, 14336, 1, 8192, False),
                   ("qwen3-30b-a3b", 128, 8, 2048, 768, 1, 8192, False)]
    args = parse_args(["--layer", "moe", "--tokens", "256", "512", "--skew"])
    assert [(s.tokens, s.skewed) for _, _, s in _shapes(args, None)] == [(256, True), (512, True)]
    assert [p for _, p, _ in _shapes(parse_args(["--layer", "mlp,moe"]), None, cuda=True)] == \
        ["llama3-8b", "mixtral-8x7b"]
    for bad in (["--layer", "moe", "--preset", "llama3-8b"], ["--layer", "mlp", "--preset", "mixtral-8x7b"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_bench_profile_writes_a_trace_and_a_table_per_mode(tmp_path):
    prof = tmp_path / "prof"
    _run_bench(tmp_path, "--layer", "moe", "--passes", "fwd", "--modes", "serial,naive", "--profile", str(prof),
               "--profile-calls", "2")
    import json
    names = sorted(p.name for p in prof.iterdir())
    assert names == ["moe_tiny_ws2_b1_t128_fwd_naive2.json", "moe_tiny_ws2_b1_t128_fwd_naive2.txt",
                     "moe_tiny_ws2_b1_t128_fwd_serial.json", "moe_tiny_ws2_b1_t128_fwd_serial.txt"], names
    events = json.loads((prof / "moe_tiny_ws2_b1_t128_fwd_naive2.json").read_text())["traceEvents"]
    ranges = {e["name"] for e in events if e.get("name", "").startswith("overlap::moe::")}
    # the executor's per-tile ops and the layer's own ranges, both tiles
    assert {"overlap::moe::dispatch[0]", "overlap::moe::dispatch[1]", "overlap::moe::route",
            "overlap::moe::combine"} <= ranges, sorted(ranges)
    # --profile-calls 2: two calls in each trace, one routing range each
    assert sum(e.get("name") == "overlap::moe::route" for e in events) == 2
    assert "Self CPU" in (prof / "moe_tiny_ws2_b1_t128_fwd_serial.txt").read_text()


def test_chart_bars_and_png(tmp_path):
    from overlap_layers.bench.chart import bars
    recs = [dict(_rec("fwd", "serial", 1, 10.0, 9.0), limit_ms=8.0), dict(_rec("fwd", "naive", 2, 9.0, 9.0), limit_ms=8.0),
            dict(_rec("fwd", "auto", 2, 8.8, 9.0), limit_ms=8.0), dict(_rec("fwd", "compute", None, 8.0, None), limit_ms=8.0),
            dict(_rec("fwdbwd", "serial", 1, 20.0, 20.0), limit_ms=16.0)]
    labels, series = bars(recs)
    assert labels == ["mlp p\nTP4 8 fwd", "mlp p\nTP4 8 fwdbwd"]
    assert list(series) == ["serial", "naive K=2", "auto"]  # compute/comm are the limit, not bars
    assert series["serial"] == [1.25, 1.25] and series["auto"][0] == 1.1 and series["auto"][1] != series["auto"][1]
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"meta": {}, "records": recs}))
    proc = subprocess.run([sys.executable, "-m", "overlap_layers.bench.chart", str(path), str(tmp_path / "r.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_bench_transport_and_carveout_reach_every_layer():
    from overlap_layers.bench.cli import _shapes, parse_args
    args = parse_args(["--layer", "mlp,attention,block,moe", "--transport", "nccl", "--sm-carveout", "0"])
    shapes = list(_shapes(args, None, cuda=True))
    assert {layer for layer, _, _ in shapes} == {"mlp", "attention", "block", "moe"}
    assert all((s.transport, s.sm_carveout) == ("nccl", 0) for _, _, s in shapes)
    assert all(s.sm_carveout is None for _, _, s in _shapes(parse_args(["--layer", "mlp,moe"]), None, cuda=True))


def _probe(name: str) -> str:
    """The path of a probe script of ``bench/probes/`` (``bench/`` in older trees)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in (os.path.join(root, "bench", "probes"), os.path.join(root, "bench")):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise FileNotFoundError(f"bench/probes/{name}")


def _trace_breakdown():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "trace_breakdown", _probe("trace_breakdown.py"))
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    return tb


def test_trace_host_sums_the_executor_ops_per_call(tmp_path):
    """``--host``: per call, the host time of the calls, of each executor op (tiles summed) and
    what lies outside them, and the torch ops with the most host time."""
    ev = []
    for c in range(2):  # two calls of 1000 us: ops qkv[0], qkv[1] (100 us each), core[0] (300 us)
        t = 10_000 * c
        ev += [dict(ph="X", cat="user_annotation", name="bench::call", ts=t, dur=1000),
               dict(ph="X", cat="user_annotation", name="overlap::attn::qkv[0]", ts=t + 10, dur=100),
               dict(ph="X", cat="user_annotation", name="overlap::attn::qkv[1]", ts=t + 120, dur=100),
               dict(ph="X", cat="user_annotation", name="overlap::attn::core[0]", ts=t + 300, dur=300),
               dict(ph="X", cat="cpu_op", name="aten::mm", ts=t + 20, dur=60),
               dict(ph="X", cat="kernel", name="nvjet", ts=t + 50, dur=500)]
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    lines = _trace_breakdown().host(str(path), 2).splitlines()
    assert lines[1].split() == ["host", "per", "call", "1000.0", "us:", "in", "the", "executor's", "ops",
                                "500.0,", "outside", "them", "500.0"]
    assert lines[3].split() == ["300.0", "us", "x", "1.0", "overlap::attn::core"]
    assert lines[4].split() == ["200.0", "us", "x", "2.0", "overlap::attn::qkv"]
    assert lines[6].split() == ["60.0", "us", "x", "1.0", "aten::mm"] and len(lines) == 7


def test_trace_timeline_lists_kernels_and_communication_gaps(tmp_path):
    """``bench/probes/trace_breakdown.py --timeline``: kernels of 20 us or more by start, the shorter ones
    counted per stream, and the spans where no collective or copy runs with the compute inside."""
    tb = _trace_breakdown()
    ev = [dict(cat="kernel", name="ncclDevKernel_AllGather", ts=100, dur=100, args={"stream": 20}),
          dict(cat="kernel", name="nvjet_gemm", ts=200, dur=300, args={"stream": 7}),
          dict(cat="kernel", name="tiny", ts=210, dur=5, args={"stream": 7}),
          dict(cat="kernel", name="ncclDevKernel_ReduceScatter", ts=400, dur=100, args={"stream": 20}),
          dict(cat="gpu_memcpy", name="Memcpy PtoP", ts=600, dur=50, args={"stream": 30}),
          dict(cat="kernel", name="sdpa", ts=560, dur=200, args={"stream": 7})]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    lines = tb.timeline(str(path)).splitlines()
    assert [ln.split()[-1] for ln in lines[2:7]] == ["ncclDevKernel_AllGather", "nvjet_gemm",
                                                     "ncclDevKernel_ReduceScatter", "sdpa", "PtoP"]
    assert "stream 7: 1 events under 20 us, 5 us in all" in lines[7]
    # no communication 200-400 (GEMM all of it), 500-600 (sdpa 560-600) and 650-760 (sdpa to the end)
    gaps = [tuple(map(float, ln.replace("compute", "").split())) for ln in lines[lines.index(next(
        ln for ln in lines if ln.startswith("gaps"))) + 1:]]
    assert gaps == [(100.0, 200.0, 200.0), (400.0, 100.0, 40.0), (550.0, 110.0, 110.0)]


def test_trace_compute_gaps_lists_where_no_compute_runs(tmp_path):
    """``bench/probes/trace_breakdown.py --compute-gaps``: the spans between compute kernels (on any
    stream), their total, and the copies and signals that ran in the ones shown (2 us or more)."""
    tb = _trace_breakdown()
    ev = [dict(cat="kernel", name="nvjet_a", ts=100, dur=100, args={"stream": 7}),
          dict(cat="kernel", name="swiglu", ts=150, dur=60, args={"stream": 8}),  # overlaps: no gap until 210
          dict(cat="gpu_memcpy", name="Memcpy PtoP", ts=205, dur=40, args={"stream": 30}),
          dict(cat="kernel", name="nvjet_b", ts=250, dur=100, args={"stream": 7}),  # gap 210-250
          dict(cat="kernel", name="c10d::symmetric_memory::wait_signal_kernel", ts=350, dur=20, args={"stream": 9}),
          dict(cat="kernel", name="sum", ts=351, dur=10, args={"stream": 7})]  # gap 350-351: under 2 us
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    lines = tb.compute_gaps(str(path)).splitlines()
    assert lines[1].startswith("compute idle 41 us in 2 gaps")
    assert len(lines) == 3
    cols = lines[2].split()
    assert cols[:2] == ["110", "40"] and cols[3] == "swiglu" and cols[5] == "nvjet_b"
    assert lines[2].split("|")[1].split() == ["Memcpy", "PtoP(40)"]


@pytest.mark.parametrize("layer", ["attention", "moe"])
def test_inproc_ab_dry_run(tmp_path, layer):
    """``bench/probes/inproc_ab.py`` on the CPU (2 gloo ranks, tiny preset), this package as both sides:
    one result per plan and pass, with the time and host time per call of each side."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "ab.json"
    proc = torchrun(2, [_probe("inproc_ab.py"), os.path.join(root, "overlap_layers"), "--layer", layer,
                        "--rounds", "1", "--calls", "1", "--plans", "rank_nccl,serial,k2", "--passes", "fwd,fwdbwd",
                        "--out", out], cwd=root, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["layer"] == layer and data["meta"]["world_size"] == 2
    assert sorted(data["results"]) == ["k2/fwd", "k2/fwdbwd", "rank_nccl/fwd", "rank_nccl/fwdbwd", "serial/fwd",
                                       "serial/fwdbwd"]
    for r in data["results"].values():
        assert len(r["rank0_old"]) == len(r["rank0_new"]) == 1
        assert 0 < r["old_host_ms"] <= r["old_ms"] * 1.001 and 0 < r["new_host_ms"] <= r["new_ms"] * 1.001


def test_inproc_ab_plan_names():
    """``bench/probes/inproc_ab.py``'s plan names: batch tiles, their compute streams and carveout."""
    import importlib.util
    import overlap_layers
    from overlap_layers.planning.plan import TilePlan
    spec = importlib.util.spec_from_file_location("inproc_ab", _probe("inproc_ab.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.plan_of(overlap_layers, "k4") == TilePlan(4)
    assert mod.plan_of(overlap_layers, "k6s1") == TilePlan(6, num_streams=1)
    assert mod.plan_of(overlap_layers, "k8s1c16") == TilePlan(8, num_streams=1, carveout=(16, 16))
    assert mod.plan_of(overlap_layers, "k2c8") == TilePlan(2, carveout=(8, 8))
    assert mod.plan_of(overlap_layers, "serial").is_serial
    assert mod.plan_of(overlap_layers, "rank_ce") == TilePlan(1, decomposition="rank", transport="copy_engine")


def _host_phases():
    import importlib.util
    spec = importlib.util.spec_from_file_location("host_phases", _probe("host_phases.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_phases_wraps_functions_methods_and_staticmethods():
    """``bench/probes/host_phases.py``'s wrapper: inclusive time and call count per wrapped name, the
    function's result and exceptions unchanged, static methods still static."""
    import types
    hp = _host_phases()
    mod = types.ModuleType("hp_target")

    class K:
        @staticmethod
        def twice(v):
            return 2 * v

        def boom(self):
            raise KeyError("x")
    mod.K, mod.f = K, lambda v: v + 1
    sys.modules["hp_target"] = mod
    try:
        acc = {}
        for p in ("hp_target:f", "hp_target:K.twice", "hp_target:K.boom"):
            hp.wrap(p, acc)
        assert mod.f(1) == 2 and K.twice(3) == 6 and K().twice(4) == 8
        with pytest.raises(KeyError):
            K().boom()
        assert {k: v[1] for k, v in acc.items()} == {"hp_target:f": 1, "hp_target:K.twice": 2, "hp_target:K.boom": 1}
        assert all(v[0] > 0 for v in acc.values())
    finally:
        del sys.modules["hp_target"]


def test_host_phases_dry_run():
    """``bench/probes/host_phases.py`` on 2 gloo ranks (tiny attention): every rank's host and wall time,
    then the wrapped functions, each called once per layer call."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = torchrun(2, [_probe("host_phases.py"), "--layer", "attention", "--plan", "rank_nccl", "--calls", "2"],
                    cwd=root, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # the CPU dry run, on GPU machines too
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines[0].startswith("attention tiny rank_nccl fwd:") and lines[0].split("by rank: ")[1].count("(") == 2
    calls = {ln.split()[-1]: float(ln.split()[3]) for ln in lines[1:]}
    for name in ("overlap_layers.layers.attention.layer:OverlapAttention.forward",
                 "overlap_layers.layers.attention.rank_chunks:RankChunkAttention._forward",
                 "overlap_layers.planning.planner:LayerPlanner.agree"):
        assert calls[name] == 1.0


def _row(layer, mode, ms, k=None, **kw):
    """A forward record of ``layer`` whose limit is 10 ms."""
    return dict(_rec("fwd", mode, k, ms, None), layer=layer, batch=2, limit_ms=10.0, **kw)


def test_targets_judge_each_row_against_its_link_and_layer():
    """By hand: the limit target is 1.10 for dense layers over NVLink, 1.15 with P2P off and for
    MoE; auto <= 1.02 x serial; auto faster than AsyncTP (MLP only); '-' where a number is missing."""
    from overlap_layers.bench.targets import judge, targets
    modes = {"auto": _row("mlp", "auto", 11.2), "serial": _row("mlp", "serial", 11.0),
             "asynctp": _row("mlp", "asynctp", 11.5)}
    assert judge("mlp", False, modes) == {"limit": (False, pytest.approx(1.12)), "serial": (True, pytest.approx(11.2 / 11)),
                                          "asynctp": (True, pytest.approx(11.2 / 11.5)), "memory": None}
    assert judge("mlp", True, modes)["limit"] == (True, pytest.approx(1.12))  # P2P off: 1.15
    assert judge("moe", False, {"auto": _row("moe", "auto", 11.6)}) == \
        {"limit": (False, pytest.approx(1.16)), "serial": None, "asynctp": None, "memory": None}
    assert judge("attention", False, {"auto": _row("attention", "auto", 10.5), "serial": _row("attention", "serial", 10.2),
                                      "asynctp": _row("attention", "asynctp", 9.0)}) == \
        {"limit": (True, pytest.approx(1.05)), "serial": (False, pytest.approx(10.5 / 10.2)), "asynctp": None,
         "memory": None}
    assert judge("mlp", False, {"serial": _row("mlp", "serial", 1.0)}) == dict.fromkeys(("limit", "serial", "asynctp",
                                                                                         "memory"))
    nvlink = [_row("mlp", "auto", 10.9, peak_bytes=3 << 20, decomposition="rank", transport="copy_engine"),
              _row("mlp", "serial", 12.0, peak_bytes=1 << 20), _row("mlp", "asynctp", 10.8)]
    text = targets([(nvlink, False), (nvlink, True)])
    lines = [ln for ln in text.splitlines() if ln.startswith("| mlp")]
    assert lines[0].endswith("| NVLink | no | r-ce (10.900) | ok 1.090 | ok 0.908 | MISS 1.009 | - | +2 | - |")
    assert lines[1].endswith("| P2P off | no | r-ce (10.900) | ok 1.090 | ok 0.908 | MISS 1.009 | - | +2 | - |")
    assert "limit: 0 of 2 rows miss" in text and "asynctp: 2 of 2 rows miss" in text


def test_targets_memory_allows_one_tile_of_serials_peak_and_counts_the_workspace():
    """By hand, serial's peak 200 MiB at TP 4: K=2 batch tiles may add 100 MiB, K=4 50; rank
    chunks at K=1 are 4 tiles (50 MiB), with the workspace counted; the block's ``tiles`` wins."""
    from overlap_layers.bench.targets import judge
    mib = 2 ** 20
    serial = _row("mlp", "serial", 12.0, k=1, peak_bytes=200 * mib)

    def memory(**auto):
        return judge("mlp", False, {"auto": _row("mlp", "auto", 10.0, **auto), "serial": serial})["memory"]
    assert memory(k=2, peak_bytes=300 * mib, decomposition="batch") == (True, pytest.approx(1.0))
    assert memory(k=4, peak_bytes=300 * mib, decomposition="batch") == (False, pytest.approx(2.0))
    assert memory(k=1, peak_bytes=210 * mib, decomposition="rank") == (True, pytest.approx(0.2))
    assert memory(k=1, peak_bytes=210 * mib, decomposition="rank", workspace_bytes=60 * mib) == \
        (False, pytest.approx(1.4))
    assert memory(k="K=1 + K=2", tiles=8, peak_bytes=225 * mib) == (True, pytest.approx(1.0))
    assert memory(k="K=1 + K=2", peak_bytes=225 * mib) is None  # no tile count
    assert memory(k=2, decomposition="batch") is None  # no peak
    # --graph-calls: the intermediates sit in each plan's graph (graph_bytes), for serial too: serial
    # holds 10 + 190 MiB, so K=2 may add 100 MiB, and auto's 5 + 290 MiB add 95
    replayed = {"serial": _row("mlp", "serial", 12.0, k=1, peak_bytes=10 * mib, graph_bytes=190 * mib, graph_calls=True)}
    assert judge("mlp", False, dict(replayed, auto=_row("mlp", "auto", 10.0, k=2, decomposition="batch",
                                                        peak_bytes=5 * mib, graph_bytes=290 * mib, graph_calls=True))
                 )["memory"] == (True, pytest.approx(0.95))


def test_targets_pass_bound_sums_each_passs_larger_reference():
    """By hand: forward compute 4 and comm 6 ms, fwd+bwd compute 13 and comm 12 (backward 9 and
    6): the pass bound is 6 + 9 = 15 ms, so a fwd+bwd auto of 16.5 reads 1.100 there (against
    the whole call's limit of 13: 1.269); a fwd row, or a fwd+bwd row without its forward's
    references, reads '-'."""
    from overlap_layers.bench.targets import pass_bound, targets

    def rec(pass_, mode, ms):
        return dict(_rec(pass_, mode, 1, ms, None), layer="mlp", batch=2,
                    limit_ms=13.0 if pass_ == "fwdbwd" else 6.0)
    fwd = [rec("fwd", "auto", 6.6), rec("fwd", "compute", 4.0), rec("fwd", "comm", 6.0)]
    fwdbwd = [rec("fwdbwd", "auto", 16.5), rec("fwdbwd", "compute", 13.0), rec("fwdbwd", "comm", 12.0)]
    assert pass_bound({r["mode"]: r for r in fwd}, {r["mode"]: r for r in fwdbwd}) == pytest.approx(15.0)
    lines = [ln for ln in targets([(fwd + fwdbwd, True)]).splitlines() if ln.startswith("| mlp")]
    assert lines[0].split(" | ")[5] == "fwd" and lines[0].endswith("| - | - |")
    assert lines[1].split(" | ")[5] == "fwdbwd" and "MISS 1.269" in lines[1] and lines[1].endswith("| - | 1.100 |")
    no_comm = [r for r in fwd if r["mode"] != "comm"] + fwdbwd
    assert [ln for ln in targets([(no_comm, True)]).splitlines() if "fwdbwd" in ln][0].endswith("| - | - |")


def test_targets_cli_reads_the_link_from_the_run(tmp_path):
    from overlap_layers.bench import targets
    recs = [_row("attention", "auto", 11.2, k=1), _row("attention", "serial", 12.0, k=1)]
    for name, p2p in (("a.json", None), ("b.json", "1")):
        (tmp_path / name).write_text(json.dumps(dict(meta=dict(nccl_p2p_disable=p2p), records=recs)))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        targets.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert "| NVLink | no | 1 (11.200) | MISS 1.120 |" in buf.getvalue()
    assert "| P2P off | no | 1 (11.200) | ok 1.120 |" in buf.getvalue()
    with pytest.raises(SystemExit, match="usage"):
        targets.main([])
    # meta.link, where the file has it: gloo rows (CPU runs) held to the NVLink targets, P2P off to its own
    for name, link in (("c.json", "gloo"), ("d.json", "p2p_off")):
        (tmp_path / name).write_text(json.dumps(dict(meta=dict(link=link, nccl_p2p_disable=None), records=recs)))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        targets.main([str(tmp_path / "c.json"), str(tmp_path / "d.json")])
    assert "| gloo | no | 1 (11.200) | MISS 1.120 |" in buf.getvalue()
    assert "| P2P off | no | 1 (11.200) | ok 1.120 |" in buf.getvalue() and "NVLink" not in buf.getvalue()


def _held(seconds):
    import time
    time.sleep(seconds)


def test_stack_sampler_reports_where_a_thread_stayed():
    """A thread that sleeps 0.5 s in one function shows as one stretch of about that long at that
    function; a sampler with a longer threshold reports nothing of it."""
    import threading
    from overlap_layers.bench.stacks import StackSampler
    with StackSampler(interval_s=0.01) as sampler:
        worker = threading.Thread(target=_held, args=(0.5,), name="held-worker")
        worker.start()
        worker.join()
    text = sampler.report(min_s=0.2)
    lines = [ln for ln in text.splitlines() if ln.startswith("SAME") and "held-worker" in ln]
    assert len(lines) == 1 and 0.2 <= float(lines[0].split()[1].rstrip("s")) <= 1.0, text
    innermost = text.split(lines[0] + "\n")[1].splitlines()[0]
    assert innermost.strip().startswith("test_bench.py:") and innermost.endswith(" _held"), text
    assert "held-worker" not in sampler.report(min_s=2.0)


def test_bench_sample_stacks_writes_one_report_per_rank(tmp_path):
    """``--sample-stacks DIR``: every rank writes its report (a tiny run, so it may list nothing)."""
    _run_bench(tmp_path, "--layer", "mlp", "--modes", "serial", "--passes", "fwd", "--sample-stacks",
               str(tmp_path / "stacks"))
    assert sorted(os.listdir(tmp_path / "stacks")) == ["stacks_rank0.txt", "stacks_rank1.txt"]


def _moe_bench_device_path_by_mode(rank, ws):
    import torch
    import torch.distributed as dist
    from overlap_layers.bench.moe import MoEBench, shapes
    shape = next(shapes("tiny", None, False, graph_calls=True))
    b = MoEBench(shape, dist.group.WORLD, torch.device("cpu"), torch.float32, 2)
    graphs = b.layer.planner.call_graphs
    out = []
    for mode, fn in (("serial", lambda: b.layer_fn(1, False)), ("naive", lambda: b.layer_fn(2, True)),
                     ("rank", lambda: b.rank_fn("nccl", False)), ("auto", lambda: b.layer_fn("auto", False))):
        fn()()
        out.append((mode, b.layer.planner.call_graphs is graphs))
    return graphs is not None, out


def test_bench_moe_graph_calls_run_the_device_path_in_auto_only(pool2):
    # the device path ignores the plan: with --graph-calls only auto may take it (serial stays serial)
    for has_graphs, modes in pool2.run(_moe_bench_device_path_by_mode):
        assert has_graphs
        assert modes == [("serial", False), ("naive", False), ("rank", False), ("auto", True)]


# ---------------------------------------------------------------- result files: bench/results/schema.json

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results",
                           "schema.json")
_TYPES = {"object": dict, "array": list, "string": str, "null": type(None), "boolean": bool}


def _is_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def schema_errors(value, schema: dict, root: dict = None, path: str = "$") -> list:
    """Where ``value`` breaks ``schema``: a small JSON Schema (draft 2020-12) validator of the
    keywords ``bench/results/schema.json`` uses (``$ref`` into ``$defs``, ``type``, ``const``,
    ``enum``, ``required``, ``properties``, ``items``, ``minimum``, ``allOf``, ``anyOf``,
    ``oneOf``, ``not``, ``if`` / ``then`` / ``else``); any other keyword fails the check, so the
    schema cannot outgrow the validator unnoticed. Annotations (``description``, ``format``,
    ...) are ignored."""
    root = schema if root is None else root
    known = {"$schema", "$id", "$defs", "$ref", "title", "description", "format", "type", "const", "enum",
             "required", "properties", "additionalProperties", "items", "minimum", "allOf", "anyOf", "oneOf",
             "not", "if", "then", "else"}
    unknown = set(schema) - known
    assert not unknown, f"{path}: schema keywords the test's validator lacks: {unknown}"
    assert schema.get("additionalProperties", True) is True, "only additionalProperties: true is supported"
    errors = []
    if "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/$defs/"), ref
        errors += schema_errors(value, root["$defs"][ref[len("#/$defs/"):]], root, path)
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, n) for n in names):
            return errors + [f"{path}: {value!r} is not of type {names}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and _is_type(value, "number") and value < schema["minimum"]:
        errors.append(f"{path}: {value!r} < {schema['minimum']}")
    if isinstance(value, dict):
        errors += [f"{path}: missing {key!r}" for key in schema.get("required", ()) if key not in value]
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += schema_errors(value[key], sub, root, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], root, f"{path}[{i}]")
    for sub in schema.get("allOf", ()):
        errors += schema_errors(value, sub, root, path)
    if "anyOf" in schema and all(schema_errors(value, sub, root, path) for sub in schema["anyOf"]):
        errors.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema and sum(not schema_errors(value, sub, root, path) for sub in schema["oneOf"]) != 1:
        errors.append(f"{path}: does not match exactly one of oneOf")
    if "not" in schema and not schema_errors(value, schema["not"], root, path):
        errors.append(f"{path}: matches what 'not' excludes")
    if "if" in schema:
        branch = "then" if not schema_errors(value, schema["if"], root, path) else "else"
        if branch in schema:
            errors += schema_errors(value, schema[branch], root, path)
    return errors


def _schema():
    with open(SCHEMA_PATH) as f:
        return json.load(f)


def _model_result():
    """A minimal whole-model result file, as the schema has it."""
    meta = dict(schema_version=1, kind="model", date="2026-11-28T14:03:12+00:00", command="python -m x",
                device="NVIDIA H200", gpu_count=4, world_size=4, backend="nccl", link="nvlink", torch="2.13.0",
                cuda="13.0", nccl="2.28.3", triton="3.6.0")
    rec = {"model": "llama3-8b", "variant": "overlap", "preset": "llama3-8b", "world_size": 4, "batch": 2,
           "tokens": None, "pass": "fwdbwd", "ms": 100.0, "spread": {"min_ms": 99.0, "max_ms": 101.0, "n": 5}}
    return {"meta": meta, "records": [rec]}


def test_schema_validator_checks_what_the_schema_says():
    """The test's validator and the schema together: a whole-model file passes; each break of a
    required key, a type, an enum, the constant version or the kind's record keys is caught."""
    schema, good = _schema(), _model_result()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema_errors(good, schema) == []

    def broken(change):
        doc = json.loads(json.dumps(good))
        change(doc)
        return schema_errors(doc, schema)
    assert broken(lambda d: d["meta"].pop("link")) == ["$.meta: missing 'link'"]
    assert broken(lambda d: d["meta"].update(link="pcie"))
    assert broken(lambda d: d["meta"].update(schema_version=2))
    assert broken(lambda d: d["meta"].update(gpu_count=1.5))
    assert broken(lambda d: d["meta"].update(cuda=13))
    assert broken(lambda d: d["records"][0].pop("variant"))  # a model record needs model + variant
    assert broken(lambda d: d["meta"].update(kind="layer"))  # ... and a layer record layer + mode
    assert broken(lambda d: d["records"][0].update({"pass": "bwd"}))
    assert broken(lambda d: d["records"][0]["spread"].pop("n"))
    assert broken(lambda d: d["records"][0].update(ms=None))  # no time without an error saying why
    assert broken(lambda d: d["records"][0].update(ms=None, error="OOM")) == []
    assert broken(lambda d: d["records"][0].update(batch=True))
    assert broken(lambda d: d.update(extra=1) or d["meta"].update(host="h") or d["records"][0].update(k=2)) == []


def test_bench_writes_the_schema_under_a_name_that_says_what_where_when(tmp_path):
    """The CPU path (2 gloo ranks, tiny shapes, mlp and moe) writes, by default, to
    bench/results/<layers>_tp<N>_<link>_<device>x<count>_<date>_<time>.json a file the schema
    accepts, every meta field filled for a gloo run; one table with its legend on stdout, nothing
    said of NVLink, NCCL or the copy engine."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "overlap_layers.bench", "--layer", "mlp", "moe", "--iters", "1",
                           "--repeats", "2", "--warmup", "1"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (name,) = os.listdir(tmp_path / "bench" / "results")
    assert re.fullmatch(r"mlp-moe_tp2_gloo_cpux2_\d{4}-\d\d-\d\d_\d{6}\.json", name), name
    data = json.loads((tmp_path / "bench" / "results" / name).read_text())
    assert schema_errors(data, _schema()) == []
    meta = data["meta"]
    assert {k: meta[k] for k in ("schema_version", "kind", "device", "gpu_count", "world_size", "backend", "link",
                                 "cuda", "nccl")} == \
        dict(schema_version=1, kind="layer", device="cpu", gpu_count=0, world_size=2, backend="gloo", link="gloo",
             cuda=None, nccl=None)
    import datetime
    import torch
    assert meta["torch"] == torch.__version__ and datetime.datetime.fromisoformat(meta["date"]).tzinfo is not None
    assert meta["command"] == "python -m overlap_layers.bench --layer mlp moe --iters 1 --repeats 2 --warmup 1"
    recs = data["records"]
    assert {r["layer"] for r in recs} == {"mlp", "moe"} and all(r["spread"]["n"] == 2 for r in recs)
    assert all(r["spread"]["min_ms"] <= r["ms"] <= r["spread"]["max_ms"] for r in recs)
    serial = {(r["layer"], r["pass"]): r["ms"] for r in recs if r["mode"] == "serial"}
    assert all(r["ratio_serial"] == pytest.approx(r["ms"] / serial[(r["layer"], r["pass"])]) for r in recs)
    out = proc.stdout
    assert out.count("Columns:") == 1 and out.count("/limit") == 2  # the header, and its line in the legend
    assert out.startswith("cpu, 2 ranks, gloo, torch ") and f"wrote {os.path.join('bench', 'results', name)}" in out
    table = out.split("Columns:")[0].splitlines()
    assert len([ln for ln in table if ln.startswith(("mlp ", "moe "))]) == len(recs)
    for word in ("NVLink", "NCCL_P2P", "copy-engine", "using NCCL"):
        assert word not in out + proc.stderr, word


def test_bench_meta_link_and_file_name():
    from overlap_layers.bench import results
    assert results.link("gloo", 2) == "gloo" and results.link("gloo", 1) == "gloo"
    assert results.link("nccl", 1) == "single"
    assert results.link("nccl", 4, {}) == "nvlink" and results.link("nccl", 4, {"NCCL_P2P_DISABLE": "0"}) == "nvlink"
    assert results.link("nccl", 4, {"NCCL_P2P_DISABLE": "1"}) == "p2p_off"
    # files written before meta.link: from the backend and nccl_p2p_disable
    assert results.link_of({"nccl_p2p_disable": "1"}) == "p2p_off" and results.link_of({}) == "nvlink"
    assert results.link_of({"backend": "gloo", "nccl_p2p_disable": None}) == "gloo"
    assert results.link_of({"link": "single", "nccl_p2p_disable": "1"}) == "single"
    assert [results.device_slug(d) for d in ("NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3",
                                             "cpu")] == ["h200", "a100", "h100", "cpu"]
    import datetime
    when = datetime.datetime(2026, 11, 28, 14, 3, 12)
    meta = dict(link="nvlink", device="NVIDIA H200", gpu_count=4, world_size=4)
    assert results.default_name(["mlp", "attention"], [2, 4], meta, when) == \
        "mlp-attention_tp2-4_nvlink_h200x4_2026-11-28_140312.json"
    assert results.default_name(["moe"], [2], dict(link="gloo", device="cpu", gpu_count=0, world_size=2), when) == \
        "moe_tp2_gloo_cpux2_2026-11-28_140312.json"
    assert results.describe(dict(meta, torch="2.13.0")) == "NVIDIA H200 x4, NVLink, torch 2.13.0"


def test_bench_list_options_take_spaces_and_commas():
    from overlap_layers.bench.cli import parse_args
    for argv in (["--layer", "mlp", "attention"], ["--layer", "mlp,attention"], ["--layer", "mlp,", "attention"]):
        assert parse_args(argv).layers == ["mlp", "attention"]
    for flag, value in (("--tp", [2, 4, 8]), ("--tokens", [2, 4, 8]), ("--batch", [2, 4, 8]), ("--naive-k", [2, 4, 8])):
        for argv in ([flag, "2", "4", "8"], [flag, "2,4,8"], [flag, "2,4", "8"]):
            assert getattr(parse_args(argv), flag[2:].replace("-", "_")) == value
    args = parse_args(["--modes", "serial", "auto,comm", "--passes", "fwd", "--preset", "tiny,llama3-8b"])
    assert (args.modes, args.passes, args.preset) == (["serial", "auto", "comm"], ["fwd"], ["tiny", "llama3-8b"])
    for bad in (["--layer", "mlp,nope"], ["--modes", "serial", "fast"], ["--passes", "fwd,bwd"], ["--tp", "2,x"],
                ["--tp", "0"], ["--layer", ","], ["--preset", "llama3-8b,huge"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_bench_every_option_says_its_default():
    """Every option has help text, and that text names its default (flags excepted)."""
    import argparse
    from overlap_layers.bench.cli import _Formatter, build_parser
    p = build_parser()
    fmt = _Formatter(p.prog)
    for action in p._actions:
        if isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
            assert action.help, action.dest
            continue
        text = fmt._get_help_string(action)
        assert text and "default" in text, (action.option_strings, text)
    text = p.format_help()
    for needle in ("(default: bfloat16 on CUDA, float32 on CPU)", "(default: 5 on CUDA, 2 on CPU)",
                   "(default: 10 on CUDA, 3 on CPU)", "(default: 5 on CUDA, 3 on CPU)", "(default: mlp)"):
        assert needle in " ".join(text.split()), needle


def test_bench_progress_bar_is_optional(monkeypatch, capsys):
    """With tqdm the bar goes to stderr (nothing to stdout); without tqdm, or where not enabled
    (ranks other than 0), no bar and no error."""
    from overlap_layers.bench.runner import Progress
    pytest.importorskip("tqdm")
    import time
    bar = Progress(2, delay_s=0.0)
    bar.mode("mlp tiny fwd serial")
    time.sleep(0.2)  # tqdm redraws at most every 0.1 s
    bar.advance()
    bar.advance()
    bar.close()
    got = capsys.readouterr()
    assert got.out == "" and "mlp tiny fwd serial" in got.err and "1/2" in got.err
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    for bar in (Progress(2, delay_s=0.0), Progress(2, enabled=False)):
        bar.mode("x")
        bar.advance()
        bar.close()
    assert capsys.readouterr() == ("", "")


def test_bench_sources_speak_in_the_present():
    """No development log (numbered work periods) in the package's comments, docstrings or help."""
    import re
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "overlap_layers", "bench")
    for top, _, names in os.walk(folder):
        for name in sorted(n for n in names if n.endswith(".py")):
            with open(os.path.join(top, name)) as f:
                text = f.read()
            assert not re.search(r"\bsessions?\b|\bsession\d", text, re.IGNORECASE), os.path.join(top, name)
