"""README's quick start runs as written: two gloo ranks whose outputs and input gradients match the
dense reference the snippet computes itself."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quick_start() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quick_start_runs_and_matches_the_dense_reference(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_quick_start())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path the README describes, also on GPU machines
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    num = r"([0-9.]+(?:e[+-]?[0-9]+)?)"  # the ranks' prints may interleave: no \S+ across them
    rows = re.findall(rf"rank (\d): output error {num}, input-gradient error {num}", out.stdout)
    assert sorted(r for r, _, _ in rows) == ["0", "1"], out.stdout
    for _, y_err, dx_err in rows:
        assert float(y_err) < 1e-4 and float(dx_err) < 1e-4, out.stdout
