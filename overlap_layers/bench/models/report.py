"""The whole-model benchmark's outputs: the table on stdout, the JSON file (``meta`` + ``records``,
``bench/results/schema.json``, kind "model"), a markdown copy of the table beside it and, where
matplotlib imports, a bar chart of each variant's step time.

Columns ``vs fastest hf`` and ``vs default hf``: each record's tokens/s over that of the model's
fastest unparallelized, uncompiled run (``dense`` / ``hf``, or for an MoE model the fastest of its
``hf[<experts implementation>]`` records: transformers' fastest experts backend) and over that of
the one with the installed transformers' default experts backend (``meta.hf_implementations``; its
variant is marked ``(default)``). Above the table, a line per MoE model names both backends.

Default file name: ``model_<models>_tp<N>[_dp<M>]_<link>_<device>x<count>_<date>.json`` (models
joined by ``-``; on CPU ``cpu`` times the ranks), under ``bench/results/`` on GPUs and under the
temp dir on CPU; an existing file is never overwritten (``_2``, ``_3``, ... are appended).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import tempfile
from typing import List, Optional, Tuple

COLUMNS = ("model", "variant", "compiled", "graphs", "ms", "min", "max", "tokens/s", "vs fastest hf", "vs default hf",
           "MFU", "peak mem", "host ms", "warm-up ms", "loss", "notes")


def _device_slug(name: str) -> str:
    words = [w for w in re.split(r"\s+", name.strip()) if w.lower() not in ("nvidia", "amd", "tesla", "")]
    first = (words[0] if words else "gpu").split("-")[0].lower()
    return re.sub(r"[^a-z0-9]", "", first) or "gpu"


def default_path(meta: dict, models: List[str]) -> str:
    """The default JSON path (module docstring)."""
    count = meta["gpu_count"] or meta["world_size"]
    dp = f"_dp{meta['dp']}" if meta.get("dp", 1) > 1 else ""
    name = (f"model_{'-'.join(models)}_tp{meta['tp']}{dp}_{meta['link']}_{_device_slug(meta['device'])}x{count}_"
            f"{datetime.date.today():%Y-%m-%d}")
    folder = os.path.join("bench", "results") if meta["device"] != "cpu" else \
        os.path.join(tempfile.gettempdir(), "overlap_layers_bench")
    path, n = os.path.join(folder, name + ".json"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(folder, f"{name}_{n}.json")
    return path


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _mem(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / 2 ** 30:.2f} GiB"


def _default_experts(data: dict, model: str) -> Optional[str]:
    return ((data["meta"].get("hf_implementations") or {}).get(model) or {}).get("experts_implementation")


def references(data: dict, model: str) -> Tuple[Optional[dict], Optional[dict]]:
    """``(fastest, default)``: the model's unparallelized, uncompiled records that ran (module
    docstring) with the most tokens/s, and the one with the default experts backend (the only one
    of a dense model); None where none ran."""
    ran = [r for r in data["records"] if r["model"] == model and r.get("tokens_per_s")
           and re.fullmatch(r"(dense|hf)(\[.+\])?", r["variant"])]
    if not ran:
        return None, None
    default = _default_experts(data, model)
    fastest = max(ran, key=lambda r: r["tokens_per_s"])
    return fastest, next((r for r in ran if r.get("experts_implementation") in (None, default)), None)


def _speed(r: Optional[dict]) -> str:
    return "did not run" if r is None else f"{r['variant']}, {r['tokens_per_s']:.0f} tokens/s"


def backends_line(data: dict) -> str:
    """A line per MoE model naming transformers' fastest experts backend and the default one."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in data["records"]):
        default = _default_experts(data, model)
        if default is None:
            continue
        fastest, ref = references(data, model)
        lines.append(f"{model}: transformers' fastest experts backend {_speed(fastest)}; default ({default}) "
                     f"{_speed(ref)}")
    return "\n".join(lines)


