"""Hugging Face transformers models for the whole-model benchmark, and PyTorch's parallel forms of them.

Reference: :func:`build` returns ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` /
``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` built from a config with the preset's dimensions
(random weights, no download), in training mode, with ``attn_implementation="sdpa"`` and, for
MoE models, the installed transformers' default experts implementation (:func:`default_experts`).
:func:`implementations` reads back what the model runs.

* Experts implementations (transformers >= 5: ``config._experts_implementation``, dispatched by
  ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``; 5.17 to 5.24 register ``eager``,
  ``grouped_mm``, ``batched_mm``, ``deepgemm``, ``sonicmoe``): :func:`experts_implementations`
  lists them, :func:`experts_unavailable` says why one cannot run here (transformers' own
  ``is_deepgemm_loadable`` / ``is_sonicmoe_loadable``: the ``kernels`` package, CUDA, the GPU's
  architecture; DeepGEMM's bfloat16), :func:`set_experts` switches a built model to one
  (``model.set_experts_implementation``).

* :func:`apply_hf_tensor_parallel`: transformers' own tensor-parallel plan (``model.tp_plan``: q/k/v
  and gate/up colwise, o/down rowwise, the vocabulary-sharded embedding and LM head, the experts
  tensor parallel) through ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``,
  the function ``from_pretrained(tp_plan="auto")`` calls after building the model, applied here to
  a model built from a config. Each rank keeps its slice of the (identical) dense weights
  (``distribute_tensor(..., src_data_rank=None)``: local slicing). Not sequence parallel.
* :class:`TorchEPMoE` (:func:`apply_torch_ep`): expert parallelism as a torch user writes it:
  each rank routes its share of the (replicated) tokens with the model's own router, sends them
  to the experts' ranks with an uneven ``all_to_all_single``, runs its experts with
  ``torch._grouped_mm`` (CUDA; a loop over experts on CPU), sends the results back, combines them
  with the router weights and all-gathers the tokens.
"""
from __future__ import annotations

import importlib
import inspect
import re
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .presets import PRESETS, Preset

_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
ATTN_IMPLEMENTATION = "sdpa"


def config_of(model: str, p: Preset):
    """The transformers config of ``model`` with the preset's dimensions (no dropout, no KV cache,
    untied embeddings, RoPE without scaling, every layer an MoE layer for MoE models)."""
    import transformers
    cfg_cls = getattr(transformers, _CLASSES[model][0])
    kw = dict(vocab_size=p.vocab, hidden_size=p.hidden, num_hidden_layers=p.layers, num_attention_heads=p.heads,
              num_key_value_heads=p.kv_heads, head_dim=p.head_dim, rms_norm_eps=p.norm_eps,
              max_position_embeddings=max(4096, 2 * 8192), tie_word_embeddings=False, use_cache=False,
              attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta})
    if model == "mixtral":
        kw.update(intermediate_size=p.moe_ffn, num_local_experts=p.experts, num_experts_per_tok=p.top_k,
                  router_jitter_noise=0.0, output_router_logits=False)
    elif model == "qwen3_moe":
        kw.update(intermediate_size=p.ffn, moe_intermediate_size=p.moe_ffn, num_experts=p.experts,
                  num_experts_per_tok=p.top_k, norm_topk_prob=p.norm_topk, decoder_sparse_step=1,
                  mlp_only_layers=[], output_router_logits=False)
    else:
        kw["intermediate_size"] = p.ffn
    params = inspect.signature(cfg_cls.__init__).parameters
    if "rope_parameters" not in params and not any(v.kind == v.VAR_KEYWORD for v in params.values()):
        kw.pop("rope_parameters")
        kw["rope_theta"] = p.rope_theta
    return cfg_cls(**kw)


def build(model: str, p: Preset, dtype: torch.dtype, device) -> nn.Module:
    """The model of the module docstring, on ``device`` in ``dtype``, weights drawn from torch's
    current random state (seed it alike on every rank for identical weights)."""
    import transformers
    cls = getattr(transformers, _CLASSES[model][1])
    cfg = config_of(model, p)
    kwargs = {"attn_implementation": ATTN_IMPLEMENTATION, "dtype": dtype}
    try:
        m = cls._from_config(cfg, **kwargs)
    except TypeError:  # an older signature: torch_dtype
        kwargs["torch_dtype"] = kwargs.pop("dtype")
        m = cls._from_config(cfg, **kwargs)
    m = m.to(device=device, dtype=dtype)
    m.train()
    return m


def implementations(m: nn.Module) -> dict:
    """``{"attn_implementation": ..., "experts_implementation": ...}`` as the model's config holds
    them (None where the installed transformers has no such setting)."""
    cfg = m.config
    attn = getattr(cfg, "_attn_implementation", None)
    experts = getattr(cfg, "_experts_implementation", None) if hasattr(type(cfg), "_experts_implementation") \
        or hasattr(cfg, "_experts_implementation_internal") else None
    return {"attn_implementation": attn, "experts_implementation": experts}


