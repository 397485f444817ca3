"""Where a serving process's threads spend their wall time: every thread's Python stack sampled at
a fixed interval, counted as collapsed stacks (``thread;file:function;... count``, the input of
flamegraph.pl and speedscope) and written when the process exits.

``SCORER_STACK_SAMPLES=PATH`` (and ``SCORER_STACK_SAMPLE_MS``, default 2) turns it on for the
process that runs the engine: for hosts where py-spy cannot attach (a GPU VM without ptrace).
``scorer serve`` writes PATH; an engine process of its own (a Ray replica's, ``engine_process``)
writes ``PATH.engine-<pid>``, so that the replicas of a host keep a file each. A
sample takes the interpreter lock, as any Python thread does; at 2 ms it holds it for tens of
microseconds. A stack that ends in a wait (a lock, a queue, ``select``) is a thread idle, not busy.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections import Counter

log = logging.getLogger(__name__)


class StackSampler:
    def __init__(self, path: str, interval_s: float = 0.002) -> None:
        self.path, self.interval_s = path, interval_s
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def sample(self) -> None:
        """One sample of every thread but the sampler's."""
        names = {t.ident: t.name for t in threading.enumerate()}
        own = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == own:
                continue
            stack = []
            while frame is not None:
                code = frame.f_code
                stack.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                frame = frame.f_back
            stack.append(names.get(ident, str(ident)))
            self.counts[";".join(reversed(stack))] += 1
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        """Stop sampling and write the counts, most frequent first."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with open(self.path, "w") as out:
            for stack, n in self.counts.most_common():
                out.write(f"{stack} {n}\n")
        log.info("%d stack samples of %d stacks written to %s", self.samples, len(self.counts), self.path)


def from_environment(suffix: str = "") -> StackSampler | None:
    """The sampler ``SCORER_STACK_SAMPLES`` asks for, started, writing to that path plus
    ``suffix`` (a process of several on one host: its own file); None when it is unset."""
    path = os.environ.get("SCORER_STACK_SAMPLES")
    if not path:
        return None
    interval_ms = float(os.environ.get("SCORER_STACK_SAMPLE_MS", "2"))
    return StackSampler(path + suffix, interval_ms / 1e3).start()
