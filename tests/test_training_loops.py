"""Tier 2: the ordinary training loop on swapped models and the library's own blocks, with no
``finalize_grads``, against the dense model in one process.

The loop, per step: ``loss.backward()``, ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``
(the norm is always above 1 here, so every step clips), ``torch.optim.AdamW(...).step()`` with its
defaults (or ``foreach=True``). Each rank runs it on the swapped model (every parameter a DTensor on
the tensor-parallel mesh: swap's default) and on the unswapped model (or a dense reference built
from the same weights), on the same batches, and checks, in float32 (float64 for the blocks):

  clip_grad_norm_'s total norm                   the dense model's, every step
  every gradient after clipping (first step)     the dense model's (a DTensor's full_tensor())
  every weight after 3 steps                     the dense model's

Models: Hugging Face Llama (GQA; one KV head replicated over the ranks, with biases), Qwen3 (q/k
norms), Mixtral (router; whole decoder layers with ``block=True``), Qwen3-MoE; a megatron-core
GPTModel with tensor parallelism 2 (and a TransformerLayer under sequence parallelism), against
Megatron's own shards gathered into dense tensors; the library's ``OverlapTransformerBlock``
(sequence parallel, built with ``mesh=``, and without sequence parallelism inside a model converted
by ``distribute_params``). Then DCP (save and reload into the same layout, into a model built on
the meta device, and into tensor parallelism 4) and FSDP2 over a (dp=2, tp=2) mesh.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from swap_helpers import full, rel

TOL = 5e-5  # relative, float32
STEPS = 3


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _norm_value(n) -> float:
    return float(n.full_tensor() if _is_dtensor(n) else n)


def _adamw(params, foreach):
    return torch.optim.AdamW(params, lr=1e-2, **({} if foreach is None else {"foreach": foreach}))


# ------------------------------------------------------------------ HF: swapped <-> dense tensors
def hf_pairs(model, dense):
    """(label, the swapped model's parameter, getter of the dense counterpart) for every dense
    parameter, each exactly once: the swapped layers' parameters by their from_dense names (a
    DTensor's global form is the dense tensor: [Note: DTensor parameters]), a swapped decoder
    layer's norms, and every other parameter by name."""
    from test_swap_hf import block_norms, dense_view, swapped_pairs
    out, covered = [], set()
    for name, layer, kind, dmod in swapped_pairs(model, dense):
        inner = getattr(layer, "layer", layer)  # HFAttention / HFMoE hold the layer
        for k, w in dense_view(dmod, kind)(lambda t: t).items():
            if w is not None:
                out.append((f"{name}.{k}", getattr(inner, k),
                            lambda get, dmod=dmod, kind=kind, k=k: dense_view(dmod, kind)(get)[k]))
        covered.update(id(p) for p in dmod.parameters())
    for name, ours, theirs in block_norms(model, dense):
        out.append((name, ours.weight, lambda get, theirs=theirs: get(theirs.weight)))
        covered.add(id(theirs.weight))
    swapped = dict(model.named_parameters())
    for pname, p in dense.named_parameters():
        if id(p) not in covered:
            out.append((pname, swapped[pname], lambda get, p=p: get(p)))
            covered.add(id(p))
    assert len(covered) == len(list(dense.parameters()))
    return out


def hf_errors(model, dense, what: str) -> dict:
    """Relative errors of every parameter (``what="weight"``) or gradient (``"grad"``)."""
    errs = {}
    for label, ours, want_of in hf_pairs(model, dense):
        want = want_of((lambda t: t.detach()) if what == "weight" else (lambda t: t.grad))
        got = ours.detach() if what == "weight" else ours.grad
        assert _is_dtensor(got), (label, type(got))
        errs[f"{what} {label}"] = rel(full(got).reshape(want.shape), want)
    return errs


def hf_loop(rank, ws, family, build_kw, swap_kw, foreach):
    from overlap_layers import OverlapConfig, distribute_params, swap
    from test_swap_hf import batch, build
    model = build(family, **build_kw)
    dense = copy.deepcopy(model)
    swap(model, group=dist.group.WORLD, config=OverlapConfig(num_tiles=2), **swap_kw)
    if swap_kw.get("dtensor") is False:  # plain parameters, converted afterwards
        distribute_params(model, group=dist.group.WORLD)
    plain = [n for n, p in model.named_parameters() if not _is_dtensor(p)]
    opts = {id(m): _adamw(m.parameters(), foreach) for m in (dense, model)}
    errs = {}
    for step in range(STEPS):
        ids = batch(seed=10 + step)
        norms = []
        for m in (dense, model):
            m(ids, labels=ids).loss.backward()
            norms.append(_norm_value(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
        errs[f"norm {step}"] = abs(norms[1] - norms[0]) / norms[0]
        assert norms[0] > 1.0, norms  # the step clips
        if step == 0:
            errs.update(hf_errors(model, dense, "grad"))
        for m in (dense, model):
            opts[id(m)].step()
            opts[id(m)].zero_grad()
    errs.update(hf_errors(model, dense, "weight"))
    moved = max((full(p.detach()).float() - q).abs().max().item()
                for p, q in zip(build(family, **build_kw).parameters(), dense.parameters()))
    return dict(errs=errs, plain=plain, moved=moved)


HF_CASES = {
    "llama": ("llama", {}, {}, None),
    "llama_kv1_bias_foreach": ("llama", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True), {}, True),
    "qwen3_qk_norm": ("qwen3", {}, {}, None),
    "mixtral_block_router": ("mixtral", dict(output_router_logits=True, router_aux_loss_coef=0.1), {"block": True},
                             None),
    "qwen3_moe_foreach": ("qwen3_moe", dict(mlp_only_layers=[0], norm_topk_prob=False), {}, True),
    # swap(dtensor=False), then distribute_params: the router's tie to HF's gate follows the conversion
    "mixtral_plain_then_distribute_params": ("mixtral", dict(output_router_logits=True, router_aux_loss_coef=0.1),
                                             {"dtensor": False}, None),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_standard_loop_equals_dense(pool2, case):
    pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")
    family, build_kw, swap_kw, foreach = HF_CASES[case]
    for rank, res in enumerate(pool2.run(hf_loop, family, build_kw, swap_kw, foreach, timeout=300)):
        assert res["plain"] == [], res["plain"]  # every parameter a DTensor
        assert res["moved"] > 1e-3  # the steps moved the weights
        bad = {k: v for k, v in res["errs"].items() if not v < TOL}
        assert not bad, f"{case} rank {rank}: {bad}"


# ------------------------------------------------------------------ Megatron: TP=2 against its gathered shards
def _sharded(p, tp: int) -> bool:
    return tp > 1 and getattr(p, "tensor_model_parallel", False)


def _gather(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


class DenseTwin:
    """The dense model of an unswapped Megatron model with tensor parallelism ``tp``: each
    parameter whole (its shards gathered, in rank order along ``partition_dim``), trained with the
    same loop in this process; after each step its weights and clipped gradients are written back
    into the Megatron model's shards (so the swapped model is compared with them there)."""

    def __init__(self, ref, group, foreach):
        self.ref, self.group, self.tp = ref, group, dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        with torch.no_grad():
            self.dense = [torch.nn.Parameter(_gather(p, p.partition_dim, group) if _sharded(p, self.tp)
                                             else p.detach().clone()) for p in ref.parameters()]
        self.opt = _adamw(self.dense, foreach)

    def step(self) -> float:
        """Clip and step the dense parameters with the reference's (sequence-parallel reduced)
        gradients; returns the total norm."""
        for p, d in zip(self.ref.parameters(), self.dense):
            d.grad = _gather(p.grad, p.partition_dim, self.group) if _sharded(p, self.tp) else p.grad.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(self.dense, 1.0))
        self.opt.step()
        with torch.no_grad():
            for p, d in zip(self.ref.parameters(), self.dense):
                mine = (lambda t: t.chunk(self.tp, p.partition_dim)[self.rank]) if _sharded(p, self.tp) \
                    else (lambda t: t)
                p.copy_(mine(d))
                p.grad.copy_(mine(d.grad))
        self.opt.zero_grad()
        return norm


def megatron_loop(rank, ws, kind, over, block, foreach):
    from overlap_layers import OverlapConfig
    from test_swap_megatron import (B, S, VOCAB, causal_mask, compare, megatron_tp, sp_reduce, swap_logged, tconfig,
                                    twins)
    with megatron_tp(2) as ps:
        tp = ps.get_tensor_model_parallel_group()
        if kind == "gpt":
            from megatron.core.models.gpt import GPTModel
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            cfg = tconfig(2, **over)

            def build():
                return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                                max_sequence_length=16, position_embedding_type="rope")

            ref, model = twins(build)
            pos = torch.arange(S)[None].expand(B, S)

            def losses(step):
                ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(20 + step))
                return (ref(ids, pos, causal_mask(), labels=ids).mean(), model(ids, pos, None, labels=ids).mean())
        else:  # a TransformerLayer under sequence parallelism (the swapped layer's [s/tp, b, h])
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.transformer.transformer_layer import TransformerLayer
            cfg = tconfig(2, sequence_parallel=True, add_bias_linear=True)
            spec = get_gpt_layer_local_spec(normalization="RMSNorm")

            class SPNorm(torch.nn.RMSNorm):  # Megatron's own norms, as tagged under sequence parallelism
                def __init__(self, config, hidden_size, eps=1e-5, **kw):
                    super().__init__(hidden_size, eps=eps)
                    self.weight.sequence_parallel = True

            spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SPNorm

            class Holder(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.layer = TransformerLayer(cfg, spec.submodules, layer_number=1)

            ref, model = twins(Holder)
            freqs = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(S)
            s = S // ws

            def losses(step):
                g = torch.Generator().manual_seed(30 + step)
                x = torch.randn(S, B, 32, generator=g)[rank * s:(rank + 1) * s]
                dy = torch.randn(S, B, 32, generator=g)[rank * s:(rank + 1) * s]
                return ((ref.layer(x, causal_mask(), rotary_pos_emb=freqs)[0] * dy).sum(),
                        (model.layer(x, None, rotary_pos_emb=freqs)[0] * dy).sum())

        swap_logged(model, group=tp, config=OverlapConfig(num_tiles=2), block=block)
        plain = [n for n, p in model.named_parameters() if not _is_dtensor(p)]
        twin = DenseTwin(ref, tp, foreach)
        opt = _adamw(model.parameters(), foreach)
        errs = {}
        for step in range(STEPS):
            loss_ref, loss = losses(step)
            loss_ref.backward()
            loss.backward()
            sp_reduce(ref, tp)  # the reference's partials, as Megatron's finalize_model_grads sums them
            want = twin.step()
            got = _norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            assert want > 1.0, want
            errs[f"norm {step}"] = abs(got - want) / want
            opt.step()
            if step in (0, STEPS - 1):  # gradients after clipping, weights after the step
                e = {}
                compare(ref, model, e, tp)
                # compare() scores to_dense as exact (0) or 1 + its relative error: here the error counts
                errs.update({f"{k} (step {step})": v - 1.0 if k.startswith("to_dense") and v >= 1.0 else v
                             for k, v in e.items()})
            opt.zero_grad()
            ref.zero_grad()
    return dict(errs=errs, plain=plain)


@pytest.mark.parametrize("kind,over,block,foreach", [
    ("gpt", {}, False, None),
    ("gpt", dict(add_bias_linear=True), True, True),
    ("layer_sp", {}, False, None),
    ("layer_sp", {}, True, None),
])
def test_megatron_tp2_standard_loop_equals_dense(pool2, kind, over, block, foreach):
    pytest.importorskip("megatron.core", reason="needs megatron-core (pip install \"overlap_layers[megatron]\")")
    for rank, res in enumerate(pool2.run(megatron_loop, kind, over, block, foreach, timeout=300)):
        assert res["plain"] == [], res["plain"]
        bad = {k: v for k, v in res["errs"].items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


# ------------------------------------------------------------------ the library's own blocks
def _block_dense(blk) -> dict:
    """The block's dense weights under block_reference's leaf names."""
    d = blk.to_dense()
    out = dict(an_w=d["attn_norm"]["weight"], an_b=d["attn_norm"]["bias"], mn_w=d["mlp_norm"]["weight"],
               mn_b=d["mlp_norm"]["bias"], **{k: d["attention"][k] for k in ("wq", "wk", "wv", "wo")},
               w_in=d["mlp"]["w_in"], w_out=d["mlp"]["w_out"], router=d["mlp"].get("router_weight"))
    return out


_LEAVES = ("an_w", "an_b", "mn_w", "mn_b", "wq", "wk", "wv", "wo", "w_in", "w_out", "router")


def _block_params(blk) -> dict:
    """The block's parameters under block_reference's leaf names (None where absent)."""
    a, m = blk.attention, blk.mlp
    return dict(an_w=blk.attn_norm.weight, an_b=blk.attn_norm.bias, mn_w=blk.mlp_norm.weight, mn_b=blk.mlp_norm.bias,
                wq=a.wq, wk=a.wk, wv=a.wv, wo=a.wo, w_in=m.w_in, w_out=m.w_out, router=getattr(m, "router_weight", None))


def blocks_loop(rank, ws, sp, foreach):
    """Two blocks (a swiglu MLP, then an MoE) trained by the ordinary loop; with ``sp`` built with
    ``mesh=`` on the sequence shards, else built with ``group=`` between an embedding and an LM
    head and converted by ``distribute_params``. The dense reference: block_reference's formulas
    on the blocks' dense weights (and the same embedding and head), in this process."""
    from torch.distributed.device_mesh import DeviceMesh
    from block_reference import E, EPS, F, H, NKV, NQ, THETA, TOPK, dense_block
    from overlap_layers import OverlapTransformerBlock, distribute_params
    torch.manual_seed(5)
    kw = dict(num_kv_heads=NKV, norm_eps=EPS, rope_theta=THETA, num_tiles=2, dtype=torch.float64,
              sequence_parallel=sp)
    where = dict(mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu")) if sp else dict(group=dist.group.WORLD)
    blocks = torch.nn.ModuleList([OverlapTransformerBlock(H, NQ, F, norm=norm, moe=moe, **where, **kw)
                                  for norm, moe in (("rmsnorm", None), ("layernorm", dict(num_experts=E, top_k=TOPK)))])
    V, B, S = 24, 2, 8
    with torch.no_grad():  # norms away from their ones and zeros
        for blk in blocks:
            for p in (blk.attn_norm.weight, blk.mlp_norm.weight, blk.attn_norm.bias, blk.mlp_norm.bias):
                if p is not None:
                    p.add_(0.1 * torch.ones_like(p))
    model = torch.nn.ModuleDict(dict(blocks=blocks))
    if not sp:
        model.embed = torch.nn.Embedding(V, H, dtype=torch.float64)
        model.head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
    dense_heads = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()
                   if n.split(".")[0] in ("embed", "head")}
    dense = [{k: (torch.nn.Parameter(v.clone()) if v is not None else None) for k, v in _block_dense(blk).items()}
             for blk in blocks]
    if not sp:
        distribute_params(model, group=dist.group.WORLD)
    plain = [n for n, p in model.named_parameters() if not _is_dtensor(p)]
    dense_list = [p for d in dense for p in d.values() if p is not None] + list(dense_heads.values())
    opt, dense_opt = _adamw(model.parameters(), foreach), _adamw(dense_list, foreach)

    def run_dense(x_or_ids, dy):
        h = x_or_ids if sp else torch.nn.functional.embedding(x_or_ids, dense_heads["embed.weight"])
        for i, d in enumerate(dense):
            c = dict(norm="rmsnorm" if i == 0 else "layernorm", moe=i == 1)
            h = dense_block(c, [h] + [d[k] for k in _LEAVES])
        return (h * dy).sum() if sp else torch.nn.functional.cross_entropy((h @ dense_heads["head.weight"].T)
                                                                           .reshape(-1, V), x_or_ids.reshape(-1))

    errs = {}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(40 + step)
        if sp:
            x, dy = torch.randn(B, S, H, generator=g, dtype=torch.float64), torch.randn(B, S, H, generator=g,
                                                                                       dtype=torch.float64)
            own = slice(rank * S // ws, (rank + 1) * S // ws)
            h = x[:, own]
            for blk in blocks:
                h = blk(h)
            loss = (h * dy[:, own]).sum()
            dense_loss = run_dense(x, dy)
        else:
            ids = torch.randint(0, V, (B, S), generator=g)
            h = model.embed(ids)
            for blk in blocks:
                h = blk(h)
            loss = torch.nn.functional.cross_entropy(model.head(h).reshape(-1, V), ids.reshape(-1))
            dense_loss = run_dense(ids, None)
        loss.backward()
        dense_loss.backward()
        got = _norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        want = float(torch.nn.utils.clip_grad_norm_(dense_list, 1.0))
        assert want > 1.0, want
        errs[f"norm {step}"] = abs(got - want) / want
        if step == 0:
            errs.update(_block_errors(blocks, dense, model, dense_heads, "grad"))
        opt.step()
        dense_opt.step()
        opt.zero_grad()
        dense_opt.zero_grad()
    errs.update(_block_errors(blocks, dense, model, dense_heads, "weight"))
    return dict(errs=errs, plain=plain)


def _block_errors(blocks, dense, model, dense_heads, what) -> dict:
    get = (lambda t: t.detach()) if what == "weight" else (lambda t: t.grad)
    errs = {}
    for i, (blk, d) in enumerate(zip(blocks, dense)):
        for k, p in _block_params(blk).items():
            if p is not None:
                want = get(d[k])
                errs[f"{what} block {i} {k}"] = rel(full(get(p)).reshape(want.shape), want)
    for n, p in model.named_parameters():
        if n in dense_heads:
            errs[f"{what} {n}"] = rel(full(get(p)), get(dense_heads[n]))
    return errs


@pytest.mark.parametrize("sp,foreach", [(True, None), (False, True)])
def test_own_blocks_standard_loop_equals_dense(pool2, sp, foreach):
    for rank, res in enumerate(pool2.run(blocks_loop, sp, foreach, timeout=300)):
        assert res["plain"] == [], res["plain"]
        bad = {k: v for k, v in res["errs"].items() if not v < 1e-9}
        assert not bad, f"rank {rank}: {bad}"
