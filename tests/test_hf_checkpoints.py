"""Tier 2: checkpoints of swapped Hugging Face models in the unswapped model's layout, on 2 gloo
ranks. The reference is the unswapped model itself (built from the same seed in each rank's
process, never swapped): what a swapped model saves must be its state dict, exactly, and what a
swapped model loads must give its values (state dict exactly, logits to float rounding).

  save_pretrained -> from_pretrained   the unswapped class loads the unswapped model's tensors and
                                       logits exactly (Llama float64, and float32 with plain
                                       parameters; Qwen3-MoE float32, per module and per decoder layer;
                                       Phi-3's fused qkv_proj / gate_up_proj, DTensor and plain)
  load_state_dict both ways            the unswapped state dict into a swapped model (its values and
                                       logits), and the swapped model's whole tensors back into an
                                       unswapped one (torch's full state dict and full_state_dict)
  DCP both ways                        dcp.save of a swapped model loads into an unswapped one, and
                                       an unswapped model's into a swapped one, in place
  another rank's / world size's        ValueError on every rank (DTensor and plain parameters)
  load_pretrained_shards               a meta-built swapped model gets the checkpoint's values while
                                       each rank reads exactly its share: the sharded tensors' bytes
                                       / ws plus every replicated tensor whole (counted by wrapping
                                       safetensors' reads, not by the function's own count), from
                                       the layouts save_pretrained writes (Qwen3-MoE's and Mixtral's
                                       experts one by one, Mixtral's block_sparse_moe); Phi-3's fused
                                       qkv_proj / gate_up_proj are read whole by every rank
"""
import copy
import os
import re
import weakref

import pytest
import torch
import torch.distributed as dist

from swap_helpers import full, rel

pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")

TOL = 5e-5
# The unswapped tensors a swapped model shards over the group (tensor or expert parallel, with as
# many KV heads as ranks); every other tensor is whole on every rank.
SHARDED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$|\.experts\.")


def _pair(family, seed=0, dtype=torch.float32, block=False, dtensor=True, **kw):
    """A model swapped over the world and its unswapped twin (the reference), from one seed."""
    from overlap_layers import swap
    from test_swap_hf import build
    dense = build(family, seed=seed, **kw).to(dtype)
    model = copy.deepcopy(dense)
    swap(model, group=dist.group.WORLD, block=block, dtensor=dtensor)
    return model, dense


def _logits(model):
    from test_swap_hf import batch
    with torch.no_grad():
        return model(batch()).logits


def _differences(state: dict, want: dict) -> list:
    """The keys whose whole tensors differ from ``want``'s (or that either lacks), exactly."""
    keys = sorted(set(state) | set(want))
    return [k for k in keys if k not in state or k not in want or not torch.equal(full(state[k]).cpu(), want[k])]


# ------------------------------------------------------------------ save_pretrained -> from_pretrained
def save_and_reload(rank, ws, family, dtype, block, dtensor, path, kw):
    model, dense = _pair(family, dtype=dtype, block=block, dtensor=dtensor, **kw)
    order = list(model.state_dict()) == list(dense.state_dict())
    diffs = _differences(model.state_dict(), dense.state_dict()) if dtensor else None
    model.save_pretrained(path)
    dist.barrier()
    loaded = type(dense).from_pretrained(path, dtype=dtype)
    return dict(order=order, diffs=diffs, loaded=_differences(loaded.state_dict(), dense.state_dict()),
                logits=torch.equal(_logits(loaded), _logits(dense)), swapped=rel(_logits(model), _logits(dense)))


