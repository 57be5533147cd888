"""Tier 2: ``overlap_layers.swap`` on tiny Hugging Face transformers models (random weights, built
locally, nothing downloaded) over 2 gloo ranks, against the unswapped model.

Each rank builds the same model (same seed), keeps a deep copy as the dense reference, swaps the
original and runs both on the same batch. What each rank must hold, from the reference alone:
  logits, loss                    the dense model's (float32 rounding)
  every parameter's gradient      the dense model's when backward returns (no finalize_grads): for
                                  the untouched modules by name; for the swapped layers, their shard
                                  gradients gathered like their weights (to_dense of the grads)
                                  equal the dense module's gradients, laid out as from_dense takes
                                  them (swiglu w_in = gate rows then up rows)
  to_dense() of a swapped layer   the dense module's weights, exactly
  one AdamW step                  every weight after it the dense model's (the swapped layers' by
                                  to_dense, every other one by name)
"""
import copy
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from swap_helpers import full, grads_to_dense, randomize_, rel
from swap_helpers import swap_logged as _swap_logged

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 5e-5  # relative, float32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


# ------------------------------------------------------------------ models
def build(family, seed=0, **over):
    """A tiny HF model of ``family`` with random weights, the same on every rank. Weights are
    re-drawn at unit scale (HF's 0.02 init makes attention uniform and the MoE output tiny, which
    would hide errors)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    common.update({k: over.pop(k) for k in list(over) if k in common})
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=64, **common, **over))
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                                 **common, **over))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                                   num_experts_per_tok=2, head_dim=16, **common, **over))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(intermediate_size=64, **common, **over))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=64, head_dim=16, **common, **over))
    elif family == "phi3":  # fused qkv_proj and gate_up_proj
        model = Phi3ForCausalLM(Phi3Config(intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                           **common, **over))
    else:
        raise ValueError(family)
    randomize_(model)
    return model.float()


def batch(seed=1, B=2, S=8, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=g)


def swap_logged(model, **kw):
    """``swap`` with the HF swap's log lines and every UserWarning captured."""
    return _swap_logged(model, "overlap_layers.integrations.hf", **kw)


# ------------------------------------------------------------------ dense <-> swapped mapping
def dense_view(dense_mod, kind):
    """The dense module's tensors under from_dense's names, as functions of a getter (weight or grad)."""
    if kind == "mlp":
        def view(get):
            if hasattr(dense_mod, "gate_up_proj"):  # Phi-3: already gate rows then up rows
                return {"w_in": get(dense_mod.gate_up_proj.weight), "w_out": get(dense_mod.down_proj.weight),
                        "b_in": None, "b_out": None}
            b = dense_mod.gate_proj.bias is not None
            return {"w_in": torch.cat([get(dense_mod.gate_proj.weight), get(dense_mod.up_proj.weight)]),
                    "w_out": get(dense_mod.down_proj.weight),
                    "b_in": torch.cat([get(dense_mod.gate_proj.bias), get(dense_mod.up_proj.bias)]) if b else None,
                    "b_out": get(dense_mod.down_proj.bias) if b else None}
    elif kind == "attention":
        def view(get):
            m = dense_mod
            if hasattr(m, "qkv_proj"):  # Phi-3: rows q heads, then k, then v
                nq, nkv, d = m.config.num_attention_heads, m.config.num_key_value_heads, m.head_dim
                wq, wk, wv = get(m.qkv_proj.weight).split([nq * d, nkv * d, nkv * d])
                return {"wq": wq, "wk": wk, "wv": wv, "wo": get(m.o_proj.weight), "bq": None, "bk": None,
                        "bv": None, "bo": None, "q_norm": None, "k_norm": None}
            out = {"wq": get(m.q_proj.weight), "wk": get(m.k_proj.weight), "wv": get(m.v_proj.weight),
                   "wo": get(m.o_proj.weight)}
            for k, lin in (("bq", m.q_proj), ("bk", m.k_proj), ("bv", m.v_proj), ("bo", m.o_proj)):
                out[k] = get(lin.bias) if lin.bias is not None else None
            qn = getattr(m, "q_norm", None)
            out["q_norm"] = get(qn.weight) if qn is not None else None
            out["k_norm"] = get(m.k_norm.weight) if qn is not None else None
            return out
    else:
        def view(get):
            return {"router_weight": get(dense_mod.gate.weight), "w_in": get(dense_mod.experts.gate_up_proj),
                    "w_out": get(dense_mod.experts.down_proj), "shared_w_in": None, "shared_w_out": None}
    return view