# ---------------------------------------------------------------------------- experts implementations
# transformers.integrations.<name>'s own check of what the implementation needs
_LOADABLE = {"deepgemm": "is_deepgemm_loadable", "sonicmoe": "is_sonicmoe_loadable"}
_DTYPES = {"deepgemm": (torch.bfloat16,)}


def experts_implementations() -> List[str]:
    """The experts implementations the installed transformers registers, ``eager`` first; empty where
    it has no choice of them."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return []
    return ["eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()]


def default_experts(model: str) -> Optional[str]:
    """The experts implementation the installed transformers gives the MoE ``model`` when none is
    asked for (None without a choice of them): read from the model built on the meta device."""
    import transformers
    with torch.device("meta"):
        m = getattr(transformers, _CLASSES[model][1])._from_config(config_of(model, PRESETS["tiny-moe"]))
    return implementations(m)["experts_implementation"]


def experts_unavailable(impl: str, dtype: torch.dtype) -> Optional[str]:
    """Why transformers' experts implementation ``impl`` cannot run here in ``dtype`` (module
    docstring), or None."""
    if impl not in experts_implementations():
        return f"transformers {_version()} has no experts implementation {impl!r}"
    loadable = getattr(importlib.import_module(f"transformers.integrations.{impl}"), _LOADABLE[impl], None) \
        if impl in _LOADABLE else None
    if loadable is not None:
        try:
            loadable(raise_error=True)
        except ImportError as e:
            return f"{impl}: {e}"
    if impl in _DTYPES and dtype not in _DTYPES[impl]:
        return f"{impl} runs in {', '.join(str(d) for d in _DTYPES[impl])} only, not {dtype}"
    return None


def set_experts(m: nn.Module, impl: str) -> None:
    """Switch the built model ``m`` to the experts implementation ``impl``, in place; RuntimeError
    where the model still runs another one afterwards."""
    m.set_experts_implementation(impl)
    got = implementations(m)["experts_implementation"]
    if got != impl:
        raise RuntimeError(f"{type(m).__name__} runs experts implementation {got!r}, not {impl!r}")


def decoder_layers(m: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (``model.model.layers``)."""
    return m.model.layers


# ---------------------------------------------------------------------------- transformers' TP plan
_EXPERT_RULE = re.compile(r"(^|\.)mlp\.(experts|gate)(\.|$)")


def apply_hf_tensor_parallel(m: nn.Module, tp_mesh, without_experts: bool = False) -> dict:
    """transformers' own TP plan applied in place (module docstring); ``without_experts``: leave the
    MoE experts and router out of the plan (they run expert parallel instead). Returns the plan
    applied (pattern -> style). RuntimeError naming the reason where the installed transformers
    has no such function."""
    try:
        from transformers.distributed import tensor_parallel as hf_tp
    except ImportError as e:
        raise RuntimeError(f"transformers {_version()} has no transformers.distributed.tensor_parallel ({e})") from e
    plan = dict(getattr(m, "tp_plan", None) or {})
    if not plan:
        raise RuntimeError(f"{type(m).__name__} has no tp_plan in transformers {_version()}")
    if without_experts:
        plan = {k: v for k, v in plan.items() if not _EXPERT_RULE.search(k)}
    heads, kv = m.config.num_attention_heads, m.config.num_key_value_heads
    for what, n in (("attention heads", heads), ("KV heads", kv), ("vocabulary", m.config.vocab_size)):
        if n % tp_mesh.size():
            raise RuntimeError(f"transformers' TP plan needs {what} ({n}) divisible by the TP size {tp_mesh.size()}")
    n_args = len(inspect.signature(hf_tp.apply_tensor_parallelism).parameters)
    if n_args >= 3:  # transformers >= 5.2x: the expanded plan is an argument
        expanded = m._expand_parallel_plan(plan) if hasattr(m, "_expand_parallel_plan") else plan
        hf_tp.apply_tensor_parallelism(m, tp_mesh, expanded)
    else:  # transformers 5.1x: the model's own plan
        m.tp_plan = plan
        hf_tp.apply_tensor_parallelism(m, tp_mesh)
    return plan


def _version() -> str:
    import transformers
    return transformers.__version__


