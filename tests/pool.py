"""A pool of gloo ranks started once per world size and reused by every test (the distributed
tier: tests that need a process group but no GPU).

``pool.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank at once and returns
the per-rank results, or raises :class:`RankFailure` carrying every rank's outcome. Workers are
started with the ``spawn`` method (forking a parent that has started threads, e.g. CUDA's on the
GPU machine, deadlocked a worker there) and use one thread. After a failure the pool
checks that the group still works (a barrier under a short timeout) and is rebuilt if not, so one
broken test cannot hang the ones after it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta

GROUP_TIMEOUT_S = 20
RESULT_TIMEOUT_S = 90


class RankFailure(Exception):
    def __init__(self, outcomes):
        self.outcomes = outcomes  # per rank: ("ok", value) | ("err", exc_type_name, message, tb) | ("timeout",)
        lines = []
        for r, o in enumerate(outcomes):
            lines.append(f"rank {r}: {o[0]}" + (f" {o[1]}: {o[2]}\n{o[3]}" if o[0] == "err" else ""))
        super().__init__("\n".join(lines))

    def errors(self):
        """Per rank, (exception type name, message), or None for a rank that did not raise."""
        return [(o[1], o[2]) if o[0] == "err" else None for o in self.outcomes]


def expect_value_error_on_every_rank(pool, fn, *args, match):
    """``pool.run(fn, *args)`` must raise ValueError on every rank, each message holding ``match``
    (a string, or a tuple of acceptable strings: any one of them)."""
    import pytest
    with pytest.raises(RankFailure) as info:
        pool.run(fn, *args, timeout=60)
    errs = info.value.errors()
    assert all(e is not None and e[0] == "ValueError" for e in errs), info.value
    alts = match if isinstance(match, tuple) else (match,)
    assert all(any(m in e[1] for m in alts) for e in errs), [e[1] for e in errs]


def assert_dense_round_trip(dense: dict, same: dict, case: dict, params) -> None:
    """A layer's ``to_dense()`` (``dense``) returned exactly the dense ``case`` tensors it was built
    from (None where the case has none), and ``same`` (name -> bool) is all true."""
    import torch
    assert set(dense) == set(params), sorted(dense)
    for n in params:
        if case[n] is None:
            assert dense[n] is None, n
        else:
            assert torch.equal(dense[n], case[n]), n
    assert all(same.values()), same


def all_reduce_ranks(rank, world_size):
    """The sum of rank + 1 over the group: a pool that still works after failures answers it."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def call_each(layers, x, loss):
    """Per layer, one call on ``x`` and ``loss(y).backward()`` from cleared gradients:
    ``[y, x.grad, *parameter grads]``."""
    out = []
    for m in layers:
        m.zero_grad(set_to_none=True)
        x.grad = None
        y = m(x)
        loss(y).backward()
        out.append([y.detach(), x.grad, *[p.grad for p in m.parameters()]])
    return out


def torchrun(nprocs: int, args, *, env=None, **kwargs) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nprocs args...`` as a subprocess (output captured as
    text; ``kwargs`` go to :func:`subprocess.run`). ``--standalone`` takes a free port, so test
    processes that run at once (the GPU machine's parallel shards) do not collide on 29500; the
    parent's rank variables are dropped from ``env`` (default: this process's environment)."""
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
                           *map(str, args)], env=env, capture_output=True, text=True, **kwargs)


def _worker(rank, world_size, store_path, conn):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(rank, world_size, *args)))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            conn.send(("err", type(e).__name__, str(e), traceback.format_exc()))
    dist.destroy_process_group()


def _barrier(rank, world_size):
    import torch.distributed as dist

    dist.barrier()
    return True


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs, self._conns = [], []
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        fd, path = tempfile.mkstemp(prefix="overlap_store_")
        os.close(fd)
        os.unlink(path)
        self._store_path = path
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world_size, path, child), daemon=True)
            p.start()
            self._procs.append(p)
            self._conns.append(parent)

    def close(self):
        for c in self._conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns = [], []
        if os.path.exists(self._store_path):
            os.unlink(self._store_path)

    def _restart(self):
        for p in self._procs:
            p.kill()
            p.join()
        self._procs, self._conns = [], []
        self._start()

    def _call(self, fn, args, timeout):
        for c in self._conns:
            try:
                c.send((fn, args))
            except (BrokenPipeError, OSError):
                pass
        outcomes = []
        for c in self._conns:
            try:
                outcomes.append(c.recv() if c.poll(timeout) else ("timeout",))
            except (EOFError, OSError):  # the worker died
                outcomes.append(("timeout",))
        return outcomes

    def run(self, fn, *args, timeout: float = RESULT_TIMEOUT_S):
        outcomes = self._call(fn, args, timeout)
        if all(o[0] == "ok" for o in outcomes):
            return [o[1] for o in outcomes]
        if any(o[0] == "timeout" for o in outcomes):
            self._restart()
        else:
            try:
                healthy = all(o[0] == "ok" for o in self._call(_barrier, (), GROUP_TIMEOUT_S + 5))
            except (EOFError, BrokenPipeError, OSError):
                healthy = False
            if not healthy:
                self._restart()
        raise RankFailure(outcomes)
