"""A same-host all-gather of small rows of numbers through shared memory, for the agreement.

Reference: ``HostMailbox.gather(values, floats)`` returns what an all-gather of ``values`` over
the group returns (one tuple per rank, in group-rank order), like the gloo path of
:class:`~overlap_layers.runtime.group.Agreement`.

[Note: host mailbox]
Every layer call starts with the agreement gather ([Note: agreement]). Over gloo that is a TCP
round trip through every rank's gloo thread, about half a millisecond at 4 ranks (the bench's
``host_agreement_us``), host time in every call, which is what bounds layers whose GPU time is a
few ms (measured: see docs/measurements.md, Host overhead). When every rank of the group runs on one x86-64 Linux host, the ranks
share a small file in /dev/shm instead, each mapping it:

* call n uses parity n % 2; rank r writes its row into its slot of that parity, then stamps the
  slot with n; every rank waits until all slots of the parity carry n and reads the rows;
* the stamp is written last and read first, and x86-64 keeps a core's stores in program order and
  its loads in program order (TSO), so a rank that sees the stamp sees the row;
* two parities suffice: a rank reaches call n+2, which rewrites parity n, only after every rank
  stamped call n+1, which each did only after reading every row of call n;
* rows longer than one slot go in several rounds; the first round carries each rank's length, and
  different lengths raise the same ValueError on every rank.

Every rank still issues every gather, so the agreement's argument against hangs is unchanged. A
waiting rank spins briefly, then yields its core, then sleeps; it checks that the ranks it waits
for are still alive and raises RuntimeError if one exited or the wait outlasts the timeout.
A wait that raised leaves the ranks out of step (the raising rank stamped a call its peers may
never make), so the rank stamps both its slots ``POISON`` (:meth:`HostMailbox.poison`): a peer
that waits on it raises within a second instead of reading a stale row or waiting out the
timeout, and the rank's own later gathers raise at once. Rows of different lengths raise
ValueError on every rank alike and leave the ranks in step. The mailbox is set up at the first
gather by two gloo gathers (one host, x86-64, the file opens on every rank, every peer process
visible); otherwise the gloo path stays. The file is unlinked once every rank has mapped it, so
nothing is left behind.
"""
from __future__ import annotations

import array
import mmap
import os
import platform
import secrets
import socket
import sys
import time
import zlib
from typing import Callable, List, Optional, Sequence, Tuple

WORDS = 256  # numbers per slot and round
_HEAD = 2  # stamp, row length
_ROW = _HEAD + WORDS
_SPINS = 2000  # busy polls before the waiting rank starts yielding its core
POISON = -1  # the stamp of a rank whose gather raised (a call's stamp is positive)


