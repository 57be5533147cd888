"""A calibration cache on disk whose use is agreed by every rank of the group.

Guarantees:
- :func:`load_agreed` returns the same :class:`HardwareModel` on every rank, or ``None`` on every
  rank, never a mix: the decision comes from one host-side gather that every rank issues
  unconditionally, whatever its own file holds (see [Note: agreement] in ``runtime/group.py``; a
  rank that recalibrated alone would issue calibration collectives the others never join).
- A cached model is used only when every rank's file exists, parses, validates, was written for
  exactly the expected key, and holds the same model as every other rank's file.
- A bad file (missing, unreadable, garbage, stale, different across ranks) never raises: every
  rank gets ``None`` and, unless all files were simply missing, the same warning naming the ranks
  and reasons.
- :func:`store` replaces the file atomically (a reader sees the old file or the new one, never
  half of one), so ranks that share a directory may all store the same model at once, and a
  cache that cannot be written only warns: a read-only cache must not stop training.
- Files are JSON (no pickle); the key names everything that changes the measured numbers: the
  device, torch and NCCL versions, the group size, the transport, the dtype and the NCCL
  environment variables that change NCCL's transport or algorithm.

Reference: without a cache, every rank calibrates (``calibrate``) at the first call; with one,
``load_agreed(...) or calibrate(...)`` followed by ``store(...)`` of the calibrated model.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config import check_positive_int
from ..runtime.group import Agreement
from ..sim import HardwareModel

FORMAT = 2  # 2: ops timed queued ahead of the device (planning/calibrate.py), not one launch at a time

NCCL_TRANSPORT_ENV = (
    "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_NET_GDR_LEVEL",
    "NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS",
    "NCCL_NET", "NCCL_COLLNET_ENABLE", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
)
"""Environment variables that change which transport or algorithm NCCL (or symmetric memory)
uses, and so the measured collective times; part of :func:`cache_key`."""

# Status codes carried through the agreement gather, and how a warning names them.
_OK, _MISSING, _UNREADABLE, _CORRUPT, _STALE = range(5)
_REASONS = {_OK: "ok", _MISSING: "missing", _UNREADABLE: "unreadable",
            _CORRUPT: "corrupt (not a valid calibration file)",
            _STALE: "stale (written for another device, version, group size, transport, dtype or NCCL env)"}


class CalibrationCacheWarning(UserWarning):
    """A calibration cache file was unusable or could not be written; calibration runs instead."""


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/overlap_layers`` when ``XDG_CACHE_HOME`` is set to an absolute path (the
    XDG spec ignores empty or relative values), else ``~/.cache/overlap_layers``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "overlap_layers")


def _nccl_version() -> Optional[str]:
    """NCCL's version as "major.minor.patch" on a CUDA build of torch, else None."""
    if torch.version.cuda is None:
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, ImportError, RuntimeError):
        return None
    if isinstance(version, (tuple, list)):
        return ".".join(str(part) for part in version)
    return str(version)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def cache_key(*, device: torch.device, world_size: int, transport: str, dtype: torch.dtype) -> Dict[str, Any]:
    """Everything a calibration depends on, as plain JSON types (see the module docstring).

    ``device`` is where the numbers were measured (CUDA: its name, e.g. "NVIDIA H100 80GB HBM3";
    otherwise its type), ``world_size`` the group's size, ``transport`` the collective backend
    name the plan uses, ``dtype`` the calibrated dtype. The NCCL environment is read here, once."""
    if not isinstance(device, (torch.device, str)):
        raise ValueError(f"device={device!r} must be a torch.device (or a device string such as 'cuda:0')")
    check_positive_int(world_size, "world_size")
    if not isinstance(transport, str):
        raise ValueError(f"transport={transport!r} must be a str naming the collective backend")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r} must be a torch.dtype")
    device = torch.device(device)
    return {"format": FORMAT, "device": _device_name(device), "torch": torch.__version__,
            "nccl": _nccl_version(), "world_size": world_size, "transport": transport, "dtype": str(dtype),
            "env": {var: os.environ.get(var) for var in NCCL_TRANSPORT_ENV}}


def _canonical(value: Any) -> str:
    """One spelling per JSON value (sorted keys, no spaces), for hashing and comparing."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def cache_path(cache_dir: str, key: Dict[str, Any]) -> str:
    """``cache_dir/calibration-<16 hex digits of sha256 of the canonical JSON of key>.json``."""
    digest = hashlib.sha256(_canonical(key).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"calibration-{digest}.json")


def _model_digest(model: HardwareModel) -> int:
    """63 bits of sha256 of the model's canonical JSON (fits the int64 of the gather)."""
    raw = hashlib.sha256(_canonical(model.to_json()).encode()).digest()
    return int.from_bytes(raw[:8], "big") >> 1


