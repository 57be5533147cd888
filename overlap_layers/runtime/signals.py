"""Signals between ranks' streams that take no SM ([Note: signals without SMs]).

Reference: :meth:`StreamSignals.put` and :meth:`StreamSignals.wait` order the streams as the
symmetric-memory handle's ``put_signal(dst, channel)`` and ``wait_signal(src, channel)`` do: a
wait on rank r for (src, channel) lets r's stream go on once src's stream has reached its put for
(r, channel), and consumes that put. They use the same flags (rank r's signal pad, word
``world_size * channel + src``), so either end may be the handle's kernel.

[Note: signals without SMs]
The handle's put and wait are kernels of one warp. Queued on a copy stream beside a GEMM that
holds every SM (cuBLAS's persistent kernels do, for their whole run), such a kernel starts only
when an SM frees: session 35 saw a put wait 23 us for one beside the attention's projection, and
a wait on the pull stream, queued before the first pull, can hold that pull back the same way.
A stream memory operation runs in the stream's front end instead: ``cuStreamWriteValue32`` (the
handle's static ``stream_write_value32``) writes the flag once the stream's earlier work is done,
after a system-wide memory fence, so the peer sees the data the stream copied before it; and
``cuStreamWaitValue32`` (called through the driver library, which torch does not wrap) holds the
stream until the flag reads 1. The wait then writes the flag back to 0 (the handle's wait kernel
does both in one compare-and-swap).

The put writes 1 without first waiting for the flag to read 0 (the handle's put spins until it
does), and the wait's reset is a separate write: both are safe only for a protocol that never puts
a flag again before the wait that consumes it has reset it, which [Note: exchange signals] gives
(each rank's next put on a flag is ordered after a signal this rank puts after its reset).
Where the driver lacks the calls (or torch the write), the handle's kernels run instead.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ

# The planner's key for a timed signal to one neighbour and one back, each flag put again only
# after its wait (a put-then-wait ring repeated in a row would put before the peer's wait): the
# cost models take half of it as one signal's latency.
SIGNAL_THERE_AND_BACK = "signal_there_and_back"


def _driver_wait() -> Optional[ctypes._CFuncPtr]:
    """The driver's ``cuStreamWaitValue32`` (its ``_v2`` entry point where it has one), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


class StreamSignals:
    """Per-peer signal flags of one symmetric-memory handle, put and waited by stream memory
    operations where the driver has them (see the module docstring); ``stream_ops`` says whether
    it does."""

    def __init__(self, handle, world_size: int, rank: int, channels: int = 2):
        self.handle, self.ws, self.rank = handle, world_size, rank
        write = getattr(type(handle), "stream_write_value32", None)
        wait = _driver_wait() if write is not None else None
        self.stream_ops = wait is not None
        self._write, self._wait = write, wait
        if self.stream_ops:
            n = world_size * channels
            self._pads = [handle.get_signal_pad(p, (n,), torch.uint32) for p in range(world_size)]

    def put(self, dst: int, channel: int) -> None:
        """Tell ``dst`` (on its ``channel``) that the current stream's earlier work is done."""
        if not self.stream_ops:
            self.handle.put_signal(dst, channel)
            return
        self._write(self._pads[dst], self.ws * channel + self.rank, 1)

    def wait(self, src: int, channel: int) -> None:
        """Hold the current stream until ``src`` has put on ``channel``, and consume that put."""
        if not self.stream_ops:
            self.handle.wait_signal(src, channel)
            return
        own, word = self._pads[self.rank], self.ws * channel + src
        stream = torch.cuda.current_stream(own.device).cuda_stream
        err = self._wait(ctypes.c_void_p(stream), own.data_ptr() + 4 * word, 1, _WAIT_EQ)
        if err:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {err} (signal from rank {src}, "
                               f"channel {channel})")
        self._write(own, word, 0)
