"""``overlap_layers.swap`` on tiny DeepSeek-V3 and DeepSeek-V2 models (random weights, built locally)
over 2 gloo ranks, against the unswapped model (transformers' router, experts and shared experts).

Each rank builds the same model, keeps a deep copy as the reference, swaps the original and runs
both on the same batch. What each rank must hold, from the reference alone:
  swapped                         layer 0's dense MLP an OverlapMLP, layer 1's MoE an HFMoE; the
                                  MLA attention left dense with its warning (the only warning)
  state_dict()                    the unswapped model's keys in its order (e_score_correction_bias
                                  included), every value the unswapped tensor (gathered)
  logits, loss                    the unswapped model's (float32 rounding)
  every parameter's gradient      the unswapped model's, by state-dict key (gathered)
  one AdamW step                  every entry of the state dict after it the unswapped model's
  load_state_dict                 the unswapped model's state dict (before the step) loads back
Checkpoints (``save_pretrained``, DCP both ways) move exactly between swapped and unswapped models;
an MoE whose layout ``swap`` refuses keeps its router's own weight and bias.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from swap_helpers import checkpoint_round_trips, randomize_, rel, swap_logged

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")

TOL = 5e-5  # relative, float32
# tiny MLA attention: 4 heads of 8 + 8 (non-rotary + rotary) dims, kv rank 16, no q LoRA
MLA = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=8)
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1, **MLA)
CASES = {
    # sigmoid + bias, 4 groups of 2 (2 kept), normalised, scaled; 1 shared expert
    "v3": ("deepseek_v3", dict(n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                               norm_topk_prob=True)),
    # softmax, group-limited greedy (groups scored by their max), scaled; 2 shared experts (width 32)
    "v2": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=2,
                               routed_scaling_factor=4.0)),
    # softmax greedy top-k, scaled
    "v2_greedy": ("deepseek_v2", dict(topk_method="greedy", n_shared_experts=1, routed_scaling_factor=2.0)),
}


def build(case, seed=0):
    """The tiny model, the same on every rank; weights re-drawn at unit scale (HF's 0.02 init makes
    the MoE output tiny, which would hide errors), V3's e_score_correction_bias random (so that it
    changes the selection)."""
    family, over = CASES[case]
    mod = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["x"])
    prefix = {"deepseek_v3": "DeepseekV3", "deepseek_v2": "DeepseekV2"}[family]
    cfg = getattr(__import__(f"transformers.models.{family}", fromlist=["x"]), f"{prefix}Config")(**COMMON, **over)
    torch.manual_seed(seed)
    model = getattr(mod, f"{prefix}ForCausalLM")(cfg)
    randomize_(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model.float()


def gathered_grads(model):
    """The swapped model's gradients by state-dict key (the unswapped layout, gathered): its
    parameters' values swapped for their gradients, ``full_state_dict``, restored."""
    from overlap_layers.integrations import full_state_dict
    params = list({id(p): p for p in model.parameters()}.values())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.grad)
        grads = {k: v.clone() for k, v in full_state_dict(model).items()}  # CPU entries are the tensors
        for p, s in zip(params, saved):
            p.copy_(s)
    return grads


def check(rank, ws, case, dtensor):
    from overlap_layers import OverlapConfig, OverlapMLP
    from overlap_layers.integrations import HFMoE, full_state_dict
    model = build(case)
    dense = copy.deepcopy(model)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    lines, warned = swap_logged(model, "overlap_layers.integrations.hf", group=dist.group.WORLD,
                                config=OverlapConfig(num_tiles=2), dtensor=dtensor)
    layers = model.model.layers
    out = dict(lines=lines, warned=warned, errs={},
               types=[type(m).__name__ for layer in layers for m in (layer.self_attn, layer.mlp)],
               ours=isinstance(layers[0].mlp, OverlapMLP) and isinstance(layers[1].mlp, HFMoE),
               keys=list(model.state_dict()) == list(dense.state_dict()),
               bias="model.layers.1.mlp.gate.e_score_correction_bias" in model.state_dict())
    errs = out["errs"]
    for k, v in full_state_dict(model).items():
        if not torch.equal(v, before[k]):
            errs[f"state {k}"] = rel(v, before[k]) or 1.0
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    out_d, out_s = dense(ids, labels=ids), model(ids, labels=ids)
    out_d.loss.backward()
    out_s.loss.backward()
    errs["logits"] = rel(out_s.logits.detach(), out_d.logits.detach())
    errs["loss"] = abs(out_s.loss.item() - out_d.loss.item()) / abs(out_d.loss.item())
    grads = gathered_grads(model)
    for k, p in dense.named_parameters():
        errs[f"grad {k}"] = rel(grads[k], p.grad)
    for m in (model, dense):
        torch.optim.AdamW(m.parameters(), lr=1e-3).step()
    after = full_state_dict(model)
    for k, v in dense.state_dict().items():
        errs[f"step {k}"] = rel(after[k], v)
    model.load_state_dict(before)
    for k, v in full_state_dict(model).items():
        errs[f"load {k}"] = rel(v, before[k])
    return out


