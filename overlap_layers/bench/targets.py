"""Each benchmark row against the performance targets: ``python -m overlap_layers.bench.targets FILE...``.

Per (layer, preset, TP, batch, tokens, pass) row of a run that timed ``auto`` with its compute-
and comm-only references (the limit, ``limit_ms``), the targets the project holds every layer to:

=========  ==============================================================================
limit      ``auto / limit`` <= 1.10 for the dense layers (mlp, attention, ulysses, block)
           over NVLink, <= 1.15 with ``NCCL_P2P_DISABLE=1`` (a PCIe-class link, read from the
           run's ``meta``); <= 1.15 for moe on either
serial     ``auto / serial`` <= 1.02 (every layer; needs the serial row)
asynctp    ``auto`` faster than ``asynctp`` (mlp rows where AsyncTP ran)
memory     auto's peak plus its symmetric workspace at most serial's peak plus one tile of
           activations: ``(auto + workspace - serial) / tile`` <= 1
=========  ==============================================================================

One tile of activations is serial's peak (one call's, above what was allocated before it)
divided by the tiles auto's plan cuts a call into: its batch tiles ``k``, times the ranks for
rank chunks (each batch tile is split by source rank), or the record's ``tiles`` (the block's:
the more of its sublayers'). The workspace (``workspace_bytes``, persistent symmetric memory of
copy-engine plans) counts in full, though the layers of a group share one. With
``config.graph_calls`` (``--graph-calls``) a call's intermediates stay in the memory pool of its
graph (``graph_bytes``), which counts with the peak of auto and of serial alike.

A cell reads ``ok`` or ``MISS`` with the ratio, or ``-`` where the target does not apply or a
number is missing. Rows are told apart by link (the run's ``meta.link``: NVLink, P2P off, gloo
for CPU runs, single GPU; the NVLink targets hold for all but P2P off) and by CUDA-graph replay
(``cuda_graphs``: "yes"; ``graph_calls``, the layers replaying their own calls: "calls"), the
targets being the same for all. Then auto's peak plus workspace minus serial's peak, in MiB.

The last column is no target: for a fwd+bwd row whose run also timed the forward, auto over the
pass bound, the sum over the passes of ``max(compute-only, comm-only)`` (the forward's from the
fwd row, the backward's as the fwd+bwd row's minus the forward's). The limit of the whole call
lets a communication-bound forward borrow the backward's compute, which a layer cannot: autograd
runs the passes as two calls, so no overlap schedule beats the pass bound. With P2P off, the
llama3-8b MLP at TP 2 on H200 has a forward of 4.34 ms compute and 6.33 comm and a backward of
8.72 and 6.43: its pass bound, 15.05 ms, is 1.15x its limit of 13.07.

Prints one markdown table for all files and the misses per target.
"""
from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional, Tuple, Union

from .results import LINK_LABELS, link_of

DENSE_LIMIT, P2P_OFF_LIMIT, MOE_LIMIT, SERIAL_LIMIT = 1.10, 1.15, 1.15, 1.02
TARGETS = ("limit", "serial", "asynctp", "memory")


def limit_target(layer: str, p2p_off: bool) -> float:
    """The largest ``auto / limit`` the row may have (module docstring)."""
    if layer.startswith("moe"):
        return MOE_LIMIT
    return P2P_OFF_LIMIT if p2p_off else DENSE_LIMIT


def tiles(rec: dict) -> Optional[int]:
    """How many tiles ``rec``'s plan cuts one call into (module docstring), or None."""
    if rec.get("tiles"):
        return int(rec["tiles"])
    k = rec.get("k")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return None
    return k * rec["world_size"] if rec.get("decomposition") == "rank" else k


def _held(rec: dict) -> int:
    """A record's peak plus what its graph of ``config.graph_calls`` keeps (``graph_bytes``: the
    call's intermediates live there, not in the replay's peak)."""
    return (rec.get("peak_bytes") or 0) + (rec.get("graph_bytes") or 0)


def _over_serial(auto: dict, serial: dict) -> Optional[int]:
    """Bytes auto's peak, workspace and kept graph take above serial's peak and kept graph, or None."""
    if auto.get("peak_bytes") is None or serial.get("peak_bytes") is None:
        return None
    return _held(auto) + (auto.get("workspace_bytes") or 0) - _held(serial)


