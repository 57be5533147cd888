"""Tiers 1 and 2: the cost model's JSON form and the calibration cache whose use every rank agrees on."""
import json
import math
import os
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from overlap_layers.planning.calibration_cache import (NCCL_TRANSPORT_ENV, CalibrationCacheWarning, cache_key,
                                                       cache_path, default_cache_dir, load_agreed, store)
from overlap_layers.runtime.group import Agreement
from overlap_layers.sim import COMM_KINDS, HardwareModel


def make_model(**changes):
    model = HardwareModel(gemm_tflops=512.5, gemm_fixed_ms=0.01, mem_gbps=2000.0, launch_ms=0.005, interference=1.25,
                          comm={k: (0.02 + i / 100, 100.0 + i) for i, k in enumerate(COMM_KINDS)},
                          gemm_measured={(4096, 1024, 8192): 0.75, (16, 32, 64): 0.003},
                          op_measured={"act:swiglu:16x32": 0.002})
    return replace(model, **changes)


def cpu_key(world_size=1, **changes):
    key = cache_key(device=torch.device("cpu"), world_size=world_size, transport="gloo", dtype=torch.float32)
    key.update(changes)
    return key


class SoloAgreement:
    """A one-rank stand-in for Agreement that counts gathers."""

    def __init__(self):
        self.calls = 0

    def gather(self, values, dtype=torch.int64):
        self.calls += 1
        return [tuple(int(v) for v in values)]