def _capable() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") \
        and os.path.isdir("/dev/shm")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class HostMailbox:
    """See the module docstring. Build one with :meth:`open`."""

    def __init__(self, mm: mmap.mmap, ws: int, rank: int, pids: Sequence[int], timeout_s: float) -> None:
        self._mm = mm
        self._q = memoryview(mm).cast("q")
        self._d = memoryview(mm).cast("d")
        self.ws, self.rank, self._pids, self._timeout = ws, rank, tuple(pids), timeout_s
        self._seq = 0
        self.failed: Optional[str] = None  # why a gather of this rank raised: see poison()

    @classmethod
    def open(cls, gather: Callable[[Sequence[int]], List[Tuple[int, ...]]], ws: int, rank: int,
             timeout_s: float) -> Optional["HostMailbox"]:
        """A collective over the group whose gloo all-gather is ``gather``: the mailbox, or None
        on every rank where any rank cannot use one (then the caller keeps gloo)."""
        capable = _capable()
        host = zlib.crc32(socket.gethostname().encode())
        token = secrets.randbits(48)
        size = 2 * ws * _ROW * 8
        path = f"/dev/shm/overlap_layers_agree_{os.getpid()}_{token:x}"
        fd, created = -1, False
        if capable and rank == 0:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
                os.ftruncate(fd, size)
            except OSError:
                capable = False
        table = gather((int(capable), host, os.getpid(), token))
        mm = None
        ok = all(row[0] for row in table) and len({row[1] for row in table}) == 1
        if ok:
            pids = [row[2] for row in table]
            try:
                if rank != 0:
                    fd = os.open(f"/dev/shm/overlap_layers_agree_{pids[0]}_{table[0][3]:x}", os.O_RDWR)
                mm = mmap.mmap(fd, size)
                ok = all(_alive(p) for p in pids)
            except OSError:
                ok = False
        if fd >= 0:
            os.close(fd)
        agreed = all(row[0] for row in gather((int(ok),)))
        if created:  # every rank has mapped it (or given up) by now
            os.unlink(path)
        if not agreed:
            if mm is not None:
                mm.close()
            return None
        return cls(mm, ws, rank, pids, timeout_s)

    def poison(self, why: str) -> None:
        """Mark this rank's slots ``POISON`` after a gather that raised (``why``): every later
        gather raises, here and on the peers that wait for this rank (module docstring)."""
        self.failed = why
        for parity in (0, self.ws):
            self._q[(parity + self.rank) * _ROW] = POISON

    def gather(self, values: Sequence, floats: bool = False) -> List[Tuple]:
        """One row per rank (group-rank order); ``floats``: float64 numbers, else int64."""
        if self.failed is not None:
            raise RuntimeError(f"an earlier gather of this rank failed ({self.failed}); the group is out of step: "
                               f"destroy and re-create it")
        cast = float if floats else int
        values = [cast(v) for v in values]
        n = len(values)
        rows: List[list] = [[] for _ in range(self.ws)]
        start = 0
        while True:
            chunk = values[start:start + WORDS]
            try:
                lengths = self._round(n, chunk, floats, rows)
            except BaseException as e:  # a timeout, an exited peer, an interrupt: out of step from here
                self.poison(str(e) or type(e).__name__)
                raise
            if start == 0 and len(set(lengths)) > 1:  # every rank read every length: every rank raises
                raise ValueError("the ranks gathered rows of different lengths: " + ", ".join(
                    f"rank {r}: {m}" for r, m in enumerate(lengths)))
            start += WORDS
            if start >= n:
                return [tuple(r) for r in rows]

    def _round(self, n: int, chunk: list, floats: bool, rows: List[list]) -> List[int]:
        self._seq += 1
        seq, q = self._seq, self._q
        view = self._d if floats else q
        parity = (seq & 1) * self.ws
        mine = (parity + self.rank) * _ROW
        view[mine + _HEAD:mine + _HEAD + len(chunk)] = memoryview(array.array("d" if floats else "q", chunk))
        q[mine + 1] = n
        q[mine] = seq  # the stamp last: see the module docstring
        lengths = []
        for r in range(self.ws):
            base = (parity + r) * _ROW
            if q[base] != seq:
                self._wait(base, seq, r)
            lengths.append(q[base + 1])
            rows[r].extend(view[base + _HEAD:base + _HEAD + len(chunk)].tolist())
        return lengths

    def _wait(self, base: int, seq: int, r: int) -> None:
        q, spins, start, checked = self._q, 0, None, 0.0
        while q[base] != seq:
            spins += 1
            if spins < _SPINS:
                continue
            now = time.monotonic()
            if start is None:
                start = checked = now
            waited = now - start
            if waited < 0.002:
                os.sched_yield()
            else:
                time.sleep(5e-5 if waited < 0.1 else 1e-3)
            if waited > self._timeout:
                raise RuntimeError(f"rank {r} of the group did not arrive within {self._timeout:.0f} s")
            if now - checked > 1.0:
                checked = now
                if q[base] == POISON:
                    raise RuntimeError(f"rank {r} of the group failed in an earlier gather (its error names "
                                       f"why); the group is out of step: destroy and re-create it")
                if not _alive(self._pids[r]):
                    raise RuntimeError(f"rank {r} of the group (pid {self._pids[r]}) exited while this rank "
                                       f"waited for its row")