def swapped_pairs(model, dense):
    """(name, swapped layer, kind, dense module) for every swapped layer; a swapped decoder layer
    (HFBlock) gives its attention and MLP / MoE, paired with the dense self_attn and mlp."""
    from overlap_layers import OverlapMLP, OverlapMoE
    from overlap_layers.integrations import HFAttention, HFMoE
    from overlap_layers.integrations.hf_adapters import HFBlock
    dense_mods = dict(dense.named_modules())
    out, blocks = [], []
    for name, m in model.named_modules():
        if any(name.startswith(b + ".") for b in blocks):
            continue
        if isinstance(m, HFBlock):
            blocks.append(name)
            out.append((name + ".block.attention", m.block.attention, "attention", dense_mods[name + ".self_attn"]))
            out.append((name + ".block.mlp", m.block.mlp, "moe" if isinstance(m.block.mlp, OverlapMoE) else "mlp",
                        dense_mods[name + ".mlp"]))
            continue
        kind = next((k for cls, k in ((OverlapMLP, "mlp"), (HFAttention, "attention"), (HFMoE, "moe"))
                     if isinstance(m, cls)), None)  # the sequence-parallel adapters are subclasses
        if kind:
            out.append((name, m, kind, dense_mods[name]))
    return out


def block_norms(model, dense):
    """(name, our norm, the dense decoder layer's norm) for every swapped decoder layer."""
    from overlap_layers.integrations.hf_adapters import HFBlock
    dense_mods = dict(dense.named_modules())
    return [(f"{name}.{theirs}", getattr(m.block, ours), dense_mods[f"{name}.{theirs}"])
            for name, m in model.named_modules() if isinstance(m, HFBlock)
            for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))]


