"""Planner fidelity report from benchmark JSON: ``python -m overlap_layers.bench.report FILE...``.

For every (layer, preset, TP, batch, tokens, pass) row of a run with modes serial, naive (K=2, 4)
and auto (mlp, attention, ulysses and moe records alike; rows grouped by layer; MoE rows of a
``--skew`` run are their own rows, layer shown as ``moe skewed``) it prints,
as markdown: measured / predicted time per fixed K, the K auto settled on and its time, the
measured-best K, auto / best and auto / serial, and measured / predicted peak memory per K; then
the summary the planner issue asks for: median |pred - meas| / meas of time and of peak memory
over the fixed-K cells, and the share of rows where auto is within 3% of the best measured K
(per layer when a run holds several).
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Dict, List

from .results import describe


def _rows(records: List[dict]) -> Dict[tuple, Dict[object, dict]]:
    """(layer, preset, TP, batch, tokens, pass, skewed) -> {K: fixed-K record, "rank" / "rank_ce":
    the pinned rank-chunk plan's record, "auto": auto record}, grouped by layer (in order of first
    appearance)."""
    rows: Dict[tuple, Dict[object, dict]] = defaultdict(dict)
    for r in records:
        if r.get("ms") is None:
            continue
        key = (r.get("layer", "mlp"), r["preset"], r["world_size"], r.get("batch"), r["tokens"], r["pass"],
               bool(r.get("skewed")))
        if r["mode"] in ("serial", "naive"):
            rows[key][r["k"]] = r
        elif r["mode"] in ("rank", "rank_ce"):
            rows[key][r["mode"]] = r
        elif r["mode"] == "auto":
            rows[key]["auto"] = r
    order = list(dict.fromkeys(key[0] for key in rows))
    return dict(sorted(rows.items(), key=lambda kv: order.index(kv[0][0])))  # stable: runs' order within a layer


class _Stats:
    """One layer's fidelity summary."""

    def __init__(self):
        self.t_err, self.m_err, self.hosts, self.planning = [], [], [], []
        self.near = self.n_auto = 0

    def summary(self, prefix: str) -> List[str]:
        t_err, m_err, hosts, planning = self.t_err, self.m_err, self.hosts, self.planning
        out = []
        if t_err:
            out.append(f"{prefix}Time: median |pred - meas| / meas {statistics.median(t_err):.1%} "
                       f"(max {max(t_err):.1%}) over {len(t_err)} fixed-plan cells.")
        if m_err:
            out.append(f"{prefix}Peak memory: median |pred - meas| / meas {statistics.median(m_err):.1%} "
                       f"(max {max(m_err):.1%}) over {len(m_err)} cells.")
        if self.n_auto:
            out.append(f"{prefix}Auto within 3% of the best measured plan on {self.near} of {self.n_auto} rows.")
        if hosts:
            out.append(f"{prefix}Cached call host time: plan lookup median "
                       f"{statistics.median(h[0] for h in hosts):.1f} us, agreement gather median "
                       f"{statistics.median(h[1] for h in hosts):.1f} us.")
        if planning:
            out.append(f"{prefix}Planning a new shape bucket (layer.warmup): median "
                       f"{statistics.median(planning):.0f} ms, max {max(planning):.0f} ms (the first bucket of a "
                       f"run includes calibration).")
        return out


def _err(pred, meas):
    return abs(pred - meas) / meas if pred is not None and meas else None


def _name(k) -> str:
    return f"K={k}" if isinstance(k, int) else k


def _plan_name(r: dict) -> str:
    if r.get("decomposition") == "rank":
        return "rank_ce" if r.get("transport") == "copy_engine" else "rank"
    return str(r["k"])


def report(records: List[dict], title: str = "") -> str:
    rows = _rows(records)
    keys = {k for row in rows.values() for k in row if k != "auto"}
    ks = sorted(k for k in keys if isinstance(k, int)) + sorted(k for k in keys if not isinstance(k, int))
    head = ["layer", "preset", "TP", "batch", "tokens", "pass"] + [f"{_name(k)} meas / pred ms" for k in ks] + \
        ["auto plan (ms)", "best plan", "auto / best", "auto / serial"] + \
        [f"{_name(k)} peak meas / pred MiB" for k in ks]
    out = [f"### {title}" if title else "", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    stats: Dict[str, _Stats] = {}
    for (layer, preset, ws, batch, tokens, pass_, skewed), row in rows.items():
        st = stats.setdefault(layer, _Stats())
        t_err, m_err, hosts, planning = st.t_err, st.m_err, st.hosts, st.planning
        cells = [layer + (" skewed" if skewed else ""), preset, str(ws), "-" if batch is None else str(batch), str(tokens), pass_]
        for k in ks:
            r = row.get(k)
            if r is None:
                cells.append("-")
                continue
            cells.append(f"{r['ms']:.2f} / {r['predicted_ms']:.2f}" if r.get("predicted_ms") else f"{r['ms']:.2f} / -")
            if _err(r.get("predicted_ms"), r["ms"]) is not None:
                t_err.append(_err(r["predicted_ms"], r["ms"]))
        fixed = {k: row[k]["ms"] for k in ks if k in row}
        best = min(fixed, key=fixed.get) if fixed else None
        auto = row.get("auto")
        if auto and best is not None:
            st.n_auto += 1
            st.near += auto["ms"] <= 1.03 * fixed[best]
            cells += [f"{_plan_name(auto)} ({auto['ms']:.2f})", _name(best), f"{auto['ms'] / fixed[best]:.2f}",
                      f"{auto['ms'] / fixed[1]:.2f}" if 1 in fixed else "-"]
            if auto.get("planning_ms") is not None:
                planning.append(auto["planning_ms"])
            if auto.get("host_plan_lookup_us") is not None:
                hosts.append((auto["host_plan_lookup_us"], auto["host_agreement_us"]))
        else:
            cells += ["-"] * 4
        for k in ks:
            r = row.get(k)
            if r is None or r.get("peak_bytes") is None:
                cells.append("-")
                continue
            pp = r.get("predicted_peak_bytes")
            cells.append(f"{r['peak_bytes'] / 2**20:.0f} / {pp / 2**20:.0f}" if pp else f"{r['peak_bytes'] / 2**20:.0f} / -")
            if _err(pp, r["peak_bytes"]) is not None:
                m_err.append(_err(pp, r["peak_bytes"]))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for layer, st in stats.items():
        out += st.summary(f"{layer}: " if len(stats) > 1 else "")
    return "\n".join(out)


def main(argv=None) -> None:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        raise SystemExit("usage: python -m overlap_layers.bench.report RESULT.json [...]")
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = data.get("meta", {})
        title = f"{path}: {describe(meta)}"
        print(report(data["records"], title))
        print()


if __name__ == "__main__":
    main()
