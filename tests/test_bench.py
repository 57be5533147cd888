"""The benchmark's CPU default runs end to end (so the README's main job cannot rot)."""
import json
import os
import subprocess
import sys


def test_bench_cpu_default(tmp_path):
    out = tmp_path / "mlp.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "overlap_layers.bench", "--out", str(out), "--iters", "1",
                           "--repeats", "1", "--warmup", "1"], cwd=root, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    recs = data["records"]
    modes = {(r["pass"], r["mode"]) for r in recs}
    for p in ("fwd", "fwdbwd"):
        for m in ("serial", "naive", "auto", "compute", "comm"):
            assert (p, m) in modes
    for r in recs:
        if r["mode"] in ("serial", "naive", "auto", "compute", "comm"):
            assert r["ms"] > 0 and r["limit_ms"] >= max(
                x["ms"] for x in recs if x["pass"] == r["pass"] and x["mode"] in ("compute", "comm")) - 1e-9
    assert [r["k"] for r in recs if r["mode"] == "naive"] == [2, 2]
    assert "serial" in proc.stdout and "/limit" in proc.stdout
    auto = [r for r in recs if r["mode"] == "auto"]
    assert all(r["host_plan_lookup_us"] > 0 and r["host_agreement_us"] > 0 and r["planning_ms"] > 0 for r in auto)
    # The report reads the run back (fixed K=1 and K=2 rows and auto for both passes).
    from overlap_layers.bench.report import report
    text = report(recs)
    assert text.count("| tiny | 2 |") == 2 and "Auto within 3% of the best measured K on" in text


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
    assert "median |pred - meas| / meas 0.0% (max 10.0%) over 5 fixed-K cells" in text
    assert "Peak memory: median |pred - meas| / meas 10.0% (max 10.0%) over 2 cells" in text
    assert "Auto within 3% of the best measured K on 1 of 2 rows" in text
    assert "| 2 (8.10) | 2 | 1.01 | 0.81 |" in text
