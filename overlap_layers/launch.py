"""Run a function on every rank: under torchrun, or by starting local gloo ranks (CPU).

Reference: ``run_ranks(fn, *args, nprocs=2)`` calls ``fn(device, *args)`` once on every rank with
the default process group initialised, then collects fn's garbage and destroys the group:

* under torchrun (``RANK`` and ``WORLD_SIZE`` set): NCCL with one GPU per local rank when CUDA is
  available, else gloo on the CPU;
* otherwise: ``nprocs`` local processes (fork on Linux: the ranks inherit the parent's imports;
  spawn elsewhere) joined by gloo over a file store, on the CPU with one thread each.

A failing rank makes the parent exit with the rank's error. Used by the benchmark and the examples.
"""
from __future__ import annotations

import gc
import os
import sys
import tempfile
from typing import Callable

import torch
import torch.distributed as dist

from .config import check_positive_int


def _init(rank: int, world: int, store_path) -> torch.device:
    if store_path is None and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        return device
    torch.set_num_threads(1)
    if store_path is not None:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
    return torch.device("cpu")


def _rank_main(rank: int, world: int, store_path, fn: Callable, args: tuple) -> None:
    device = _init(rank, world, store_path)
    try:
        fn(device, *args)
    finally:
        # fn's objects (layers hold the group) are collected first, so that destroying the group
        # frees it and joins gloo's worker threads now. Left to interpreter exit, a worker that
        # releases a finished collective's tensors there needs the GIL and aborts the process.
        gc.collect()
        dist.destroy_process_group()


def run_ranks(fn: Callable, *args, nprocs: int = 2) -> None:
    """See the module docstring. ``fn`` must be picklable (a module-level function) off Linux."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, fn, args)
        return
    check_positive_int(nprocs, "nprocs")
    import torch.multiprocessing as mp
    fd, store = tempfile.mkstemp(prefix="overlap_ranks_")
    os.close(fd)
    os.unlink(store)
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    try:
        mp.start_processes(_rank_main, args=(nprocs, store, fn, args), nprocs=nprocs, join=True,
                           start_method=method)
    except mp.ProcessRaisedException as e:
        sys.exit(f"a rank failed:\n{e}")
    except mp.ProcessExitedException as e:
        sys.exit(f"a rank exited: {e}")
    finally:
        if os.path.exists(store):
            os.unlink(store)
