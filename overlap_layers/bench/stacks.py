"""Where a rank's host stalls: a sampler of every thread's Python stack (``--sample-stacks DIR``).

Reference: while a :class:`StackSampler` runs, a daemon thread records every other thread's
stack (its innermost ``depth`` frames) every ``interval_s``; :meth:`StackSampler.report` lists

* each stretch of at least ``min_s`` in which one thread's stack stayed the same (from the
  first sample with that stack to the last), innermost frame first;
* each gap of at least ``min_s`` between two samples: some thread held the GIL in C code all
  that time (the stacks on either side are the first and last samples of the gap).

It shows where the host time of slow verification trials goes (Triton compiles, cuDNN graph
builds, first backward passes, and the other ranks' waits for them). A stretch needs two
samples, so nothing shorter than ``interval_s`` shows; sampling costs the GIL for about a
millisecond per sample.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional, Tuple

Stack = Tuple[str, ...]


def _stack(frame, depth: int) -> Stack:
    return tuple(f"{os.path.basename(fs.filename)}:{fs.lineno} {fs.name}"
                 for fs in traceback.extract_stack(frame)[-depth:])


class StackSampler:
    """Samples every other thread's stack every ``interval_s`` while running (see the module
    docstring); ``with StackSampler() as s: ...`` then ``s.report()``."""

    def __init__(self, interval_s: float = 0.02, depth: int = 16):
        self.interval_s, self.depth = interval_s, depth
        self.samples: List[Tuple[float, Dict[str, Stack]]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "StackSampler":
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            frames = sys._current_frames()
            self.samples.append((time.perf_counter(), {f"{names.get(i, '?')} {i}": _stack(f, self.depth)
                                                       for i, f in frames.items() if i != me}))
            time.sleep(self.interval_s)

    def report(self, min_s: float = 0.15) -> str:
        """The stretches and gaps of at least ``min_s`` (module docstring), in time order; times
        in seconds from the first sample."""
        if not self.samples:
            return ""
        t0, found = self.samples[0][0], []
        for (a, stacks_a), (b, stacks_b) in zip(self.samples, self.samples[1:]):
            if b - a >= min_s:
                found.append((a, f"GAP {b - a:.3f}s at {a - t0:.2f}s (no sample: a thread held the GIL)"))
        threads = sorted({name for _, stacks in self.samples for name in stacks})
        for name in threads:
            seq = [(t, stacks[name]) for t, stacks in self.samples if name in stacks]
            i = 0
            while i < len(seq):
                j = i
                while j + 1 < len(seq) and seq[j + 1][1] == seq[i][1]:
                    j += 1
                if seq[j][0] - seq[i][0] >= min_s:
                    frames = "\n  ".join(reversed(seq[i][1]))
                    found.append((seq[i][0], f"SAME {seq[j][0] - seq[i][0]:.3f}s at {seq[i][0] - t0:.2f}s, thread "
                                             f"{name}:\n  {frames}"))
                i = j + 1
        return "\n".join(text for _, text in sorted(found, key=lambda f: f[0])) + "\n"