def rows(data: dict) -> List[List[str]]:
    """One row of :data:`COLUMNS` per record."""
    out = []
    refs = {m: references(data, m) for m in dict.fromkeys(r["model"] for r in data["records"])}
    for r in data["records"]:
        fastest, default = refs[r["model"]]
        ratio = lambda ref: "-" if ref is None or not r.get("tokens_per_s") else \
            f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x"  # noqa: E731
        variant = r["variant"] + (" (default)" if r.get("experts_implementation") is not None
                                  and r["experts_implementation"] == _default_experts(data, r["model"]) else "")
        spread = r.get("spread") or {}
        warm = ", ".join(f"{w:.0f}" for w in r.get("warmup_ms") or []) or "-"
        loss = (r.get("loss") or {}).get("final")
        notes = "; ".join(r.get("notes") or [])
        if r.get("fused_ops"):
            f = r["fused_ops"]
            notes = (notes + "; " if notes else "") + (f"fused AG-matmul {f['fused_all_gather_matmul']}, "
                                                       f"matmul-RS {f['fused_matmul_reduce_scatter']} in "
                                                       f"{f['graphs']} graphs")
        out.append([r["model"], variant, "yes" if r.get("compiled") else "no",
                    "yes" if r.get("graphs") else "no", _fmt(r.get("ms")), _fmt(spread.get("min_ms")),
                    _fmt(spread.get("max_ms")), _fmt(r.get("tokens_per_s"), ".0f"), ratio(fastest), ratio(default),
                    "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%", _mem(r.get("peak_mem_bytes")),
                    _fmt(r.get("host_ms")), warm, _fmt(loss, ".5f"), notes])
    return out


def text_table(data: dict) -> str:
    """The table, columns aligned (notes last, unpadded)."""
    body = rows(data)
    widths = [max(len(str(x)) for x in col) for col in zip(COLUMNS, *body)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells[:-1], widths)) + "  " + cells[-1]  # noqa: E731
    return "\n".join([fmt(list(COLUMNS)), fmt(["-" * w for w in widths[:-1]] + ["-----"])] + [fmt(r) for r in body])


def markdown_table(data: dict) -> str:
    """The table in markdown, under a line on where it ran."""
    m = data["meta"]
    peak = f", peak {m['peak_tflops']:.0f} TFLOP/s per GPU (bf16 GEMM)" if m.get("peak_tflops") else ""
    head = (f"Whole-model training step: {m['device']} x{m['gpu_count'] or m['world_size']} ({m['link']}), "
            f"TP {m['tp']} x DP {m['dp']}, {m['dtype']}, torch {m['torch']}{peak}; `{m['command']}`\n\n")
    backends = backends_line(data)
    head += "".join(f"{line}\n\n" for line in backends.splitlines())
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows(data)]
    return head + "\n".join(lines) + "\n"


def bar_chart(data: dict, path: str) -> Optional[str]:
    """A PNG of each variant's median step time, one panel per model; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = list(dict.fromkeys(r["model"] for r in data["records"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        recs = [r for r in data["records"] if r["model"] == model and r.get("ms") is not None]
        names = [r["variant"] for r in recs]
        ax.bar(range(len(recs)), [r["ms"] for r in recs],
               yerr=[[r["ms"] - r["spread"]["min_ms"] for r in recs], [r["spread"]["max_ms"] - r["ms"] for r in recs]],
               color=["#999999" if not n.startswith("overlap") else "#2a7ab0" for n in names], capsize=3)
        ax.set_xticks(range(len(recs)), names, rotation=40, ha="right", fontsize=8)
        ax.set_title(f"{model} ({recs[0]['preset'] if recs else '-'})", fontsize=9)
        ax.set_ylabel("step time (ms, median; bars: min-max)", fontsize=8)
    m = data["meta"]
    fig.suptitle(f"{m['device']} x{m['gpu_count'] or m['world_size']}, TP {m['tp']}, {m['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(data: dict, args) -> str:
    """Print the table and write the JSON, markdown and PNG files; returns the JSON path."""
    print()
    backends = backends_line(data)
    print(text_table(data) + (f"\n\n{backends}" if backends else ""), flush=True)
    path = args.out or default_path(data["meta"], args.model)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    stem = os.path.splitext(path)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown_table(data))
    png = bar_chart(data, stem + ".png")
    print(f"\nwrote {path}, {stem}.md" + (f", {png}" if png else " (no chart: matplotlib is not installed)"),
          flush=True)
    return path
