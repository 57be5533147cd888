"""Tier 2: ``overlap_layers.swap`` on tiny megatron-core (0.16) models over 2 gloo ranks, against
the unswapped Megatron model (random weights, built locally, CPU).

Megatron's parallel state is initialised with ``tensor_model_parallel_size=2`` over the pool's
world group (or 1, for the full-weights mode). [Note: CPU shim] megatron-core 0.16 allocates its
sequence-parallel gather / scatter buffers on ``torch.cuda.current_device()``, which the CPU build
of torch cannot answer: the workers point it at ``"cpu"`` for the duration of a test (and back).
Its dropout RNG tracker forks CUDA RNG states: the workers use Megatron's inference tracker (a
no-op fork; every dropout here is 0). Megatron's default causal mask is built on "cuda": the
reference model is always given an explicit causal mask (the swapped one is run both with the mask
and with None).

What each rank must hold, from the reference alone (each rank builds both models with the same
seed and the same re-drawn weights):
  outputs (vocab-parallel logits, loss / layer output)    the reference's (float32 rounding)
  every parameter's gradient                              the reference's, after the
                                                          sequence-parallel reduction Megatron's
                                                          finalize_model_grads does (parameters
                                                          tagged ``sequence_parallel``): untouched
                                                          modules by name, swapped layers through
                                                          ``to_dense`` of their gradients vs
                                                          ``megatron_dense`` of the reference's
  ``to_dense()`` of a swapped layer                       ``megatron_dense`` of the replaced
                                                          module, exactly
"""
import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist

from swap_helpers import full, grads_to_dense, rel
from swap_helpers import swap_logged as _swap_logged

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install \"overlap_layers[megatron]\")")

TOL = 5e-5  # relative, float32
B, S, VOCAB = 2, 8, 96


# ------------------------------------------------------------------ worker helpers
@contextlib.contextmanager
def megatron_tp(tp=2):
    """Megatron's parallel state over the world group, with the CPU shim ([Note: CPU shim])."""
    import torch.cuda
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    warnings.filterwarnings("ignore", module="megatron")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield ps
    finally:
        ps.destroy_model_parallel()
        mrandom.initialize_rng_tracker(force_reset=True)
        torch.cuda.current_device = saved


def tconfig(tp, **over):
    from megatron.core.transformer import TransformerConfig
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
              use_cpu_initialization=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
              add_bias_linear=False, normalization="RMSNorm", tensor_model_parallel_size=tp,
              bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
              bias_dropout_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
              hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
    kw.update(over)
    return TransformerConfig(**kw)


