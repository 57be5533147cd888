"""The layers' own CUDA graphs (``OverlapConfig(graph_calls=True)``) in the loops users write, one
case per process (``python graph_loop_worker.py CASE [STEPS]`` under torchrun, one GPU): the
process must exit 0 and prints one JSON line, ``RESULT {...}``, with each step's time (ms, the
device synchronised at each step's end), the warnings the library raised, how many calls the
layers replayed from graphs, and the largest error against an eager twin built from the same
weights (forward outputs and gradients). ``tests/test_graph_loops.py`` runs every case.

Cases:

* ``mlp``, ``attention``, ``moe``: ``y = layer(x); y.sum().backward()``;
* ``accumulate``: four micro-batches' backward, then an AdamW step;
* ``optimizer``: AdamW step and ``zero_grad`` after every call;
* ``eval``: a ``torch.no_grad()`` call between training calls;
* ``autocast``: float32 weights under ``torch.autocast("cuda", torch.bfloat16)``;
* ``hf_llama``: a swapped Hugging Face Llama (2 layers) trained with ``loss.backward()`` and AdamW;
* ``make_graphed``: the MLP (``graph_calls=False``) wrapped by ``torch.cuda.make_graphed_callables``;
* ``reduce_overhead``: the MLP (``graph_calls=False``) under ``torch.compile(mode="reduce-overhead")``
  (its op is unsafe for Inductor's CUDA graphs: the layer runs eagerly inside);
* ``failing``: the MLP whose calls cannot be captured (a host read inside): the capture fails,
  the calls run eagerly, and afterwards the caller's stream is current again, random ops work
  and the process exits cleanly.
"""
from __future__ import annotations

import json
import sys
import time
import warnings

import torch
import torch.distributed as dist

from overlap_layers import OverlapAttention, OverlapConfig, OverlapMLP, OverlapMoE
from overlap_layers.launch import run_ranks

GRAPHS = OverlapConfig(graph_calls=True)
EAGER = OverlapConfig(graph_calls=False)


def _layer(kind: str, config: OverlapConfig, dtype):
    torch.manual_seed(0)
    group = dist.group.WORLD
    if kind == "attention":
        return OverlapAttention(1024, 8, 8, group=group, sequence_parallel=False, config=config, dtype=dtype)
    if kind == "moe":
        return OverlapMoE(1024, 512, 16, 2, group=group, config=config, dtype=dtype)
    return OverlapMLP(1024, 4096, group=group, sequence_parallel=False, config=config, dtype=dtype)


def _replays(model) -> int:
    graphs = [m.planner.call_graphs for m in model.modules() if hasattr(m, "planner")]
    return sum(len(g) for g in graphs if g is not None)


def _grads(model) -> list:
    return [p.grad.detach().float().clone() if p.grad is not None else None for p in model.parameters()]


def _err(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _layer_case(case: str, steps: int, dev) -> dict:
    kind = case if case in ("mlp", "attention", "moe") else "mlp"
    dtype = torch.float32 if case == "autocast" else torch.bfloat16
    models = [_layer(kind, cfg, dtype).to(dev) for cfg in (GRAPHS, EAGER)]
    caller = torch.cuda.current_stream(dev)
    outside = case in ("make_graphed", "reduce_overhead")  # the caller captures, not the layer
    if outside:
        models[0] = _layer(kind, EAGER, dtype).to(dev)
        for _ in range(3):  # plan and verify eagerly first: a captured call runs the settled plan
            models[0](torch.randn(4, 256, 1024, device=dev, dtype=dtype, requires_grad=True)).sum().backward()
        models[0].zero_grad(set_to_none=True)
        sample = torch.randn(4, 256, 1024, device=dev, dtype=dtype)
        wrapped = torch.cuda.make_graphed_callables(models[0], (sample,)) if case == "make_graphed" else \
            torch.compile(models[0], mode="reduce-overhead")
        calls = [wrapped, models[1]]
    else:
        calls = models
    if case == "failing":  # a host read inside the call: no capture can hold it
        run = models[0]._run
        models[0]._run = lambda x, *a, **k: run(x + 0 * float(x[0, 0, 0]), *a, **k)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models] if case in ("accumulate", "optimizer") \
        else None
    gen = torch.Generator(device=dev).manual_seed(1)
    times, errs = [], []
    micro = 4 if case == "accumulate" else 1
    for step in range(steps):
        x = torch.randn(4, 256, 1024, device=dev, generator=gen, dtype=dtype)
        outs = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, (m, call) in enumerate(zip(models, calls)):
            for _ in range(micro):
                with torch.autocast("cuda", torch.bfloat16, enabled=case == "autocast"):
                    y = call(x)
                y.float().square().mean().backward()
            if case == "eval":
                with torch.no_grad():
                    y_eval = m(x)
                outs.append(y_eval)
            outs.append(y.detach())
            if opts is not None and i == 0:
                opts[0].step()
            if i == 0:
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
        if opts is not None:
            opts[1].step()
        errs.append(max([_err(a, b) for a, b in zip(outs[:len(outs) // 2], outs[len(outs) // 2:])] +
                        [_err(a, b) for a, b in zip(_grads(models[0]), _grads(models[1]))]))
        for m in models:
            m.zero_grad(set_to_none=True)
    random_ok = bool(torch.nn.functional.dropout(torch.ones(64, device=dev), 0.5).isfinite().all())
    return dict(step_ms=times, max_err=max(errs), replays=1 if outside else _replays(models[0]), random_ok=random_ok,
                caller_stream=torch.cuda.current_stream(dev) == caller)


def _hf_case(steps: int, dev) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from overlap_layers.integrations.hf import swap
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=2, vocab_size=8192, max_position_embeddings=1024)
    torch.manual_seed(0)
    models = []
    for config in (GRAPHS, EAGER):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to(dev, torch.bfloat16)
        models.append(swap(m, dist.group.WORLD, config=config))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-5) for m in models]
    gen = torch.Generator(device=dev).manual_seed(1)
    times, errs = [], []
    for step in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (2, 2048), device=dev, generator=gen)
        losses = []
        for i, (m, opt) in enumerate(zip(models, opts)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i == 0:
                times.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.detach())
        errs.append(_err(losses[0], losses[1]))
    return dict(step_ms=times, max_err=max(errs), replays=_replays(models[0]))


def main(dev, case: str, steps: int) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _hf_case(steps, dev) if case == "hf_llama" else _layer_case(case, steps, dev)
    out["warnings"] = [f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught]
    out["case"] = case
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    run_ranks(main, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)
