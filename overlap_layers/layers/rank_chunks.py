"""The sequence-parallel MLP split by source rank instead of by batch tile (DESIGN.md 4, remedy a).

Reference (what it must equal, per rank r): the serial SP MLP of ``mlp.py``,
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
the serial backward over ``dy`` (gathered the same way, and ``x`` too when re-gathering):

=========  =======================================================================
dgrad      dh = dy_q @ w_out; dpre = act'(pre_q, dh); dx partial = dpre @ w_in -> rank q
wgrad      dw_out += dy_q.T @ act(pre_q); dw_in += dpre.T @ x_q; db_in += sum(dpre)
=========  =======================================================================

Legend: T local rows, h = T // 2, H hidden, I local fc1 width, F local ffn width; pre is saved
for all gathered rows ``[ws, T, I]`` (as the serial layer saves ``[ws*T, I]``).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch


def pieces(rank: int, world_size: int, rows: int) -> List[Tuple[int, int, int, int]]:
    """``(step, source rank, first row, end row)`` in launch order; step 0 is the rank's own rows."""
    half = rows // 2
    out = [(0, rank, 0, half)] if half else []
    out += [(j, (rank + j) % world_size, 0, rows) for j in range(1, world_size)]
    return out + [(0, rank, half, rows)]


def _finish(exchange, recorder) -> torch.Tensor:
    tok = recorder.begin("sum", 0, "compute0") if recorder is not None else None
    out = exchange.finish()
    if tok is not None:
        recorder.end(tok)
    return out


def _tag(j: int, a: int, b: int, rows: int) -> str:
    return str(j) if j else ("own[:h]" if a == 0 and b < rows else "own[h:]" if a else "own")


def forward(exchange, x_TH: torch.Tensor, w_in: torch.Tensor, b_in, w_out: torch.Tensor,
            act: Callable, pre_all: torch.Tensor, log, recorder=None) -> torch.Tensor:
    """The forward in the module table; writes ``pre`` of every gathered row into ``pre_all``
    ``[ws, T, I]`` and returns ``y [T, H]``. ``recorder`` (an ``OpRecorder``) times each piece."""
    rank, ws, T = exchange.rank, exchange.ws, x_TH.shape[0]
    for j, q, a, b in pieces(rank, ws, T):
        tok = recorder.begin("fwd", _tag(j, a, b, T), "compute0") if recorder is not None else None
        with torch.profiler.record_function(f"overlap::mlp::rank_chunk[{q}]"):
            xin = x_TH[a:b] if j == 0 else exchange.pull(j)[0]
            pre = pre_all[q, a:b]
            if b_in is None:
                torch.mm(xin, w_in.t(), out=pre)
            else:
                torch.addmm(b_in, xin, w_in.t(), out=pre)
            h = act(pre)
            out = exchange.own_partial[a:b] if j == 0 else None
            out = torch.mm(h, w_out.t(), out=out)
            if j:
                exchange.push(j, out)
        if tok is not None:
            recorder.end(tok)
        if log is not None:
            log.append((f"step{j}[{a}:{b}]", "rank_chunk", "fwd"))  # rank-independent, like every log entry
    return _finish(exchange, recorder)


def backward(exchange, dy_TH, gathered_x, pre_all, w_in, w_out, act_backward, grads: dict, log, recorder=None):
    """The backward in the module table; ``act_backward(pre, dh)`` returns ``(dpre, act(pre))``.
    ``gathered_x(j, q, a, b, pulled)`` returns the input rows of a piece (saved, or pulled as
    ``exchange``'s second source). Fills ``grads`` (``w_in``,
    ``w_out`` and ``b_in`` if not None) and returns ``dx [T, H]``."""
    rank, ws, T = exchange.rank, exchange.ws, dy_TH.shape[0]
    first = True
    for j, q, a, b in pieces(rank, ws, T):
        tok = recorder.begin("bwd", _tag(j, a, b, T), "compute0") if recorder is not None else None
        with torch.profiler.record_function(f"overlap::mlp_bwd::rank_chunk[{q}]"):
            pulled = exchange.pull(j) if j else None
            dy = dy_TH[a:b] if j == 0 else pulled[0]
            x = gathered_x(j, q, a, b, pulled)
            pre = pre_all[q, a:b]
            dpre, h = act_backward(pre, torch.mm(dy, w_out))
            out = exchange.own_partial[a:b] if j == 0 else None
            out = torch.mm(dpre, w_in, out=out)
            if j:
                exchange.push(j, out)
            if first:
                torch.mm(dy.t(), h, out=grads["w_out"])
                torch.mm(dpre.t(), x, out=grads["w_in"])
                if grads.get("b_in") is not None:
                    torch.sum(dpre, 0, out=grads["b_in"])
            else:
                grads["w_out"].addmm_(dy.t(), h)
                grads["w_in"].addmm_(dpre.t(), x)
                if grads.get("b_in") is not None:
                    grads["b_in"].add_(dpre.sum(0))
            first = False
        if tok is not None:
            recorder.end(tok)
        if log is not None:
            log.append((f"step{j}[{a}:{b}]", "rank_chunk", "bwd"))
    return _finish(exchange, recorder)
