"""Tier 2: ``overlap_layers.swap(..., sequence_parallel=True)`` (and ``attention="ulysses"``) on tiny
Hugging Face models over 2 (and 4) gloo ranks, against the unswapped model.

Reference, as for tests/test_swap_hf.py (whose ``check_family`` each case runs): every rank feeds the
same whole batch; logits, loss (with Mixtral's router aux loss), every parameter's full gradient
when backward returns (norms and embeddings included: the norms see only the rank's positions, so
their gradients must be summed inside backward) and one AdamW step equal the unswapped model's.
Inside the decoder layers each rank holds its half of the positions; what the sequence-parallel
swap cannot serve (a length the group does not divide, a padding mask, a KV cache, Ulysses without
sequence parallelism) raises ValueError on every rank.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from pool import expect_value_error_on_every_rank
from swap_helpers import rel
from test_swap_hf import TOL, batch, build, run_case

pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")

SP = {"sequence_parallel": True}
ULYSSES = {"sequence_parallel": True, "attention": "ulysses"}


def _sp_logged(lines):
    assert any("sequence parallel over 2 ranks" in ln and "config.use_cache=False" in ln for ln in lines), lines


@pytest.mark.parametrize("case", ["llama_gqa_llama3rope", "llama_kv1_bias_eager", "qwen3", "mixtral_aux",
                                  "qwen3_moe", "phi3"])
def test_sequence_parallel_equals_dense(pool2, case):
    """OverlapAttention / OverlapMLP with ``sequence_parallel=True``, HFSequenceMoE on the shards:
    GQA and one replicated KV head, Llama 3 RoPE, eager's float causal mask, q/k norms, router
    logits recorded, a dense layer among MoE layers, Phi-3's fused projections."""
    _sp_logged(run_case(pool2, case, SP))


@pytest.mark.parametrize("case", ["llama_gqa_llama3rope", "qwen3", "qwen3_moe"])
def test_ulysses_equals_dense(pool2, case):
    """``attention="ulysses"``: every attention is a UlyssesAttention (whole weights, gradients
    summed inside backward), the MLP / MoE as with OverlapAttention."""
    lines = run_case(pool2, case, ULYSSES)
    _sp_logged(lines)
    assert any("swap: attention: replaced 2" in ln and "left 0" in ln for ln in lines), lines
    assert any("UlyssesAttention x2" in ln for ln in lines), lines


@pytest.mark.parametrize("case", ["llama_gqa_llama3rope", "mixtral_aux"])
def test_block_sequence_parallel_equals_dense(pool2, case):
    """``block=True``: OverlapTransformerBlock(sequence_parallel=True) per decoder layer (its norms
    summed inside backward by the block), the final norm's by the swap."""
    lines = run_case(pool2, case, {**SP, "block": True})
    assert any("swap: block: replaced 2" in ln and "left 0" in ln for ln in lines), lines


def test_plain_parameters_and_a_dense_module_inside(pool2):
    """``dtensor=False`` (the norms' sums through the swap's own hooks), with layer 0's attention
    left dense by the plan: it runs replicated (input gathered, output split) among the shards."""
    plan = {"model.layers.0.self_attn": None, "model.layers.*.self_attn": "attention", "model.layers.*.mlp": "mlp"}
    lines = run_case(pool2, "llama_gqa_llama3rope", {**SP, "dtensor": False, "plan": plan})
    assert any("run replicated" in ln and "LlamaAttention x1" in ln for ln in lines), lines


def _heads(rank, ws, attention, heads):
    """``heads = (query heads, KV heads)`` of a Llama with head_dim 8, swapped with ``attention``."""
    from swap_helpers import swap_logged
    model = build("llama", hidden_size=8 * heads[0], num_attention_heads=heads[0], num_key_value_heads=heads[1])
    dense = copy.deepcopy(model)
    lines, warned = swap_logged(model, "overlap_layers.integrations.hf", group=dist.group.WORLD, **SP,
                                attention=attention)
    ids = batch()
    out = [m(ids, labels=ids) for m in (model, dense)]
    for o in out:
        o.loss.backward()
    errs = [rel(out[0].logits.detach(), out[1].logits.detach()),
            rel(model.model.layers[0].input_layernorm.weight.grad, dense.model.layers[0].input_layernorm.weight.grad)]
    return type(model.model.layers[0].self_attn).__name__, lines, warned, max(errs)