def redraw(model, seed=0):
    """Unit-scale weights (Megatron's 0.02 init makes attention uniform): tensor-parallel shards
    differ per rank, replicated parameters are the same on every rank."""
    from megatron.core import parallel_state as ps
    rank, tp = dist.get_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            sharded = tp > 1 and getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(seed * 1000 + i + (100000 * rank if sharded else 0))
            if p.dim() >= 2:
                fan_in = p.shape[-1] * (tp if sharded and p.partition_dim == 1 else 1)
                p.copy_(torch.randn(p.shape, generator=g) * fan_in ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def twins(build):
    """The reference and the model to swap: the same build, the same weights."""
    torch.manual_seed(0)
    ref = build()
    redraw(ref)
    model = build()
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(q)
    return ref, model


def causal_mask():
    return torch.ones(S, S, dtype=torch.bool).triu_(1)[None, None]


def sp_reduce(model, group, skip=()):
    """What Megatron's finalize_model_grads does for sequence parallelism: sum, over the TP group,
    the gradients of parameters tagged ``sequence_parallel`` (except ``skip``)."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None and id(p) not in skip:
            dist.all_reduce(p.grad, group=group)


def local_of(t):
    """``t``'s local tensor where a DTensor, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def swap_logged(model, **kw):
    """``swap`` with the Megatron swap's log lines and overlap_layers' warnings captured."""
    return _swap_logged(model, "overlap_layers.integrations.megatron", ours_only=True, **kw)


def swapped_layers(model):
    """(name of the replaced Megatron module, our layer) of every swapped MLP / attention, those
    inside a swapped TransformerLayer (MegatronBlock) included, and (name, our norm) of the blocks'
    norms."""
    from overlap_layers.integrations import MegatronAttention, MegatronMLP
    from overlap_layers.integrations.megatron import MegatronBlock
    layers, norms = [], []
    for name, m in model.named_modules():
        if isinstance(m, (MegatronMLP, MegatronAttention)):
            layers.append((name, m.layer))
        elif isinstance(m, MegatronBlock):
            layers += [(f"{name}.self_attention", m.block.attention), (f"{name}.mlp", m.block.mlp)]
            norms += [(f"{name}.input_layernorm", m.block.attn_norm), (f"{name}.pre_mlp_layernorm", m.block.mlp_norm)]
    return layers, norms


def compare(ref, model, errs, group):
    """to_dense (exact) and gradients of every parameter, swapped or not; returns (checked, total)."""
    from overlap_layers.integrations.megatron import megatron_dense
    refs = dict(ref.named_modules())
    checked = set()
    layers, norms = swapped_layers(model)
    for name, ours in norms:
        for attr in ("weight", "bias"):
            want = getattr(refs[name], attr, None)
            if want is not None:
                got = full(getattr(ours, attr))
                errs[f"to_dense {name}.{attr}"] = 0.0 if torch.equal(got, want) else 1.0 + rel(got, want)
                errs[f"grad {name}.{attr}"] = rel(getattr(ours, attr).grad, want.grad)
                checked.add(id(want))
    for name, layer in layers:
        want_w = megatron_dense(refs[name])
        want_g = megatron_dense(refs[name], get=lambda p: p.grad)
        got_w, got_g = layer.to_dense(), grads_to_dense(layer)
        for k, w in want_w.items():
            assert (got_w[k] is None) == (w is None), (name, k)
            if w is not None:
                errs[f"to_dense {name}.{k}"] = 0.0 if torch.equal(got_w[k], w) else 1.0 + rel(got_w[k], w)
                errs[f"grad {name}.{k}"] = rel(got_g[k], want_g[k])
        checked.update(id(p) for p in refs[name].parameters())
    params = dict(model.named_parameters())
    for pname, p in ref.named_parameters():
        if id(p) not in checked:  # this rank's tensor of it (a DTensor's local: Megatron's shard, or all of it)
            errs[f"grad {pname}"] = rel(local_of(params[pname].grad), p.grad)
            checked.add(id(p))
    return len(checked), len(list(ref.parameters()))


# ------------------------------------------------------------------ GPTModel, TP=2 (no sequence parallelism)
def check_gpt(rank, ws, over, block=False):
    from overlap_layers import OverlapConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    with megatron_tp(2) as ps:
        tp = ps.get_tensor_model_parallel_group()
        cfg = tconfig(2, **over)

        def build():
            return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                            max_sequence_length=16, position_embedding_type="rope")

        ref, model = twins(build)
        lines, warned = swap_logged(model, group=tp, config=OverlapConfig(num_tiles=2), block=block)
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(S)[None].expand(B, S)
        errs = {}
        logits_ref = ref(ids, pos, causal_mask())
        logits = model(ids, pos, causal_mask())
        errs["logits"] = rel(logits.detach(), logits_ref.detach())
        with torch.no_grad():
            errs["logits mask=None"] = rel(model(ids, pos, None), logits_ref)
            errs["loss"] = rel(model(ids, pos, None, labels=ids), ref(ids, pos, causal_mask(), labels=ids))
        w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2 + rank))
        (logits_ref * w).sum().backward()
        (logits * w).sum().backward()
        checked, total = compare(ref, model, errs, tp)
        layer0 = model.decoder.layers[0]
        if block:
            types = [type(layer0).__name__]
            w_in = layer0.block.mlp.w_in
        else:
            types = [type(m).__name__ for m in (layer0.mlp, layer0.self_attention)]
            w_in = layer0.mlp.layer.w_in
        attrs = {k: getattr(w_in, k, None) for k in ("tensor_model_parallel", "partition_dim", "partition_stride")}
    return dict(errs=errs, checked=checked, total=total, lines=lines, warned=warned, types=types, attrs=attrs)


