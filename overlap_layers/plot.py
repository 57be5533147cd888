"""Draw a predicted or measured timeline (a Chrome/Perfetto trace) as a PNG.

Reference: ``plot_timeline(path, png)`` draws what ``chrome://tracing`` or Perfetto shows for a
trace written from :meth:`~overlap_layers.sim.Timeline.to_chrome_trace`: one row per thread
(stream), one bar per complete event, communication and compute in different colours.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]

_EXPECTED = ("a Chrome/Perfetto trace as Timeline.to_chrome_trace() writes it: "
             "{\"traceEvents\": [...]} with \"M\" thread_name events (args.name) and \"X\" events "
             "with pid, tid, ts and dur in us")
_COLOURS = {"comm": "tab:orange", "compute": "tab:blue"}
_OTHER_COLOUR = "tab:gray"


def plot_timeline(trace_path: PathLike, png_path: PathLike) -> None:
    """Read the trace JSON at ``trace_path`` and save its timeline as a PNG at ``png_path``.

    One horizontal row per thread (``M`` ``thread_name`` events name them; rows are ordered by
    pid, then tid), one bar per ``X`` event with ``cat`` ``"comm"`` or ``"compute"`` in its own
    colour (others grey), the event's name written on its bar where it fits, the x axis in ms.
    Events that overlap on one row (collectives in flight together in a measured run) are
    stacked in lanes inside the row; zero-length events (waits) are not drawn. With more than
    one pid, row names are prefixed with the process name (``process_name`` metadata) or the pid.
    Other phases (``B``/``E``, ``i``, counters)
    are ignored.

    Raises ``ValueError`` when the file is not such a trace, and ``ImportError`` without
    matplotlib (draws with its Agg canvas directly: the global backend is left alone).
    """
    rows, bars = _read_trace(trace_path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot_timeline needs matplotlib: pip install matplotlib") from e

    fig = Figure(figsize=(12, 1.2 + 0.55 * max(len(rows), 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    end_ms = max((s + d for _, s, d, _, _ in bars), default=0.0)
    ax.set_xlim(0.0, end_ms * 1.01 if end_ms > 0 else 1.0)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    ax.set_yticks(range(len(rows)), [label for _, label in rows])
    ax.set_xlabel("time (ms)")
    ax.set_title(os.path.basename(os.fspath(trace_path)), fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)
    row_index = {key: i for i, (key, _) in enumerate(rows)}
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    row_px = _row_px(ax)
    for key, _ in rows:
        mine = sorted((b for b in bars if b[0] == key and b[2] > 0), key=lambda b: b[1])
        lanes = _lanes([(s, s + d) for _, s, d, _, _ in mine])
        n_lanes = max(lanes, default=0) + 1
        height = 0.8 / n_lanes
        for (_, start, dur, name, cat), lane in zip(mine, lanes):
            y = row_index[key] - 0.4 + lane * height
            colour = _COLOURS.get(cat, _OTHER_COLOUR)
            ax.broken_barh([(start, dur)], (y, height), facecolors=colour, edgecolors="black",
                           linewidths=0.4, alpha=0.85)
            (x0, _), (x1, _) = ax.transData.transform([(start, 0), (start + dur, 0)])
            if x1 - x0 < 12:  # too narrow for any label: skip measuring one
                continue
            text = ax.text(start + dur / 2, y + height / 2, name, ha="center", va="center",
                           fontsize=7, clip_on=True)
            box = text.get_window_extent(renderer)
            if box.width > (x1 - x0) - 2 or box.height > height * row_px:
                text.remove()  # does not fit on its bar
    handles = [_patch(c, k) for k, c in _COLOURS.items()]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
              fontsize=7, frameon=False, borderaxespad=0.2)
    fig.savefig(os.fspath(png_path), dpi=120)


def _read_trace(path: PathLike) -> Tuple[List[Tuple[tuple, str]], List[tuple]]:
    """(rows as ((pid, tid), label), bars as ((pid, tid), start_ms, dur_ms, name, cat))."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{os.fspath(path)} is not JSON ({e}); expected {_EXPECTED}") from e
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{os.fspath(path)} has no \"traceEvents\" list; expected {_EXPECTED}")
    names: Dict[tuple, str] = {}
    processes: Dict[object, str] = {}
    bars: List[tuple] = []
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise ValueError(f"{os.fspath(path)}: traceEvents[{i}] is {type(ev).__name__}, not an "
                             f"object; expected {_EXPECTED}")
        key = (ev.get("pid", 0), ev.get("tid", 0))
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            name = (ev.get("args") or {}).get("name") if isinstance(ev.get("args"), dict) else None
            if not isinstance(name, str):
                raise ValueError(f"{os.fspath(path)}: traceEvents[{i}] is a thread_name event "
                                 f"without args.name; expected {_EXPECTED}")
            names[key] = name
        elif ev.get("ph") == "M" and ev.get("name") == "process_name":
            name = (ev.get("args") or {}).get("name") if isinstance(ev.get("args"), dict) else None
            if isinstance(name, str):
                processes[key[0]] = name
        elif ev.get("ph") == "X":
            ts, dur = ev.get("ts"), ev.get("dur")
            if not _number(ts) or not _number(dur) or dur < 0:
                raise ValueError(f"{os.fspath(path)}: traceEvents[{i}] is an \"X\" event without "
                                 f"numeric ts and dur >= 0 (got ts={ts!r}, dur={dur!r}); "
                                 f"expected {_EXPECTED}")
            bars.append((key, ts / 1e3, dur / 1e3, str(ev.get("name", "")), ev.get("cat")))
    if not names and not bars:
        raise ValueError(f"{os.fspath(path)} has neither thread_name nor \"X\" events; "
                         f"expected {_EXPECTED}")
    keys = sorted(set(names) | {b[0] for b in bars}, key=lambda k: (str(k[0]), _sortable(k[1])))
    several = len({k[0] for k in keys}) > 1
    rows = []
    for k in keys:
        label = names.get(k, f"tid {k[1]}")
        rows.append((k, f"{processes.get(k[0], k[0])}: {label}" if several else label))
    if bars:  # times from the first event, as the simulator's timelines start at 0
        t0 = min(b[1] for b in bars)
        bars = [(k, s - t0, d, n, c) for k, s, d, n, c in bars]
    return rows, bars


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _sortable(tid):
    return (0, tid, "") if _number(tid) else (1, 0, str(tid))


def _lanes(intervals: List[Tuple[float, float]]) -> List[int]:
    """Greedy lane per interval (sorted by start) so that intervals in one lane do not overlap."""
    ends: List[float] = []
    out = []
    for a, b in intervals:
        for lane, end in enumerate(ends):
            if end <= a:
                ends[lane] = b
                out.append(lane)
                break
        else:
            ends.append(b)
            out.append(len(ends) - 1)
    return out


def _row_px(ax) -> float:
    """Display pixels per y unit (one row)."""
    (_, y0), (_, y1) = ax.transData.transform([(0, 0), (0, 1)])
    return abs(y1 - y0)


def _patch(colour: str, label: str):
    from matplotlib.patches import Patch
    return Patch(facecolor=colour, edgecolor="black", linewidth=0.4, label=label)
