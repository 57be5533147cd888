"""The whole-model benchmark on its CPU path: every variant trains the same model to the same losses.

What must hold: on 2 gloo ranks, float32, tiny shapes, 1 warm-up + 3 timed steps of SGD at lr 2
(steps proportional to the gradients, so each later loss checks the previous steps' gradients,
scale included: a router gradient left unsummed over the expert-parallel ranks, or an all-gather
whose backward sums instead of slicing, moves a later loss by > 1e-4), every eager variant's loss
at every step equals the unparallelized model's within 1e-4 relative, for the torchtitan-style decoder (PyTorch's sequence-parallel TP,
the overlap layers serial and planned), transformers' Llama and Qwen3-MoE (transformers' TP
plan, the torch expert-parallel MoE, ``overlap_layers.swap``); the variants run genuinely
different code (DTensor colwise/rowwise sharding, all-to-all expert parallelism, the overlap
layers' tiled programs). transformers' experts backends: Qwen3-MoE's hf variant runs once per
``--hf-experts`` name (the installed transformers' default and eager: the same losses; deepgemm,
which needs CUDA, recorded as skipped with the reason), Llama's ignores it. And the JSON has the
schema's fields (``bench/results/schema.json``, validated with jsonschema where it is installed),
with a markdown table (each variant's tokens/s over the fastest and the default hf backend's) and
a chart beside it.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "bench", "results", "schema.json")
EXPECTED = {  # model -> variants that must have run (qwen3_moe: also hf[<the installed transformers' default>])
    "titan": {"dense", "torch_tp", "overlap_serial", "overlap_auto"},
    "llama": {"hf", "torch_tp", "overlap_serial", "overlap_auto"},
    "qwen3_moe": {"hf[eager]", "torch_tp", "torch_ep", "overlap_serial", "overlap_auto"},
}
UNAVAILABLE = "deepgemm"  # needs CUDA (and the kernels package): recorded as skipped
STEPS, WARMUP = 3, 1
RECORD_KEYS = ("model", "variant", "preset", "world_size", "batch", "tokens", "pass", "ms", "spread", "tokens_per_s",
               "mfu", "peak_mem_bytes", "host_ms", "warmup_ms", "loss", "compiled", "graphs", "notes")
META_KEYS = ("schema_version", "kind", "date", "command", "device", "gpu_count", "world_size", "backend", "link",
             "torch", "cuda", "nccl", "triton", "transformers", "attn_implementation", "experts_implementation")

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("model_bench") / "model_cpu.json"
    cmd = [sys.executable, "-m", "overlap_layers.bench.model", "--model", "titan,llama,qwen3_moe", "--preset", "tiny",
           "--device", "cpu", "--nprocs", "2", "--steps", str(STEPS), "--warmup", str(WARMUP), "--dtype", "float32",
           "--variants", "eager", "--hf-experts", "default", "eager", UNAVAILABLE, "--optimizer", "sgd", "--lr", "2.0",
           "--out", str(out), "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), out, proc


def _ran(data):
    return [r for r in data["records"] if "error" not in r]


def test_losses_agree_across_variants(run):
    data, _, _ = run
    default = data["meta"]["hf_implementations"]["qwen3_moe"]["experts_implementation"]
    by_model = {}
    for r in _ran(data):
        by_model.setdefault(r["model"], {})[r["variant"]] = r
    expected = {**EXPECTED, "qwen3_moe": EXPECTED["qwen3_moe"] | {f"hf[{default}]"}}
    assert {m: set(v) for m, v in by_model.items()} == expected
    for model, recs in by_model.items():
        base = recs[{"titan": "dense", "qwen3_moe": f"hf[{default}]"}.get(model, "hf")]["loss"]["steps"]
        assert len(base) == WARMUP + STEPS
        for variant, r in recs.items():
            got = r["loss"]["steps"]
            assert r["loss"]["final"] == got[-1]
            assert len(got) == len(base), (model, variant)
            for step, (a, b) in enumerate(zip(got, base)):
                assert abs(a - b) <= 1e-4 * abs(b), f"{model}/{variant} step {step}: loss {a} vs unparallelized {b}"


def test_each_experts_backend_is_a_record(run):
    data, out, proc = run
    default = data["meta"]["hf_implementations"]["qwen3_moe"]["experts_implementation"]
    assert default == data["meta"]["experts_implementation"] and default is not None
    hf = {r["variant"]: r for r in data["records"] if r["model"] == "qwen3_moe" and r["variant"].startswith("hf")}
    assert set(hf) == {f"hf[{default}]", "hf[eager]", f"hf[{UNAVAILABLE}]"}
    for name, r in hf.items():
        assert name == f"hf[{r['experts_implementation']}]"
    skipped = hf[f"hf[{UNAVAILABLE}]"]
    assert skipped["error"].startswith("skipped: ") and skipped["ms"] is None and skipped["loss"]["steps"] == []
    assert [r["experts_implementation"] for r in data["records"] if r["model"] == "llama"] == [None] * 4
    md = open(os.path.splitext(str(out))[0] + ".md").read()
    assert f"| hf[{default}] (default) |" in md and "| vs fastest hf | vs default hf |" in md
    assert "qwen3_moe: transformers' fastest experts backend hf[" in md and "qwen3_moe: transformers'" in proc.stdout


def test_report_ratios_against_the_fastest_and_the_default_backend():
    from overlap_layers.bench.models.report import references, rows
    rec = lambda variant, tps, experts=None: dict(model="m", variant=variant, tokens_per_s=tps,  # noqa: E731
                                                 experts_implementation=experts)
    data = dict(meta=dict(hf_implementations={"m": {"experts_implementation": "grouped_mm"}}),
                records=[rec("hf[grouped_mm]", 100.0, "grouped_mm"), rec("hf[batched_mm]", 200.0, "batched_mm"),
                         rec("hf[deepgemm]", None, "deepgemm"), rec("hf_compile[eager]", 400.0, "eager"),
                         rec("overlap_auto", 300.0)])
    fastest, default = references(data, "m")
    assert fastest["variant"] == "hf[batched_mm]" and default["variant"] == "hf[grouped_mm]"
    table = {r[1]: r[8:10] for r in rows(data)}
    assert table["overlap_auto"] == ["1.50x", "3.00x"] and table["hf[grouped_mm] (default)"] == ["0.50x", "1.00x"]
    assert table["hf[deepgemm]"] == ["-", "-"]


def test_records_and_meta_have_the_schema_fields(run):
    data, out, proc = run
    meta = data["meta"]
    for k in META_KEYS:
        assert k in meta, k
    assert meta["schema_version"] == 1 and meta["kind"] == "model" and meta["device"] == "cpu"
    assert meta["backend"] == "gloo" and meta["link"] == "gloo" and meta["world_size"] == 2 and meta["gpu_count"] == 0
    assert meta["attn_implementation"] == "sdpa" and meta["experts_implementation"] in ("grouped_mm", "eager", None)
    assert meta["hf_implementations"]["llama"]["attn_implementation"] == "sdpa"
    for r in _ran(data):
        for k in RECORD_KEYS:
            assert k in r, (r["variant"], k)
        assert r["pass"] == "fwdbwd" and r["world_size"] == 2 and r["tokens"] == r["batch"] * 32
        assert r["spread"]["n"] == STEPS and r["spread"]["min_ms"] <= r["ms"] <= r["spread"]["max_ms"]
        assert len(r["warmup_ms"]) == WARMUP and r["mfu"] is None and r["peak_mem_bytes"] is None
        assert r["compiled"] is False and r["graphs"] is False and r["host_ms"] > 0 and r["tokens_per_s"] > 0
    if os.path.exists(SCHEMA):
        schema = json.load(open(SCHEMA))
        try:
            import jsonschema
        except ImportError:
            jsonschema = None
        if jsonschema is not None:
            jsonschema.validate(data, schema)
        defs = schema.get("$defs", {})
        for k in defs.get("meta", {}).get("required", []):
            assert k in meta, k
        for k, spec in defs.get("meta", {}).get("properties", {}).items():
            if "enum" in spec:
                assert meta[k] in spec["enum"], (k, meta[k])
        for r in data["records"]:
            for part in ("record", "model_record"):
                for k in defs.get(part, {}).get("required", []):
                    assert k in r, (part, k)
            for k, spec in defs.get("record", {}).get("properties", {}).items():
                if "enum" in spec and k in r:
                    assert r[k] in spec["enum"], (k, r[k])
    stem = os.path.splitext(str(out))[0]
    assert os.path.exists(stem + ".md") and "| overlap_auto |" in open(stem + ".md").read()
    assert "variant" in proc.stdout and "overlap_serial" in proc.stdout


@pytest.mark.parametrize("argv, option", [
    (["--model", "gpt5"], "--model"), (["--preset", "llama3-8b", "--model", "mixtral"], "--preset"),
    (["--variants", "fast"], "--variants"), (["--dtype", "int8"], "--dtype"), (["--steps", "0"], "--steps"),
    (["--device", "cpu", "--nprocs", "2", "--tp", "3"], "--tp"), (["--device", "cpu", "--seq", "33"], "--seq"),
    (["--device", "cpu", "--model", "qwen3_moe", "--hf-experts", "fast"], "--hf-experts"),
])
def test_bad_input_names_the_option(argv, option, capsys):
    from overlap_layers.bench.model import parse_args
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert option in capsys.readouterr().err


def test_hf_experts_names_resolve_per_moe_model():
    from overlap_layers.bench.models.hf import default_experts, experts_implementations
    from overlap_layers.bench.model import parse_args
    args = parse_args(["--device", "cpu", "--model", "llama", "qwen3_moe", "--hf-experts", "eager,default", "eager"])
    assert args.hf_experts == {"qwen3_moe": list(dict.fromkeys(["eager", default_experts("qwen3_moe")]))}
    assert parse_args(["--device", "cpu", "--model", "qwen3_moe", "--hf-experts", "all"]).hf_experts == \
        {"qwen3_moe": experts_implementations()}
    assert parse_args(["--device", "cpu", "--model", "llama", "--hf-experts", "all"]).hf_experts == {}
