"""What a call's agreement compares across the ranks beyond its signature: the layer's
configuration, and with ``config.check_inputs`` the inputs that must be equal on every rank.

Reference: :func:`config_difference` names every field of two ranks' :func:`config_table` that
differs, with each rank's value; :func:`input_difference` names every input whose
:func:`fingerprints` differ, with the ranks that hold each value. Both read rows that every rank
gathered, so every rank finds the same differences.

[Note: layer config]
Every rank of a group must build a layer alike: a rank whose layer has another activation,
bias, head count, RoPE base or sequence parallelism runs other collectives (or other shapes in
the same collectives) or computes another function, and neither shows in the call's signature.
So each layer lists what its ranks must share (``TiledLayer._config_table``: its class, its own
construction arguments, the weights' dtype, ``num_tiles``, the ``OverlapConfig`` fields but
``cache_dir``, and what a module around it adds, a block's norms) and the call's agreement
carries a digest of that table (:func:`config_digest`) as a column: compared at no cost whenever
the row is gathered, i.e. at the first call of every call signature ([Note: agreement once per
call signature] in ``planning/call_agreement.py``), whether the plan is planned, fixed or pinned.
A digest cannot say what differs; when the digests differ (every rank sees that, from the same
gathered rows) every rank gathers once more: each field's value packed into ``WORDS_PER_FIELD``
numbers (:func:`pack_config`), so that the ValueError every rank raises names each differing
field and every rank's value. A table has at most ``MAX_FIELDS`` fields (the row's length must
not depend on the rank's layer); a layer's own are about fifteen.

[Note: input checks]
Some inputs must be equal on every rank of the group and cannot be checked for free: the
position ids and RoPE tables of the attention layers, and ``x`` itself where the layer's contract
replicates it (no sequence parallelism: every rank holds the whole batch; with it the ranks hold
different shards and nothing is compared). ``OverlapConfig(check_inputs=True)`` compares them at
every call: each is reduced on its device to three numbers (:func:`fingerprints`: its shape and
dtype, and two sums over its bits weighted by row and by column, so equal tensors always agree
and swapped rows or columns do not) that ride in the call's agreement row, which is then gathered
at every call. The attention masks are not among them: a layer accepts only a mask equal to the
causal one (checked on each rank), so masks that pass cannot differ in meaning.
"""
from __future__ import annotations

import zlib
from dataclasses import fields
from typing import List, Optional, Sequence, Tuple

import torch

from ..config import OverlapConfig

MAX_FIELDS = 40  # fields of a config table that the naming gather carries
WORDS_PER_FIELD = 6  # a field's repr digest, then its first 40 bytes
_TEXT_BYTES = 8 * (WORDS_PER_FIELD - 1)
# the config fields every rank must share: all but cache_dir (a rank's own path) and num_tiles (the layer's, below)
_CONFIG_FIELDS = tuple(f.name for f in fields(OverlapConfig) if f.name not in ("cache_dir", "num_tiles"))
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SUMMABLE = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # sum(dtype=torch.int64) takes them


# ----------------------------------------------------------------- the layer's configuration
def config_table(layer, own: tuple) -> tuple:
    """``layer``'s table ([Note: layer config]): its class, ``own`` (its ``_config_fields``), the
    weights' dtype, ``num_tiles``, ``config``'s fields and ``_config_context``."""
    cfg = layer.config
    return (("layer", type(layer).__name__), *own, ("dtype", str(layer._weight.dtype)), ("num_tiles", layer.num_tiles),
            *((f"config.{name}", getattr(cfg, name)) for name in _CONFIG_FIELDS), *layer._config_context)


def config_digest(table: tuple) -> int:
    """A number equal on two ranks whose tables are (``hash()`` is salted per process)."""
    return zlib.crc32(repr(table).encode())


