"""The whole-model benchmark's variants: one dense model, built once, turned into each way of
running it over a tensor-parallel group.

Reference: every variant of a model starts from a ``copy.deepcopy`` of the same dense model (so
the same initial weights) and, fed the same batch on every rank of the group, computes the dense
model's loss and, after its ``finalize``, the dense model's gradients (its shards of them), up to
rounding. Each parallel variant keeps its rank's slices of the dense weights.

=====================  ==========================================================================
variant                what runs
=====================  ==========================================================================
dense / hf             the model as it is, unparallelized, on every rank (``dense`` for the titan
                       model, ``hf`` for transformers' models; an MoE model's with each asked-for
                       experts implementation of transformers: ``hf[grouped_mm]``, ...)
dense_compile /        the same with each decoder block under ``torch.compile`` (as torchtitan
hf_compile             compiles per block)
torch_tp               titan: ``parallelize_module`` with sequence and loss parallelism
                       (:func:`.titan.parallelize_torch_tp`); transformers: the model's own TP plan
                       (:func:`.hf.apply_hf_tensor_parallel`)
torch_tp_asynctp       torch_tp with each block under ``torch.compile`` and micro-pipeline TP
                       (``_micro_pipeline_tp``, symmetric memory on the group): CUDA, >= 2 ranks
torch_ep               MoE models: transformers' TP plan for attention, :class:`.hf.TorchEPMoE` for
                       the experts
overlap_serial         the overlap layers with ``num_tiles=1`` (titan: :func:`.titan.parallelize_overlap`;
                       transformers: ``overlap_layers.swap``)
overlap_auto           the same with the default ``OverlapConfig`` (planned tiles)
overlap_auto_graphs    the same with ``OverlapConfig(graph_calls=True)``: CUDA only
overlap_compile        overlap_auto with each decoder block under ``torch.compile``
=====================  ==========================================================================

With a data-parallel axis (``dp > 1``) every variant is then sharded over it with FSDP2
(``fully_shard`` per block, then the root).
"""
from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import hf as hf_models
from . import titan

VARIANTS = ("dense", "dense_compile", "torch_tp", "torch_tp_asynctp", "torch_ep", "overlap_serial", "overlap_auto",
            "overlap_auto_graphs", "overlap_compile")
ALIASES = {"hf": "dense", "hf_compile": "dense_compile"}
EAGER = ("dense", "torch_tp", "torch_ep", "overlap_serial", "overlap_auto")
COMPILED = ("dense_compile", "torch_tp_asynctp", "overlap_compile")
GRAPHS = ("overlap_auto_graphs",)


def display_name(variant: str, model: str, experts: Optional[str] = None) -> str:
    """The record's name of ``variant`` for ``model``: ``hf`` / ``hf_compile`` for transformers' models,
    with the experts implementation ``experts`` where given (``hf[grouped_mm]``)."""
    if model != "titan" and variant in ("dense", "dense_compile"):
        return variant.replace("dense", "hf") + (f"[{experts}]" if experts else "")
    return variant


class Skip(Exception):
    """The variant does not run here; the message says why (it goes into the record)."""


def applies(variant: str, is_moe: bool) -> bool:
    """Whether ``variant`` applies to a dense (``is_moe`` False) or MoE model: torch_ep needs experts."""
    return variant != "torch_ep" or is_moe


@dataclass
class Env:
    """What every variant of a run shares: the device and dtype, the meshes (``mesh`` 1-D over the
    TP group, or 2-D ``(dp, tp)``), the TP group, and the batch shape."""

    device: torch.device
    dtype: torch.dtype
    tp: int
    dp: int
    mesh: object
    tp_mesh: object
    tp_group: object
    dp_mesh: Optional[object]
    batch: int
    seq: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Built:
    """One variant, ready to train: ``loss(inputs, labels)`` runs the forward and returns the loss
    (inside ``context()``, which also holds the backward); ``finalize()`` runs after backward."""

    model: nn.Module
    loss: Callable
    context: Callable = contextlib.nullcontext
    finalize: Callable = lambda: None
    compiled: bool = False
    graphs: bool = False
    notes: List[str] = field(default_factory=list)
    fused_counter: Optional["InductorCode"] = None


def blocks(model: nn.Module, name: str) -> List[nn.Module]:
    """The decoder blocks of ``model`` (titan's ``layers`` values, transformers' ``model.layers``)."""
    return list(model.layers.values()) if name == "titan" else list(hf_models.decoder_layers(model))


