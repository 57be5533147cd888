"""What a benchmark result file says about its run: the ``meta`` object of
``bench/results/schema.json`` (schema version 1), the link between the ranks, and the default
file name ``<layers>_tp<N>_<link>_<device>x<count>_<date>_<time>.json``.

``link`` names how the ranks talk: ``gloo`` (the CPU backend), ``single`` (one rank on a GPU:
nothing to cross), ``p2p_off`` (NCCL with ``NCCL_P2P_DISABLE=1``: traffic through host memory, a
PCIe-class link), else ``nvlink`` (NCCL peer to peer). :func:`link_of` reads it back, also from
files written before the field existed (from ``backend`` and ``nccl_p2p_disable``).
"""
from __future__ import annotations

import datetime
import os
import re
import shlex
import sys
from typing import Optional, Sequence

import torch

SCHEMA_VERSION = 1
KINDS = ("layer", "model", "host")  # the per-layer, whole-model and host-overhead benchmarks
LINKS = ("nvlink", "p2p_off", "gloo", "single")
LINK_LABELS = {"nvlink": "NVLink", "p2p_off": "P2P off", "gloo": "gloo", "single": "single GPU"}


def p2p_disabled(env=None) -> bool:
    """Whether NCCL runs with ``NCCL_P2P_DISABLE`` set to a true value."""
    value = (os.environ if env is None else env).get("NCCL_P2P_DISABLE")
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def link(backend: str, world_size: int, env=None) -> str:
    """The ``link`` of a run (module docstring)."""
    if backend == "gloo":
        return "gloo"
    if world_size == 1:
        return "single"
    return "p2p_off" if p2p_disabled(env) else "nvlink"


def link_of(meta: dict) -> str:
    """The ``link`` of a result file's ``meta``, also for files written before the field."""
    if meta.get("link") in LINKS:
        return meta["link"]
    if meta.get("backend") == "gloo":
        return "gloo"
    return "p2p_off" if p2p_disabled({"NCCL_P2P_DISABLE": str(meta.get("nccl_p2p_disable") or "")}) else "nvlink"


def describe(meta: dict) -> str:
    """One line on where a result file's run ran, e.g. ``NVIDIA H200 x4, NVLink, torch 2.13.0``."""
    count = meta.get("gpu_count") or meta.get("world_size", "?")
    where = f"{meta.get('device', '?')} x{count}" if meta.get("device") != "cpu" else \
        f"cpu, {meta.get('world_size', '?')} ranks"
    return f"{where}, {LINK_LABELS[link_of(meta)]}, torch {meta.get('torch', '?')}"


def _triton_version() -> Optional[str]:
    try:
        import triton
    except Exception:  # noqa: BLE001 - not installed, or broken: no version to record
        return None
    return getattr(triton, "__version__", None)


def command_line(argv: Optional[Sequence[str]] = None, module: str = "overlap_layers.bench") -> str:
    """The command that ran: ``python -m MODULE ARGS`` (also under torchrun, whose options it does
    not see), or the script's own command line."""
    if argv is not None:
        return shlex.join(["python", "-m", module, *argv])
    script = sys.argv[0].replace(os.sep, "/") if sys.argv else ""
    path = module.replace(".", "/")
    if script.endswith(f"{path}/__main__.py") or script.endswith(f"{path}.py"):
        return shlex.join(["python", "-m", module, *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def meta(kind: str, backend: str, world_size: int, cuda: bool, command: str, **extra) -> dict:
    """The ``meta`` of a result file (``bench/results/schema.json``); ``extra`` keys follow the
    schema's. One GPU per rank on CUDA."""
    assert kind in KINDS and backend in ("nccl", "gloo"), (kind, backend)
    nccl = None
    if cuda:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    out = dict(schema_version=SCHEMA_VERSION, kind=kind,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=command, device=torch.cuda.get_device_name() if cuda else "cpu",
               gpu_count=world_size if cuda else 0, world_size=world_size, backend=backend,
               link=link(backend, world_size), torch=torch.__version__, cuda=torch.version.cuda if cuda else None,
               nccl=nccl, triton=_triton_version(),
               nccl_p2p_disable=os.environ.get("NCCL_P2P_DISABLE"))  # read by older tools
    out.update(extra)
    return out


def device_slug(device_name: str) -> str:
    """A short file-name form of a device name: ``NVIDIA H200`` -> ``h200``,
    ``NVIDIA A100-SXM4-80GB`` -> ``a100``, ``cpu`` -> ``cpu``."""
    words = [w for w in re.split(r"\s+", device_name.strip()) if w.lower() not in ("nvidia", "amd", "tesla", "")]
    first = (words[0] if words else "gpu").split("-")[0].lower()
    return re.sub(r"[^a-z0-9]", "", first) or "gpu"


def default_name(layers: Sequence[str], tp: Sequence[int], meta_: dict,
                 when: Optional[datetime.datetime] = None) -> str:
    """``<layers>_tp<N>_<link>_<device>x<count>_<date>_<time>.json``: what ran (layers joined by
    ``-``, TP sizes by ``-``), over which link, on which devices (on CPU ``cpu`` times the ranks),
    and when (local time)."""
    when = when or datetime.datetime.now()
    count = meta_["gpu_count"] if meta_["gpu_count"] else meta_["world_size"]
    return (f"{'-'.join(layers)}_tp{'-'.join(map(str, tp))}_{meta_['link']}_{device_slug(meta_['device'])}x{count}_"
            f"{when:%Y-%m-%d_%H%M%S}.json")
