"""The Triton kernels' tests again, on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``):
CI has no GPU, so otherwise the kernels (heads step, query-chunk merge, slot sum, routing, SwiGLU,
the table-driven row copy, the send rows' placing, the MoE combine, the experts' weight gradients,
the rank pieces' offsets, and the MoE's device path end to end against the dense reference; then
the MLP, attention, block and MoE layers' tests with their kernels) would be checked only on GPU
machines. The interpreter runs each kernel's indexing, masks and arithmetic on the host; what it
cannot show is the compiled code's speed. Running the layers so showed that the heads step, the
query-chunk merge, SwiGLU and the MoE combine computed float64 in float32 (relative errors of
2e-8 to 8e-8 where the float64 references hold 1e-10): float64 now takes their torch paths, or is
summed in float64 (session 39).

Triton comes from the folder ``OVERLAP_TEST_TRITON`` names (``pip install --no-deps --target DIR
triton``, as README's test command does) and only the child process imports it: this process stays
without Triton, as a CPU install is. Unset, the test skips."""
import os
import subprocess
import sys

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


def _interpreted(tests) -> str:
    """The last line of a pytest run of ``tests`` in a child process under the interpreter."""
    path = os.environ.get("OVERLAP_TEST_TRITON")
    if not path:
        pytest.skip("OVERLAP_TEST_TRITON is not set (README's test command installs Triton there)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (path, root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                           "ignore::RuntimeWarning", *tests], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(900)  # the child's own limit: setup.cfg's 300 s per test cut it once (session 47)
def test_triton_kernels_under_the_interpreter():
    summary = _interpreted(KERNEL_TESTS)
    # every kernel test ran: none skipped (a skip would mean the child found no Triton)
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


@pytest.mark.timeout(900)
def test_layers_with_their_kernels_under_the_interpreter():
    summary = _interpreted(LAYER_TESTS)
    assert " passed" in summary and "failed" not in summary, summary