def pack_config(table: tuple) -> Tuple[int, ...]:
    """``table``'s values as ``MAX_FIELDS * WORDS_PER_FIELD`` int64s: per field the digest of its
    repr, then its repr's first bytes; fields past ``MAX_FIELDS`` are left out, missing ones zero."""
    out: List[int] = []
    for _, value in table[:MAX_FIELDS]:
        text = repr(value).encode()
        out.append(zlib.crc32(text) + 1)  # never 0, which stands for a missing field
        raw = text[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0")
        out.extend(int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, _TEXT_BYTES, 8))
    return tuple(out) + (0,) * (MAX_FIELDS * WORDS_PER_FIELD - len(out))


def _text(words: Sequence[int]) -> str:
    if words[0] == 0:
        return "(none)"
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[1:]).rstrip(b"\0")
    text = raw.decode("utf-8", "replace")
    return text if len(raw) < _TEXT_BYTES else text + "..."


def config_difference(table: tuple, packed: Sequence[Sequence[int]]) -> str:
    """Each field whose values differ across the ranks' rows ``packed`` (:func:`pack_config`),
    named as this rank's ``table`` names it, with every rank's value; only the class where the
    ranks' layers are of different classes."""
    names = [name for name, _ in table[:MAX_FIELDS]]
    out = []
    for j in range(MAX_FIELDS):
        cells = [row[j * WORDS_PER_FIELD:(j + 1) * WORDS_PER_FIELD] for row in packed]
        if len({c[0] for c in cells}) > 1:
            name = names[j] if j < len(names) else f"field {j}"
            out.append(f"{name} differs: " + ", ".join(f"rank {r}: {_text(c)}" for r, c in enumerate(cells)))
            if j == 0:  # layers of different classes: their other fields do not line up
                break
    return "; ".join(out) or f"a field past the first {MAX_FIELDS} differs"


# ----------------------------------------------------------------- inputs equal on every rank
def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as an integer tensor that ``sum(dtype=torch.int64)`` takes (a view where one
    fits: floats, complex and bools by their width; integers as they are)."""
    if t.dtype in _SUMMABLE:
        return t
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        ints = _INTS.get(t.element_size())
        return t.view(ints) if ints is not None else t.contiguous().view(torch.uint8)
    return t.to(torch.int64)


@torch.no_grad()
def fingerprints(tensors: Sequence[Optional[torch.Tensor]]) -> Tuple[int, ...]:
    """Three int64s per tensor ([Note: input checks]): ``(0, 0, 0)`` for None, else a digest of
    its shape and dtype, and the sums of its bits (:func:`_bits`) over each row weighted by the
    row's index + 1, and over each column (last dim) weighted likewise. Reduced on the tensors'
    devices, read in one host copy per device."""
    out: List[list] = []
    sums: dict = {}  # device -> [(position in out, sum)]
    for t in tensors:
        if t is None:
            out.append([0, 0, 0])
            continue
        out.append([zlib.crc32(repr((tuple(t.shape), str(t.dtype))).encode()) + 1, 0, 0])
        if t.numel() == 0:
            continue
        bits = _bits(t)
        grid = bits.reshape(-1, bits.shape[-1] if bits.dim() else 1)
        for j, dim in ((1, 1), (2, 0)):
            part = grid.sum(dim=dim, dtype=torch.int64)
            weighted = (part * torch.arange(1, part.numel() + 1, device=part.device)).sum()
            sums.setdefault(t.device, []).append((len(out) - 1, j, weighted))
    for held in sums.values():
        for (i, j, _), v in zip(held, torch.stack([w for _, _, w in held]).tolist()):
            out[i][j] = v
    return tuple(v for row in out for v in row)


def input_difference(names: Sequence[str], table: Sequence[Sequence[int]]) -> Optional[str]:
    """The inputs ``names`` whose :func:`fingerprints` differ across the ranks' rows ``table``,
    each with the ranks holding each value (groups of equal values, in rank order), or None."""
    out = []
    for j, name in enumerate(names):
        groups: dict = {}
        for r, row in enumerate(table):
            groups.setdefault(tuple(row[3 * j:3 * j + 3]), []).append(r)
        if len(groups) > 1:
            out.append(f"{name} differs across ranks: ranks with equal values: "
                       + " | ".join(", ".join(map(str, ranks)) for ranks in groups.values()))
    return "; ".join(out) or None
