"""Tier 2: ``swap``'s declarative plan -- specs (``MLPSpec``, ``AttentionSpec``, ``MoESpec``,
``BlockSpec``) written here, in the test, for models the library does not know: a small custom
``nn.Module`` model with its own names (a GeGLU MLP with biases; an MoE whose router, experts,
shared expert and its sigmoid gate are all named differently), and Hugging Face's Qwen2 (not in
the families' table: q/k/v biases, no o bias), module by module and as decoder layers. Each swapped
model must equal the unswapped one over 2 gloo ranks, compared by the unswapped model's state-dict
keys (``swap_helpers.check_against_dense``: state dict, logits, loss, every gradient, one AdamW
step, the state dict loaded). Bad specs and plans raise ValueError naming the argument, the value
and what is valid; a spec whose names the module lacks leaves it, warned.
"""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from swap_helpers import check_against_dense
from swap_helpers import swap_logged as _swap_logged

TOL = 5e-5  # relative: float32 (Qwen2), float64 (the custom model)
H, E, K = 32, 4, 2


# ------------------------------------------------------------------ a model the library does not know
class FFN(nn.Module):
    """``fc_out(gelu_tanh(fc_gate(x)) * fc_up(x))``, with biases."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.fc_gate, self.fc_up, self.fc_out = nn.Linear(hidden, ffn), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.fc_out(self.act(self.fc_gate(x)) * self.fc_up(x))


class SharedMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    def __init__(self, experts, hidden, ffn):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.act = nn.SiLU()


class RoutedFFN(nn.Module):
    """Top-k softmax routing (renormalised) over the experts, plus a shared expert scaled by
    ``sigmoid(shared_gate(x))``: every expert computed on every token, weighted densely."""

    def __init__(self, hidden, ffn, shared_ffn):
        super().__init__()
        self.router = nn.Linear(hidden, E, bias=False)
        self.experts = Experts(E, hidden, ffn)
        self.shared = SharedMLP(hidden, shared_ffn)
        self.shared_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x):
        t = x.reshape(-1, x.shape[-1])
        p = torch.softmax(self.router(t).float(), dim=-1)
        w, idx = p.topk(K, dim=-1)
        dense_w = torch.zeros_like(p).scatter(1, idx, w / w.sum(-1, keepdim=True)).to(t.dtype)  # [T, E]
        g, u = torch.einsum("th,efh->etf", t, self.experts.w13).chunk(2, dim=-1)
        y_e = torch.einsum("etf,ehf->eth", self.experts.act(g) * u, self.experts.w2)
        y = torch.einsum("te,eth->th", dense_w, y_e) + torch.sigmoid(self.shared_gate(t)) * self.shared(t)
        return y.view_as(x)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.ffn, self.routed = FFN(H, 48), RoutedFFN(H, 24, 40)

    def forward(self, x):
        x = x + self.ffn(self.norm1(x))
        return x + self.routed(self.norm2(x))


class Tiny(nn.Module):
    def __init__(self, vocab=96):
        super().__init__()
        self.embed = nn.Embedding(vocab, H)
        self.blocks = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(H, vocab, bias=False)

    def forward(self, ids, labels=None):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return SimpleNamespace(logits=logits, loss=F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def redraw(model, seed=0):
    """Weights re-drawn at unit scale, the same on every rank."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5) if p.dim() >= 2 else p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.float()


def tiny_plan():
    from overlap_layers.integrations.hf_specs import Activation, MLPSpec, MoESpec
    return {"blocks.*.ffn": MLPSpec(gate="fc_gate", up="fc_up", down="fc_out", activation=Activation.GELU_TANH,
                                    act_fn="act"),
            "blocks.*.routed": {"spec": MoESpec(router="router", gate_up="w13", down="w2", act_fn="act", top_k=K,
                                                normalize_topk=True, shared_expert="shared",
                                                shared_mlp=MLPSpec(gate="w1", up="w3", down="w2", act_fn=None),
                                                shared_gate="shared_gate"),
                                "num_tiles": 2}}