@pytest.mark.parametrize("family,dtype,block,dtensor,kw", [
    ("llama", torch.float64, False, True, {}),
    ("llama", torch.float32, False, False, dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    ("qwen3_moe", torch.float32, False, True, dict(mlp_only_layers=[0])),
    ("qwen3_moe", torch.float32, True, True, dict(mlp_only_layers=[0])),
    ("phi3", torch.float64, False, True, {}),
    ("phi3", torch.float32, False, False, dict(num_key_value_heads=1)),
    ("phi3", torch.float32, True, True, {}),
], ids=["llama_f64", "llama_plain_kv1_bias", "qwen3_moe", "qwen3_moe_block", "phi3_f64", "phi3_plain_kv1",
        "phi3_block"])
def test_save_pretrained_from_pretrained_exact(pool2, tmp_path, family, dtype, block, dtensor, kw):
    for res in pool2.run(save_and_reload, family, dtype, block, dtensor, str(tmp_path), kw):
        assert res["order"], "state_dict keys differ from the unswapped model's (or their order)"
        assert res["diffs"] in (None, []), res["diffs"]
        assert res["loaded"] == [] and res["logits"], res["loaded"]
        assert res["swapped"] < TOL


# ------------------------------------------------------------------ load_state_dict both ways
def load_both_ways(rank, ws, family, block, dtensor, kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from overlap_layers.integrations import full_state_dict
    from test_swap_hf import build
    _, dense = _pair(family, **kw)
    model, _ = _pair(family, seed=7, block=block, dtensor=dtensor, **kw)
    model.load_state_dict(dense.state_dict())
    out = dict(into=_differences(full_state_dict(model), dense.state_dict()),
               logits=rel(_logits(model), _logits(dense)))
    whole = [full_state_dict(model)]
    if dtensor:  # torch's own full state dict walks the keys as attribute paths
        whole.append(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    out["back"] = []
    for state in whole:
        back = build(family, seed=8, **kw)
        back.load_state_dict(state)
        out["back"].append(_differences(back.state_dict(), dense.state_dict()))
    twin, _ = _pair(family, seed=9, block=block, dtensor=dtensor, **kw)  # swapped -> swapped, this rank's parts
    twin.load_state_dict(model.state_dict())
    out["twin"] = _differences(full_state_dict(twin), dense.state_dict())
    return out


@pytest.mark.parametrize("family,block,dtensor,kw", [
    ("llama", False, True, dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    ("llama", False, False, dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    ("mixtral", True, True, {}),
    ("phi3", False, True, dict(num_key_value_heads=1)),
    ("phi3", False, False, {}),
], ids=["llama_kv1_bias", "llama_kv1_bias_plain", "mixtral_block", "phi3_kv1", "phi3_plain"])
def test_unswapped_state_dict_loads_into_swapped_and_back(pool2, family, block, dtensor, kw):
    for res in pool2.run(load_both_ways, family, block, dtensor, kw):
        assert res["into"] == [] and res["logits"] < TOL, res
        assert all(d == [] for d in res["back"]), res["back"]
        assert res["twin"] == [], res["twin"]


# ------------------------------------------------------------------ DCP both ways
def dcp_both_ways(rank, ws, family, path, kw):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from test_swap_hf import build
    model, dense = _pair(family, **kw)
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(path, "swapped"))
    unswapped = build(family, seed=7, **kw)
    state = unswapped.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(path, "swapped"))
    unswapped.load_state_dict(state)
    out = dict(to_unswapped=_differences(unswapped.state_dict(), dense.state_dict()))
    dcp.save(dense.state_dict(), checkpoint_id=os.path.join(path, "unswapped"))
    swapped, _ = _pair(family, seed=8, **kw)
    state = swapped.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(path, "unswapped"))  # the entries are views: in place
    out["in_place"] = _differences(swapped.state_dict(), dense.state_dict())
    set_model_state_dict(swapped, state)
    out["to_swapped"] = _differences(swapped.state_dict(), dense.state_dict())
    out["logits"] = rel(_logits(swapped), _logits(dense))
    return out


@pytest.mark.parametrize("family,kw", [("llama", {}), ("qwen3_moe", dict(mlp_only_layers=[0])), ("phi3", {})])
def test_dcp_between_swapped_and_unswapped(pool2, tmp_path, family, kw):
    """Phi-3's fused qkv_proj / gate_up_proj are Replicate() DTensors gathered from the layers'
    parameters, not views of them: dcp.load fills them in the state dict, and only loading that
    state dict (set_model_state_dict) puts them in the model."""
    fused = re.compile(r"\.(qkv_proj|gate_up_proj)\.weight$")
    for res in pool2.run(dcp_both_ways, family, str(tmp_path), kw):
        assert res["to_unswapped"] == [] and res["to_swapped"] == [], res
        assert [k for k in res["in_place"] if not fused.search(k)] == [], res
        if family == "phi3":
            assert res["in_place"], "the fused entries are views now: tighten this test"
        assert res["logits"] < TOL


# ------------------------------------------------------------------ another rank's, another world size's
def wrong_parts(rank, ws, dtensor, path):
    from overlap_layers import swap
    from test_swap_hf import build
    model, dense = _pair("llama", dtensor=dtensor)
    torch.save(model.state_dict(), os.path.join(path, f"{dtensor}{rank}.pt"))
    dist.barrier()
    errors = {}

    def attempt(name, state, **kw):
        try:
            model.load_state_dict(state, **kw)
            errors[name] = None
        except (ValueError, RuntimeError) as e:
            errors[name] = (type(e).__name__, str(e))

    attempt("own", torch.load(os.path.join(path, f"{dtensor}{rank}.pt")))
    attempt("other_rank", torch.load(os.path.join(path, f"{dtensor}{1 - rank}.pt")))
    singles = [dist.new_group([r]) for r in range(ws)]  # every rank makes every group
    single = build("llama")
    swap(single, group=singles[rank], dtensor=dtensor)  # a world size of one: whole tensors
    attempt("world_size_1", single.state_dict())
    state = model.state_dict()
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:8]
    attempt("shape", state)
    state = model.state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    missing = model.load_state_dict(state, strict=False).missing_keys
    attempt("missing", state)
    errors["values"] = _differences(model.state_dict(), dense.state_dict()) if dtensor else None
    return errors, missing


@pytest.mark.parametrize("dtensor", [True, False], ids=["dtensor", "plain"])
def test_another_ranks_or_world_sizes_parts_raise(pool2, tmp_path, dtensor):
    for rank, (errors, missing) in enumerate(pool2.run(wrong_parts, dtensor, str(tmp_path))):
        assert errors["own"] is None, errors["own"]
        kind, msg = errors["other_rank"]
        assert kind == "ValueError" and f"rank {1 - rank}" in msg and f"rank {rank}" in msg, msg
        if dtensor:
            kind, msg = errors["world_size_1"]
            assert kind == "ValueError" and "another world size" in msg, msg
        else:  # a world size of one holds the whole tensors: they load
            assert errors["world_size_1"] is None, errors["world_size_1"]
        kind, msg = errors["shape"]
        assert kind == "ValueError" and "model.layers.0.mlp.up_proj.weight" in msg and "(8, 32)" in msg, msg
        assert missing == ["model.layers.1.mlp.up_proj.weight"], missing
        kind, msg = errors["missing"]
        assert kind == "RuntimeError" and "model.layers.1.mlp.up_proj.weight" in msg and "w_in" not in msg, msg
        assert errors["values"] in (None, []), errors["values"]


# ------------------------------------------------------------------ shard-only loading
class _CountedReads:
    """safetensors' ``safe_open`` with every tensor it returns counted: the bytes in all, and the
    bytes alive at once (each counted until it is freed)."""

    def __init__(self, real):
        self.real, self.total, self.alive, self.peak, self.tensors = real, 0, 0, 0, 0

    def _count(self, t):
        self.total += t.nbytes
        self.alive += t.nbytes
        self.peak = max(self.peak, self.alive)
        self.tensors += 1
        weakref.finalize(t, self._freed, t.nbytes)
        return t

    def _freed(self, n):
        self.alive -= n

    def open(self, *args, **kwargs):
        counted, handle = self, self.real(*args, **kwargs)

        class Slice:
            def __init__(self, s):
                self.s = s

            def get_shape(self):
                return self.s.get_shape()

            def __getitem__(self, box):
                return counted._count(self.s[box])

        class Handle:
            def keys(self):
                return handle.keys()

            def get_slice(self, name):
                return Slice(handle.get_slice(name))

            def get_tensor(self, name):
                return counted._count(handle.get_tensor(name))

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False
        return Handle()


def load_shards(rank, ws, family, dtensor, path, kw):
    import safetensors
    from overlap_layers import swap
    from overlap_layers.integrations import full_state_dict, load_pretrained_shards
    from test_swap_hf import build
    dense = build(family, **kw)
    if rank == 0:
        dense.save_pretrained(path, max_shard_size="20KB")
    dist.barrier()
    with torch.device("meta"):
        model = type(dense)(dense.config)
    swap(model, group=dist.group.WORLD, dtensor=dtensor)
    model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=dense.config)  # not in a checkpoint
    counted = _CountedReads(safetensors.safe_open)
    safetensors.safe_open = counted.open
    try:
        info = load_pretrained_shards(model, path)
    finally:
        safetensors.safe_open = counted.real
    sizes = {k: t.nbytes for k, t in dense.state_dict().items()}
    replicated = sum(n for k, n in sizes.items() if not SHARDED.search(k))
    parts = {k: n // ws if SHARDED.search(k) else n for k, n in sizes.items()}
    diffs = _differences(full_state_dict(model), dense.state_dict())
    return dict(info=info, read=counted.total, peak=counted.peak, reads=counted.tensors, total=sum(sizes.values()),
                replicated=replicated, expected=sum(parts.values()), largest=max(parts.values()),
                files=len({f for f in os.listdir(path) if f.endswith(".safetensors")}), diffs=diffs,
                logits=rel(_logits(model), _logits(dense)))


@pytest.mark.parametrize("family,dtensor,kw", [("llama", True, {}), ("llama", False, {}),
                                               ("qwen3_moe", True, dict(mlp_only_layers=[0])), ("mixtral", True, {}),
                                               ("phi3", True, {}), ("phi3", False, {})],
                         ids=["llama", "llama_plain", "qwen3_moe", "mixtral", "phi3", "phi3_plain"])
def test_load_pretrained_shards_reads_only_each_ranks_share(pool2, tmp_path, family, dtensor, kw):
    """Per rank the bytes read are exactly R + (T - R) / ws (T the checkpoint's tensor bytes, R those
    of the tensors every rank holds whole: embeddings, norms, LM head, routers, qk-norms), and at
    most one tensor's part is held at a time."""
    for rank, res in enumerate(pool2.run(load_shards, family, dtensor, str(tmp_path), kw)):
        print(f"\n{family} {'DTensor' if dtensor else 'plain'} rank {rank}: read {res['read']} B in {res['reads']} "
              f"slices of a {res['total']} B checkpoint in {res['files']} files (replicated {res['replicated']} B; "
              f"R + (T - R)/ws = {res['expected']} B); at most {res['peak']} B held at once (largest part "
              f"{res['largest']} B)")
        assert res["files"] > 1  # an index and its shards
        assert res["diffs"] == [] and res["logits"] < TOL, res["diffs"]
        assert res["info"]["missing"] == [] and res["info"]["unused"] == [], res["info"]
        assert res["read"] == res["expected"] == res["info"]["bytes_read"], res
        assert res["read"] < res["replicated"] + (res["total"] - res["replicated"]) / 2 + 1
        assert res["peak"] <= res["largest"], res
