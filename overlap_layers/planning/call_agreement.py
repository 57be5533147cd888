"""A layer call's agreement across the ranks of its group ([Note: agreement] in ``runtime/group.py``):
one host gather of what decides which collectives the call runs, before any of them runs.

Reference: :func:`agree` returns the same :class:`Agreed` on every rank, or raises the same
ValueError on every rank: when the ranks' layers are configured differently ([Note: layer config]
in ``planning/cross_checks.py``: the error names each differing field and every rank's value),
when some rank's input is bad (its error code is not 0), when the ranks differ in the shape,
dtype, plan request, grad mode, the layer's ``extra`` columns, whether ``x`` is a DTensor,
whether the call is being captured into a CUDA graph, or ``config.graph_calls``, or, with
``config.check_inputs``, in an input that must be equal on every rank ([Note: input checks]).
The layer's *floor* (``TiledLayer._floor``) rides in the same gather; its minimum over the ranks,
not its equality, is what counts (``LayerPlanner.agreed_floor``). Every error names the layer and
its call (``LayerPlanner.describe``).

[Note: agreement once per call signature]
A call whose row (everything above, floor included, as this rank would send it, but the config
digest and the fingerprints) equals the row of the layer's last agreed call reuses that agreement
without a gather; a world of one rank never gathers. The config is therefore compared at the
first call of each signature: a layer changed on one rank after that is seen at its next new one. This is safe by induction: every rank gathers at the same calls (a rank gathers
exactly when its row changed, and the rows of agreed calls are equal on every rank), so the
last agreed row is the same on every rank, and a rank that skips runs the call the others
agreed on. What the skip cannot see is a rank whose input changed while its peers' did not:
that rank gathers alone, and waits in the gather until the group's timeout while its peers'
collectives wait for it; a divergence that the agreement would have named becomes a timeout on
every rank, never a silent mix (the timeout names the layer, the call and the rank that did not
arrive). With ``config.check_inputs`` every call gathers (its inputs' fingerprints ride in the
row), so such a rank is named at once by a ValueError on every rank; a call whose rows all equal
the last agreed one then keeps that agreement. Calls are not remembered where the agreement must
run every time: layers whose ranks may hold different shapes (``shape_names`` with a None, the MoE's
token counts), a call whose parameters moved under ``config.graph_calls``, and plans that
exchange over the copy engine (their floor says whether the ranks' symmetric workspaces still
agree, which can change on one rank alone: :meth:`LayerPlanner.known_agreement`).
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from ..runtime.group import first_disagreement
from .calls import capturing_graph
from .cross_checks import config_difference, fingerprints, input_difference, pack_config
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
          extra_names: Sequence[str] = (), shape_names=("batch", "seq", "hidden"),
          replicated: Sequence[Tuple[str, Optional[torch.Tensor]]] = ()) -> Agreed:
    """The call's agreement (module docstring): one host gather of (input error ``err``, shape,
    dtype, plan request, grad mode, ``extra``, DTensor input, capture, graph calls, the layer's
    floor, whether its parameters are where its captured calls read them), after the digest of
    the layer's config and before the fingerprints of ``replicated`` (``(name, tensor or
    None)``: the inputs every rank must hold equal, compared with ``config.check_inputs``) from
    every rank; ``errors[code]`` says why an input is bad, ``what`` names the arguments. Sets the
    planner's ``agreed_floor`` (before any check raises) and ``capturing`` (after the checks
    passed)."""
    planner.calls += 1
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
    if known is not None and not planner.checks_inputs:  # [Note: agreement once per call signature]
        return known
    # [Note: input checks]: not while capturing (no host read), nor for a bad input; zeros keep the length
    prints = fingerprints([t for _, t in replicated]) if planner.checks_inputs and err == 0 and not capturing \
        else (0,) * (3 * len(replicated))
    sent = (layer._config_digest(), *row, *prints)
    full = planner.agreement.gather(sent, who=planner.describe) if layer.world_size > 1 else [sent]
    n = len(prints)
    digests, prints_table = {r[0] for r in full}, [r[len(r) - n:] for r in full]
    full = [r[1:len(r) - n] for r in full]
    if len(digests) > 1:  # [Note: layer config]: every rank saw the same digests and gathers again
        table = layer._config_table()
        named = config_difference(table, planner.agreement.gather(pack_config(table), who=planner.describe))
        raise ValueError(f"layer config differs across ranks: every rank of the group must build the layer alike; "
                         f"{named} [{planner.describe()}]")
    # with check_inputs a repeated call gathers too; where every rank's row is its last agreed one,
    # that agreement stands on every rank (below, once the checks passed)
    repeated = known is not None and all(r == row for r in full)
    if graphs is not None and min(row[-1] for row in full) == 0:
        graphs.moved()  # on every rank that has graphs (config.graph_calls is agreed below)
    full = [row[:-1] for row in full]
    table = [row[:len(row) - len(floor)] for row in full]
    planner.agreed_floor = floor_of(full, len(floor))
    _raise_bad_input(layer, x, err, errors, what, table, planner)
    names = ("input error", *shape_names, "dtype", "plan request (0 = auto)", "grad mode", *extra_names,
             "x a DTensor", "capturing a CUDA graph", "config.graph_calls")
    bad = first_disagreement(table, names)
    if bad:
        raise ValueError(f"x: every rank of the group must call the layer alike (shapes, dtype, num_tiles or "
                         f"pinned plan, grad mode{''.join(', ' + n for n in extra_names)}, "
                         f"DTensor or plain x, CUDA-graph capture or not, config.graph_calls); {bad} "
                         f"[{planner.describe()}]")
    differ = input_difference([name for name, _ in replicated], prints_table) if n else None
    if differ:
        raise ValueError(f"check_inputs: {differ}; these inputs must be equal on every rank of the group "
                         f"[{planner.describe()}]")
    if repeated:
        return known
    planner.capturing = capturing  # agreed: equal on every rank
    layer._after_agreement(planner.agreed_floor, capturing)
    agreed = Agreed(layer._agreed_shape(shape, table), dtype, save, fixed)
    if kept and (layer.world_size == 1 or None not in shape_names):  # shapes that may differ: every call
        planner.remember_agreement(row, agreed)
    return agreed


def _raise_bad_input(layer, x, err: int, errors: Mapping[int, str], what: str, table, planner) -> None:
    """The ValueError every rank raises when some rank's input is bad (its error code in ``table``)."""
    errs = {r: row[0] for r, row in enumerate(table) if row[0]}
    if not errs:
        return
    w = layer._weight
    mine = f"; this rank: {errors[err]} (got x {tuple(getattr(x, 'shape', ()))}, " \
           f"{getattr(x, 'dtype', None)}, {getattr(x, 'device', None)}; hidden_size={layer.hidden_size}, " \
           f"weights {w.dtype} on {w.device})" if err else ""
    raise ValueError(f"{what}: bad input on rank(s) " + ", ".join(
        f"{r} ({errors[e]})" for r, e in errs.items()) + mine + f" [{planner.describe()}]")
