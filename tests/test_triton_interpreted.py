"""The Triton kernels' tests again, on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``):
CI has no GPU, so otherwise the kernels (heads step, query-chunk merge, slot sum, routing, SwiGLU,
the table-driven row copy, the send rows' placing, the MoE combine, the experts' weight gradients,
the rank pieces' offsets, and the MoE's device path end to end against the dense reference; then
the MLP, attention, block and MoE layers' tests with their kernels) would be checked only on GPU
machines. The interpreter runs each kernel's indexing, masks and arithmetic on the host; what it
cannot show is the compiled code's speed. The layers' runs also check float64 end to end: the
heads step, the query-chunk merge, SwiGLU and the MoE combine send float64 to their torch paths,
or sum it in float64, which the float64 references' tolerances (1e-10) require.

Triton comes from the folder ``OVERLAP_TEST_TRITON`` names (``pip install --no-deps --target DIR
triton``, as README's test command does) and only the child process imports it: this process stays
without Triton, as a CPU install is. Unset, the test skips. The children start when pytest has
collected these tests and run beside the rest of the suite (``interpreted_runs.py``)."""
import pytest

from interpreted_runs import LIMIT_S, summary_of


@pytest.mark.timeout(LIMIT_S)  # the child's own limit: setup.cfg's 300 s per test is too short for it
def test_triton_kernels_under_the_interpreter(request):
    summary = summary_of(request.config, "test_triton_kernels_under_the_interpreter")
    # every kernel test ran: none skipped (a skip would mean the child found no Triton)
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


@pytest.mark.timeout(LIMIT_S)
def test_layers_with_their_kernels_under_the_interpreter(request):
    summary = summary_of(request.config, "test_layers_with_their_kernels_under_the_interpreter")
    assert " passed" in summary and "failed" not in summary, summary
