"""The thread pool of a store backend's parallel transfers: the parts of one multipart
upload, the ranged reads of one large read, each a slice of the caller's buffer.

Order of calls (any thread of the backend's caller): :meth:`TransferPool.start` submits
the tasks, each given one shared stop event; :meth:`TransferPool.finish` waits for them
and, on the first failure, stops the others and raises it once none still runs;
:meth:`TransferPool.close` (the backend's ``close``) stops the threads. The pool is made
on first use. Used by the S3 and MSC backends; torch-free (the worker process imports
them).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from quicksave.storage.retry import Abandoned

T = TypeVar("T")


class TransferPool:
    """Runs the pieces of one transfer in parallel (see the module docstring).

    Args:
        max_workers: pieces in flight at once.
        thread_name_prefix: names the pool's threads (``quicksave-s3``...).

    Thread-safe: several transfers may share the pool at once, each with its own stop
    event.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self.max_workers = max(1, int(max_workers))
        self.thread_name_prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_workers, thread_name_prefix=self.thread_name_prefix
                )
            return self._pool

    def start(
        self, tasks: list[Callable[[threading.Event], T]]
    ) -> tuple[list[concurrent.futures.Future], threading.Event]:
        """Submit ``tasks`` (each is given the shared stop event) to the pool. A task
        that fails sets the event at once, so that no queued sibling starts after it."""
        stop = threading.Event()

        def run(task: Callable[[threading.Event], T]) -> T:
            if stop.is_set():
                raise Abandoned("not started: another part of the same transfer failed")
            try:
                return task(stop)
            except BaseException:
                stop.set()
                raise

        pool = self._executor()
        return [pool.submit(run, task) for task in tasks], stop

    @staticmethod
    def finish(futures: list[concurrent.futures.Future], stop: threading.Event) -> list[Any]:
        """Wait for ``futures``; on the first failure stop the others (queued ones are
        cancelled, running ones make no further try) and, once none is running any
        more, raise that failure. Never returns while a task still touches the
        caller's buffer."""
        try:
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        finally:
            if not all(f.done() and not f.cancelled() and f.exception() is None for f in futures):
                TransferPool.stop(futures, stop)
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
        if errors:  # the first real cause, not a sibling's "abandoned"
            raise next((e for e in errors if not isinstance(e, Abandoned)), errors[0])
        return [f.result() for f in futures]

    def run(self, tasks: list[Callable[[threading.Event], T]]) -> list[T]:
        """:meth:`start` then :meth:`finish`: the tasks' results, in order."""
        return self.finish(*self.start(tasks))

    @staticmethod
    def stop(futures: list[concurrent.futures.Future], stop: threading.Event) -> None:
        """Stop a transfer whose caller gave up: set ``stop``, cancel the queued tasks
        and wait until none is running."""
        stop.set()
        for f in futures:
            f.cancel()
        concurrent.futures.wait(futures)

    def close(self) -> None:
        """Stop the threads (queued tasks are cancelled); a later transfer makes a new
        pool."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