# ------------------------------------------------------------------ worker: equality with the dense model
def check_family(rank, ws, family, build_kw, swap_kw, attn_impl=None):
    from overlap_layers import OverlapConfig
    model = build(family, **build_kw)
    if attn_impl:
        model.set_attn_implementation(attn_impl)
    dense = copy.deepcopy(model)
    lines, warned = swap_logged(model, group=dist.group.WORLD, config=OverlapConfig(num_tiles=2), **swap_kw)
    pairs = swapped_pairs(model, dense)
    errs = {}
    # to_dense round trip, before any step: exact
    for name, layer, kind, dmod in pairs:
        want = dense_view(dmod, kind)(lambda t: t.detach())
        got = layer.to_dense()
        for k, w in want.items():
            assert (got[k] is None) == (w is None), (name, k)
            if w is not None and not torch.equal(got[k], w):
                errs[f"to_dense {name}.{k}"] = rel(got[k], w)
    norms = block_norms(model, dense)
    for name, ours, theirs in norms:
        if not torch.equal(full(ours.weight), theirs.weight) or ours.eps != theirs.variance_epsilon:
            errs[f"norm {name}"] = 1.0
    ids = batch()  # the same batch on every rank
    out_d = dense(ids, labels=ids)
    out_s = model(ids, labels=ids)
    out_d.loss.backward()
    out_s.loss.backward()  # every gradient complete when backward returns: no finalize_grads
    errs["logits"] = rel(out_s.logits.detach(), out_d.logits.detach())
    errs["loss"] = abs(out_s.loss.item() - out_d.loss.item()) / abs(out_d.loss.item())
    if getattr(out_d, "aux_loss", None) is not None:
        errs["aux_loss"] = abs(out_s.aux_loss.item() - out_d.aux_loss.item()) / abs(out_d.aux_loss.item())
    # every dense parameter's gradient is checked exactly once
    checked = set()
    for name, layer, kind, dmod in pairs:
        want = dense_view(dmod, kind)(lambda t: t.grad)
        got = grads_to_dense(layer)
        for k, w in want.items():
            if w is not None:
                errs[f"grad {name}.{k}"] = rel(got[k], w)
        checked.update(id(p) for p in dmod.parameters())
    for name, ours, theirs in norms:
        errs[f"grad {name}.weight"] = rel(ours.weight.grad, theirs.weight.grad)
        checked.add(id(theirs.weight))
    swapped_params = dict(model.named_parameters())
    for pname, p in dense.named_parameters():
        if id(p) in checked:
            continue
        errs[f"grad {pname}"] = rel(swapped_params[pname].grad, p.grad)
        checked.add(id(p))
    # one AdamW step on each (the ordinary loop: DTensor parameters): every weight after it
    for m in (model, dense):
        torch.optim.AdamW(m.parameters(), lr=1e-3).step()
    for name, layer, kind, dmod in pairs:
        got = layer.to_dense()
        for k, w in dense_view(dmod, kind)(lambda t: t.detach()).items():
            if w is not None:
                errs[f"step {name}.{k}"] = rel(got[k], w)
    for name, ours, theirs in norms:
        errs[f"step {name}.weight"] = rel(ours.weight.detach(), theirs.weight.detach())
    for pname, p in dense.named_parameters():
        if pname in swapped_params:
            errs[f"step {pname}"] = rel(swapped_params[pname].detach(), p.detach())
    n_dense = len(list(dense.parameters()))
    return dict(errs=errs, checked=len(checked), n_dense=n_dense, lines=lines, warned=warned,
                loss=(out_d.loss.item(), out_s.loss.item()))


CASES = {
    # GQA (4 query heads, 2 KV heads: one each), Llama 3 rope scaling, SDPA (mask None)
    "llama_gqa_llama3rope": ("llama", dict(rope_parameters=LLAMA3_ROPE), None),
    # 1 KV head replicated over both ranks, biases everywhere, eager attention (float causal mask)
    "llama_kv1_bias_eager": ("llama", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True), "eager"),
    # MoE with HF's router logits recorded: the loss includes the load-balancing aux loss
    "mixtral_aux": ("mixtral", dict(output_router_logits=True, router_aux_loss_coef=0.1), None),
    # q_norm / k_norm, head_dim 16 != hidden/heads, norm_topk_prob False, layer 0 a dense MLP
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[0], norm_topk_prob=False), None),
    # same structure as Llama / Qwen3-MoE's attention; Mistral's sliding window (16) >= the sequence
    "mistral": ("mistral", dict(sliding_window=16), None),
    "qwen3": ("qwen3", dict(), None),
    # fused qkv_proj / gate_up_proj split into the layers' layouts; GQA, then 1 KV head replicated, eager
    "phi3": ("phi3", dict(), None),
    "phi3_kv1_eager": ("phi3", dict(num_key_value_heads=1), "eager"),
}


def run_case(pool, case, swap_kw):
    """``check_family`` of ``case`` on every rank, asserting that every dense parameter was checked,
    every error is within TOL and nothing warned; returns rank 0's log lines."""
    family, build_kw, attn_impl = CASES[case]
    results = pool.run(check_family, family, build_kw, swap_kw, attn_impl)
    for rank, res in enumerate(results):
        assert res["checked"] == res["n_dense"], f"rank {rank}: checked {res['checked']} of {res['n_dense']} params"
        bad = {k: v for k, v in res["errs"].items() if v > TOL}
        assert not bad, f"{case} rank {rank}: {bad}"
        assert not res["warned"], res["warned"]
    return results[0]["lines"]