def _warn(message: str) -> None:
    warnings.warn(message, CalibrationCacheWarning, stacklevel=3)


def store(path: str, key: Dict[str, Any], model: HardwareModel) -> None:
    """Writes ``{"key": key, "model": model.to_json()}`` to ``path`` atomically: a temp file with
    a unique name in the same directory (created if needed), then ``os.replace``. Never raises for
    the file system or for a model that :func:`load_agreed` would reject: it warns
    (:class:`CalibrationCacheWarning`) and writes nothing."""
    try:
        HardwareModel.from_json(model.to_json())
        text = _canonical({"key": key, "model": model.to_json()})
    except ValueError as e:
        _warn(f"calibration not cached at {path}: the model cannot be stored ({e})")
        return
    try:
        _write_atomically(path, text)
    except OSError as e:
        _warn(f"calibration not cached at {path}: {type(e).__name__}: {e}")


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".calibration-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_local(path: str, key: Dict[str, Any]) -> Tuple[int, Optional[HardwareModel], str]:
    """(status, model or None, detail) of this rank's file; never raises for a bad file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return _MISSING, None, ""
    except OSError as e:
        return _UNREADABLE, None, f"{type(e).__name__}: {e}"
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # includes JSONDecodeError and UnicodeDecodeError
        return _CORRUPT, None, f"not JSON: {type(e).__name__}: {e}"
    if not isinstance(doc, dict) or set(doc) != {"key", "model"}:
        return _CORRUPT, None, 'not a JSON object with exactly the fields "key" and "model"'
    try:
        same_key = _canonical(doc["key"]) == _canonical(key)
    except (ValueError, TypeError, RecursionError):
        same_key = False
    if not same_key:
        return _STALE, None, "the file's key differs from this run's key"
    try:
        return _OK, HardwareModel.from_json(doc["model"]), ""
    except ValueError as e:
        return _CORRUPT, None, f"invalid model: {e}"


def _check_local(path: str, key: Dict[str, Any]) -> Tuple[int, Optional[HardwareModel], str]:
    """:func:`_read_local`, made total: any exception becomes a corrupt status, because a rank that
    raised here would skip the gather that every other rank is waiting in ([Note: agreement])."""
    try:
        return _read_local(path, key)
    except Exception as e:  # noqa: BLE001 - see the docstring
        return _CORRUPT, None, f"unexpected {type(e).__name__}: {e}"


def _disagreement(table: List[Tuple[int, ...]]) -> Optional[str]:
    """Why the gathered (status, digest) table rules the cache out, or None if it is usable or
    simply absent everywhere. The same on every rank, since it reads only the gathered table."""
    bad = [(rank, status) for rank, (status, _) in enumerate(table) if status not in (_OK, _MISSING)]
    if bad:
        return "; ".join(f"rank {rank}: {_REASONS[status]}" for rank, status in bad)
    if all(status == _OK for status, _ in table) and len({digest for _, digest in table}) > 1:
        groups: Dict[int, List[int]] = {}
        for rank, (_, digest) in enumerate(table):
            groups.setdefault(digest, []).append(rank)
        return "ranks hold different calibrations: " + " vs ".join(
            "ranks " + ",".join(map(str, ranks)) for ranks in groups.values())
    return None


def load_agreed(path: str, key: Dict[str, Any], agreement: Agreement) -> Optional[HardwareModel]:
    """The cached model at ``path`` (this rank's file) if every rank of ``agreement``'s group has
    a valid file for ``key`` holding the same model, else None; the same answer on every rank.

    Every rank issues exactly one ``agreement.gather`` of (status, model digest), whatever its file
    holds. If any rank's file is unusable, or the ranks' models differ, every rank warns
    (:class:`CalibrationCacheWarning`) naming ranks and reasons; if the files are merely missing
    on some or all ranks, nothing is said. Never raises for a bad file."""
    status, model, detail = _check_local(path, key)
    digest = _model_digest(model) if model is not None else 0
    table = agreement.gather((status, digest), dtype=torch.int64)
    if all(s == _OK for s, _ in table) and len({d for _, d in table}) == 1:
        return model
    reason = _disagreement(table)
    if reason is not None:
        local = f" This rank ({path}): {detail}." if detail else ""
        _warn(f"calibration cache not used, recalibrating: {reason}.{local}")
    return None