@pytest.mark.parametrize("attention,heads,swapped", [("ulysses", (3, 3), False), ("overlap", (6, 3), False),
                                                     ("ulysses", (6, 3), True)])
def test_attention_the_group_cannot_split(pool2, attention, heads, swapped):
    """Heads over 2 ranks: 3 query heads split neither way (left dense, warned, run replicated among
    the shards); 3 KV heads for 6 query heads only Ulysses splits (its heads need only the group)."""
    for cls, lines, warned, err in pool2.run(_heads, attention, heads):
        assert err < TOL
        if swapped:
            assert cls == "HFSequenceAttention" and not warned, (cls, warned)
        else:
            assert cls == "LlamaAttention" and any("LlamaAttention unswapped" in w for w in warned), warned
            assert any("run replicated" in ln and "LlamaAttention x2" in ln for ln in lines), lines


def _ulysses_one_plus(rank, ws):
    """Qwen3 with a plan whose attention spec says Gemma's ``(1 + w)`` q/k norm weights."""
    from swap_helpers import swap_logged
    from overlap_layers.integrations.hf_specs import AttentionSpec, NormWeight
    model = build("qwen3")
    spec = AttentionSpec(q_norm="q_norm", k_norm="k_norm", norm_weight=NormWeight.ONE_PLUS)
    _, warned = swap_logged(model, "overlap_layers.integrations.hf", group=dist.group.WORLD, **ULYSSES,
                            plan={"model.layers.*.self_attn": spec, "model.layers.*.mlp": "mlp"})
    return type(model.model.layers[0].self_attn).__name__, warned


def test_ulysses_refuses_one_plus_norm_weights(pool2):
    """UlyssesAttention has no ``qk_norm_offset``: a spec's ``NormWeight.ONE_PLUS`` attention is left
    dense, warned, rather than swapped with the wrong norm weights."""
    for cls, warned in pool2.run(_ulysses_one_plus):
        assert cls == "Qwen3Attention", cls
        assert any("Qwen3Attention unswapped" in w and "UlyssesAttention applies w" in w for w in warned), warned


# ------------------------------------------------------------------ shards, clipping, rejected input
def _shards_and_clipping(rank, ws, attention):
    from overlap_layers import UlyssesAttention, swap
    model = build("qwen3")
    dense = copy.deepcopy(model)
    swap(model, group=dist.group.WORLD, sequence_parallel=True, attention=attention)
    seen = []
    model.model.layers[1].post_attention_layernorm.register_forward_hook(
        lambda m, a, out: seen.append(tuple(out.shape)))
    ids = batch()
    for m in (model, dense):
        m(ids, labels=ids).loss.backward()
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9).item() for m in (model, dense)]
    return dict(seen=seen, clip=abs(norms[0] - norms[1]) / norms[1],
                grads=[p.grad is not None for p in model.parameters()],
                ulysses=isinstance(model.model.layers[0].self_attn.layer, UlyssesAttention),
                sharded=rel(model(ids).logits.detach(), dense(ids).logits.detach()))


@pytest.mark.parametrize("attention", ["overlap", "ulysses"])
def test_decoder_layers_see_shards_and_clip_gives_the_dense_norm(pool2, attention):
    for res in pool2.run(_shards_and_clipping, attention):
        assert set(res["seen"]) == {(2, 4, 32)}, res["seen"]  # batch 2, 8 positions over 2 ranks
        assert res["clip"] < TOL and all(res["grads"]), res
        assert res["ulysses"] == (attention == "ulysses")
        assert res["sharded"] < TOL