@pytest.mark.parametrize("case", list(CASES))
def test_swapped_equals_dense(pool2, case):
    family = CASES[case][0]
    lines = run_case(pool2, case, {})
    want = {"llama": {"mlp": 2, "attention": 2, "moe": 0}, "mixtral": {"mlp": 0, "attention": 2, "moe": 2},
            "qwen3_moe": {"mlp": 1, "attention": 2, "moe": 1}}.get(family, {"mlp": 2, "attention": 2, "moe": 0})
    for kind, n in want.items():
        assert any(f"swap: {kind}: replaced {n}" in ln and "left 0" in ln for ln in lines), (kind, lines)
    assert not any("use_cache=False" in ln for ln in lines)  # generation keeps its KV cache


@pytest.mark.parametrize("case", ["llama_gqa_llama3rope", "mixtral_aux", "qwen3_moe", "qwen3", "phi3"])
def test_block_swap_equals_dense(pool2, case):
    """``swap(..., block=True)``: every decoder layer becomes one OverlapTransformerBlock (HFBlock);
    logits, loss (with Mixtral's recorded router logits and aux loss) and every gradient equal
    the dense model's when backward returns."""
    lines = run_case(pool2, case, {"block": True})
    assert any("swap: block: replaced 2" in ln and "left 0" in ln for ln in lines), lines
    assert any("swap: mlp: replaced 0" in ln for ln in lines), lines


