"""The whole-model benchmark (``python -m overlap_layers.bench.model``): a decoder's training step
under each way of running it over a tensor-parallel group, PyTorch's own and the overlap layers'.

What it must do: train every asked-for model for ``--warmup`` + ``--steps`` steps under every
variant (``models/variants.py``: dense / hf, their per-block ``torch.compile``, PyTorch's tensor
parallelism, AsyncTP, expert parallelism, the overlap layers serial / planned / with graph calls /
compiled), all in one process group, from the same dense weights (built once per model from the
seed, deep-copied per variant) on the same seeded batches, and report per variant the step time
(median, min, max over the timed steps, each the slowest rank's), tokens/s, MFU, peak memory,
host time per step, the warm-up steps' times, the loss at every step, and whether it ran compiled
or from CUDA graphs. Each step is ``zero_grad``, forward and loss, backward,
``overlap_layers.finalize_grads(model)`` (overlap variants), ``AdamW.step`` (over
``overlap_layers.param_groups(model)``).

transformers' experts backends (MoE models): the hf (and hf_compile) variant runs once per experts
implementation that ``--hf-experts`` names (``model.set_experts_implementation`` on its copy;
default: the installed transformers' default and, on CUDA, every implementation it registers),
recorded as ``hf[<name>]`` with ``experts_implementation`` in the record; one that cannot run here
(deepgemm / sonicmoe without the ``kernels`` package or CUDA, deepgemm outside bfloat16) is recorded
as skipped with the reason. ``meta.hf_implementations[model].experts_implementation`` is the
installed transformers' default; the other variants keep it (torch_tp runs transformers' experts
with it; torch_ep and the overlap variants replace the experts). The table gives every variant's
tokens/s over the fastest hf backend's and over the default backend's.

Runs:

* CPU (the default without a GPU): 2 gloo ranks started by ``run_ranks``, tiny shapes, float32,
  the eager variants; results under the temp dir (``*_cpu*`` names are not results to commit).
* One GPU: ``python -m overlap_layers.bench.model`` (TP = 1, bf16, full-size presets cut to
  4 layers).
* Several GPUs: ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun
  --nproc-per-node 4 -m overlap_layers.bench.model --model titan llama --tp 4`` (``--dp 2
  --tp 2``: FSDP2 over the data-parallel axis of a 2-D mesh).

Measures: step time = wall time from the step's start (all ranks leave a barrier together) to
the device finishing it, the maximum over ranks; host time = on CUDA the wall time until the
step's work is queued (no synchronisation inside the step: what the host spends launching), on
CPU the process's CPU time over the step; FLOPs per token = 6 x (parameters less the input
embedding; MoE: only the routed top-k experts' share) + 12 x layers x heads x head_dim x seq
(torchtitan's count); MFU = FLOPs per step / step time / (peak x GPUs), the peak measured by an
8192^3 bf16 GEMM in the same run (printed; null on CPU); peak memory =
``torch.cuda.max_memory_allocated`` over building and training the variant, the maximum over
ranks (null on CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shlex
import socket
import statistics
import sys
import time
import traceback
import warnings
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..launch import run_ranks
from . import results
from .models import hf as hf_models
from .models import titan
from .models.presets import HF_MODELS, MODELS, preset_for
from .models.variants import (ALIASES, COMPILED, EAGER, OPTIMIZERS, VARIANTS, Env, Skip, applies, build,
                              disable_async_tp, display_name, loss_value, mean_over, optimizer)
from .runner import Progress, measure_peak_tflops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# ---------------------------------------------------------------------------- command line
def _split(values: Sequence[str]) -> List[str]:
    return [v for item in values for v in item.replace(",", " ").split() if v]


# over 80 lines: one table of options read top-down (one add_argument each), then their checks
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options (``--help``); ValueError-free: bad input exits through ``parser.error`` with a
    message naming the option."""
    p = argparse.ArgumentParser(prog="python -m overlap_layers.bench.model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["titan", "llama", "mixtral"],
                   help=f"models, space- or comma-separated: {', '.join(MODELS)} (default: titan llama mixtral)")
    p.add_argument("--preset", default="default",
                   help="shape preset: default (each model's own on GPUs: llama3-8b, qwen3-8b, mixtral-8x7b, "
                        "qwen3-30b-a3b; tiny on CPU), tiny, llama3-8b, llama3-70b, qwen3-8b, qwen3-30b-a3b, "
                        "mixtral-8x7b (dense presets for titan/llama/qwen3, MoE presets for mixtral/qwen3_moe)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the preset's own for tiny, 4 for a full-size preset)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step per TP group (default: 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 8192 on GPUs, 32 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default: 10 on GPUs, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed first steps per variant: planning, verification, compilation; their times are "
                        "reported as warmup_ms (default: 5 on GPUs, 1 on CPU)")
    p.add_argument("--variants", nargs="+", default=["default"],
                   help=f"variants, space- or comma-separated: {', '.join(VARIANTS)} (hf = dense, hf_compile = "
                        f"dense_compile), or the groups all, eager ({' '.join(EAGER)}), compiled; default: all on "
                        f"CUDA, eager on CPU (compilation on 2 CPU cores takes minutes)")
    p.add_argument("--hf-experts", nargs="+", default=None,
                   help="transformers' experts implementations (MoE models, transformers >= 5): the hf and "
                        "hf_compile variants run once per name, recorded as hf[<name>]; space- or comma-separated "
                        "names the installed transformers registers (5.17: eager, grouped_mm, batched_mm, deepgemm, "
                        "sonicmoe), default (its default for the model) or all; one that cannot run here is "
                        "recorded as skipped with the reason; dense models ignore it (default: default all on "
                        "CUDA, default on CPU)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on GPUs, "
                                                 "float32 on CPU)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: world size / --dp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size: FSDP2 over the dp axis of a (dp, tp) "
                                                     "mesh (default: 1)")
    p.add_argument("--nprocs", type=int, default=2, help="CPU ranks to start when not under torchrun (default: 2)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="auto: one GPU per rank where CUDA is available (a single GPU without torchrun), else CPU; "
                        "cpu: gloo ranks on the CPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default: 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: 1e-3)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw (default), or sgd: steps proportional to the gradients, so the losses of later "
                        "steps check the gradients' scale too (AdamW normalises it away)")
    p.add_argument("--out", default=None,
                   help="JSON path (a .md table and, with matplotlib, a .png chart beside it); default: "
                        "bench/results/model_<models>_tp<N>_<link>_<device>x<count>_<date>.json on GPUs, the same "
                        "name under the temp dir on CPU")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.model = _split(args.model)
    for m in args.model:
        if m not in MODELS:
            p.error(f"--model: unknown model {m!r}; valid: {', '.join(MODELS)}")
    if not args.model:
        p.error("--model: give at least one model")
    args.model = list(dict.fromkeys(args.model))
    args.variants = _split(args.variants)
    groups = {"all": VARIANTS, "eager": EAGER, "compiled": COMPILED}
    for v in args.variants:
        if v not in VARIANTS and v not in ALIASES and v not in groups and v != "default":
            p.error(f"--variants: unknown variant {v!r}; valid: {', '.join(VARIANTS)}, hf, hf_compile, "
                    f"all, eager, compiled, default")
    for name in ("layers", "batch", "seq", "steps", "dp", "nprocs"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name}={v}: must be a positive integer")
    if args.tp is not None and args.tp < 1:
        p.error(f"--tp={args.tp}: must be a positive integer")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"--warmup={args.warmup}: must be >= 0")
    if args.lr <= 0:
        p.error(f"--lr={args.lr}: must be > 0")
    if args.dtype is not None:
        d = DTYPE_ALIASES.get(args.dtype, args.dtype)
        if d not in DTYPES:
            p.error(f"--dtype: unknown dtype {args.dtype!r}; valid: {', '.join(DTYPES)}")
        args.dtype = d
    args.cuda = args.device == "auto" and torch.cuda.is_available()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (1 if args.cuda else args.nprocs)
    if world % args.dp:
        p.error(f"--dp={args.dp} does not divide the world size {world}")
    args.tp = args.tp or world // args.dp
    if args.tp * args.dp != world:
        p.error(f"--tp={args.tp} x --dp={args.dp} = {args.tp * args.dp}, but the world has {world} ranks")
    args.world = world
    cuda = args.cuda
    args.batch = args.batch or 2
    args.seq = args.seq or (8192 if cuda else 32)
    args.steps = args.steps or (10 if cuda else 3)
    args.warmup = (5 if cuda else 1) if args.warmup is None else args.warmup
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.seq % args.tp:
        p.error(f"--seq={args.seq} must be divisible by --tp={args.tp} (sequence parallelism splits it)")
    chosen = []
    for v in args.variants:
        if v == "default":
            chosen += VARIANTS if cuda else EAGER
        else:
            chosen += groups.get(v, (ALIASES.get(v, v),))
    args.variants = [v for v in VARIANTS if v in chosen]
    args.presets = {}
    for m in args.model:
        try:
            args.presets[m] = preset_for(m, args.preset, args.layers, cuda)
        except ValueError as e:
            p.error(str(e))
    if any(m in HF_MODELS for m in args.model):
        try:
            import transformers  # noqa: F401 - only whether it imports
        except ImportError:
            p.error("--model: transformers' models need `pip install transformers` (>= 5); or --model titan")
    args.hf_experts = _experts_per_model(p, args)
    return args