def _swapped_call(rank, ws, key):
    from overlap_layers import swap
    model = build("llama")
    swap(model, group=dist.group.WORLD, sequence_parallel=True)
    ids = batch()
    if key == "odd_length":
        model(ids[:, :7])
    elif key == "padding":
        am = torch.ones(2, 8, dtype=torch.long)
        am[0, :3] = 0
        model(ids, attention_mask=am)
    elif key == "cache":
        model(ids, use_cache=True)
    elif key == "generate":
        model.generate(ids, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("key,match", [("odd_length", "sequence length 7 is not divisible by the group size 2"),
                                       ("padding", "causal attention only"), ("cache", "keeps no KV cache"),
                                       ("generate", "keeps no KV cache")])
def test_unserved_calls_raise_on_every_rank(pool2, key, match):
    expect_value_error_on_every_rank(pool2, _swapped_call, key, match=match)


def _bad_arguments(rank, ws, kw):
    from overlap_layers import swap
    model = build("llama")
    if kw.pop("swapped", False):
        swap(model, group=dist.group.WORLD)
    swap(model, group=dist.group.WORLD, **kw)


@pytest.mark.parametrize("kw,match", [({"attention": "ulysses"}, "needs sequence_parallel=True"),
                                      ({**ULYSSES, "block": True}, "block=True"),
                                      ({"sequence_parallel": "yes"}, "sequence_parallel='yes'"),
                                      ({**SP, "attention": "ring"}, "attention='ring'"),
                                      ({**SP, "swapped": True}, "swapped without sequence parallelism")])
def test_bad_arguments_raise(pool2, kw, match):
    expect_value_error_on_every_rank(pool2, _bad_arguments, kw, match=match)


def _swapped_twice(rank, ws, dtensor):
    """A second sequence-parallel swap of a swapped model changes nothing: logits and gradients."""
    from overlap_layers import swap
    model = build("llama")
    dense = copy.deepcopy(model)
    for _ in range(2):
        swap(model, group=dist.group.WORLD, sequence_parallel=True, dtensor=dtensor)
    ids = batch()
    out = [m(ids, labels=ids) for m in (model, dense)]
    for o in out:
        o.loss.backward()
    return max(rel(out[0].logits.detach(), out[1].logits.detach()),
               rel(model.model.norm.weight.grad, dense.model.norm.weight.grad),
               *(rel(model.get_parameter(n).grad, dense.get_parameter(n).grad)
                 for n in ("model.layers.0.input_layernorm.weight", "model.embed_tokens.weight")))


@pytest.mark.parametrize("dtensor", [True, False])
def test_swapping_twice_changes_nothing(pool2, dtensor):
    assert max(pool2.run(_swapped_twice, dtensor)) < TOL



# ------------------------------------------------------------------ state dicts, checkpointing, copies
def _state_checkpointing_copy(rank, ws, dtensor, attention):
    """The state dict in the unswapped layout and values, loading the dense one; HF's gradient
    checkpointing (the split runs inside the first checkpointed layer); a deep copy's logits."""
    from overlap_layers import swap
    from overlap_layers.integrations import full_state_dict
    model = build("llama")
    dense = copy.deepcopy(model)
    swap(model, group=dist.group.WORLD, sequence_parallel=True, attention=attention, dtensor=dtensor)
    want = dense.state_dict()
    full = full_state_dict(model)
    errs = {"state": max(rel(full[k], want[k]) for k in want)}
    model.load_state_dict(want)
    for m in (model, dense):
        m.gradient_checkpointing_enable()
        m.train()
    ids = batch()
    losses = [m(ids, labels=ids).loss for m in (model, dense)]
    for loss in losses:
        loss.backward()
    errs["loss"] = abs(losses[0].item() - losses[1].item()) / losses[1].item()
    ours = dict(model.named_parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        errs[name] = rel(ours[name].grad, dense.get_parameter(name).grad)
    with torch.no_grad():
        errs["copy"] = rel(copy.deepcopy(model)(ids).logits, dense(ids).logits)
    return list(model.state_dict()) == list(want), errs


@pytest.mark.parametrize("dtensor,attention", [(True, "ulysses"), (False, "overlap")])
def test_state_dict_checkpointing_and_copies(pool2, dtensor, attention):
    for same_keys, errs in pool2.run(_state_checkpointing_copy, dtensor, attention):
        assert same_keys
        assert max(errs.values()) < TOL, errs


# ------------------------------------------------------------------ four ranks
def _four_ranks(rank, ws, family, attention, dtensor):
    from test_swap_hf import check_family
    res = check_family(rank, ws, family, {}, {**SP, "attention": attention, "dtensor": dtensor})
    return res["errs"], res["checked"] == res["n_dense"], res["warned"]


@pytest.mark.parametrize("family,attention,dtensor", [("llama", "overlap", True), ("qwen3_moe", "ulysses", False)])
def test_four_ranks(pool4, family, attention, dtensor):
    """2 positions per rank; Llama's 2 KV heads replicated over 4 ranks, Qwen3-MoE's experts one
    per rank, Ulysses' 4 query heads one per rank, plain parameters."""
    for errs, all_checked, warned in pool4.run(_four_ranks, family, attention, dtensor):
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad and all_checked and not warned, (bad, all_checked, warned)