def captured(fn, *args):
    """(fn's result, messages of the CalibrationCacheWarnings it issued)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in caught if issubclass(w.category, CalibrationCacheWarning)]


# --- HardwareModel JSON ----------------------------------------------------------------------------

def test_json_round_trip():
    model = make_model()
    d = model.to_json()
    assert json.loads(json.dumps(d, allow_nan=False)) == d  # plain JSON types only
    assert d["gemm_measured"] == {"16,32,64": 0.003, "4096,1024,8192": 0.75}
    assert d["comm"]["all_to_all"] == [0.05, 103.0]
    back = HardwareModel.from_json(json.loads(json.dumps(d)))
    assert back == model
    assert back.gemm_ms(4096, 1024, 8192) == 0.75 and back.comm_ms("all_gather", 0) == 0.02


def test_from_json_accepts_bounds_and_ints():
    d = make_model(gemm_fixed_ms=0.0, launch_ms=0.0, interference=1.0, gemm_measured={}).to_json()
    d["comm"]["all_reduce"] = [0, 7]
    d["gemm_tflops"] = 3
    model = HardwareModel.from_json(d)
    assert model.comm["all_reduce"] == (0.0, 7.0) and isinstance(model.gemm_tflops, float)
    assert model.to_json()["gemm_tflops"] == 3.0


def _set(path, value):
    def edit(d):
        *outer, last = path
        for p in outer:
            d = d[p]
        d[last] = value
    return edit


def _delete(path):
    def edit(d):
        *outer, last = path
        for p in outer:
            d = d[p]
        del d[last]
    return edit


BAD_MODELS = {
    "missing field": (_delete(["mem_gbps"]), "mem_gbps"),
    "unknown field": (_set(["extra"], 1.0), "extra"),
    "nan rate": (_set(["gemm_tflops"], math.nan), "gemm_tflops"),
    "infinite time": (_set(["launch_ms"], math.inf), "launch_ms"),
    "zero rate": (_set(["mem_gbps"], 0.0), "mem_gbps"),
    "negative fixed": (_set(["gemm_fixed_ms"], -0.1), "gemm_fixed_ms"),
    "interference < 1": (_set(["interference"], 0.9), "interference"),
    "bool": (_set(["interference"], True), "interference"),
    "string number": (_set(["gemm_tflops"], "600"), "gemm_tflops"),
    "huge int": (_set(["gemm_tflops"], 10 ** 400), "gemm_tflops"),
    "comm kind missing": (_delete(["comm", "all_to_all"]), "all_to_all"),
    "comm kind unknown": (_set(["comm", "broadcast"], [0.1, 1.0]), "broadcast"),
    "comm pair length": (_set(["comm", "all_gather"], [0.1, 1.0, 2.0]), "all_gather"),
    "comm gbps zero": (_set(["comm", "reduce_scatter"], [0.1, 0.0]), "reduce_scatter"),
    "comm alpha negative": (_set(["comm", "all_reduce"], [-1e-3, 5.0]), "all_reduce"),
    "comm not object": (_set(["comm"], [[0.1, 1.0]] * 4), "comm"),
    "gemm key short": (_set(["gemm_measured", "1,2"], 0.1), "gemm_measured"),
    "gemm key zero": (_set(["gemm_measured", "0,2,3"], 0.1), "gemm_measured"),
    "gemm key leading zero": (_set(["gemm_measured", "016,32,64"], 0.1), "gemm_measured"),
    "gemm key sign": (_set(["gemm_measured", "-1,2,3"], 0.1), "gemm_measured"),
    "gemm time zero": (_set(["gemm_measured", "16,32,64"], 0.0), "gemm_measured"),
    "op time negative": (_set(["op_measured", "act:swiglu:16x32"], -1.0), "op_measured"),
    "op not object": (_set(["op_measured"], [1.0]), "op_measured"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_from_json_rejects_malformed(case):
    edit, names = BAD_MODELS[case]
    d = make_model().to_json()
    edit(d)
    with pytest.raises(ValueError, match=names):
        HardwareModel.from_json(d)


@pytest.mark.parametrize("d", [None, [], "model", 1.0])
def test_from_json_rejects_non_objects(d):
    with pytest.raises(ValueError, match="JSON object"):
        HardwareModel.from_json(d)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-10 ** 400, max_value=10 ** 400) | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
FIELD_PATHS = st.sampled_from([["gemm_tflops"], ["interference"], ["comm"], ["comm", "all_gather"],
                               ["gemm_measured"], ["gemm_measured", "16,32,64"]])


@settings(max_examples=150, deadline=None)
@given(path=FIELD_PATHS, value=JSON_VALUES)
def test_from_json_raises_only_value_error(path, value):
    d = make_model().to_json()
    _set(path, value)(d)
    try:
        model = HardwareModel.from_json(d)
    except ValueError:
        return
    assert HardwareModel.from_json(model.to_json()) == model  # what it accepts round-trips


# --- key, path, store ------------------------------------------------------------------------------

def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == os.path.join(str(tmp_path), "overlap_layers")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == os.path.join(str(tmp_path / "home"), ".cache", "overlap_layers")


def test_cache_key_and_path(monkeypatch, tmp_path):
    for var in NCCL_TRANSPORT_ENV:
        monkeypatch.delenv(var, raising=False)
    key = cpu_key(world_size=4)
    assert key["format"] == 2 and key["device"] == "cpu" and key["torch"] == torch.__version__
    assert key["world_size"] == 4 and key["transport"] == "gloo" and key["dtype"] == "torch.float32"
    assert set(key["env"]) == set(NCCL_TRANSPORT_ENV) and not any(key["env"].values())
    assert key["nccl"] is None or isinstance(key["nccl"], str)
    path = cache_path(str(tmp_path), key)
    name = os.path.basename(path)
    assert os.path.dirname(path) == str(tmp_path) and name.startswith("calibration-") and len(name) == 33
    assert cache_path(str(tmp_path), json.loads(json.dumps(key))) == path  # canonical, not identity
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    changed = cpu_key(world_size=4)
    assert changed["env"]["NCCL_P2P_DISABLE"] == "1" and cache_path(str(tmp_path), changed) != path
    assert cache_path(str(tmp_path), cpu_key(world_size=2)) != path


@pytest.mark.parametrize("kw,name", [({"world_size": 0}, "world_size"), ({"world_size": True}, "world_size"),
                                     ({"transport": None}, "transport"), ({"dtype": "float32"}, "dtype")])
def test_cache_key_rejects_bad_arguments(kw, name):
    args = dict(device=torch.device("cpu"), world_size=2, transport="gloo", dtype=torch.float32)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        cache_key(**args)


def test_store_then_load_one_rank(tmp_path):
    key, model = cpu_key(), make_model()
    path = cache_path(str(tmp_path / "new" / "dir"), key)
    store(path, key, model)
    store(path, key, model)  # replacing an existing file
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temp files left
    with open(path) as f:
        assert json.load(f) == {"key": key, "model": model.to_json()}
    agreement = SoloAgreement()
    got, warned = captured(load_agreed, path, key, agreement)
    assert got == model and warned == [] and agreement.calls == 1


def test_store_unwritable_warns(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    path = str(blocker / "cache" / "calibration.json")
    _, warned = captured(store, path, cpu_key(), make_model())
    assert len(warned) == 1 and path in warned[0]
    assert blocker.read_text() == "not a directory"


def test_store_invalid_model_warns_and_writes_nothing(tmp_path):
    path = str(tmp_path / "c.json")
    _, warned = captured(store, path, cpu_key(), make_model(interference=math.nan))
    assert len(warned) == 1 and "interference" in warned[0] and not os.path.exists(path)


def _write(path, content):
    with open(path, "wb") as f:
        f.write(content if isinstance(content, bytes) else json.dumps(content).encode())


BAD_FILES = {
    "garbage": (b"\x00\xff\xfe garbage", "corrupt"),
    "not utf-8": (b'{"key": "\xff"}', "corrupt"),
    "truncated": (b'{"key": {"format": 1', "corrupt"),
    "deeply nested": (b"[" * 200_000, "corrupt"),
    "list": ([], "corrupt"),
    "no model": ({"key": "KEY"}, "corrupt"),
    "stale torch": ({"key": "STALE", "model": "MODEL"}, "stale"),
    "invalid model": ({"key": "KEY", "model": "BAD"}, "corrupt"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_one_rank(tmp_path, case):
    key = cpu_key()
    content, reason = BAD_FILES[case]
    if isinstance(content, dict):
        good = make_model().to_json()
        bad = dict(good, interference=0.5)
        subs = {"KEY": key, "STALE": dict(key, torch="0.0"), "MODEL": good, "BAD": bad}
        content = {k: subs[v] for k, v in content.items()}
    path = cache_path(str(tmp_path), key)
    _write(path, content)
    agreement = SoloAgreement()
    got, warned = captured(load_agreed, path, key, agreement)
    assert got is None and agreement.calls == 1
    assert len(warned) == 1 and "rank 0" in warned[0] and reason in warned[0], warned


def test_unreadable_path_one_rank(tmp_path):
    key = cpu_key()
    path = cache_path(str(tmp_path), key)
    os.mkdir(path)  # a directory where the file should be
    got, warned = captured(load_agreed, path, key, SoloAgreement())
    assert got is None and len(warned) == 1 and "unreadable" in warned[0]


# --- two gloo ranks --------------------------------------------------------------------------------

def two_rank_case(rank, ws, base, case):
    key = cpu_key(world_size=ws)
    path = cache_path(os.path.join(base, f"rank{rank}"), key)
    if case in ("same", "corrupt on 0", "stale on 1") or (case == "only rank 0" and rank == 0):
        store(path, key, make_model())
    if case == "different":
        store(path, key, make_model().with_measured(gemms={(8, 8, 8): 0.1 * (rank + 1)}))
    if case == "corrupt on 0" and rank == 0:
        _write(path, b"\x13\x37 garbage \xff")
    if case == "stale on 1" and rank == 1:
        _write(path, {"key": dict(key, torch="1.0.0"), "model": make_model().to_json()})
    return captured(load_agreed, path, key, Agreement(dist.group.WORLD))


@pytest.mark.parametrize("case,usable,warns", [
    ("same", True, None), ("missing", False, None), ("only rank 0", False, None),
    ("corrupt on 0", False, ["rank 0: corrupt"]), ("stale on 1", False, ["rank 1: stale"]),
    ("different", False, ["different calibrations", "ranks 0 vs ranks 1"])])
def test_two_ranks_agree(pool2, tmp_path, case, usable, warns):
    results = pool2.run(two_rank_case, str(tmp_path), case)
    models = [got for got, _ in results]
    assert models == ([make_model()] * 2 if usable else [None, None])
    for rank, (_, warned) in enumerate(results):
        if warns is None:
            assert warned == [], (rank, warned)
        else:
            assert len(warned) == 1 and all(w in warned[0] for w in warns), (rank, warned)
    if warns is not None:
        # The agreed part of the message is identical on both ranks; each adds its own detail.
        head = [warned[0].split(" This rank")[0] for _, warned in results]
        assert head[0] == head[1]