def qwen2(**over):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return redraw(Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, **over)))


def qwen2_plan(block: bool):
    from overlap_layers.integrations.hf_specs import AttentionSpec, BlockSpec, MLPSpec
    if block:
        return {"model.layers.*": BlockSpec(attention=AttentionSpec(), mlp_spec=MLPSpec())}
    return {"model.layers.*.self_attn": AttentionSpec(), "model.layers.*.mlp": {"kind": "mlp", "spec": MLPSpec()}}


def batch(seed=1, B=2, S=8, vocab=96):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ worker: equality with the dense model
def check_plan(rank, ws, which, swap_kw):
    # seed 5: every expert is routed some token in both layers (an expert routed none has a gradient
    # of rounding errors, which AdamW's normalisation turns into whole steps of either sign)
    model = redraw(Tiny(), seed=5).double() if which == "tiny" else qwen2()
    dense = copy.deepcopy(model)
    plan = tiny_plan() if which == "tiny" else qwen2_plan(swap_kw.get("block", False))
    lines, warned = _swap_logged(model, "overlap_layers.integrations.hf", group=dist.group.WORLD, plan=plan,
                                 **swap_kw)
    errs, ids = {}, batch()

    def run(m):
        out = m(ids, labels=ids)
        return out.logits, out.loss

    check_against_dense(model, dense, run, errs)
    tiles = [m.num_tiles for m in model.modules() if type(m).__name__ == "OverlapMoE"]
    return dict(errs=errs, lines=lines, warned=warned, tiles=tiles)


@pytest.mark.parametrize("which, swap_kw", [("tiny", {}), ("qwen2", {}), ("qwen2", {"block": True}),
                                            ("tiny", {"dtensor": False})])
def test_plan_swaps_unknown_family(pool2, which, swap_kw):
    if which == "qwen2":
        pytest.importorskip("transformers", reason="needs transformers")
    for rank, res in enumerate(pool2.run(check_plan, which, swap_kw)):
        bad = {k: v for k, v in res["errs"].items() if v > TOL}
        assert not bad, f"{which} {swap_kw} rank {rank}: {bad}"
        assert not res["warned"], res["warned"]
        lines = res["lines"]
        want = {"block": 2} if swap_kw.get("block") else {"mlp": 2, "moe": 2} if which == "tiny" else \
            {"mlp": 2, "attention": 2}
        for kind, n in want.items():
            assert any(f"{kind}: replaced {n}" in ln and "left 0" in ln for ln in lines), (kind, lines)
        if which == "tiny":
            assert res["tiles"] == [2, 2]


