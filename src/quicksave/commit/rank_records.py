"""Commit records in the ``torch.distributed`` store: how ranks learn, without a
collective, that every rank's files are durable and whether the checkpoint committed.

Every store operation of a multi-rank save is in this module. Keys, for one save
identified by its ``token`` (agreed by all ranks at plan time, without a collective)::

    quicksave/<token>/rank/<r>   "ok", or "error: <message>"   set by rank r's writer
    quicksave/<token>/commit     "ok", or "error: <message>"   set by the coordinator

Life of one save: every rank's writer writes its data files and its part
(``quicksave.commit.parts``), then posts its rank record → the coordinator's writer waits for all
rank records (``wait_ranks``, bounded) and commits, or aborts on the first error or at
the timeout → it posts the commit record → every other rank's writer waits for that
record (``wait_commit``, bounded) and reports it as its own outcome. A rank whose writer
dies posts its error from the trainer (``post_rank``), so nobody waits for it.

The writers run in the worker process, which has no ``ProcessGroup``: it reconnects to
the same store from a :class:`StoreAddress` (TCPStore or FileStore). Torch is imported
only when connecting, so the worker's modules stay torch-free; a worker started for a
multi-rank saver connects at start-up, in the background (:class:`StoreClients`), so
that its first save does not pay for the import.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from quicksave.errors import CheckpointError

OK = "ok"
# Store polling while waiting (a check is one small request): fast at first, since the
# records usually arrive within milliseconds, then backing off.
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.02


@dataclass(frozen=True)
class StoreAddress:
    """How another process reaches the same store: ``kind`` "tcp" (host, port) or
    "file" (path)."""

    kind: str
    host: str = ""
    port: int = 0
    path: str = ""


def store_address(store: Any) -> StoreAddress:
    """The address of ``store`` (a PrefixStore chain is unwrapped to its base store;
    the records use their own ``quicksave/`` keys on it).

    Raises:
        CheckpointError: a store another process cannot reach (e.g. HashStore).
    """
    import torch.distributed as dist

    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return StoreAddress("tcp", host=base.host, port=base.port)
    if isinstance(base, dist.FileStore):
        return StoreAddress("file", path=base.path)
    raise CheckpointError(
        f"multi-rank saves need a TCPStore or FileStore behind the process group, got "
        f"{type(base).__name__}, which the checkpoint worker cannot reach"
    )


def base_store(store: Any) -> Any:
    """``store`` without its PrefixStore wrappers (the store the records live in)."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def connect(address: StoreAddress, timeout_s: float = 60.0) -> Any:
    """A new client of the store at ``address`` (imports torch)."""
    import torch.distributed as dist

    if address.kind == "tcp":
        return dist.TCPStore(
            address.host, address.port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
    if address.kind == "file":
        return dist.FileStore(address.path, -1)
    raise CheckpointError(f"unknown store kind {address.kind!r}")


class StoreClients:
    """One persister's clients of the ranks' stores, one per address: connected ahead of
    time in a background thread (:meth:`connect_soon`) or when a job needs one (:meth:`get`).
    Safe to use from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[StoreAddress, Any] = {}
        self._connecting: dict[StoreAddress, threading.Thread] = {}
        self.connects = 0  # connections made (each imports torch the first time)

    def connect_soon(self, address: StoreAddress, timeout_s: float) -> None:
        """Start connecting to ``address`` in a background thread, unless connected or
        connecting already. A failure is left to :meth:`get` to meet again (and report)."""
        with self._lock:
            if address in self._clients or address in self._connecting:
                return
            t = threading.Thread(
                target=self._connect,
                args=(address, timeout_s),
                name="quicksave-store-connect",
                daemon=True,
            )
            self._connecting[address] = t
            t.start()  # under the lock: get() may join it as soon as it is listed

    def _connect(self, address: StoreAddress, timeout_s: float) -> None:
        try:
            client = connect(address, timeout_s)
        except Exception:  # noqa: BLE001 - get() connects again and reports it
            client = None
        with self._lock:
            self._connecting.pop(address, None)
            if client is not None:
                self._clients[address] = client
                self.connects += 1

    def get(self, address: StoreAddress, timeout_s: float) -> Any | None:
        """The client for ``address``, once connected: a connect in progress is waited
        for, else one is made now. None if it cannot connect."""
        with self._lock:
            if address in self._clients:
                return self._clients[address]
        self.connect_soon(address, timeout_s)
        with self._lock:
            pending = self._connecting.get(address)
        if pending is not None:
            pending.join()
        with self._lock:
            return self._clients.get(address)

    def status(self) -> dict[str, Any]:
        """What is ready now (for tests and monitoring): ``stores`` (clients connected),
        ``connecting`` (in progress), ``connects`` (connections made so far)."""
        with self._lock:
            return {
                "stores": len(self._clients),
                "connecting": len(self._connecting),
                "connects": self.connects,
            }


def _key(token: str, *parts: object) -> str:
    return "/".join(("quicksave", token, *map(str, parts)))


def post_rank(store: Any, token: str, rank: int, error: str | None = None) -> None:
    """Record that ``rank``'s files and part are durable (``error`` None) or why not."""
    store.set(_key(token, "rank", rank), OK if error is None else f"error: {error}")


def post_commit(store: Any, token: str, error: str | None = None) -> None:
    """Record the coordinator's outcome: committed (``error`` None), or aborted and why."""
    store.set(_key(token, "commit"), OK if error is None else f"error: {error}")


def _value(store: Any, key: str) -> str:
    return bytes(store.get(key)).decode(errors="replace")


def wait_ranks(store: Any, token: str, world_size: int, timeout_s: float) -> dict[int, str]:
    """Wait until every rank posted its record, or one posted an error, or the timeout.

    Returns:
        rank -> problem, for the ranks that failed or did not report in time (empty:
        every rank is durable).
    """
    deadline = time.monotonic() + timeout_s
    waiting = set(range(world_size))
    pause = POLL_MIN_S
    while True:
        for r in sorted(waiting):
            key = _key(token, "rank", r)
            if store.check([key]):
                waiting.discard(r)
                value = _value(store, key)
                if value != OK:
                    return {r: value.removeprefix("error: ")}
        if not waiting:
            return {}
        if time.monotonic() >= deadline:
            return {r: f"did not report its files durable within {timeout_s:g} s" for r in waiting}
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


def commit_wait_s(timeout_s: float) -> float:
    """How long a rank waits for the commit record of a save whose coordinator waits
    ``timeout_s`` for every rank: a bit longer, so that the coordinator's verdict, not a
    guess, ends the save."""
    return timeout_s * 1.5 + 10.0


def posted_commit(store: Any, token: str) -> bool:
    """Whether the coordinator's outcome of the save ``token`` is posted (committed or
    aborted); one check, no wait."""
    return bool(store.check([_key(token, "commit")]))


def wait_commit(store: Any, token: str, timeout_s: float, coordinator: int = 0) -> str | None:
    """Wait for the coordinator's commit record. Returns None if committed, else the
    reason (its error, or that it did not come within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    key = _key(token, "commit")
    pause = POLL_MIN_S
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return f"the coordinator (rank {coordinator}) did not commit within {timeout_s:g} s"
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
    value = _value(store, key)
    return None if value == OK else value.removeprefix("error: ")
