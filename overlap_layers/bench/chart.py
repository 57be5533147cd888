"""One PNG per benchmark JSON: each mode's time over the limit, per shape and pass.

Usage: ``python -m overlap_layers.bench.chart RESULT.json OUT.png [--title TEXT]``.
Bars are ``ms / limit_ms`` (1.0 = communication fully hidden under the compute-only reference,
or the comm-only time where that is larger), one group per (layer, preset, TP, batch, tokens,
pass), one bar per mode present; a dashed line marks 1.0. The title says where the run ran
(device, link, torch) unless ``--title`` replaces it. Needs matplotlib.
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Tuple

from .results import describe

ORDER = ("serial", "naive", "auto", "rank", "rank_ce", "asynctp")


def _label(r: dict) -> str:
    if r["mode"] != "naive":
        return r["mode"]
    return f"naive K={r['k']}" if isinstance(r["k"], int) else f"naive {r['k']}"


def bars(records: List[dict]) -> Tuple[List[str], Dict[str, List[float]]]:
    """(group labels, mode label -> ratio per group; NaN where a mode has no number)."""
    groups: Dict[tuple, Dict[str, float]] = {}
    for r in records:
        if r.get("ms") is None or not r.get("limit_ms") or r["mode"] in ("compute", "comm"):
            continue
        key = (r.get("layer", "mlp"), r["preset"], r["world_size"], r.get("batch"), r["tokens"], r["pass"])
        groups.setdefault(key, {})[_label(r)] = r["ms"] / r["limit_ms"]
    modes = sorted({m for g in groups.values() for m in g},
                   key=lambda m: (ORDER.index(m.split()[0]) if m.split()[0] in ORDER else len(ORDER), m))
    labels = [f"{layer} {preset}\nTP{ws}{'' if batch is None else f' B{batch}'} {tokens} {pass_}"
              for layer, preset, ws, batch, tokens, pass_ in groups]
    return labels, {m: [g.get(m, float("nan")) for g in groups.values()] for m in modes}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m overlap_layers.bench.chart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="a result file of python -m overlap_layers.bench")
    p.add_argument("png", help="the chart to write")
    p.add_argument("--title", default=None, help="the chart's title (default: device, link and torch of the run)")
    args = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("the chart needs matplotlib: python3 -m pip install matplotlib") from None
    with open(args.json) as f:
        data = json.load(f)
    labels, series = bars(data["records"])
    if not labels:
        raise SystemExit(f"{args.json}: no records with a limit (run the compute and comm modes too)")
    meta = data.get("meta", {})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) + 2), 4.5))
    width = 0.8 / max(len(series), 1)
    for i, (mode, ys) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=mode)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("time / limit")
    finite = [y for ys in series.values() for y in ys if y == y]
    ax.set_ylim(0.9 * min(finite + [1.0]), 1.05 * max(finite + [1.0]))
    ax.set_title(args.title or describe(meta), fontsize=9)
    ax.legend(fontsize=7, ncol=min(len(series), 4))
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
