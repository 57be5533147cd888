"""The symmetric memory a group's copy-engine exchanges share: one rank's buffer, its handle and
copy streams (:class:`SymmetricWorkspace`), shared per group, device and purpose
(:func:`shared_workspace`), and whether a group can use it at all (:func:`symmetric_memory_status`).

Reference: every rank of a group holds the same workspace (the same bytes, grown at the same
calls); the exchanges of one purpose run on it in the same order on every rank ([Note: exchange
signals] in ``runtime/exchange.py``).
"""
from __future__ import annotations

import importlib.util
import warnings
import weakref
from typing import Optional, Tuple

import torch
import torch.distributed as dist


class SymmetricWorkspace:
    """One rank's symmetric buffer for a group (sources, then ws partial slots), its handle and
    the two copy streams; grown collectively when a call needs more bytes.

    Layers get it from :func:`shared_workspace`, so every layer of a group shares one buffer
    (sized for the largest exchange) instead of each holding its own. Its bytes are persistent
    device memory beside the layers'; it is freed when the last layer holding it is. Growing is a
    collective decided from each rank's own size, so every rank must hold the same workspace: the
    bytes a rank holds are a column of every call's agreement (:func:`held_workspace_bytes`), and
    when ranks differ (some still hold the workspace of freed layers) all release theirs first.

    A CUDA graph that captured an exchange copies into this buffer, and its peers' graphs into
    theirs, at every replay: once captured, a buffer outgrown later is kept (with its handle)
    rather than freed, and growing during a capture raises RuntimeError ([Note: CUDA graphs] in
    ``planning/planner.py``)."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.ws, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.nbytes, self._buf, self.handle = 0, None, None
        self.captured = False  # whether a CUDA graph captured an exchange on the current buffer
        self._retired: list = []  # (buffer, handle) outgrown after a capture: graphs still use them
        self._views: dict = {}  # (rank, shape, dtype, offset) -> tensor: every call asks for the same few
        self.pull_stream = torch.cuda.Stream(device=device)
        self.push_stream = torch.cuda.Stream(device=device)

    def reserve(self, nbytes: int) -> None:
        """Grow to at least ``nbytes`` (a collective: every rank passes the same number)."""
        capturing = torch.cuda.is_current_stream_capturing()
        if nbytes <= self.nbytes:
            self.captured |= capturing
            return
        if capturing:
            raise RuntimeError(f"a copy-engine exchange needs {nbytes} symmetric bytes while a CUDA graph is being "
                               f"captured, and the workspace has {self.nbytes}: allocating them is a collective "
                               "with host synchronisation, which capture forbids; run one eager call of this "
                               "shape before capturing")
        from torch.distributed import _symmetric_memory as symm_mem
        if self._buf is not None:
            self.release()
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed on older torch; a deprecated no-op on newer ones
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group.group_name)
        nbytes = -(-nbytes // 4096) * 4096
        self._buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self._buf, self.group)
        self.nbytes = nbytes

    def release(self) -> None:
        """Free the buffer (kept alive instead if a graph captured it) once every rank has drained
        its work, since peers may still read it: a collective, every rank of the group calls it at
        the same point (growing, or :meth:`RankChunkPlans._after_agreement` when the ranks'
        workspaces differ), with or without a buffer."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        if self.captured:
            self._retired.append((self._buf, self.handle))
        self._buf = self.handle = None
        self._views.clear()
        self.nbytes, self.captured = 0, False

    def view(self, rank: int, shape: Tuple[int, ...], dtype: torch.dtype, offset_bytes: int) -> torch.Tensor:
        """Rank ``rank``'s buffer from ``offset_bytes`` as a ``shape`` tensor of ``dtype`` (made
        once per workspace size: a peer buffer's tensor costs host time to build)."""
        key = (rank, tuple(shape), dtype, offset_bytes)
        t = self._views.get(key)
        if t is None:
            if len(self._views) >= 256:  # many shapes (e.g. varying lengths): start over
                self._views.clear()
            elt = dtype.itemsize
            assert offset_bytes % elt == 0
            t = self._views[key] = self.handle.get_buffer(rank, tuple(shape), dtype, offset_bytes // elt)
        return t



_WORKSPACES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _workspace_key(group, device: torch.device, purpose: str) -> tuple:
    """``(id(group), device index, purpose)``: a workspace holds its group, so the id is that
    group's for as long as the entry lives. Not the group's name: names repeat after
    ``destroy_process_group`` and a new ``init_process_group``, while layers of the old group may
    still hold its workspace."""
    return id(group), device.index if device.index is not None else torch.cuda.current_device(), purpose


def shared_workspace(group, device: torch.device, purpose: str = "exchange") -> SymmetricWorkspace:
    """The workspace of ``group`` on ``device`` for ``purpose``, shared by the layers that hold it
    (a weak cache: no layer holding it, no buffer). Exchanges whose protocols differ use
    workspaces of their own: "exchange" for the copy-engine exchanges of this module,
    "device_counts" for ``device_all_to_all.DeviceCountAllToAll`` (its peers write its table
    without waiting for this rank's next call, which another protocol's data there would race)."""
    key = _workspace_key(group, device, purpose)
    w = _WORKSPACES.get(key)
    if w is None:
        w = _WORKSPACES[key] = SymmetricWorkspace(group, torch.device("cuda", key[1]))
    return w


def held_workspace_bytes(group, device: torch.device, purpose: str = "exchange") -> int:
    """Bytes of ``group``'s shared workspace on ``device`` in this process; 0 when it has none
    (CPU included). Never creates one. Ranks can differ here only when some still hold the
    workspace of layers that others have freed (garbage collection runs at different times)."""
    if device.type != "cuda":
        return 0
    w = _WORKSPACES.get(_workspace_key(group, device, purpose))
    return w.nbytes if w is not None else 0


def staged_source(workspace: SymmetricWorkspace, x: torch.Tensor) -> Optional[torch.Tensor]:
    """Where :class:`CopyEngineExchange` copies a first source with ``x``'s elements, as a tensor
    of ``x``'s shape in this rank's buffer (a contiguous source there is not copied again:
    [Note: staged input] in ``planning/call_graphs.py``); None while the buffer is smaller."""
    if workspace.handle is None or workspace.nbytes < aligned(x.numel() * x.element_size()):
        return None
    return workspace.view(workspace.rank, (x.numel(),), x.dtype, 0).view(x.shape)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 256 (each source starts on a 256-byte boundary)."""
    return -(-nbytes // 256) * 256


def symmetric_memory_status(group, device: torch.device) -> str:
    """"" when this group can use the copy-engine transport on ``device``, else why not.

    Local facts only (device type, backend, the symmetric-memory module, peer access); the caller
    agrees the answer across ranks, and that they share one host, before acting on it."""
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError) as e:
        return f"the group has no backend ({e})"
    if "nccl" not in str(backend):
        return f"the group's backend is {backend}, not nccl"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return "torch.distributed._symmetric_memory is missing"
    if dist.get_world_size(group) > torch.cuda.device_count():
        return "the group has more ranks than this host has GPUs"
    me = device.index if device.index is not None else torch.cuda.current_device()
    for other in range(torch.cuda.device_count()):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"cuda:{me} cannot access cuda:{other} as a peer"
    return ""

