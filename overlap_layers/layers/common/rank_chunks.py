"""The sequence-parallel MLP split by source rank instead of by batch tile
(docs/architecture.md, Transports).

Reference (what it must equal, per rank r): the serial SP MLP of ``layers/mlp/layer.py``,
``y_r = RS(act(AG(x) @ w_in.T + b_in) @ w_out.T)``. Rows of the gathered input that came from
rank q only ever meet rows from q, so the layer is a sum of independent per-source pieces:

=========  =======================================================================  ==========
piece      forward                                                                  partial to
=========  =======================================================================  ==========
own, 1st   p = act(x_r[:h] @ w_in.T + b_in) @ w_out.T                               own slot
peer q     p = act(x_q @ w_in.T + b_in) @ w_out.T   (x_q pulled while earlier run)   rank q
own, 2nd   same on x_r[h:]                                                          own slot
=========  =======================================================================  ==========

then ``y_r = sum of the slots`` (the partials every rank computed for r's rows). Peers come in
step order q = r+1, r+2, ... (mod ws): the exchange's pull order. The own rows start at once (no
pipeline fill) and the second half hides the last push (no drain). Backward is the same split of
the serial backward over ``dy`` (gathered the same way, and ``x`` too when re-gathering), with
the own rows whole and first: a piece pushes its dx partial, and the weight gradients run once
over every gathered row after the last piece, so they hide the last push and, over the copy
engine, the sum of the slots (``exchange.reduce_early``); halves would only cost GEMM efficiency
there. Forward, the copy engine sums the first half's rows beside the own second half, the rest
after it.

=========  =======================================================================
dgrad      dh = dy_q @ w_out; dpre_q, h_q = act'(pre_q, dh), act(pre_q);
           dx partial = dpre_q @ w_in -> rank q                (per piece)
wgrad      dw_out = dy.T @ h; dw_in = dpre.T @ x; db_in = sum(dpre)   (every row, after the pieces)
=========  =======================================================================

[Note: weight gradients over every row]
Per piece, the weight gradients would be ``2*ws`` GEMMs with ``K = T`` (all but two accumulating
into the gradients), slower than the two GEMMs over the ``ws*T`` gathered rows that the serial
layer runs (measured: see docs/measurements.md, MLP). So they run over every row, once. They need
every row at the end: ``dy`` and ``x`` (the exchange's gathered buffers or the one the forward
kept, own rows copied in: ``exchange.whole``), ``h`` (a buffer of ``ws*T`` rows, as the serial
layer holds) and ``dpre``, which each piece writes over its ``pre`` rows, read just before and
never again, unless a second backward will read ``pre`` (``retain_graph=True``: then into a
buffer of its own).

Legend: T local rows, h = T // 2, H hidden, I local fc1 width, F local ffn width; pre is saved
for all gathered rows ``[ws, T, I]`` (as the serial layer saves ``[ws*T, I]``).

:func:`piece`, :func:`finish`, :func:`accumulate`, :func:`accumulate_rows` and :func:`step_tag`
serve the attention's rank-chunk path too (``layers/attention/rank_chunks.py``), :func:`piece` and :func:`piece_tag`
the MoE's (``layers/moe/ranks.py``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Tuple

import torch

from ...runtime.exchange import push_tag
from ...runtime.executor import profiler_range


def pieces(rank: int, world_size: int, rows: int, backward: bool = False) -> List[Tuple[int, int, int, int]]:
    """``(step, source rank, first row, end row)`` in launch order; step 0 is the rank's own rows
    (halves first and last forward, whole and first backward: the module docstring)."""
    if backward:
        return [(0, rank, 0, rows)] + [(j, (rank + j) % world_size, 0, rows) for j in range(1, world_size)]
    half = rows // 2
    out = [(0, rank, 0, half)] if half else []
    out += [(j, (rank + j) % world_size, 0, rows) for j in range(1, world_size)]
    return out + [(0, rank, half, rows)]


def finish(exchange, recorder=None) -> torch.Tensor:
    """``exchange.finish()`` (the sum of the partial slots, or of the rows ``reduce_early`` left),
    timed by ``recorder`` if given (the early sum is timed by the exchange itself)."""
    if exchange.summed_early:
        return exchange.finish()
    with piece(recorder, "sum", 0):
        return exchange.finish()


@contextlib.contextmanager
def piece(recorder, name: str, tag, label: str = ""):
    """Runs a piece: the ops launched inside are timed on the compute stream as ``name[tag]``
    by ``recorder`` (if any) and carry the profiler range ``label`` (if any)."""
    tok = recorder.begin(name, tag, "compute0") if recorder is not None else None
    with profiler_range(label) if label else contextlib.nullcontext():
        yield
    if tok is not None:
        recorder.end(tok)


def accumulate(grads: dict, key: str, a_t: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``grads[key] = a_t.T @ b`` on the first piece, ``+=`` after (a no-op for a None entry)."""
    if grads.get(key) is None:
        return
    if first:
        torch.mm(a_t.t(), b, out=grads[key])
    else:
        grads[key].addmm_(a_t.t(), b)