# ---------------------------------------------------------------------------- expert parallelism
class _TakeShare(torch.autograd.Function):
    """Forward: this rank's share of the rows of a replicated ``x`` (``x`` split evenly over the
    group). Backward: the shares' gradients all-gathered, so every rank holds the whole (the rows
    downstream of the other shares reach the loss through the other ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ws, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(ws)[r].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather_rows(g.contiguous(), ctx.group), None


class _GatherShares(torch.autograd.Function):
    """Forward: the ranks' shares all-gathered into the replicated whole. Backward: this rank's rows
    of the (replicated, so identical on every rank) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x.contiguous(), group)

    @staticmethod
    def backward(ctx, g):
        ws, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(ws)[r].contiguous(), None


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def _all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    """Uneven all-to-all with autograd (its backward swaps the splits): functional collectives'
    ``all_to_all_single_autograd``, as torchtitan's expert parallelism calls it."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    out = all_to_all_single_autograd(x, out_splits, in_splits, group)
    return out.wait() if hasattr(out, "wait") else out


def _expert_of_rows(counts: torch.Tensor) -> torch.Tensor:
    """For rows laid out by ``counts [ranks, experts]`` (rank-major), each row's expert."""
    e = torch.arange(counts.shape[1], device=counts.device).repeat(counts.shape[0])
    return torch.repeat_interleave(e, counts.reshape(-1))


class TorchEPMoE(nn.Module):
    """A transformers sparse MoE block (``gate`` router + ``experts`` with ``gate_up_proj [E, 2F, H]``
    and ``down_proj [E, H, F]``) run expert parallel over ``group`` (module docstring).

    Reference: equal to the block on the replicated ``[b, S, H]`` input, on every rank. The router
    runs on this rank's tokens only: :func:`sum_router_grads` sums its weight's gradient over the
    group after backward (a step, not a hook: FSDP2 replaces the parameters).
    Rank r holds experts ``r*E/ws .. (r+1)*E/ws - 1``."""

    def __init__(self, block: nn.Module, group):
        super().__init__()
        self.group, self.ws, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        experts = block.experts
        E = experts.gate_up_proj.shape[0]
        if E % self.ws:
            raise ValueError(f"{E} experts cannot be split evenly over {self.ws} ranks")
        self.n_local = E // self.ws
        lo = self.rank * self.n_local
        self.gate = block.gate  # the model's own router (top-k, renormalisation as the model does it)
        self.act_fn = experts.act_fn
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[lo:lo + self.n_local].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[lo:lo + self.n_local].clone())
        self.num_experts = E

    def _experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Local experts over rows grouped by expert (``counts [n_local]`` rows each)."""
        if x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            return torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            gate, up = F.linear(x[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
            start += n
        return torch.cat(outs) if outs else x.new_zeros((0, x.shape[1]))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, S, H = hidden_states.shape
        mine = _TakeShare.apply(hidden_states.reshape(-1, H), self.group)
        _, weights, idx = self.gate(mine)  # [t, k] routing weights and experts
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        send = mine[order // k]
        counts = torch.bincount(flat, minlength=self.num_experts)  # per expert, this rank's rows
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [ws * n_local]: rows from each rank
        recv_counts = recv_counts.view(self.ws, self.n_local)
        in_splits = counts.view(self.ws, self.n_local).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv = _all_to_all(send, out_splits, in_splits, self.group)
        by_expert = torch.argsort(_expert_of_rows(recv_counts), stable=True)
        y_sorted = self._experts(recv[by_expert], recv_counts.sum(0))
        y = torch.empty_like(y_sorted).index_copy(0, by_expert, y_sorted)
        back = _all_to_all(y, in_splits, out_splits, self.group)
        w = weights.reshape(-1)[order].to(back.dtype)
        out = torch.zeros_like(mine).index_add(0, order // k, (back * w[:, None]).to(mine.dtype))
        return _GatherShares.apply(out, self.group).view(B, S, H)


def sum_router_grads(m: nn.Module) -> None:
    """Sum each :class:`TorchEPMoE` router weight's gradient (the rank's tokens' partial) over its
    group; every rank of the group must call it after backward."""
    from torch.distributed.tensor import DTensor
    for mod in m.modules():
        if isinstance(mod, TorchEPMoE) and mod.gate.weight.grad is not None:
            g = mod.gate.weight.grad
            dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=mod.group)


def apply_torch_ep(m: nn.Module, group) -> int:
    """Replace every sparse MoE block (a module with ``gate`` and ``experts.gate_up_proj``) of ``m``
    by a :class:`TorchEPMoE` over ``group``, in place; returns how many were replaced."""
    n = 0
    for name, mod in list(m.named_modules()):
        if hasattr(mod, "gate") and hasattr(getattr(mod, "experts", None), "gate_up_proj"):
            parent_name, _, child = name.rpartition(".")
            setattr(m.get_submodule(parent_name) if parent_name else m, child, TorchEPMoE(mod, group))
            n += 1
    return n


def check_tokens(batch: int, seq: int, ws: int) -> Optional[str]:
    """Why the token split of :class:`TorchEPMoE` would be uneven, or None."""
    return None if (batch * seq) % ws == 0 else f"batch*seq = {batch * seq} is not divisible by {ws} ranks"