# ------------------------------------------------------------------ worker: plan, warnings, errors
class CustomMLP(torch.nn.Module):
    """An MLP of a class swap does not know (same structure as LlamaMLP)."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def plans_and_errors(rank, ws):
    from overlap_layers import OverlapMLP, swap
    from overlap_layers.integrations import HFAttention
    out = {}
    g = dist.group.WORLD
    # a plan with options; layer 0's MLP is of an unknown class: warned and left, layer 1's swapped
    model = build("llama")
    model.model.layers[0].mlp = CustomMLP(model.model.layers[0].mlp)
    dense = copy.deepcopy(model)
    lines, warned = swap_logged(model, group=g, plan={"model.layers.*.mlp": {"kind": "mlp", "num_tiles": 3},
                                                      "model.layers.1.self_attn": "attention",
                                                      "model.layers.0.self_attn": None,
                                                      "lm_head.nothing": "mlp"})
    out["plan_types"] = [type(model.model.layers[i].mlp).__name__ for i in range(2)] + \
                        [type(model.model.layers[i].self_attn).__name__ for i in range(2)]
    out["plan_tiles"] = model.model.layers[1].mlp.num_tiles
    out["plan_lines"], out["plan_warned"] = lines, warned
    ids = batch()
    out["plan_logits"] = rel(model(ids).logits.detach(), dense(ids).logits.detach())
    # no plan: an unknown MLP-looking class warns
    model = build("llama")
    model.model.layers[1].mlp = CustomMLP(model.model.layers[1].mlp)
    lines, warned = swap_logged(model, group=g)
    out["auto_lines"], out["auto_warned"] = lines, warned
    out["auto_types"] = [type(model.model.layers[i].mlp).__name__ for i in range(2)]
    # a recognised module the group cannot split (3 heads over 2 ranks) is left, with a warning;
    # the half-swapped model still equals the dense one
    model = build("llama", hidden_size=24, num_attention_heads=3, num_key_value_heads=3)
    dense = copy.deepcopy(model)
    lines, warned = swap_logged(model, group=g)
    out["heads3"] = ([type(model.model.layers[0].self_attn).__name__, type(model.model.layers[0].mlp).__name__],
                     warned, lines, rel(model(ids).logits.detach(), dense(ids).logits.detach()))
    # swapping again is a no-op
    lines, warned = swap_logged(model, group=g)
    out["again_lines"] = lines
    # errors
    errors = {}
    for key, fn in {
        "block": lambda: swap(build("llama"), group=g, block="yes"),
        "block_kind": lambda: swap(build("llama"), group=g, plan={"model.layers.*": "block"}),
        "kind_mismatch": lambda: swap(build("llama"), group=g, plan={"model.layers.*.self_attn": "mlp"}),
        "bad_kind": lambda: swap(build("llama"), group=g, plan={"model.layers.*.mlp": "ffn"}),
        "bad_option": lambda: swap(build("llama"), group=g, plan={"model.layers.*.mlp": {"kind": "mlp", "tiles": 2}}),
        "no_group": lambda: swap(build("llama")),
    }.items():
        try:
            fn()
            errors[key] = None
        except Exception as e:  # noqa: BLE001
            errors[key] = (type(e).__name__, str(e))
    out["errors"] = errors
    # run-time calls that the swapped attention serves (padding, a cache: tests/test_hf_inference.py
    # checks their values) and one it rejects on every rank (no hang): flash attention's varlen arguments
    model = build("llama")
    swap(model, group=g)
    am = torch.ones(2, 8, dtype=torch.long)
    am[0, :3] = 0
    runtime = {}
    for key, kw in {"padding": dict(attention_mask=am), "cache": dict(use_cache=True),
                    "ones_mask": dict(attention_mask=torch.ones(2, 8, dtype=torch.long)),
                    "varlen": dict(cu_seq_lens_q=torch.tensor([0, 8]))}.items():
        try:
            model(ids, **kw)
            runtime[key] = None
        except Exception as e:  # noqa: BLE001
            runtime[key] = (type(e).__name__, str(e))
    out["runtime"] = runtime
    out["attn_is_ours"] = isinstance(model.model.layers[0].self_attn, HFAttention)
    out["mlp_is_ours"] = isinstance(model.model.layers[0].mlp, OverlapMLP)
    return out


def test_plan_warnings_and_errors(pool2):
    for res in pool2.run(plans_and_errors):
        assert res["plan_types"] == ["CustomMLP", "OverlapMLP", "LlamaAttention", "HFAttention"]
        assert res["plan_tiles"] == 3
        assert res["plan_logits"] < TOL
        assert any("CustomMLP" in w and "not a recognised mlp class" in w for w in res["plan_warned"]), \
            res["plan_warned"]
        assert any("'lm_head.nothing' matched no module" in w for w in res["plan_warned"]), res["plan_warned"]
        assert any("mlp: replaced 1" in ln and "left 1" in ln and "CustomMLP" in ln for ln in res["plan_lines"])
        assert any("attention: replaced 1" in ln and "excluded by plan" in ln for ln in res["plan_lines"])
        assert res["auto_types"] == ["OverlapMLP", "CustomMLP"]
        assert any("CustomMLP looks like a mlp module" in w for w in res["auto_warned"]), res["auto_warned"]
        assert any("already overlap layers" in ln for ln in res["again_lines"])
        types, warned, lines, err = res["heads3"]
        assert types == ["LlamaAttention", "OverlapMLP"] and err < TOL
        assert any("LlamaAttention unswapped" in w and "num_heads=3" in w for w in warned), warned
        assert any("attention: replaced 0, left 2" in ln for ln in lines), lines
        e = res["errors"]
        assert e["block"][0] == "ValueError" and "block='yes'" in e["block"][1]
        assert e["block_kind"][0] == "ValueError" and "'block'" in e["block_kind"][1]
        assert e["kind_mismatch"][0] == "ValueError" and "known attention module" in e["kind_mismatch"][1]
        assert e["bad_kind"][0] == "ValueError" and "'ffn'" in e["bad_kind"][1]
        assert e["bad_option"][0] == "ValueError" and "tiles" in e["bad_option"][1]
        assert e["no_group"][0] == "ValueError" and "group=" in e["no_group"][1]
        rt = res["runtime"]
        assert rt["padding"] is None and rt["cache"] is None and rt["ones_mask"] is None
        assert rt["varlen"][0] == "ValueError" and "cu_seq_lens_q" in rt["varlen"][1], rt["varlen"]
        assert res["attn_is_ours"] and res["mlp_is_ours"]


# ------------------------------------------------------------------ MoE token split: uneven and tiny
def moe_uneven(rank, ws):
    """7 tokens over 2 ranks (4 + 3) and 1 token (rank 1 empty): outputs and input gradients."""
    from overlap_layers import swap
    out = {}
    for B, S in ((1, 7), (1, 1)):
        model = build("mixtral", num_hidden_layers=1)
        dense = copy.deepcopy(model)
        swap(model, group=dist.group.WORLD)
        moe_s, moe_d = model.model.layers[0].mlp, dense.model.layers[0].mlp
        seen = []
        moe_s.layer.register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape)))
        x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(3))
        xs, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
        ys, yd = moe_s(xs), moe_d(xd)
        dy = torch.randn_like(yd)
        ys.backward(dy)
        yd.backward(dy)
        out[(B, S)] = dict(errs=(rel(ys.detach(), yd.detach()), rel(xs.grad, xd.grad),
                                 rel(moe_s.layer.router_weight.grad, moe_d.gate.weight.grad)), seen=seen)
    return out


def test_moe_split_uneven(pool2):
    """Each rank routes only its share of the tokens (7 = 4 + 3; 1 = 1 + 0), and the output, the
    input gradient and the router gradient equal the dense block's."""
    shares = {(1, 7): [4, 3], (1, 1): [1, 0]}
    for rank, res in enumerate(pool2.run(moe_uneven)):
        for shape, r in res.items():
            assert max(r["errs"]) < TOL, (shape, r["errs"])
            assert r["seen"] == [(1, shares[shape][rank], 32)], (rank, shape, r["seen"])


