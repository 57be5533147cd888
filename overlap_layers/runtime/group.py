"""Process groups from ``group=`` / ``mesh=`` / ``axis=`` and cross-rank agreement.

[Note: agreement]
Every decision that changes which collectives a layer issues must be identical on every rank
by construction: a collective that some ranks issue and others do not hangs the group. A layer therefore starts *every* call with
:meth:`Agreement.gather`: one tiny all-gather of the numbers its plan depends on (input shape,
dtype, tile count, grad mode, plan hash, a local input-error code). Every rank issues it
unconditionally, so it cannot hang, and every rank sees the same gathered table, so either every
rank proceeds or every rank raises the same ValueError. A per-rank "new shape" branch that
issued its own collective could hang.
The gather runs on the host: on the group itself when it has a gloo backend, otherwise on a gloo
twin of the group (same ranks) created at the first call by the group's members alone. Doing it
over NCCL would need a host sync on a device result every call, which drains the GPU queue and
exposes all host launch overhead (about 0.3 ms per MLP call). When the whole
group shares one x86-64 Linux host, the gather goes through a shared-memory mailbox instead of
gloo, a few microseconds instead of 0.3-0.5 ms ([Note: host mailbox] in ``runtime/mailbox.py``).
The layers of one group share one Agreement (:func:`shared_agreement`): one gloo twin and one
mailbox per group, not per layer (a deep model would otherwise create a gloo group and a
/dev/shm file for every layer). Sharing is safe because every rank calls the group's layers in
the same order, as their collectives already require; a rank that calls another layer than its
peers then gathers a row of another shape or content, which raises on every rank instead of
mixing calls. The share lives as long as the group object (not as long as some layer), so whether
a layer finds it never depends on when each rank's garbage collector freed the layers before it:
a rank that made a new Agreement would set up a mailbox with gloo gathers while a rank that
reused one gathered through the mailbox. torch's process-group registry holds every group until
``destroy_process_group``, on every rank alike. The share holds its group only weakly, so once
the group is destroyed and its layers are gone, the group, its gloo twin and the mailbox are
freed then, not at interpreter exit, where a gloo worker thread that releases a finished
collective's tensors needs the GIL and aborts the process. Gathers of one group must come from
one thread at a time.
Every gather waits the group's own timeout (:func:`group_timeout`), and its errors say which
gather it was (``who``: the layer, its module name where known, and its call) and, through the
mailbox, which rank did not arrive. A gather that failed leaves the group out of step (the
mailbox poisons its slots, gloo closes its pairs), so the group's later gathers raise at once
on this rank and, through the mailbox, within a second on its peers: after a timeout the group
must be re-created, as after any collective's timeout.
"""
from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .collectives import all_gather_single
from .mailbox import HostMailbox


def resolve_group(group=None, mesh=None, axis=None):
    """The ProcessGroup named by exactly one of ``group`` or ``mesh`` (+ ``axis``)."""
    if (group is None) == (mesh is None):
        raise ValueError("pass exactly one of group= (a ProcessGroup) or mesh= (a DeviceMesh); "
                         f"got group={group!r}, mesh={mesh!r}")
    if group is not None:
        if axis is not None:
            raise ValueError(f"axis={axis!r} is only valid with mesh=; with group= leave it None")
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group={group!r} is not a torch.distributed.ProcessGroup")
        return group
    if mesh.ndim == 1:
        if axis not in (None, 0) and axis not in (mesh.mesh_dim_names or ()):
            raise ValueError(f"axis={axis!r} is not a dim of the 1-D mesh {mesh}")
        return mesh.get_group()
    if axis is None:
        raise ValueError(f"mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; pass axis= naming "
                         "the tensor-parallel dim")
    return mesh.get_group(axis)