def compile_blocks(model: nn.Module, name: str) -> None:
    """Each decoder block under ``torch.compile``, in place (``nn.Module.compile``)."""
    for b in blocks(model, name):
        b.compile()


def shard_dp(model: nn.Module, name: str, env: Env) -> None:
    """FSDP2 over the data-parallel axis: ``fully_shard`` on each block, then on the root."""
    from torch.distributed.fsdp import fully_shard
    for b in blocks(model, name):
        fully_shard(b, mesh=env.dp_mesh)
    fully_shard(model, mesh=env.dp_mesh)


class InductorCode:
    """Collects the code Inductor generates (or loads from its cache) while active, and counts the
    fused all-gather-matmul / matmul-reduce-scatter calls in it (micro-pipeline TP's rewrites).
    ``available`` is False where the installed torch has no hook for the code."""

    PATTERNS = {"fused_all_gather_matmul": re.compile(r"fused_all_gather_matmul\w*\.default\("),
                "fused_matmul_reduce_scatter": re.compile(r"fused_matmul_reduce_scatter\w*\.default\(")}

    def __init__(self):
        self.codes: List[str] = []
        try:
            from torch._inductor.graph import GraphLowering
            self._cls = GraphLowering if hasattr(GraphLowering, "save_output_code") else None
        except ImportError:
            self._cls = None
        self.available = self._cls is not None
        self._old = None

    def __enter__(self):
        if self.available:
            self._old = self._cls.save_output_code
            self._cls.save_output_code = staticmethod(self._save)
        return self

    def _save(self, code: str) -> None:
        if self._old is not None:
            self._old(code)
        self.codes.append(code)

    def __exit__(self, *exc):
        if self.available:
            self._cls.save_output_code = self._old
        return False

    def counts(self) -> Optional[dict]:
        """``{pattern: calls in the unique generated graphs, "graphs": how many}``; None if unavailable."""
        if not self.available:
            return None
        unique = list(dict.fromkeys(self.codes))
        out = {k: sum(len(p.findall(c)) for c in unique) for k, p in self.PATTERNS.items()}
        out["graphs"] = len(unique)
        return out


def _enable_async_tp(env: Env) -> List[str]:
    """Micro-pipeline TP as torchtitan enables it; returns notes."""
    import torch._inductor.config as inductor_config
    if not hasattr(inductor_config, "_micro_pipeline_tp"):
        raise Skip(f"torch {torch.__version__} has no torch._inductor.config._micro_pipeline_tp")
    inductor_config._micro_pipeline_tp = True
    from torch.distributed import _symmetric_memory as symm_mem
    name = env.tp_group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(name)
        return [f"micro-pipeline TP on, symmetric memory enabled for group {name}"]
    return ["micro-pipeline TP on (this torch enables symmetric memory per group by itself)"]


def disable_async_tp() -> None:
    """Micro-pipeline TP off again (after the asynctp variant: the others compile without it)."""
    import torch._inductor.config as inductor_config
    if hasattr(inductor_config, "_micro_pipeline_tp"):
        inductor_config._micro_pipeline_tp = False


def _titan_loss(model, inputs, labels):
    logits = model(inputs)  # a Shard(-1) DTensor under loss_parallel
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _hf_loss(model, inputs, labels):
    return model(input_ids=inputs, labels=inputs).loss


def _overlap_config(variant: str):
    from overlap_layers import OverlapConfig
    if variant == "overlap_serial":
        return OverlapConfig(num_tiles=1)
    if variant == "overlap_auto_graphs":
        return OverlapConfig(graph_calls=True)
    return OverlapConfig()