def judge(layer: str, p2p_off: bool, modes: Dict[str, dict]) -> Dict[str, Optional[Tuple[bool, float]]]:
    """Target -> ``(met, ratio)`` for one row's records by mode, or None where it does not apply."""
    auto = modes.get("auto")
    out: Dict[str, Optional[Tuple[bool, float]]] = dict.fromkeys(TARGETS)
    if auto is None or not auto.get("ms"):
        return out
    ms = auto["ms"]
    if auto.get("limit_ms"):
        ratio = ms / auto["limit_ms"]
        out["limit"] = (ratio <= limit_target(layer, p2p_off), ratio)
    serial = modes.get("serial", {}).get("ms")
    if serial:
        out["serial"] = (ms / serial <= SERIAL_LIMIT, ms / serial)
    asynctp = modes.get("asynctp", {}).get("ms")
    if layer == "mlp" and asynctp:
        out["asynctp"] = (ms < asynctp, ms / asynctp)
    over, n = _over_serial(auto, modes.get("serial", {})), tiles(auto)
    serial_bytes = _held(modes.get("serial", {}))
    if over is not None and n and serial_bytes > 0:
        ratio = over / (serial_bytes / n)
        out["memory"] = (ratio <= 1.0, ratio)
    return out


def pass_bound(fwd: Dict[str, dict], fwdbwd: Dict[str, dict]) -> Optional[float]:
    """The pass bound in ms (module docstring) from one shape's fwd and fwd+bwd records by mode,
    or None where a compute- or comm-only time is missing."""
    times = [(rows_.get(mode) or {}).get("ms") for rows_ in (fwd, fwdbwd) for mode in ("compute", "comm")]
    if not all(times):
        return None
    cf, mf, cfb, mfb = times
    return max(cf, mf) + max(cfb - cf, mfb - mf)


def _link(link: Union[str, bool]) -> str:
    """A run's ``link`` (``meta.link``); a bool says P2P off (True) or NVLink (False)."""
    if isinstance(link, bool):
        return "p2p_off" if link else "nvlink"
    return link


def rows(records: List[dict], link: Union[str, bool]) -> Dict[tuple, Dict[str, dict]]:
    """(layer, preset, TP, batch, tokens, pass, link, graphs) -> {mode: record} for one run over
    ``link`` (``meta.link``, or a bool: P2P off)."""
    out: Dict[tuple, Dict[str, dict]] = {}
    label = LINK_LABELS[_link(link)]
    for r in records:
        layer = r.get("layer", "mlp") + (" skewed" if r.get("skewed") else "")
        key = (layer, r["preset"], r["world_size"], r.get("batch"), r["tokens"], r["pass"], label,
               "calls" if r.get("graph_calls") else "yes" if r.get("cuda_graphs") else "no")
        out.setdefault(key, {})[r["mode"]] = r
    return out


def _cell(verdict: Optional[Tuple[bool, float]]) -> str:
    if verdict is None:
        return "-"
    met, ratio = verdict
    return f"{'ok' if met else 'MISS'} {ratio:.3f}"


def _plan(auto: dict) -> str:
    if auto.get("decomposition") == "rank":
        return "r-ce" if auto.get("transport") == "copy_engine" else "rank"
    return str(auto.get("k", "?"))


def targets(runs: List[Tuple[List[dict], Union[str, bool]]]) -> str:
    """The markdown table and the misses per target for ``runs``: (records, link) per file, the
    link as ``meta.link`` or a bool (P2P off)."""
    head = ["layer", "preset", "TP", "batch", "tokens", "pass", "link", "replayed", "auto plan (ms)",
            "auto / limit", "auto / serial", "auto / asynctp", "(auto + workspace - serial) / tile",
            "auto + workspace - serial MiB", "auto / pass bound"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    misses = dict.fromkeys(TARGETS, 0)
    judged = dict.fromkeys(TARGETS, 0)
    for records, run_link in runs:
        p2p_off = _link(run_link) == "p2p_off"
        by_row = rows(records, run_link)
        for (layer, preset, ws, batch, tokens, pass_, link, graphs), modes in by_row.items():
            auto = modes.get("auto")
            if auto is None or not auto.get("ms"):
                continue
            verdicts = judge(layer.split()[0], p2p_off, modes)
            for t, v in verdicts.items():
                if v is not None:
                    judged[t] += 1
                    misses[t] += not v[0]
            over = _over_serial(auto, modes.get("serial", {}))
            peak = "-" if over is None else f"{over / 2**20:+.0f}"
            fwd = by_row.get((layer, preset, ws, batch, tokens, "fwd", link, graphs))
            bound = pass_bound(fwd, modes) if pass_ == "fwdbwd" and fwd else None
            out.append("| " + " | ".join([layer, preset, str(ws), "-" if batch is None else str(batch), str(tokens),
                                          pass_, link, graphs, f"{_plan(auto)} ({auto['ms']:.3f})"]
                                         + [_cell(verdicts[t]) for t in TARGETS]
                                         + [peak, "-" if bound is None else f"{auto['ms'] / bound:.3f}"]) + " |")
    out.append("")
    out += [f"{t}: {misses[t]} of {judged[t]} rows miss" for t in TARGETS if judged[t]]
    return "\n".join(out)


def main(argv=None) -> None:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        raise SystemExit("usage: python -m overlap_layers.bench.targets RESULT.json [...]")
    runs = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        runs.append((data["records"], link_of(data.get("meta", {}))))
    print(targets(runs))


if __name__ == "__main__":
    main()
