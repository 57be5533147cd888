"""A layer call as one opaque custom op, so that ``torch.compile`` traces a model holding the
layers without graph breaks.

Reference: under ``torch.compile`` a layer call returns what the eager call returns, and backward
gives the gradients the eager call gives (the op runs the eager layer inside).

[Note: compiled calls]
What the layer does per call (the agreement gather, planning, first-call verification, streams,
async collectives, host reads of split sizes) cannot be traced, so while dynamo traces
(``torch.compiler.is_compiling()``) a layer's ``forward`` emits one ``overlap_layers::layer_call``
op instead: the graph gets a node whose output has the shape of ``x`` and a scalar token. At run
time the op's implementation runs the layer eagerly, on the op's input tensors (``x``, the
position tensors, the layer's parameters, through ``torch.func.functional_call``), with autograd
re-enabled inside (custom-op kernels run below autograd, so the key guard lifts that exclusion
for the call) and keeps the call's autograd graph in the layer's planner
(``LayerPlanner.compiled_graphs``), under the token.
``overlap_layers::layer_call_backward`` (the op's registered backward) takes the token and the
output's gradient and returns the gradients of ``x`` and of every parameter from that graph,
which it then drops; nothing is recomputed. A graph whose backward never runs is dropped when its
token tensor dies.

DTensor parameters enter the op as their local tensors (``p.to_local()``, traced, so their
gradients reach the DTensor parameters) and the layer computes on them as on its DTensors' local
views. The op finds its layer by a key in one process-wide weak table (as c10d finds a process
group by its name): the table holds no layer alive. Not covered (the eager path, with graph
breaks, runs instead): DTensor inputs, and autocast regions around a compiled call (the op runs
the layer's own autocast handling eagerly, so results match, but the region breaks the graph).
"""
from __future__ import annotations

import itertools
import weakref
from typing import List, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

_LAYERS: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
_AUTOGRAD = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality) | \
    torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)


def _autograd_inside():
    """Lift the custom-op kernel's exclusion of the autograd keys for the block (grad mode is the
    caller's to set)."""
    inc, exc = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    return torch._C._ForceDispatchKeyGuard(inc, exc - _AUTOGRAD)


def _layer(key: int):
    layer = _LAYERS.get(key)
    if layer is None:
        raise RuntimeError(f"overlap_layers::layer_call: layer {key} no longer exists")
    return layer


# The ops run host work (agreement, planning, host reads) and keep each call's autograd graph between
# the forward and backward ops: Inductor must not capture them into its CUDA graphs
# (``mode="reduce-overhead"``), which then leaves the graphs holding them eager (or, with
# ``torch._inductor.config.graph_partition``, captures the ops around them).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("overlap_layers::layer_call", mutates_args=(), tags=_TAGS)
def layer_call(key: int, x: torch.Tensor, extras: Sequence[torch.Tensor], present: Sequence[bool],
               params: Sequence[torch.Tensor], requires_grad: Sequence[bool]) -> List[torch.Tensor]:
    """``[y, token]``: the layer's eager call on ``x`` with ``params`` in place of its parameters;
    its other tensor arguments are ``extras``, spread over the slots where ``present`` is True (the
    others None); ``requires_grad`` per input (x, then params) says what the kept graph must reach
    ([Note: compiled calls])."""
    layer = _layer(key)
    given = iter(extras)
    slots = [next(given) if p else None for p in present]
    names = [n for n, _ in layer.named_parameters()]
    record = any(requires_grad)
    with _autograd_inside(), torch.set_grad_enabled(record):
        xl = x.detach().requires_grad_(requires_grad[0])
        leaves = {n: p.detach().requires_grad_(r) for n, p, r in zip(names, params, requires_grad[1:])}
        y = torch.func.functional_call(layer, leaves, (xl,), layer._compiled_kwargs(slots), strict=True)
    token = next(_KEYS)
    token_t = torch.tensor(token, dtype=torch.int64)
    if record:
        calls = layer.planner.compiled_graphs
        calls[token] = (y, [xl, *leaves.values()])
        weakref.finalize(token_t, calls.pop, token, None)
    return [y.detach(), token_t]


@layer_call.register_fake
def _(key, x, extras, present, params, requires_grad):
    return [torch.empty_like(x), torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("overlap_layers::layer_call_backward", mutates_args=(), tags=_TAGS)
def layer_call_backward(key: int, token: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor,
                        params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The gradients of ``x`` and of every parameter from the graph kept under ``token`` (zeros
    where the graph does not reach an input); the graph is dropped."""
    y, leaves = _layer(key).planner.compiled_graphs.pop(int(token))
    wanted = [t for t in leaves if t.requires_grad]
    with _autograd_inside():
        got = iter(torch.autograd.grad(y, wanted, grad_y, allow_unused=True))
    out, seen = [], {t.untyped_storage().data_ptr() for t in (token, grad_y, x, *params) if t.numel()}
    for t in leaves:
        g = next(got) if t.requires_grad else None
        g = torch.zeros_like(t) if g is None else g
        if g.numel() and g.untyped_storage().data_ptr() in seen:  # an op's outputs may not alias
            g = g.clone()
        seen.add(g.untyped_storage().data_ptr())
        out.append(g)
    return out


@layer_call_backward.register_fake
def _(key, token, grad_y, x, params):
    return [torch.empty_like(x)] + [torch.empty_like(p) for p in params]


def _setup(ctx, inputs, output):
    key, x, extras, present, params, _ = inputs
    ctx.key, ctx.n_extras, ctx.no_slots = key, len(extras), not present
    ctx.save_for_backward(output[1], x, *params)


def _backward(ctx, grads):
    token, x, *params = ctx.saved_tensors
    g = torch.ops.overlap_layers.layer_call_backward(ctx.key, token, grads[0], x, params)
    # the same structure as the inputs: one None per extra tensor, None for a non-empty list of
    # bools but [] for an empty one (torch.library compares the pytree specs)
    return None, g[0], [None] * ctx.n_extras, [] if ctx.no_slots else None, list(g[1:]), None


layer_call.register_autograd(_backward, setup_context=_setup)


def can_compile(layer, x) -> bool:
    """Whether a call of ``layer`` on ``x`` takes the op under tracing ([Note: compiled calls])."""
    return not isinstance(x, DTensor) and not torch.is_autocast_enabled(x.device.type)


def register_layer(layer) -> int:
    """``layer``'s key in the op's weak table (its planner keeps it: ``compiled_key``)."""
    key = next(_KEYS)
    _LAYERS[key] = layer
    return key


def compiled_call(layer, x: torch.Tensor, extras: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """The layer's call as ``overlap_layers::layer_call`` (traced by dynamo, run eagerly)."""
    key = layer.planner.compiled_key
    params = [p.to_local() if isinstance(p, DTensor) else p for _, p in layer.named_parameters()]
    grad = torch.is_grad_enabled()
    requires_grad = [grad and x.requires_grad] + [grad and p.requires_grad for p in params]
    given = [t for t in extras if t is not None]
    present = [t is not None for t in extras]
    return torch.ops.overlap_layers.layer_call(key, x, given, present, params, requires_grad)[0]
