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