# ------------------------------------------------------------------ the examples' CPU paths
def test_examples_run():
    """Both examples' CPU paths (each starts 2 gloo ranks itself; the Llama one also with --block),
    run together (their start-up is mostly imports): they exit 0 and print one line per step and
    that the losses match."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    runs = {("train_tiny_llama.py",): 3, ("train_tiny_llama.py", "--block"): 2, ("moe_example.py",): 2}
    procs = {script: subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", script[0]), *script[1:],
                                       "--steps", str(n)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for script, n in runs.items()}
    for script, p in procs.items():
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        assert p.returncode == 0, f"{script}:\n{out[-3000:]}{err[-3000:]}"
        steps = [ln for ln in out.splitlines() if ln.lstrip().startswith("step")]
        assert len(steps) == runs[script], out
        assert "losses match" in out, out


# ------------------------------------------------------------------ HF gradient checkpointing
def checkpointed_run(rank, ws, block):
    """``model.gradient_checkpointing_enable()`` on a swapped model (HF checkpoints its decoder
    layers, or our HFBlocks): loss and every gradient equal the dense model's, and the blocks did
    recompute (their layers ran forward twice)."""
    from overlap_layers import OverlapAttention, swap
    model = build("llama")
    dense = copy.deepcopy(model)
    swap(model, group=dist.group.WORLD, block=block)
    model.gradient_checkpointing_enable()
    model.train()
    dense.train()
    attn = next(m for m in model.modules() if isinstance(m, OverlapAttention))
    attn.launch_log = []
    ids = batch()
    loss, want = model(ids, labels=ids).loss, dense(ids, labels=ids).loss
    n_fwd = len(attn.launch_log)
    loss.backward()
    want.backward()
    recomputed = Counter(name for _, name, _ in attn.launch_log)
    errs = {"loss": abs(loss.item() - want.item()) / abs(want.item())}
    for name, layer, kind, dmod in swapped_pairs(model, dense):
        got = grads_to_dense(layer)
        for k, w in dense_view(dmod, kind)(lambda t: t.grad).items():
            if w is not None:
                errs[f"grad {name}.{k}"] = rel(got[k], w)
    errs["embed"] = rel(model.model.embed_tokens.weight.grad, dense.model.embed_tokens.weight.grad)
    fwd_ops = Counter(name for _, name, _ in attn.launch_log[:n_fwd])
    return errs, all(recomputed[k] == 2 * v for k, v in fwd_ops.items())


@pytest.mark.parametrize("block", [False, True])
def test_hf_gradient_checkpointing(pool2, block):
    for errs, recomputed in pool2.run(checkpointed_run, block):
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, bad
        assert recomputed


def _deepcopy_swapped(rank, ws, family, block):
    """A swapped model after one training step's forward and backward, and its deep copy: the
    copy's loss and logits on the same batch, against the original's."""
    from overlap_layers import swap
    model = build(family)
    swap(model, group=dist.group.WORLD, block=block)
    ids = batch()
    model(ids, labels=ids).loss.backward()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        a, b = model(ids, labels=ids), twin(ids, labels=ids)
    return rel(b.logits, a.logits), abs(b.loss.item() - a.loss.item())


@pytest.mark.parametrize("family,block", [("llama", False), ("llama", True), ("mixtral", False)])
def test_deepcopy_of_a_swapped_model_computes_the_same(pool2, family, block):
    """``copy.deepcopy`` of a Hugging Face model with the layers (or blocks) swapped in, as an
    EMA or reference model is made ([Note: copying a layer]): the copy gives the same logits."""
    for logits, loss in pool2.run(_deepcopy_swapped, family, block):
        assert logits < 1e-6 and loss < 1e-6, (logits, loss)


# ------------------------------------------------------------------ Phi-3 with partial rotary
def phi3_partial_rotary(rank, ws):
    """RoPE on half of each head (``partial_rotary_factor=0.5``): OverlapAttention rotates whole heads,
    so the attention is left dense with a warning; the MLPs are swapped and the logits equal the dense."""
    model = build("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    dense = copy.deepcopy(model)
    lines, warned = swap_logged(model, group=dist.group.WORLD)
    ids = batch()
    types = [type(m).__name__ for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    return types, lines, warned, rel(model(ids).logits.detach(), dense(ids).logits.detach())


def test_phi3_partial_rotary_left_dense_with_a_warning(pool2):
    for types, lines, warned, err in pool2.run(phi3_partial_rotary):
        assert types == ["Phi3Attention", "OverlapMLP"] * 2, types
        assert any("Phi3Attention" in w and "partial_rotary_factor=0.5" in w for w in warned), warned
        assert any("attention: replaced 0, left 2" in ln for ln in lines), lines
        assert err < TOL


def phi3_resid_dropout_block(rank, ws):
    """``block=True`` on a Phi-3 with residual dropout (``resid_pdrop > 0``, which the block lacks):
    the decoder layers are left, warned, and their attention and MLP swapped one by one."""
    model = build("phi3", resid_pdrop=0.1).eval()
    dense = copy.deepcopy(model)
    lines, warned = swap_logged(model, group=dist.group.WORLD, block=True)
    ids = batch()
    types = [type(m).__name__ for layer in model.model.layers for m in (layer, layer.self_attn, layer.mlp)]
    return types, warned, rel(model(ids).logits.detach(), dense(ids).logits.detach())


def test_phi3_residual_dropout_block_left_with_a_warning(pool2):
    for types, warned, err in pool2.run(phi3_resid_dropout_block):
        assert types == ["Phi3DecoderLayer", "HFAttention", "OverlapMLP"] * 2, types
        assert any("resid_pdrop > 0" in w for w in warned), warned
        assert err < TOL