def _experts_per_model(p: argparse.ArgumentParser, args) -> dict:
    """``{MoE model of transformers: [experts implementation, ...]}`` from ``--hf-experts`` (its
    help); empty where no such model runs or the installed transformers has no choice of them."""
    names = _split(args.hf_experts or (["default", "all"] if args.cuda else ["default"]))
    if not any(m in HF_MODELS for m in args.model):
        return {}
    known = hf_models.experts_implementations()
    for n in names:
        if n not in ("default", "all") and n not in known:
            p.error(f"--hf-experts: unknown experts implementation {n!r}; valid: default, all, {', '.join(known)}"
                    if known else f"--hf-experts: transformers {_version('transformers')} has no experts "
                                  f"implementations to choose from")
    out = {}
    for m in [m for m in args.model if m in HF_MODELS and args.presets[m].moe and known]:
        chosen = []
        for n in names:
            chosen += known if n == "all" else [hf_models.default_experts(m) if n == "default" else n]
        out[m] = list(dict.fromkeys(chosen))
    return out


# ---------------------------------------------------------------------------- measures
def flops_per_token(dense: torch.nn.Module, p, seq: int) -> tuple:
    """``(FLOPs per token, parameters, active parameters)``: torchtitan's count (module docstring)."""
    total = sum(t.numel() for t in dense.parameters())
    emb = p.vocab * p.hidden
    active = total - emb
    if p.moe:  # only top_k of the experts' weights run per token
        per_expert = 3 * p.hidden * p.moe_ffn
        active -= p.layers * (p.experts - p.top_k) * per_expert
    return 6 * active + 12 * p.layers * p.heads * p.head_dim * seq, total, active