GPT_CASES = {
    # GQA (4 query heads, 2 groups: one per rank), swiglu, RoPE, no biases
    "gqa_swiglu_rope": dict(),
    # biases everywhere, plain gelu, MHA, head_dim 16 != hidden / heads, explicit softmax scale
    "bias_gelu_kv16": dict(add_bias_linear=True, gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                           num_query_groups=4, kv_channels=16, softmax_scale=0.2),
}


def _gpt_results(pool, case, block):
    results = pool.run(check_gpt, GPT_CASES[case], block)
    for rank, res in enumerate(results):
        assert res["checked"] == res["total"], res
        bad = {k: v for k, v in res["errs"].items() if v > TOL}
        assert not bad, f"{case} rank {rank}: {bad}"
        assert not res["warned"], res["warned"]
        assert res["attrs"] == {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride":
                                2 if case == "gqa_swiglu_rope" else 1}
    return results


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_gpt_block_swap_equals_megatron(pool2, case):
    """``block=True``: each TransformerLayer becomes one OverlapTransformerBlock (MegatronBlock)."""
    for res in _gpt_results(pool2, case, True):
        assert res["types"] == ["MegatronBlock"]
        assert any("block: replaced 2 (TransformerLayer x2" in ln and "left 0" in ln for ln in res["lines"]), \
            res["lines"]
        assert any("mlp: replaced 0" in ln for ln in res["lines"]), res["lines"]


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_gpt_swapped_equals_megatron(pool2, case):
    for rank, res in enumerate(pool2.run(check_gpt, GPT_CASES[case])):
        assert res["checked"] == res["total"], res
        bad = {k: v for k, v in res["errs"].items() if v > TOL}
        assert not bad, f"{case} rank {rank}: {bad}"
        assert not res["warned"], res["warned"]
        assert res["types"] == ["MegatronMLP", "MegatronAttention"]
        assert res["attrs"] == {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride":
                                2 if case == "gqa_swiglu_rope" else 1}
        assert any("mlp: replaced 2 (MLP x2" in ln and "left 0" in ln for ln in res["lines"]), res["lines"]
        assert any("attention: replaced 2 (SelfAttention x2" in ln for ln in res["lines"]), res["lines"]


