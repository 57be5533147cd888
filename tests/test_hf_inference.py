"""Inference with swapped Hugging Face models at 2 ranks (gloo): greedy ``generate()`` with a KV
cache gives the unswapped model's tokens for every supported family (Mistral with a sliding window
shorter than the prompt), and padded and packed batches give the unswapped model's logits on the
real tokens. The reference is the unswapped model on one process, float32."""
import copy

import pytest
import torch
import torch.distributed as dist

from test_swap_hf import batch, build

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")

FAMILIES = ["llama", "qwen3", "mistral", "mixtral", "qwen3_moe", "phi3"]


def _pair(family, **over):
    """The dense model and a swapped copy of it (same weights, every rank alike)."""
    from overlap_layers import swap
    dense = build(family, **over).eval()
    swapped = swap(copy.deepcopy(dense), group=dist.group.WORLD).eval()
    return dense, swapped


def _generate_run(rank, ws, family):
    over = dict(sliding_window=4) if family == "mistral" else {}
    dense, swapped = _pair(family, **over)
    prompt = batch(seed=5, B=2, S=8)
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        want = dense.generate(prompt, **kw)
        got = swapped.generate(prompt, **kw)
        # the cache really served: a second generate from a static cache equals it too
        static = swapped.generate(prompt, cache_implementation="static", **kw)
    return want.tolist(), got.tolist(), static.tolist(), swapped.config.use_cache


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_a_kv_cache_equals_the_unswapped_model(pool2, family):
    for want, got, static, use_cache in pool2.run(_generate_run, family):
        assert got == want, (got, want)
        assert static == want, (static, want)
        assert use_cache  # swap leaves generation's cache on


def _masks_run(rank, ws, family):
    """Left- and right-padded batches, and two sequences packed into one row (position ids that
    restart, a block-diagonal mask): the swapped model's logits on the real tokens against the
    unswapped model's (for the packed row: each sequence's on its own), and the input gradient of a
    padded batch."""
    over = dict(sliding_window=4) if family == "mistral" else {}
    dense, swapped = _pair(family, **over)
    ids = batch(seed=7, B=2, S=8)
    out = {}
    for side in ("left", "right"):
        am = torch.ones(2, 8, dtype=torch.long)
        if side == "left":
            am[0, :3] = 0
        else:
            am[0, 5:] = 0
        real = am.bool()
        with torch.no_grad():
            want = dense(ids, attention_mask=am).logits[real]
            got = swapped(ids, attention_mask=am).logits[real]
        out[side] = float((got - want).abs().max() / want.abs().max())
    # packed: sequences of 5 and 3 tokens in one row, positions restarting, kept apart by a
    # block-diagonal causal mask (HF takes a 4-D mask as given; position ids alone do not separate
    # sequences under SDPA), boolean and additive; against the two sequences run one by one
    packed = batch(seed=9, B=1, S=8)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    seg = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    keep = ((seg[:, None] == seg[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril())[None, None]
    with torch.no_grad():
        apart = torch.cat([dense(packed[:, :5]).logits, dense(packed[:, 5:]).logits], dim=1)
        for form, mask in (("bool", keep), ("additive", (~keep).float() * torch.finfo(torch.float32).min)):
            want = dense(packed, position_ids=pos, attention_mask=mask).logits
            got = swapped(packed, position_ids=pos, attention_mask=mask).logits
            out[f"packed_{form}"] = float((got - want).abs().max() / want.abs().max())
            if family != "mistral":  # the mask as given has no sliding window: apart, the window applies
                out[f"packed_{form}_apart"] = float((got - apart).abs().max() / apart.abs().max())
    # training on a padded batch: the embeddings' gradient on the real tokens
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :2] = 0
    grads = []
    for model in (dense, swapped):
        model.train()
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=emb, attention_mask=am).logits
        (logits[am.bool()] ** 2).sum().backward()
        grads.append(emb.grad[am.bool()])
    out["padded_grad"] = float((grads[1] - grads[0]).abs().max() / grads[0].abs().max())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_and_packed_batches_equal_the_unswapped_model_on_real_tokens(pool2, family):
    for out in pool2.run(_masks_run, family):
        assert all(v < 1e-4 for v in out.values()), out


def _decode_bookkeeping_run(rank, ws):
    """What two greedy generates of a swapped Llama from the same prompt, 3 and 10 new tokens (of an
    unpadded batch, then of a left-padded one), ask of the layers' planning machinery: agreements
    made (``LayerPlanner.agree``: the row, the input checks, and where the row is new the gather),
    agreement gathers, calls through the planner (``LayerPlanner.call``) and plans made. The 7 extra decoding steps must add none of them
    ([Note: direct calls] in planning/planner.py). Also each generate's tokens and the unswapped
    model's."""
    from overlap_layers.planning.plan_maker import PlanMaker
    from overlap_layers.planning.planner import LayerPlanner
    from overlap_layers.runtime.group import Agreement
    dense, swapped = _pair("llama")
    prompt = batch(seed=5, B=2, S=8)
    counted = {"agreements": (LayerPlanner, "agree"), "planner calls": (LayerPlanner, "call"),
               "gathers": (Agreement, "gather"), "plans": (PlanMaker, "make_plan")}
    counts = dict.fromkeys(counted, 0)
    originals = {k: getattr(cls, name) for k, (cls, name) in counted.items()}

    def counting(key):
        def method(self, *a, **k):
            counts[key] += 1
            return originals[key](self, *a, **k)
        return method
    for key, (cls, name) in counted.items():
        setattr(cls, name, counting(key))
    padded = torch.ones_like(prompt)
    padded[0, :3] = 0  # left padding: a 4-D mask over the growing cache at every step
    try:
        out = []
        with torch.no_grad():
            for mask in (None, padded):
                kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
                swapped.generate(prompt, max_new_tokens=2, **kw)  # every signature seen once
                for n in (3, 10):
                    before = dict(counts)
                    got = swapped.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
                    out.append(({k: counts[k] - before[k] for k in counts}, got.tolist(),
                                dense.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw).tolist()))
    finally:
        for key, (cls, name) in counted.items():
            setattr(cls, name, originals[key])
    return out


def test_decoding_steps_do_no_planning_or_agreement(pool2):
    for runs in pool2.run(_decode_bookkeeping_run):
        for (short, got3, want3), (long, got10, want10) in (runs[:2], runs[2:]):  # unpadded, padded
            assert long == short, (short, long)
            assert long["plans"] == 0 and long["planner calls"] == 0, long
            assert got3 == want3 and got10 == want10, (got3, want3, got10, want10)