def _version(mod: str) -> Optional[str]:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - missing or broken: no version to record
        return None


def meta_of(args, device: torch.device, peak: Optional[float], impls: dict) -> dict:
    """The result file's ``meta`` (``bench/results/schema.json``, kind "model")."""
    moe_impl = [v["experts_implementation"] for v in impls.values() if v.get("experts_implementation")]
    return results.meta(
        "model", dist.get_backend(), args.world, device.type == "cuda",
        shlex.join(["python", "-m", "overlap_layers.bench.model", *args.argv]),
        transformers=_version("transformers") if impls else None,
        attn_implementation=hf_models.ATTN_IMPLEMENTATION if impls else None,
        experts_implementation=moe_impl[0] if moe_impl else None, hf_implementations=impls,
        tp=args.tp, dp=args.dp, dtype=args.dtype, peak_tflops=peak, seed=args.seed, lr=args.lr,
        optimizer=args.optimizer,
        weights="the dense model is built once per model from the seed on every rank (identical), deep-copied "
                "per variant; each parallel variant keeps its rank's slices of it (parallelize_module: "
                "distribute_tensor from rank 0's equal copy; transformers' TP plan and from_dense / swap: local "
                "slicing; torch_ep: the rank's experts)",
        data="random tokens from a generator seeded by (seed, step, dp rank): the same batches for every variant "
             "and every rank of a TP group")


