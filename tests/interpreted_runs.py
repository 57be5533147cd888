"""The child pytest runs of ``test_triton_interpreted.py``: the Triton kernels' tests, and the layers'
with their kernels, under Triton's interpreter (``TRITON_INTERPRET=1``), each in a process of its own.

They start as soon as pytest has collected the tests that read them (``conftest.py``), so that
they run beside the rest of the suite: run one after the other at their turn they would take most
of the suite's time on CI's two cores. A run's test waits for its result; a run whose test is not
collected never starts, and the end of the pytest run stops any still running."""
import os
import subprocess
import sys
import tempfile
import time

import pytest

KERNEL_TESTS = ("tests/test_heads_kernel.py", "tests/test_query_chunks.py::test_triton_merge_equals_torch_merge",
                "tests/test_slot_sum.py", "tests/test_routing.py::test_fused_routing_matches_the_eager_path",
                "tests/test_swiglu.py", "tests/test_device_all_to_all.py", "tests/test_moe_combine.py",
                "tests/test_moe_device.py", "tests/test_expert_wgrad.py",
                "tests/test_moe_plan.py::test_rank_piece_offsets_by_hand")
# the layers end to end with their kernels, against the float64 dense references (some of their
# tests are CUDA-only and skip: the kernel tests above show that the child has Triton)
LAYER_TESTS = ("tests/test_query_chunks.py", "tests/test_mlp.py", "tests/test_attention.py", "tests/test_block.py",
               "tests/test_moe.py")
RUNS = {"test_triton_kernels_under_the_interpreter": KERNEL_TESTS,
        "test_layers_with_their_kernels_under_the_interpreter": LAYER_TESTS}  # test name -> its child's tests
MODULE = "test_triton_interpreted.py"
LIMIT_S = 900  # a child's time from its start; the tests' pytest timeout is as long
_STARTED = pytest.StashKey[dict]()


class InterpretedRun:
    """``pytest -q tests`` in a child process under the interpreter, with Triton from the folder
    ``triton_dir`` on its path (this process stays without Triton, as a CPU install is)."""

    def __init__(self, tests, triton_dir: str) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join(p for p in (triton_dir, root, os.environ.get("PYTHONPATH")) if p))
        self._out = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: nothing reads it until the end
        self._start = time.monotonic()
        self._proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                                       "ignore::RuntimeWarning", *tests], cwd=root, env=env, stdout=self._out,
                                      stderr=subprocess.STDOUT, text=True)

    def result(self) -> tuple:
        """``(return code, output)`` once the child ends, at most ``LIMIT_S`` after its start (past
        that it is killed and ``subprocess.TimeoutExpired`` raised)."""
        try:
            code = self._proc.wait(timeout=max(LIMIT_S - (time.monotonic() - self._start), 0.0))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self._out.seek(0)
        out = self._out.read()
        self._out.close()
        return code, out

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def start_collected(config, items) -> None:
    """Start the run of every collected test of :data:`RUNS` (``OVERLAP_TEST_TRITON`` set)."""
    if config.option.collectonly:
        return
    triton_dir = os.environ.get("OVERLAP_TEST_TRITON")
    names = {item.originalname for item in items if item.path.name == MODULE}
    config.stash[_STARTED] = {name: InterpretedRun(RUNS[name], triton_dir)
                              for name in RUNS if name in names and triton_dir}


def stop_all(config) -> None:
    for run in config.stash.get(_STARTED, {}).values():
        run.stop()


def summary_of(config, name: str) -> str:
    """The last line of test ``name``'s run (started now if collection did not start it)."""
    triton_dir = os.environ.get("OVERLAP_TEST_TRITON")
    if not triton_dir:
        pytest.skip("needs OVERLAP_TEST_TRITON, a folder holding Triton for the interpreted runs "
                    "(pip install --no-deps --target DIR triton; README's test command sets it)")
    runs = config.stash.setdefault(_STARTED, {})
    if name not in runs:
        runs[name] = InterpretedRun(RUNS[name], triton_dir)
    code, out = runs[name].result()
    assert code == 0, out[-6000:]
    return out.strip().splitlines()[-1]