# ------------------------------------------------------------------ TransformerLayer, TP=2 with sequence parallelism
def check_layer_sp(rank, ws, block=False):
    from overlap_layers import OverlapConfig, finalize_grads
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class SPNorm(torch.nn.RMSNorm):
        """Megatron's torch norm refuses sequence parallelism; a plain RMSNorm tagged as Megatron's
        own norms are under sequence parallelism."""

        def __init__(self, config, hidden_size, eps=1e-5, **kw):
            super().__init__(hidden_size, eps=eps)
            self.weight.sequence_parallel = True

    with megatron_tp(2) as ps:
        tp = ps.get_tensor_model_parallel_group()
        cfg = tconfig(2, sequence_parallel=True, add_bias_linear=True)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.input_layernorm = SPNorm
        spec.submodules.pre_mlp_layernorm = SPNorm

        class Holder(torch.nn.Module):  # swap replaces submodules: the layer under test is one
            def __init__(self):
                super().__init__()
                self.layer = TransformerLayer(cfg, spec.submodules, layer_number=1)

        ref_holder, holder = twins(Holder)
        lines, warned = swap_logged(holder, group=tp, config=OverlapConfig(num_tiles=2), block=block)
        ref, model = ref_holder.layer, holder.layer
        rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
        freqs = rope(S)
        x_full = torch.randn(S, B, 32, generator=torch.Generator().manual_seed(5))
        s = S // ws
        x = x_full[rank * s:(rank + 1) * s]
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, _ = ref(xr, causal_mask(), rotary_pos_emb=freqs)
        ys, _ = model(xs, None, rotary_pos_emb=freqs)
        dy = torch.randn(yr.shape, generator=torch.Generator().manual_seed(7 + rank))
        yr.backward(dy)
        ys.backward(dy)
        errs = {"out": rel(ys.detach(), yr.detach()), "dx": rel(xs.grad, xr.grad)}
        mlp, attn = (model.block.mlp, model.block.attention) if block else (model.mlp.layer, model.self_attention.layer)
        # the SP biases, a block's norms, and Megatron's own norms (block=False): tagged
        # sequence_parallel in the reference, summed inside backward in the swapped layer (their tag
        # cleared, so that Megatron's finalize_model_grads would not sum them again)
        ours = [mlp.b_out, attn.bo] + ([model.block.attn_norm.weight, model.block.mlp_norm.weight] if block else
                                       [model.input_layernorm.weight, model.pre_mlp_layernorm.weight])
        tagged = [bool(getattr(p, "sequence_parallel", False)) for p in ours]
        before = [full(p.grad).clone() for p in ours]
        finalize_grads(model)  # nothing left to do: a no-op
        errs.update({f"finalize_grads changed {i}": rel(p.grad, b) for i, (b, p) in enumerate(zip(before, ours))})
        sp_reduce(ref, tp)  # the reference's partials, as Megatron's finalize_model_grads sums them
        sp_reduce(model, tp)  # nothing is tagged any more
        checked, total = compare(ref_holder, holder, errs, tp)
        sp = [mlp.sequence_parallel, attn.sequence_parallel]
    return dict(errs=errs, checked=checked, total=total, warned=warned, tagged=tagged, sp=sp)


@pytest.mark.parametrize("block", [False, True])
def test_layer_sequence_parallel(pool2, block):
    """Megatron's sequence parallelism ([s/tp, b, h] per rank) -> sequence_parallel=True layers
    (or, with block=True, one sequence-parallel OverlapTransformerBlock)."""
    for rank, res in enumerate(pool2.run(check_layer_sp, block)):
        assert res["checked"] == res["total"], res
        bad = {k: v for k, v in res["errs"].items() if v > TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert not res["warned"], res["warned"]
        assert not any(res["tagged"]) and res["sp"] == [True, True]


# ------------------------------------------------------------------ Megatron TP=1: full weights, sharded over group
def check_tp1(rank, ws):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    with megatron_tp(1):
        cfg = tconfig(1)

        def build():
            return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                            max_sequence_length=16, position_embedding_type="rope")

        ref, model = twins(build)  # TP=1: every parameter replicated, the same on both ranks
        _, warned = swap_logged(model, group=dist.group.WORLD)
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))  # the same batch
        pos = torch.arange(S)[None].expand(B, S)
        lr, ls = ref(ids, pos, causal_mask()), model(ids, pos, None)
        lr.square().mean().backward()
        ls.square().mean().backward()
        errs = {"logits": rel(ls.detach(), lr.detach())}
        checked, total = compare(ref, model, errs, None)
        shard = tuple(local_of(model.decoder.layers[0].mlp.layer._local("w_in")).shape)
        attrs = hasattr(model.decoder.layers[0].mlp.layer.w_in, "tensor_model_parallel")
    return dict(errs=errs, checked=checked, total=total, warned=warned, shard=shard, attrs=attrs)