# ---------------------------------------------------------------------------- one variant
def _batch(args, p, step: int, dp_rank: int, device) -> tuple:
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1009 + dp_rank)
    data = torch.randint(0, p.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    return data[:, :-1], data[:, 1:]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(model_name: str, p, dense, variant: str, env: Env, args, dp_group, bar: Progress,
                experts: Optional[str] = None) -> dict:
    """Build and train one variant (an hf variant with transformers' experts implementation
    ``experts``); its record (``error`` set where it was skipped or failed, on every rank alike)."""
    device, cuda = env.device, env.cuda
    name = display_name(variant, model_name, experts)
    rec = dict(model=model_name, variant=name, preset=p.name, layers=p.layers, world_size=env.tp, dp=env.dp,
               batch=args.batch, seq=args.seq, tokens=args.batch * args.seq * env.dp, dtype=args.dtype,
               **{"pass": "fwdbwd"}, ms=None, spread=dict(min_ms=None, max_ms=None, n=0), tokens_per_s=None,
               mfu=None, peak_mem_bytes=None, host_ms=None, warmup_ms=[], loss=dict(final=None, steps=[]),
               compiled=variant in COMPILED, graphs=variant == "overlap_auto_graphs", experts_implementation=experts,
               notes=[])
    total = args.warmup + args.steps
    err, built, opt = None, None, None
    times, hosts, losses = [], [], []
    with warnings.catch_warnings(record=True) as seen:  # what the variant warned: recorded, once each
        warnings.simplefilter("always")
        try:
            if variant in COMPILED:
                torch._dynamo.reset()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            built = build(model_name, dense, variant, env, p.moe, experts)
            rec.update(compiled=built.compiled, graphs=built.graphs, notes=list(built.notes))
            model = built.model
            opt = optimizer(model, env, args.lr, args.optimizer)
            counter = built.fused_counter
            for step in range(total):
                inputs, labels = _batch(args, p, step, dist.get_rank(dp_group) if dp_group is not None else 0, device)
                _sync(device)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                capture = counter is not None and step < max(args.warmup, 1)  # compilation happens here
                with counter if capture else contextlib.nullcontext():
                    opt.zero_grad(set_to_none=True)
                    with built.context():
                        loss = built.loss(model, inputs, labels)
                        loss.backward()
                    built.finalize()
                    opt.step()
                host = (time.perf_counter() - t0) if cuda else (time.process_time() - c0)
                _sync(device)
                times.append(time.perf_counter() - t0)
                hosts.append(host)
                losses.append(loss_value(loss).detach().float().reshape(()))
                bar.mode(f"{model_name}/{name}")
                bar.advance()
            if counter is not None:
                rec["fused_ops"] = counter.counts()
                if rec["fused_ops"] is None:
                    rec["notes"].append("fused-op count unavailable: no Inductor code hook in this torch")
        except Skip as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - recorded; every rank learns of it below
            err = f"{type(e).__name__}: {e}"
            if dist.get_rank() == 0:
                traceback.print_exc(file=sys.stderr)
        finally:
            if variant == "torch_tp_asynctp":
                disable_async_tp()
    rec["warnings"] = list(dict.fromkeys(f"{w.category.__name__}: {str(w.message)[:300]}" for w in seen))
    if rec["warnings"]:
        rec["notes"].append(f"{len(rec['warnings'])} distinct warning(s), in the JSON")
    failed = torch.tensor([1.0 if err else 0.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        rec["error"] = err or "failed on another rank"
        rec["notes"].append(rec["error"])
        bar.mode(f"{model_name}/{name}")
        bar.advance(total - len(times))
        del built, opt
        return rec
    t = torch.tensor([times, hosts], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank, step by step
    times_ms, hosts_ms = (t[0] * 1e3).tolist(), (t[1] * 1e3).tolist()
    loss_t = mean_over(torch.stack(losses), dp_group).cpu().tolist()
    timed = times_ms[args.warmup:]
    rec.update(ms=statistics.median(timed), spread=dict(min_ms=min(timed), max_ms=max(timed), n=len(timed)),
               host_ms=statistics.median(hosts_ms[args.warmup:]), warmup_ms=times_ms[:args.warmup],
               loss=dict(final=loss_t[-1], steps=loss_t))
    rec["tokens_per_s"] = rec["tokens"] / (rec["ms"] / 1e3)
    if cuda:
        mem = torch.tensor([torch.cuda.max_memory_allocated(device)], device=device, dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        rec["peak_mem_bytes"] = int(mem.item())
    del built, opt
    return rec


# ---------------------------------------------------------------------------- the run
def _meshes(args, device):
    from torch.distributed.device_mesh import init_device_mesh
    if args.dp > 1:
        mesh = init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
        return mesh, mesh["tp"], mesh["dp"]
    mesh = init_device_mesh(device.type, (args.tp,), mesh_dim_names=("tp",))
    return mesh, mesh, None


def _build_dense(model_name: str, p, args, device, dtype):
    torch.manual_seed(args.seed)  # the same weights on every rank
    if model_name == "titan":
        m = titan.Transformer(p)
        m.init_weights()
        return m.to(device=device, dtype=dtype).train()
    return hf_models.build(model_name, p, dtype, device)


def run(device: torch.device, args) -> None:
    """One rank of the benchmark (module docstring)."""
    rank = dist.get_rank()
    dtype = DTYPES[args.dtype]
    mesh, tp_mesh, dp_mesh = _meshes(args, device)
    env = Env(device=device, dtype=dtype, tp=args.tp, dp=args.dp, mesh=mesh, tp_mesh=tp_mesh,
              tp_group=tp_mesh.get_group(), dp_mesh=dp_mesh, batch=args.batch, seq=args.seq)
    dp_group = dp_mesh.get_group() if dp_mesh is not None else None
    peak = measure_peak_tflops(device)
    say = print if rank == 0 else (lambda *a, **k: None)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(f"{where}: {args.world} ranks (tp {args.tp} x dp {args.dp}), {args.dtype}, batch {args.batch} x seq "
        f"{args.seq}, {args.warmup} warm-up + {args.steps} timed steps per variant", flush=True)
    say(f"peak bf16 GEMM: {peak:.1f} TFLOP/s per GPU (8192^3, measured now)" if peak else
        "peak: not measured on CPU (MFU reported as null)", flush=True)
    runs = {m: [(v, e) for v in args.variants if applies(v, args.presets[m].moe)
                for e in (args.hf_experts.get(m, [None]) if v in ("dense", "dense_compile") else [None])]
            for m in args.model}
    bar = Progress(sum(map(len, runs.values())) * (args.warmup + args.steps), rank == 0 and not args.no_progress,
                   delay_s=0.0, unit="step")
    records, impls = [], {}
    for model_name in args.model:
        p = args.presets[model_name]
        dense = _build_dense(model_name, p, args, device, dtype)
        fpt, n_params, n_active = flops_per_token(dense, p, args.seq)
        if model_name in HF_MODELS:
            impls[model_name] = hf_models.implementations(dense)
            if not p.moe:  # a dense model has no experts to run
                impls[model_name]["experts_implementation"] = None
            say(f"{model_name}: transformers {_version('transformers')}, attn_implementation="
                f"{impls[model_name]['attn_implementation']}, experts_implementation (default)="
                f"{impls[model_name]['experts_implementation']}"
                + (f", hf runs {' '.join(args.hf_experts[model_name])}" if model_name in args.hf_experts else ""),
                flush=True)
        for variant, experts in runs[model_name]:
            rec = run_variant(model_name, p, dense, variant, env, args, dp_group, bar, experts)
            rec.update(params=n_params, active_params=n_active, flops_per_step=fpt * rec["tokens"])
            if rec["ms"] is not None and peak:
                rec["mfu"] = rec["flops_per_step"] / (rec["ms"] / 1e3) / (peak * 1e12 * args.world)
            records.append(rec)
            torch._dynamo.reset()  # compiled code holds its model's parameters until reset
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del dense
        gc.collect()
    bar.close()
    if rank == 0:
        from .models.report import write_outputs
        data = dict(meta=meta_of(args, device, peak, impls), records=records)
        write_outputs(data, args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line (module docstring)."""
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        run_ranks(run, args)  # under torchrun: joins the launched ranks
    elif args.cuda:  # one GPU, one rank: NCCL through run_ranks' torchrun path
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        run_ranks(run, args)
    else:
        run_ranks(run, args, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