def accumulate_rows(grads: dict, key: str, rows: torch.Tensor, first: bool) -> None:
    """``grads[key] = rows.sum(0)`` on the first piece, ``+=`` after (a bias gradient)."""
    if grads.get(key) is None:
        return
    if first:
        torch.sum(rows, 0, out=grads[key])
    else:
        grads[key].add_(rows.sum(0))


def step_tag(j: int, block: int = 0, blocks: int = 1, half: Optional[int] = None) -> str:
    """A rank-chunk piece's tag in traces: its step (``own`` for the rank's own rows), prefixed by
    its batch tile when there are several (the attention's), suffixed by its half of a halved last
    push (``[:h]``, ``[h:]``: [Note: halved last push] in ``runtime/exchange.py``)."""
    return push_tag(block, str(j) if j else "own", blocks, half)


def piece_tag(j: int, a: int, b: int, rows: int) -> str:
    """A piece's tag in traces, as the cost models name it: its step, or for the own rows
    ``[a, b)`` of ``rows`` the first half, the second half or the whole."""
    return str(j) if j else ("own[:h]" if a == 0 and b < rows else "own[h:]" if a else "own")


def forward(exchange, x_TH: torch.Tensor, w_in: torch.Tensor, b_in, w_out: torch.Tensor,
            act: Callable, pre_all: Optional[torch.Tensor], log, recorder=None) -> torch.Tensor:
    """The forward in the module table; returns ``y [T, H]``. Writes ``pre`` of every gathered
    row into ``pre_all`` ``[ws, T, I]`` (kept for the backward), or, with ``pre_all=None`` (nothing
    saved), each piece into a temporary of its own rows that the next piece reuses: a no-grad call
    holds one piece's ``pre``, not all ``ws*T`` rows'. ``recorder`` (an ``OpRecorder``) times each
    piece."""
    rank, ws, T = exchange.rank, exchange.ws, x_TH.shape[0]
    half = T // 2
    for j, q, a, b in pieces(rank, ws, T):
        with piece(recorder, "fwd", piece_tag(j, a, b, T), f"overlap::mlp::rank_chunk[{q}]"):
            xin = x_TH[a:b] if j == 0 else exchange.pull(j)[0]
            pre = pre_all[q, a:b] if pre_all is not None else xin.new_empty((b - a, w_in.shape[0]))
            if b_in is None:
                torch.mm(xin, w_in.t(), out=pre)
            else:
                torch.addmm(b_in, xin, w_in.t(), out=pre)
            out = torch.mm(act(pre), w_out.t(), out=exchange.own_partial[a:b] if j == 0 else None)
            if j:
                exchange.push(j, out)
            if j == ws - 1 and half:  # the last push: the first half's rows may be summed beside the second half
                exchange.reduce_early(half)
        if log is not None:
            log.append((f"step{j}[{a}:{b}]", "rank_chunk", "fwd"))  # rank-independent, like every log entry
    return finish(exchange, recorder)


def backward(exchange, dy_TH, x_all: Callable[[], torch.Tensor], pre_all, w_in, w_out, act_backward, grads: dict,
             log, recorder=None, in_place: bool = True):
    """The backward in the module table; ``act_backward(pre, dh, out, h_out)`` returns ``(dpre,
    act(pre))`` into ``out`` and ``h_out``. ``exchange``'s first source is ``dy``, its own rows
    kept; ``x_all()`` returns the gathered input ``[ws, T, H]``, every rank's rows (called after
    the pieces). ``dpre`` overwrites ``pre_all`` with ``in_place``, else goes to a buffer of its
    own ([Note: weight gradients over every row]). Fills ``grads`` (``w_in``, ``w_out`` and
    ``b_in`` if not None) and returns ``dx [T, H]``."""
    rank, ws, T = exchange.rank, exchange.ws, dy_TH.shape[0]
    dpre_all = pre_all if in_place else torch.empty_like(pre_all)
    h_all = dy_TH.new_empty((ws, T, w_out.shape[1]))
    for j, q, a, b in pieces(rank, ws, T, backward=True):
        with piece(recorder, "bwd", piece_tag(j, a, b, T), f"overlap::mlp_bwd::rank_chunk[{q}]"):
            dy = dy_TH[a:b] if j == 0 else exchange.pull(j)[0]
            dpre, _ = act_backward(pre_all[q, a:b], torch.mm(dy, w_out), dpre_all[q, a:b], h_all[q, a:b])
            out = torch.mm(dpre, w_in, out=exchange.own_partial[a:b] if j == 0 else None)
            if j:
                exchange.push(j, out)
            if j == ws - 1:  # the last push: the sum may run beside the weight gradients
                exchange.reduce_early()
        if log is not None:
            log.append((f"step{j}[{a}:{b}]", "rank_chunk", "bwd"))
    with piece(recorder, "wgrad", "all", "overlap::mlp_bwd::wgrad"):
        rows = dpre_all.view(ws * T, -1)
        accumulate(grads, "w_out", exchange.whole(0).view(ws * T, -1), h_all.view(ws * T, -1), True)
        accumulate(grads, "w_in", rows, x_all().view(ws * T, -1), True)
        accumulate_rows(grads, "b_in", rows, True)
    if log is not None:
        log.append(("wgrad[all]", "rank_chunk", "bwd"))
    return finish(exchange, recorder)