def test_megatron_tp1_full_weights(pool2):
    for rank, res in enumerate(pool2.run(check_tp1)):
        assert res["checked"] == res["total"]
        bad = {k: v for k, v in res["errs"].items() if v > TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert not res["warned"], res["warned"]
        assert res["shard"] == (64, 32) and not res["attrs"]  # 2 * 64/2 rows: sharded over our group


# ------------------------------------------------------------------ refusals, warnings, errors
def refusals(rank, ws):
    from overlap_layers import swap
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    out = {}
    with megatron_tp(2) as ps:
        tp = ps.get_tensor_model_parallel_group()

        def gpt(rotary_percent=1.0, **over):
            torch.manual_seed(0)
            return GPTModel(tconfig(2, **over), get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                            max_sequence_length=16, position_embedding_type="rope", rotary_percent=rotary_percent)

        # interleaved RoPE cannot be mapped: attention left (warned), MLP swapped
        model = gpt(rotary_interleaved=True)
        lines, warned = swap_logged(model, group=tp)
        out["interleaved"] = ([type(model.decoder.layers[0].self_attention).__name__,
                               type(model.decoder.layers[0].mlp).__name__], warned, lines)
        # block=True with hidden dropout: the TransformerLayers are left (warned) and their attention
        # and MLP swapped one by one (Megatron's bias-dropout-add stays)
        model = gpt(hidden_dropout=0.1)
        lines, warned = swap_logged(model, group=tp, block=True)
        layer0 = model.decoder.layers[0]
        out["dropout_block"] = ([type(m).__name__ for m in (layer0, layer0.self_attention, layer0.mlp)], warned, lines)
        # a plan: only layer 1's MLP
        model = gpt()
        lines, warned = swap_logged(model, group=tp, plan={"decoder.layers.1.mlp": "mlp"})
        out["plan"] = ([type(m.mlp).__name__ for m in model.decoder.layers] +
                       [type(m.self_attention).__name__ for m in model.decoder.layers], lines)
        # a group that is not Megatron's TP group
        singles = [dist.new_group([0]), dist.new_group([1])]
        try:
            swap(gpt(), group=singles[rank])
            out["group"] = None
        except ValueError as e:
            out["group"] = str(e)
        # run-time rejections, on every rank
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(S)[None].expand(B, S)
        pad = causal_mask().expand(B, 1, S, S).clone()
        pad[0, ..., :2] = True
        runtime = {}
        model = swap(gpt(), group=tp)
        partial = swap(gpt(rotary_percent=0.5), group=tp)
        for key, fn in {"padding": lambda: model(ids, pos, pad),
                        "packed": lambda: model.decoder.layers[0].self_attention(
                            torch.randn(S, B, 32), None, packed_seq_params=PackedSeqParams(qkv_format="thd")),
                        "partial_rope": lambda: partial(ids, pos, None)}.items():
            try:
                fn()
                runtime[key] = None
            except Exception as e:  # noqa: BLE001
                runtime[key] = (type(e).__name__, str(e))
        out["runtime"] = runtime
    return out


def test_refusals(pool2):
    for res in pool2.run(refusals):
        types, warned, lines = res["interleaved"]
        assert types == ["SelfAttention", "MegatronMLP"], types
        assert any("rotary_interleaved=True" in w and "SelfAttention unswapped" in w for w in warned), warned
        types, warned, lines = res["dropout_block"]
        assert types == ["TransformerLayer", "MegatronAttention", "MegatronMLP"], types
        assert any("hidden_dropout=0.1" in w and "TransformerLayer unswapped" in w for w in warned), warned
        assert any("block: replaced 0, left 2" in ln for ln in lines), lines
        types, lines = res["plan"]
        assert types == ["MLP", "MegatronMLP", "SelfAttention", "SelfAttention"], types
        assert any("attention: replaced 0, left 2" in ln and "not in the plan" in ln for ln in lines), lines
        assert res["group"] is not None and "tensor-parallel group" in res["group"]
        rt = res["runtime"]
        assert rt["padding"][0] == "ValueError" and "causal" in rt["padding"][1], rt
        assert rt["packed"][0] == "ValueError" and "packed" in rt["packed"][1], rt
        assert rt["partial_rope"][0] == "ValueError" and "partial rotary" in rt["partial_rope"][1], rt
