"""A layer call's agreement across the ranks of its group ([Note: agreement] in ``runtime/group.py``):
one host gather of what decides which collectives the call runs, before any of them runs.

Reference: :func:`agree` returns the same :class:`Agreed` on every rank, or raises the same
ValueError on every rank: when some rank's input is bad (its error code is not 0), or when the
ranks differ in the shape, dtype, plan request, grad mode, the layer's ``extra`` columns, whether
``x`` is a DTensor, whether the call is being captured into a CUDA graph, or
``config.graph_calls``. The layer's *floor* (``TiledLayer._floor``) rides in the same gather; its
minimum over the ranks, not its equality, is what counts (``LayerPlanner.agreed_floor``).

[Note: agreement once per call signature]
A call whose row (everything above, floor included, as this rank would send it) equals the row
of the layer's last agreed call reuses that agreement without a gather; a world of one rank
never gathers. This is safe by induction: every rank gathers at the same calls (a rank gathers
exactly when its row changed, and the rows of agreed calls are equal on every rank), so the
last agreed row is the same on every rank, and a rank that skips runs the call the others
agreed on. What the skip cannot see is a rank whose input changed while its peers' did not:
that rank gathers alone, and waits in the gather until the group's timeout while its peers'
collectives wait for it; a divergence that the agreement would have named becomes a timeout on
every rank, never a silent mix. Calls are not remembered where the agreement must run every
time: layers whose ranks may hold different shapes (``shape_names`` with a None, the MoE's
token counts), a call whose parameters moved under ``config.graph_calls``, and plans that
exchange over the copy engine (their floor says whether the ranks' symmetric workspaces still
agree, which can change on one rank alone: :meth:`LayerPlanner.known_agreement`).
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence

import torch

from ..runtime.group import first_disagreement
from .calls import capturing_graph
from .plan import TilePlan

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class Agreed(NamedTuple):
    """A call's agreed values, equal on every rank: the ``shape`` planning uses (the layer's
    ``_agreed_shape``), the ``dtype`` the call computes in (autocast's where enabled), whether it
    saves for backward (``save``), and the ``fixed`` plan (pinned, or a fixed K) or None when the
    planner decides."""

    shape: tuple
    dtype: Optional[torch.dtype]
    save: bool
    fixed: Optional[TilePlan]


def floor_of(table, n: int) -> tuple:
    """The minimum over the rows of ``table`` of each of their last ``n`` columns."""
    return tuple(min(col) for col in zip(*(row[len(row) - n:] for row in table))) if n else ()


def agree(layer, planner, x, err: int, errors: Mapping[int, str], what: str, *, extra: Sequence[int] = (),
          extra_names: Sequence[str] = (), shape_names=("batch", "seq", "hidden")) -> Agreed:
    """The call's agreement (module docstring): one host gather of (input error ``err``, shape,
    dtype, plan request, grad mode, ``extra``, DTensor input, capture, graph calls, the layer's
    floor, whether its parameters are where its captured calls read them) from every rank;
    ``errors[code]`` says why an input is bad, ``what`` names the arguments. Sets the planner's
    ``agreed_floor`` (before any check raises) and ``capturing`` (after the checks passed)."""
    floor = layer._floor()
    shape = tuple(x.shape) if err == 0 else (0, 0, 0)
    fixed = planner.fixed_plan(shape) if err == 0 else TilePlan(1)
    save = torch.is_grad_enabled() and (
        (err == 0 and x.requires_grad) or any(p.requires_grad for p in layer.parameters()))
    dtype = x.dtype if err == 0 else None
    if err == 0 and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    dtype_code = DTYPES.index(dtype) if dtype in DTYPES else -1
    request = fixed.digest() if fixed is not None else 0
    # the last columns: whether x came as a DTensor ([Note: DTensor inputs]), so that a DTensor on
    # some ranks and a plain tensor on others is a ValueError on every rank, not a silent mix;
    # whether the call is being captured into a CUDA graph ([Note: CUDA graphs])
    capturing = err == 0 and capturing_graph(x)
    # then config.graph_calls, and after the floor whether this rank's parameters are the tensors
    # its captured calls read (the minimum counts: [Note: graph calls] in planning/call_graphs.py)
    graphs = planner.call_graphs
    kept = graphs.params_kept(planner.graph_params()) if graphs is not None else 1
    row = (err, *shape, dtype_code, request, int(save), *extra, int(planner.dtensor_input), int(capturing),
           int(graphs is not None), *floor, kept)
    known = planner.known_agreement(row)
    if known is not None:  # [Note: agreement once per call signature]
        return known
    full = planner.agreement.gather(row) if layer.world_size > 1 else [row]
    if graphs is not None and min(row[-1] for row in full) == 0:
        graphs.moved()  # on every rank that has graphs (config.graph_calls is agreed below)
    full = [row[:-1] for row in full]
    table = [row[:len(row) - len(floor)] for row in full]
    planner.agreed_floor = floor_of(full, len(floor))
    _raise_bad_input(layer, x, err, errors, what, table)
    names = ("input error", *shape_names, "dtype", "plan request (0 = auto)", "grad mode", *extra_names,
             "x a DTensor", "capturing a CUDA graph", "config.graph_calls")
    bad = first_disagreement(table, names)
    if bad:
        raise ValueError(f"x: every rank of the group must call the layer alike (shapes, dtype, num_tiles or "
                         f"pinned plan, grad mode{''.join(', ' + n for n in extra_names)}, "
                         f"DTensor or plain x, CUDA-graph capture or not, config.graph_calls); {bad}")
    planner.capturing = capturing  # agreed: equal on every rank
    layer._after_agreement(planner.agreed_floor, capturing)
    agreed = Agreed(layer._agreed_shape(shape, table), dtype, save, fixed)
    if kept and (layer.world_size == 1 or None not in shape_names):  # shapes that may differ: every call
        planner.remember_agreement(row, agreed)
    return agreed


def _raise_bad_input(layer, x, err: int, errors: Mapping[int, str], what: str, table) -> None:
    """The ValueError every rank raises when some rank's input is bad (its error code in ``table``)."""
    errs = {r: row[0] for r, row in enumerate(table) if row[0]}
    if not errs:
        return
    w = layer._weight
    mine = f"; this rank: {errors[err]} (got x {tuple(getattr(x, 'shape', ()))}, " \
           f"{getattr(x, 'dtype', None)}, {getattr(x, 'device', None)}; hidden_size={layer.hidden_size}, " \
           f"weights {w.dtype} on {w.device})" if err else ""
    raise ValueError(f"{what}: bad input on rank(s) " + ", ".join(
        f"{r} ({errors[e]})" for r, e in errs.items()) + mine)
