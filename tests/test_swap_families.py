"""Tier 2: the families ``swap`` recognises by type since the plan specs (Gemma 2, Gemma 3,
Qwen2-MoE), on tiny Hugging Face models (random weights, nothing downloaded) over 2 gloo ranks,
against the unswapped model; and the gated gelu-tanh activation (Gemma's MLP) against torch.

What each rank must hold, from the unswapped model alone (float32 rounding, relative), compared
by the unswapped model's state-dict keys (``swap_helpers.check_against_dense``): its state dict,
logits, loss, every parameter's gradient when backward returns, every weight after one AdamW step,
and its state dict loaded; then greedy ``generate()`` (KV caches) gives its tokens (not under
sequence parallelism, which keeps no KV cache). Qwen2-MoE's ``save_pretrained`` and DCP checkpoints
move exactly between its swapped and unswapped models; a layout ``swap`` refuses leaves the MoE's
router holding its own weight.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from swap_helpers import check_against_dense, checkpoint_round_trips
from swap_helpers import swap_logged as _swap_logged

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")

TOL = 5e-5  # relative, float32


def has_family(family: str) -> bool:
    import importlib
    try:
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        return True
    except ImportError:
        return False


# ------------------------------------------------------------------ models
def redraw(model, seed=0):
    """Weights re-drawn at unit scale, the same on every rank (HF's 0.02 init would hide errors)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.float()


def build(family, **over):
    """A tiny model of ``family``: 2 layers, 4 query heads over 2 KV heads, head_dim 16 (so
    ``query_pre_attn_scalar`` 24 is not head_dim), windows of 4 on 8-token sequences."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16)
    if family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM
        cfg = dict(intermediate_size=64, query_pre_attn_scalar=24, sliding_window=4, **common)
        cfg.update(over)
        model = Gemma2ForCausalLM(Gemma2Config(**cfg))
    elif family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        cfg = dict(intermediate_size=64, query_pre_attn_scalar=24, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"], **common)
        cfg.update(over)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg))
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
        cfg = dict(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                   num_experts_per_tok=2, mlp_only_layers=[0], **common)
        cfg.update(over)
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**cfg))
    elif family == "qwen2":  # not in the families' table: swapped from a plan
        from transformers import Qwen2Config, Qwen2ForCausalLM
        model = Qwen2ForCausalLM(Qwen2Config(intermediate_size=64, **common, **over))
    else:
        raise ValueError(family)
    return redraw(model)


def batch(seed=1, B=2, S=8, vocab=96):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def swap_logged(model, **kw):
    return _swap_logged(model, "overlap_layers.integrations.hf", **kw)


# ------------------------------------------------------------------ worker
def check_family(rank, ws, family, build_kw, swap_kw):
    from overlap_layers import OverlapConfig
    model = build(family, **build_kw)
    dense = copy.deepcopy(model)
    lines, warned = swap_logged(model, group=dist.group.WORLD, config=OverlapConfig(num_tiles=2), **swap_kw)
    errs, ids = {}, batch()

    def run(m):
        out = m(ids, labels=ids)
        return out.logits, out.loss

    check_against_dense(model, dense, run, errs)  # ends with the same weights in both
    # greedy generation with HF's KV caches (sliding ones past the window of 4)
    if not (swap_kw.get("block") or swap_kw.get("sequence_parallel")):
        prompt = ids[:, :6]
        same = torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False),
                           dense.generate(prompt, max_new_tokens=4, do_sample=False))
        errs["generate"] = 0.0 if same else 1.0
    types = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith(("Overlap", "HF"))})
    return dict(errs=errs, lines=lines, warned=warned, types=types)


CASES = {
    # logit soft-capping (Gemma 2's default): attention left dense, warned; the GeGLU MLPs swapped
    "gemma2_softcap": ("gemma2", {}, {}),
    # without soft-capping: query_pre_attn_scalar scaling, a sliding layer (window 4 < 8 tokens) and a global one
    "gemma2": ("gemma2", dict(attn_logit_softcapping=None), {}),
    # q_norm / k_norm with (1 + w) weights, sliding and global layers (each its own RoPE base)
    "gemma3": ("gemma3", {}, {}),
    # q/k/v biases without an o bias; layer 0 dense, layer 1 an MoE with a sigmoid-gated shared expert
    "qwen2_moe": ("qwen2_moe", {}, {}),
    # the same as decoder layers (block=True); and with plain parameters (shards, tagged parts)
    "qwen2_moe_block": ("qwen2_moe", dict(norm_topk_prob=True), {"block": True}),
    "qwen2_moe_plain": ("qwen2_moe", {}, {"dtensor": False}),
    # sequence parallelism (the spec-built layers with sequence_parallel=True, HFSequenceMoE), and as blocks
    "qwen2_moe_sp": ("qwen2_moe", {}, {"sequence_parallel": True}),
    "qwen2_moe_block_sp": ("qwen2_moe", {}, {"block": True, "sequence_parallel": True}),
}
FAMILY_OF = {case: spec[0] for case, spec in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_family_equals_dense(pool2, case):
    family, build_kw, swap_kw = CASES[case]
    if not has_family(family):
        pytest.skip(f"transformers has no {family}")
    for rank, res in enumerate(pool2.run(check_family, family, build_kw, swap_kw)):
        bad = {k: v for k, v in res["errs"].items() if v > TOL}
        assert not bad, f"{case} rank {rank}: {bad}"
        lines, warned = res["lines"], res["warned"]
        if case == "gemma2_softcap":
            assert any("Gemma2Attention unswapped" in w and "soft-capping" in w and "attn_logit_softcapping=50.0" in w
                       for w in warned), warned
            assert any("mlp: replaced 2" in ln for ln in lines) and any("attention: replaced 0, left 2" in ln
                                                                         for ln in lines), lines
            continue
        assert not warned, warned
        if swap_kw.get("block"):
            assert any("block: replaced 2" in ln and "left 0" in ln for ln in lines), lines
        else:
            want = {"mlp": 1, "moe": 1} if family == "qwen2_moe" else {"mlp": 2}
            for kind, n in {**want, "attention": 2}.items():
                assert any(f"{kind}: replaced {n}" in ln and "left 0" in ln for ln in lines), (kind, lines)


# ------------------------------------------------------------------ checkpoints, refused layouts
def round_trips(rank, ws, path):
    from overlap_layers import swap
    model, dense = build("qwen2_moe"), build("qwen2_moe")
    swap(model, group=dist.group.WORLD)
    swapped = redraw(build("qwen2_moe"), seed=5)
    swap(swapped, group=dist.group.WORLD)
    return checkpoint_round_trips(model, dense, redraw(build("qwen2_moe"), seed=6), swapped, path)


def test_checkpoints_round_trip(pool2, tmp_path):
    """The gated shared expert's gate and up rows (``shared_w_in``'s global form ``[2, sF, H]``)
    and its sigmoid gate: ``save_pretrained`` / ``from_pretrained`` and DCP both ways, exact."""
    if not has_family("qwen2_moe"):
        pytest.skip("transformers has no qwen2_moe")
    for res in pool2.run(round_trips, str(tmp_path)):
        assert res == {"from_pretrained": [], "dcp_to_unswapped": [], "dcp_to_swapped": []}, res


def refused(rank, ws, block):
    """Layer 1's MoE given a parameter no swapped module holds: its layout is refused (plain
    parameters: with DTensor ones every parameter is replaced by its DTensor after the swap)."""
    model = build("qwen2_moe")
    moe = model.model.layers[1].mlp
    moe.extra = torch.nn.Parameter(torch.zeros(3))
    weight = moe.gate.weight
    _, warned = swap_logged(model, group=dist.group.WORLD, block=block, dtensor=False)
    return type(model.model.layers[1].mlp).__name__, model.model.layers[1].mlp.gate.weight is weight, warned


@pytest.mark.parametrize("block", [False, True])
def test_refused_moe_keeps_its_router_weight(pool2, block):
    """The router is tied to the layer only once the replacement is accepted: a module (and, with
    ``block=True``, a decoder layer) whose state-dict layout is refused keeps its own weight."""
    if not has_family("qwen2_moe"):
        pytest.skip("transformers has no qwen2_moe")
    for cls, same, warned in pool2.run(refused, block):
        assert cls == "Qwen2MoeSparseMoeBlock" and same, (cls, same)
        assert any("Qwen2MoeSparseMoeBlock unswapped" in w and "'extra'" in w for w in warned), warned


# ------------------------------------------------------------------ the gated gelu-tanh activation
def test_geglu_tanh_equals_torch():
    """``act`` / ``act_backward`` of ``geglu_tanh`` equal ``gelu(gate, approximate="tanh") * up``
    and its autograd gradient, also written into given buffers (``out`` may be ``pre`` itself)."""
    from overlap_layers.layers.common.activations import act, act_backward, gated
    assert gated("geglu_tanh") and gated("swiglu") and not gated("gelu")
    torch.manual_seed(0)
    pre = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    dh = torch.randn(5, 6, dtype=torch.float64)
    gate, up = pre.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    (want_dpre,) = torch.autograd.grad(want, pre, dh)
    assert torch.allclose(act("geglu_tanh", pre.detach()), want.detach(), rtol=1e-12, atol=1e-12)
    dpre, h = act_backward("geglu_tanh", pre.detach(), dh)
    assert torch.allclose(dpre, want_dpre, rtol=1e-12, atol=1e-12) and torch.allclose(h, want.detach())
    buf, h_out = pre.detach().clone(), torch.empty(5, 6, dtype=torch.float64)
    dpre, h = act_backward("geglu_tanh", buf, dh, out=buf, h_out=h_out)
    assert dpre.data_ptr() == buf.data_ptr() and h.data_ptr() == h_out.data_ptr()
    assert torch.allclose(buf, want_dpre, rtol=1e-12, atol=1e-12) and torch.allclose(h_out, want.detach())


def test_layer_arguments_of_the_new_conventions():
    """The layers' new arguments raise ValueError naming the value (before any group is needed)."""
    from overlap_layers import OverlapAttention, OverlapMoE
    with pytest.raises(ValueError, match=r"shared_expert_gate=True.*shared expert"):
        OverlapMoE(8, 6, 4, 2, shared_expert_gate=True)
    with pytest.raises(ValueError, match=r"qk_norm_offset=0\.5"):
        OverlapAttention(32, 4, qk_norm_offset=0.5)
