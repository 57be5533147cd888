"""Tier 2: checkpoints and FSDP2 of swapped Hugging Face models (every parameter a DTensor on the
tensor-parallel mesh: swap's default), on gloo ranks, against the dense model in one process.

DCP (``torch.distributed.checkpoint`` with ``get_state_dict`` / ``set_state_dict``: the model and
AdamW's state) saved by a 2-rank run after 2 steps of the ordinary loop, then:
  reloaded into the same layout (a model built from other weights), into a model built on the
  meta device, and into tensor parallelism 4 (4 ranks: the KV heads go from Shard(0) to
  replicated)                                   the saved model's logits, and after one more step
                                                the weights the saving run reached after it
  the saved model's dense tensors               the dense model's after the same 2 steps
FSDP2 over dp of a (dp=2, tp=2) mesh (``swap(mesh=, axis="tp")``, ``fully_shard`` per decoder
layer and the root), each dp rank on half of the batch: clip_grad_norm_'s norm every step, the
gradients after clipping and the weights after 3 steps equal the dense model's on the whole batch.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from swap_helpers import full, rel
from test_training_loops import STEPS, TOL, _adamw, _is_dtensor, _norm_value, hf_errors

pytest.importorskip("transformers", reason="needs transformers (pip install \"overlap_layers[hf]\")")


def _step(model, opt, step, rows=None):
    """One step of the ordinary loop on batch ``step`` (``rows``: this rank's rows of it); the
    clipped norm."""
    from test_swap_hf import batch
    ids = batch(seed=10 + step, B=4)
    if rows is not None:
        ids = ids[rows]
    model(ids, labels=ids).loss.backward()
    norm = _norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    opt.zero_grad()
    return norm


def _logits(model):
    from test_swap_hf import batch
    with torch.no_grad():
        ids = batch(seed=99, B=4)
        return model(ids).logits


def _weights(model) -> dict:
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def dcp_save(rank, ws, path):
    """2 steps, save, then the logits and a third step (what a reload must reproduce), and the
    dense twin's weights after the 2 steps."""
    import torch.distributed.checkpoint as dcp
    from overlap_layers import swap
    from test_swap_hf import build
    model = build("llama")
    dense = copy.deepcopy(model)
    swap(model, group=dist.group.WORLD)
    opt, dense_opt = _adamw(model.parameters(), None), _adamw(dense.parameters(), None)
    for step in range(2):
        _step(model, opt, step)
        _step(dense, dense_opt, step)
    dcp.save(_state(model, opt), checkpoint_id=path)
    errs = hf_errors(model, dense, "weight")
    logits = _logits(model)
    _step(model, opt, 2)
    return dict(errs=errs, logits=logits, after=_weights(model))


def dcp_load(rank, ws, path, meta):
    """A new swapped model (other weights, or on the meta device), loaded from ``path``: its
    logits, and its weights after the third step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from overlap_layers import swap
    from test_swap_hf import build
    if meta:
        config = build("llama").config
        with torch.device("meta"):
            model = type(build("llama"))(config)
        swap(model, group=dist.group.WORLD)
        model.to_empty(device="cpu")
        rotary = model.model.rotary_emb
        model.model.rotary_emb = type(rotary)(config=config)  # its buffers are not in a checkpoint
    else:
        model = build("llama", seed=7)
        swap(model, group=dist.group.WORLD)
    opt = _adamw(model.parameters(), None)
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    logits = _logits(model)
    _step(model, opt, 2)
    return dict(logits=logits, after=_weights(model), placements=placements,
                plain=[n for n, p in model.named_parameters() if not _is_dtensor(p)])


def _check_reload(saved, loaded, tol):
    for res in saved:
        bad = {k: v for k, v in res["errs"].items() if not v < TOL}
        assert not bad, bad
    want = saved[0]
    for res in loaded:
        assert res["plain"] == []
        assert rel(res["logits"], want["logits"]) < tol
        bad = {n: rel(t, want["after"][n]) for n, t in res["after"].items() if not rel(t, want["after"][n]) < tol}
        assert not bad, bad


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "step2")
    return path, pool2.run(dcp_save, path, timeout=300)


@pytest.mark.parametrize("meta", [False, True])
def test_dcp_reload_same_layout(pool2, saved, meta):
    path, results = saved
    loaded = pool2.run(dcp_load, path, meta, timeout=300)
    _check_reload(results, loaded, 1e-6)  # the same layout: the same arithmetic


def test_dcp_reload_at_tp4(pool4, saved):
    path, results = saved
    loaded = pool4.run(dcp_load, path, False, timeout=300)
    _check_reload(results, loaded, TOL)
    assert "Replicate" in loaded[0]["placements"]["model.layers.0.self_attn.layer.wk"]  # 2 KV heads, 4 ranks


# ------------------------------------------------------------------ FSDP2 over dp, TP over tp
def fsdp_loop(rank, ws, family, foreach):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from overlap_layers import OverlapConfig, swap
    from test_swap_hf import build
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    dp_i = mesh.get_coordinate()[0]
    model = build(family)
    dense = copy.deepcopy(model)
    swap(model, mesh=mesh, axis="tp", config=OverlapConfig(num_tiles=2))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    meshes = {tuple(p.device_mesh.mesh_dim_names) for p in model.parameters()}
    opt, dense_opt = _adamw(model.parameters(), foreach), _adamw(dense.parameters(), foreach)
    rows = slice(2 * dp_i, 2 * dp_i + 2)
    errs = {}
    from test_swap_hf import batch
    for step in range(STEPS):
        ids = batch(seed=10 + step, B=4)
        norms = []
        for m, r in ((dense, slice(None)), (model, rows)):
            m(ids[r], labels=ids[r]).loss.backward()
            norms.append(_norm_value(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
        errs[f"norm {step}"] = abs(norms[1] - norms[0]) / norms[0]
        if step == 0:
            errs.update(hf_errors(model, dense, "grad"))
        for m, o in ((dense, dense_opt), (model, opt)):
            o.step()
            o.zero_grad()
    errs.update(hf_errors(model, dense, "weight"))
    return dict(errs=errs, meshes=meshes)


@pytest.mark.parametrize("family,foreach", [("llama", None), ("mixtral", True)])
def test_fsdp2_dp_by_tp_standard_loop_equals_dense(pool4, family, foreach):
    for rank, res in enumerate(pool4.run(fsdp_loop, family, foreach, timeout=400)):
        assert res["meshes"] == {("dp", "tp")}, res["meshes"]  # every parameter on the 2-D mesh
        bad = {k: v for k, v in res["errs"].items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


# ------------------------------------------------------------------ the example
def test_example_train_fsdp_dcp():
    """``examples/train_fsdp_dcp.py`` on its CPU paths (it starts its gloo ranks itself): tp=2 on 2
    ranks, and FSDP2 dp=2 x tp=2 on 4; each exits 0, prints its steps, checkpoints and resumes with
    the same losses, and reloads its save_pretrained checkpoint shard by shard with the same loss."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    script = os.path.join(root, "examples", "train_fsdp_dcp.py")
    runs = {"tp2": ["--steps", "4"], "fsdp_dp2_tp2": ["--steps", "4", "--nprocs", "4", "--fsdp"]}
    procs = {name: subprocess.Popen([sys.executable, script, *a], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, a in runs.items()}
    for name, p in procs.items():
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        assert p.returncode == 0, f"{name}:\n{out[-3000:]}{err[-3000:]}"
        assert len([ln for ln in out.splitlines() if ln.startswith("step")]) == 4, out
        assert len([ln for ln in out.splitlines() if ln.startswith("resumed step")]) == 2, out
        assert "saved" in out and "resumed losses match" in out, out
        assert "pretrained checkpoint reloaded shard by shard" in out, out
        assert ("dp=2 x tp=2" if name.startswith("fsdp") else "tp=2") in out, out