@pytest.mark.parametrize("case,dtensor", [(case, True) for case in CASES] + [("v3", False)])
def test_swapped_deepseek_equals_dense(pool2, case, dtensor):
    """DTensor parameters (swap's default), and plain ones (``dtensor=False``: the state dict's
    entries this rank's parts, gathered by ``full_state_dict``)."""
    family = CASES[case][0]
    pytest.importorskip(f"transformers.models.{family}.modeling_{family}", reason=f"no {family} in this transformers")
    prefix = {"deepseek_v3": "DeepseekV3", "deepseek_v2": "DeepseekV2"}[family]
    for rank, res in enumerate(pool2.run(check, case, dtensor)):
        assert res["types"] == [f"{prefix}Attention", "OverlapMLP", f"{prefix}Attention", "HFMoE"], res["types"]
        assert res["ours"] and res["keys"]
        assert res["bias"] is (case == "v3")
        bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
        assert not bad, f"{case} rank {rank}: {bad}"
        assert len(res["warned"]) == 1 and "multi-head latent attention" in res["warned"][0], res["warned"]
        for kind, n, left in (("mlp", 1, 0), ("moe", 1, 0), ("attention", 0, 2)):
            assert any(f"swap: {kind}: replaced {n}" in ln and f"left {left}" in ln for ln in res["lines"]), \
                (kind, res["lines"])


def save_and_load(rank, ws, path):
    """``load_pretrained_shards`` of a swapped DeepSeek-V3's ``save_pretrained`` into a swapped
    model of other weights, and the round trips of ``checkpoint_round_trips``: exact state dicts."""
    from overlap_layers import swap
    from overlap_layers.integrations import full_state_dict, load_pretrained_shards
    model, dense = build("v3"), build("v3")
    swap(model, group=dist.group.WORLD)
    swapped = build("v3", seed=6)
    swap(swapped, group=dist.group.WORLD)
    out = checkpoint_round_trips(model, dense, build("v3", seed=7), swapped, path)
    other = build("v3", seed=5)
    swap(other, group=dist.group.WORLD)
    load_pretrained_shards(other, f"{path}/pretrained")
    out["shards"] = [k for k, v in full_state_dict(other).items() if not torch.equal(v, dense.state_dict()[k])]
    return out


def test_save_pretrained_and_load_pretrained_shards(pool2, tmp_path):
    pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    for res in pool2.run(save_and_load, str(tmp_path)):
        assert res == {"from_pretrained": [], "dcp_to_unswapped": [], "dcp_to_swapped": [], "shards": []}, res


def refused(rank, ws):
    """Layer 1's MoE given a parameter no swapped module holds: its layout is refused (plain
    parameters: with DTensor ones every parameter is replaced by its DTensor after the swap)."""
    model = build("v3")
    moe = model.model.layers[1].mlp
    moe.extra = torch.nn.Parameter(torch.zeros(3))
    weight, bias = moe.gate.weight, moe.gate.e_score_correction_bias
    _, warned = swap_logged(model, "overlap_layers.integrations.hf", group=dist.group.WORLD, dtensor=False)
    moe = model.model.layers[1].mlp
    return type(moe).__name__, moe.gate.weight is weight, moe.gate.e_score_correction_bias is bias, warned


def test_refused_moe_keeps_its_router_tensors(pool2):
    """The router's weight and ``e_score_correction_bias`` are tied to the layer's only once the
    replacement is accepted: a block whose state-dict layout is refused keeps its own."""
    pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    for cls, weight, bias, warned in pool2.run(refused):
        assert cls == "DeepseekV3MoE" and weight and bias, (cls, weight, bias)
        assert any("DeepseekV3MoE unswapped" in w and "'extra'" in w for w in warned), warned
