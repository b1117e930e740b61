"""One thread for all of a model's work: load it, and run every turn on that same thread.

Why: torch and our C kernels parallelise with OpenMP (libgomp), which keeps a pool of worker threads for each
thread that starts parallel regions. With two such pools (a model loaded on one thread and run on another) there
are more OpenMP threads than cores on a small machine, and libgomp then stops spinning between regions and puts its
workers to sleep after each one; a decode step runs dozens of short regions. Measured on 2 cores (the default
model, 128 tokens): 35.6 tok/s decoding on a second thread against 68-75 tok/s on the thread that loaded the model.
The app's worker thread loads and runs its model itself; the CLI and the server use EngineThread.
"""

from __future__ import annotations

import queue
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