# ------------------------------------------------------------------ bad specs and plans
def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def test_bad_specs_raise_naming_the_field():
    from overlap_layers.integrations.hf_specs import Activation, AttentionSpec, BlockSpec, MLPSpec, MoESpec
    cases = {
        "MLPSpec(activation='silu')": (lambda: MLPSpec(activation="silu"), ("activation='silu'", "Activation.SILU")),
        "MLPSpec(gate=3)": (lambda: MLPSpec(gate=3), ("gate=3", "sub-module")),
        "MLPSpec(down='a..b')": (lambda: MLPSpec(down="a..b"), ("down='a..b'", "dotted path")),
        "MLPSpec(gate_up=, gate=)": (lambda: MLPSpec(gate="g", gate_up="gu"), ("gate_up='gu'", "None when gate='g'")),
        "AttentionSpec(q_norm only)": (lambda: AttentionSpec(q_norm="q_norm"), ("q_norm='q_norm'", "both or neither")),
        "AttentionSpec(num_heads=0)": (lambda: AttentionSpec(num_heads=0), ("num_heads=0", "positive int")),
        "AttentionSpec(qkv=, q=)": (lambda: AttentionSpec(qkv="qkv", q="wq"), ("qkv='qkv'", "q='wq'")),
        "AttentionSpec(norm_weight=1)": (lambda: AttentionSpec(norm_weight=1),
                                         ("norm_weight=1", "NormWeight.ONE_PLUS")),
        "MoESpec(shared_gate without shared_expert)": (lambda: MoESpec(shared_gate="g"),
                                                        ("shared_gate='g'", "without a shared_expert")),
        "MoESpec(top_k=True)": (lambda: MoESpec(top_k=True), ("top_k=True", "positive int")),
        "MoESpec(normalize_topk='yes')": (lambda: MoESpec(normalize_topk="yes"),
                                          ("normalize_topk='yes'", "True, False")),
        "MoESpec(shared_mlp=dict)": (lambda: MoESpec(shared_mlp={}), ("shared_mlp={}", "an MLPSpec")),
        "MoESpec(routing='deepseek')": (lambda: MoESpec(routing="deepseek"), ("routing='deepseek'", "Router.DEEPSEEK")),
        "AttentionSpec(latent_kv='')": (lambda: AttentionSpec(latent_kv=""), ("latent_kv=''", "or None")),
        "MoESpec(activation=)": (lambda: MoESpec(activation=Activation), ("activation=", "Activation.GELU_TANH")),
        "BlockSpec(attention=MLPSpec())": (lambda: BlockSpec(attention=MLPSpec()),
                                           ("attention=MLPSpec(", "AttentionSpec")),
        "BlockSpec(mlp_spec='mlp')": (lambda: BlockSpec(mlp_spec="mlp"), ("mlp_spec='mlp'", "MLPSpec or MoESpec")),
    }
    for name, (fn, wants) in cases.items():
        msg = _error(fn)
        assert msg is not None, f"{name} did not raise"
        assert all(w in msg for w in wants), (name, msg)


def plan_errors(rank, ws):
    from overlap_layers import swap
    from overlap_layers.integrations.hf_specs import AttentionSpec, BlockSpec, MLPSpec
    g = dist.group.WORLD
    errors = {key: _error(fn) for key, fn in {
        # a spec of another kind than the known class it matches
        "known_other_kind": lambda: swap(qwen2_known(), group=g, plan={"model.layers.*.mlp": AttentionSpec()}),
        # 'kind' disagreeing with the spec's
        "kind_vs_spec": lambda: swap(redraw(Tiny()), group=g,
                                     plan={"blocks.*.ffn": {"kind": "moe", "spec": MLPSpec()}}),
        # 'spec' that is not one
        "not_a_spec": lambda: swap(redraw(Tiny()), group=g, plan={"blocks.*.ffn": {"spec": "mlp"}}),
        # a BlockSpec without block=True
        "block_spec": lambda: swap(redraw(Tiny()), group=g, plan={"blocks.*": BlockSpec()}),
    }.items()}
    # a spec naming what the module lacks: left, warned with the name
    model = redraw(Tiny())
    _, warned = _swap_logged(model, "overlap_layers.integrations.hf", group=g,
                             plan={"blocks.*.ffn": MLPSpec(gate="w_gate", up="fc_up", down="fc_out", act_fn=None)})
    return dict(errors=errors, warned=warned, kept=type(model.blocks[0].ffn).__name__)


def qwen2_known():
    """A model of a family in the table (Qwen2-MoE's dense MLPs), or Qwen2 where it is absent."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=96, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, mlp_only_layers=[0]))


def test_bad_plans_raise_and_missing_names_warn(pool2):
    pytest.importorskip("transformers", reason="needs transformers")
    for res in pool2.run(plan_errors):
        e = res["errors"]
        assert e["known_other_kind"] and "known mlp module" in e["known_other_kind"], e
        assert e["kind_vs_spec"] and "kind 'moe'" in e["kind_vs_spec"] and "swaps 'mlp'" in e["kind_vs_spec"], e
        assert e["not_a_spec"] and "['spec'] = 'mlp'" in e["not_a_spec"] and "MLPSpec" in e["not_a_spec"], e
        assert e["block_spec"] and "'block'" in e["block_spec"], e
        assert res["kept"] == "FFN"
        assert any("FFN unswapped" in w and "'w_gate'" in w for w in res["warned"]), res["warned"]
