"""One thread for all of a model's work: load it, and run every turn on that same thread.

Why: torch and our C kernels parallelise with OpenMP (libgomp), which keeps a pool of worker threads for each
thread that starts parallel regions. With two such pools (a model loaded on one thread and run on another) there
are more OpenMP threads than cores on a small machine, and libgomp then stops spinning between regions and puts its
workers to sleep after each one; a decode step runs dozens of short regions. Measured on 2 cores (the default
model, 128 tokens): 35.6 tok/s decoding on a second thread against 68-75 tok/s on the thread that loaded the model.
The app's worker thread loads and runs its model itself; the CLI and the server use EngineThread.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future


class EngineThread:
    """A daemon thread running submitted calls one at a time, in order (a process that exits does not wait)."""

    def __init__(self, name: str = "engine"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put(((lambda: fn(*args, **kwargs)) if args or kwargs else fn, future))
        return future

    def call(self, fn: Callable, *args, **kwargs):
        """Run on the engine thread and wait for the result (its exception is raised here)."""
        return self.submit(fn, *args, **kwargs).result()


class DecodeThreads:
    """How many OpenMP threads a CPU decode step runs on, chosen by timing the steps themselves.

    A decode step is dozens of short parallel regions, each ending at a barrier. On a machine whose cores are busy
    with other work, a thread that waits at a barrier gives up its time slice and the step waits for the scheduler
    at every region: measured on 2 cores with other processes keeping them busy (load 4-5), the default model
    decoded at 16-19 tok/s on two threads against 110-160 on one. On an idle machine two threads are ~1.6x faster
    than one, and letting threads sleep at once (OMP_WAIT_POLICY=PASSIVE) cost 2.5x there. So each step is timed:
    every WINDOW steps the median is kept for the thread count in use, the other count is tried for PROBE_WINDOW
    steps from time to time (first after 64 steps, then PROBE_AFTER, doubling while the choice holds, at once when
    the steps turn twice as slow as the best window since the last probe), and the faster is kept. The choice lives as long as the
    process, so a long-running app pays for the probes less and less. Prefill keeps every thread (its regions are long).
    DSV41_DECODE_THREADS=fixed turns this off."""

    WINDOW = 8
    PROBE_WINDOW = 4
    PROBE_AFTER = 64
    LONGEST_WAIT = 4096

    def __init__(self, full: int):
        self.full = max(1, full)
        self.use = self.full
        self.window: list[float] = []
        self.medians: dict[int, float] = {}
        self.best: dict[int, float] = {}
        self.probing = False
        self.wait = 64  # the first probe comes early: the process learns which is faster on this machine now
        self.backoff = self.PROBE_AFTER

    @property
    def other(self) -> int:
        return 1 if self.use == self.full else self.full

    def step(self, seconds: float) -> int:
        """One decode step took `seconds` on `self.use` threads: the thread count for the next step."""
        if self.full == 1:
            return 1
        self.window.append(seconds)
        if len(self.window) < (self.PROBE_WINDOW if self.probing else self.WINDOW):
            return self.use
        median = sorted(self.window)[len(self.window) // 2]
        self.window.clear()
        self.medians[self.use] = median
        self.best[self.use] = min(self.best.get(self.use, median), median)
        if self.probing:  # the probe's window is done: keep the faster
            self.probing = False
            tried, before = self.use, self.other
            faster = tried if median < self.medians.get(before, float("inf")) else before
            self.backoff = self.PROBE_AFTER if faster != before else min(self.backoff * 2, self.LONGEST_WAIT)
            self.use, self.wait = faster, self.backoff
            # "twice as slow" counts from now on: steps that grow with the context do not set off a probe each window
            self.best[faster] = self.medians[faster]
            return self.use
        self.wait -= self.WINDOW
        if self.wait <= 0 or median > 2 * self.best[self.use]:
            self.use, self.probing = self.other, True
        return self.use


_DECODE_THREADS: DecodeThreads | None = None


def decode_threads() -> DecodeThreads | None:
    """The process's DecodeThreads (None when turned off, or with one thread)."""
    global _DECODE_THREADS
    import os

    if os.environ.get("DSV41_DECODE_THREADS", "adapt").lower() == "fixed":
        return None
    if _DECODE_THREADS is None:
        import torch

        _DECODE_THREADS = DecodeThreads(torch.get_num_threads())
    return _DECODE_THREADS if _DECODE_THREADS.full > 1 else None


@contextlib.contextmanager
def ctrl_c_sets(event: threading.Event):
    """Within it, Ctrl-C sets `event` from a handler of our own on the main thread. The default handler raises
    KeyboardInterrupt, which can be lost: Python runs a signal's handler at its next step, which may be inside an
    object's finalizer run by the garbage collector, and an exception there is printed and dropped; a handler that
    sets an event has done its work wherever it ran. Off the main thread, or where the handler was set from C,
    nothing changes (the caller's `except KeyboardInterrupt` is the way then)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