def group_timeout(group) -> timedelta:
    """The timeout ``group`` was created with (its backend's, on any of its devices), or torch's
    default where the backend does not say: the agreement's gathers wait as long as the group's
    collectives do."""
    for device in ("cuda", "cpu"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return dist.default_pg_timeout


class PlanMismatchError(RuntimeError):
    """Ranks of one group chose different plans for the same call (raised on every rank)."""


class Agreement:
    """Gathers small integer tuples from every rank of ``group`` on the host; see
    [Note: agreement]."""

    def __init__(self, group, shared_memory: bool = True) -> None:
        """``shared_memory=False``: always gloo, never the same-host mailbox. Holds ``group``
        weakly: its caller (a layer) holds it."""
        self._group = weakref.ref(group)
        self._twin = None  # the gloo twin of a group without a gloo backend
        self._ready = False
        self._shared_memory = shared_memory
        self.mailbox: Optional[HostMailbox] = None
        self.layers = 0  # layers made on this group by this rank (new_layer)

    @property
    def group(self):
        group = self._group()
        if group is None:
            raise RuntimeError("the Agreement's process group was destroyed")
        return group

    def _host(self):
        if not self._ready:
            timeout = group_timeout(self.group)
            if "gloo" not in str(dist.get_backend(self.group)):
                self._twin = dist.new_group(dist.get_process_group_ranks(self.group), backend="gloo",
                                            use_local_synchronization=True, timeout=timeout)
            self._ready = True
            if self._shared_memory and dist.get_world_size(self.group) > 1:
                self.mailbox = HostMailbox.open(self._gloo_gather, dist.get_world_size(self.group),
                                                dist.get_rank(self.group), timeout.total_seconds())

    def _gloo_group(self):
        return self._twin if self._twin is not None else self.group

    def new_layer(self) -> int:
        """The index of a new layer among the group's layers made on this rank (0, 1, ...): part of
        the layer's description in this agreement's errors."""
        self.layers += 1
        return self.layers - 1

    def gather(self, values: Sequence, dtype=torch.int64, who: Optional[Callable[[], str]] = None) -> List[Tuple]:
        """One tuple per rank of the group (group-rank order) of everyone's ``values``. An error
        (a rank that did not arrive within the group's timeout or exited, rows of different
        lengths) says which gather it was: ``who()``, e.g. the layer and its call."""
        try:
            self._host()
            if self.mailbox is not None and dtype in (torch.int64, torch.float64):
                return self.mailbox.gather(values, floats=dtype == torch.float64)
            return self._gloo_gather(values, dtype)
        except (RuntimeError, ValueError) as e:
            what = "agreement" if who is None else f"agreement of {who()}"
            raise (ValueError if isinstance(e, ValueError) else RuntimeError)(f"{what}: {e}") from e

    def _gloo_gather(self, values: Sequence, dtype=torch.int64) -> List[Tuple]:
        group = self._gloo_group()
        ws = dist.get_world_size(group)
        mine = torch.tensor(list(values), dtype=dtype)
        out = mine.new_empty(ws * len(values))
        all_gather_single(out, mine, group=group)
        return [tuple(r) for r in out.view(ws, len(values)).tolist()]

    def max(self, values: Sequence[float]) -> List[float]:
        """Element-wise maximum over the ranks (float64), identical on every rank."""
        if not values:
            return []
        return [max(col) for col in zip(*self.gather(values, dtype=torch.float64))]

    def min(self, values: Sequence[float]) -> List[float]:
        if not values:
            return []
        return [min(col) for col in zip(*self.gather(values, dtype=torch.float64))]


_AGREEMENTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its Agreement


def shared_agreement(group) -> Agreement:
    """The :class:`Agreement` of ``group``, the same object for every layer of the process that
    asks (see the module docstring)."""
    a = _AGREEMENTS.get(group)
    if a is None:
        a = _AGREEMENTS[group] = Agreement(group)
    return a


def first_disagreement(table: Sequence[Tuple[int, ...]], names: Sequence[str]) -> Optional[str]:
    """A readable description of the first field that differs across ranks, or None. Fields
    named None may differ (e.g. token counts of an expert-parallel layer)."""
    for j, name in enumerate(names):
        if name is None:
            continue
        col = [row[j] for row in table]
        if len(set(col)) > 1:
            return f"{name} differs across ranks: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(col))
    return None
