"""An executor whose work runs on the thread that calls `CallerThreadExecutor.work`.

`bitquilt serve` steps its batch on the main thread, the one that loaded the model, while uvicorn's event loop runs in
a thread of its own. Every kernel call then runs on one OpenMP thread team: a decode thread of its own would start a
second team beside the one loading made, and with more OpenMP threads than cores libgomp stops spinning between
parallel regions, so that each of the hundreds of regions of a decode step waits for its workers to be woken.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

POLL_S = 0.1  # how often `work` looks at its `until` while no work comes


class CallerThreadExecutor(Executor):
    """Work submitted from any thread, run in order by the thread in `work`."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, dict]] = queue.SimpleQueue()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("cannot schedule new work after shutdown")
        future: Future = Future()
        self._items.put((future, fn, args, kwargs))
        return future

    def work(self, until: Callable[[], bool]) -> None:
        """Run the submitted work, in order, on this thread until `until()` is true."""
        while not until():
            try:
                future, fn, args, kwargs = self._items.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except Exception as e:  # the submitter gets it, as from any executor
                future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work is taken; with `cancel_futures`, what waits is cancelled (`wait` has nothing to wait for: the
        work runs on the caller's thread)."""
        self._closed = True
        while cancel_futures:
            try:
                self._items.get_nowait()[0].cancel()
            except queue.Empty:
                break
