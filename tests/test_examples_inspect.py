"""examples/inspect_plan.py, run as a user would (it spawns its own 2 gloo ranks): it prints the
plan and writes the predicted and measured traces with a PNG of each."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "inspect_plan.py")


def _x_events(path):
    with open(path) as f:
        data = json.load(f)
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]


def test_inspect_plan_writes_traces_and_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib (pip install \"overlap_layers[plot]\")")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, "--layer", "mlp,attention", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for kind in ("mlp", "attention"):
        assert f"=== {kind}: " in proc.stdout
        for which in ("predicted", "measured"):
            trace, png = out / f"{kind}_{which}.json", out / f"{kind}_{which}.png"
            assert str(trace) in proc.stdout and str(png) in proc.stdout
            events = _x_events(trace)
            assert events and {e["cat"] for e in events} >= {"comm", "compute"}, events
            with open(png, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        # every rank recorded its measured call, with the same ops
        names = sorted(e["name"] for e in _x_events(out / f"{kind}_measured.json"))
        assert names == sorted(e["name"] for e in _x_events(out / f"{kind}_measured_rank1.json"))
    assert proc.stdout.count("plan: K=") == 2


def test_inspect_plan_rejects_unknown_layer():
    proc = subprocess.run([sys.executable, SCRIPT, "--layer", "mlp,conv"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--layer" in proc.stderr