def build(name: str, dense: nn.Module, variant: str, env: Env, is_moe: bool, experts: Optional[str] = None) -> Built:
    """The variant ``variant`` of the dense model ``dense`` (left untouched), as the module
    docstring says, the hf variants with transformers' experts implementation ``experts`` (None:
    the model's own); :class:`Skip` where it does not apply or cannot run here."""
    from torch.distributed.tensor.parallel import loss_parallel

    import overlap_layers
    if variant == "torch_tp_asynctp" and not (env.cuda and env.tp >= 2):
        raise Skip("skipped: needs >= 2 CUDA ranks")
    if variant == "overlap_auto_graphs" and not env.cuda:
        raise Skip("skipped: graph calls need CUDA")
    if not applies(variant, is_moe):
        raise ValueError(f"{variant} does not apply to a dense model")
    if experts is not None and variant not in ("dense", "dense_compile"):
        raise ValueError(f"{variant} does not take an experts implementation")
    unavailable = hf_models.experts_unavailable(experts, env.dtype) if experts is not None else None
    if unavailable:
        raise Skip(f"skipped: {unavailable}")
    model = copy.deepcopy(dense)
    if experts is not None:
        hf_models.set_experts(model, experts)
    titan_model = name == "titan"
    notes: List[str] = []
    built = Built(model=model, loss=_titan_loss if titan_model else _hf_loss)
    if variant in ("dense", "dense_compile"):
        if env.tp > 1:
            notes.append("unparallelized: every rank of the TP group runs the whole model")
    elif variant in ("torch_tp", "torch_tp_asynctp"):
        if titan_model:
            titan.parallelize_torch_tp(model, env.tp_mesh, loss_parallel=True)
            built.context = loss_parallel
            notes.append("parallelize_module: sequence + loss parallel (torchtitan's plan)")
        else:
            try:
                hf_models.apply_hf_tensor_parallel(model, env.tp_mesh)
            except RuntimeError as e:
                raise Skip(f"skipped: transformers' TP plan does not apply ({e})") from e
            notes.append("transformers' tp_plan (not sequence parallel)")
        if variant == "torch_tp_asynctp":
            notes += _enable_async_tp(env)
            compile_blocks(model, name)
            built.compiled = True
            built.fused_counter = InductorCode()
            if not titan_model:
                notes.append("transformers' plan has no all-gather / reduce-scatter around matmuls to fuse")
    elif variant == "torch_ep":
        err = hf_models.check_tokens(env.batch, env.seq, env.tp)
        if err:
            raise Skip(f"skipped: {err}")
        try:
            hf_models.apply_hf_tensor_parallel(model, env.tp_mesh, without_experts=True)
            notes.append("attention: transformers' tp_plan")
        except RuntimeError as e:
            notes.append(f"attention unparallelized ({e})")
        n = hf_models.apply_torch_ep(model, env.tp_group)
        built.finalize = lambda: hf_models.sum_router_grads(model)
        notes.append(f"{n} MoE blocks expert parallel (all_to_all_single + "
                     f"{'torch._grouped_mm' if env.cuda and env.dtype == torch.bfloat16 else 'a loop over experts'})")
    elif variant.startswith("overlap_"):
        cfg = _overlap_config(variant)
        mesh_kw = dict(mesh=env.mesh, axis="tp") if env.dp > 1 else dict(mesh=env.tp_mesh)
        if titan_model:
            titan.parallelize_overlap(model, mesh_kw["mesh"], axis=mesh_kw.get("axis"), config=cfg)  # group= layers
            built.context = loss_parallel
            notes.append("parallelize_overlap: sequence + loss parallel; attention and MLP as overlap layers")
        elif env.dp > 1:
            overlap_layers.swap(model, mesh=env.mesh, axis="tp", config=cfg)
        else:
            overlap_layers.swap(model, group=env.tp_group, config=cfg)
        built.finalize = lambda: overlap_layers.finalize_grads(model)
        built.graphs = cfg.graph_calls
        if variant == "overlap_compile":
            compile_blocks(model, name)
            built.compiled = True
    else:
        raise ValueError(f"unknown variant {variant!r}")
    if variant == "dense_compile":
        compile_blocks(model, name)
        built.compiled = True
    if env.dp > 1:
        shard_dp(model, name, env)
        notes.append(f"FSDP2 over {env.dp} data-parallel ranks")
    built.notes = notes
    return built


OPTIMIZERS = ("adamw", "sgd")


def optimizer(model: nn.Module, env: Env, lr: float = 1e-3, kind: str = "adamw") -> torch.optim.Optimizer:
    """AdamW (or plain SGD, whose step is proportional to the gradient: a check of the gradients'
    scale, which AdamW normalises away) over ``overlap_layers.param_groups(model)`` (DTensors and
    plain tensors in separate groups); fused on CUDA, foreach on CPU, the same for every variant."""
    from overlap_layers import param_groups
    kw = {"fused": True} if env.cuda else {"foreach": True}
    if kind == "sgd":
        return torch.optim.SGD(param_groups(model), lr=lr, **kw)
    return torch.optim.AdamW(param_groups(model), lr=lr, weight_decay=0.0, **kw)


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """A step's loss as a plain tensor (a DTensor loss of ``loss_parallel`` is replicated)."""
    from torch.distributed.tensor import DTensor
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def mean_over(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` averaged over ``group`` (the data-parallel ranks' losses); ``t`` when it has one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)
