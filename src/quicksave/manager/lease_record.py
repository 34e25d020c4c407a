"""The writer lease object of an object-store folder: what it says, and who wrote it.

``<folder>/.quicksave-lease.json`` is UTF-8 JSON (docs/FORMAT.md §6.1)::

    {"lease": 1, "token": "<32 hex>", "holder": {"host": ..., "pid": ..., "boot_id": ...,
     "pid_ns": ..., "proc_start": ...}, "since": <POSIX s>, "renewed_at": <POSIX s>,
     "renewals": N, "renew_s": 5.0, "expiry_s": 30.0, "released": false}

:class:`Holder` names a process precisely enough for a process of the same machine to
tell whether it still runs (same host, kernel boot and pid namespace; pid alive with the
same start time). How the lease is taken, renewed and released: ``store_lease.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass

LEASE_NAME = ".quicksave-lease.json"
LEASE_FORMAT = 1
MAX_LEASE_BYTES = 4096
_MAX_EXPIRY_S = 86400.0  # a lease claiming a longer expiry is no lease (a watcher waits that long)


@dataclass(frozen=True)
class Holder:
    """A process, as a lease names it. ``boot_id`` and ``pid_ns`` tell whether a pid
    seen in a lease means a process that this machine can check (the same kernel boot
    and pid namespace: not a container beside ours with the same host name)."""

    host: str
    pid: int
    boot_id: str = ""
    pid_ns: int = 0
    proc_start: int = 0  # the process's start time, in clock ticks since boot

    def same_machine(self, other: Holder) -> bool:
        return bool(self.boot_id) and (self.host, self.boot_id, self.pid_ns) == (
            other.host,
            other.boot_id,
            other.pid_ns,
        )

    def alive(self) -> bool:
        """Whether this process still runs (call only for a :meth:`same_machine` one):
        its pid exists and started when the lease says."""
        start = _proc_start(self.pid)
        return start is not None and (not self.proc_start or start == self.proc_start)

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host[:255]!r}"


def this_process() -> Holder:
    """The :class:`Holder` of the calling process."""
    pid = os.getpid()
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: no proof of death, only expiry
        boot_id, pid_ns = "", 0
    return Holder(socket.gethostname(), pid, boot_id, pid_ns, _proc_start(pid) or 0)


def _proc_start(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time), or None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class LeaseRecord:
    """The content of the lease object (JSON, ``"lease": 1``)."""

    token: str
    holder: Holder
    since: float  # POSIX seconds, holder's clock
    renewed_at: float
    renewals: int
    expiry_s: float
    renew_s: float
    released: bool = False

    def encode(self) -> bytes:
        body = dataclasses.asdict(self)
        return json.dumps({"lease": LEASE_FORMAT, **body}, sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes) -> LeaseRecord | None:
        """The record, or None for anything that is not a lease of this format."""
        try:
            d = json.loads(raw.decode("utf-8"))
            if d.get("lease") != LEASE_FORMAT:
                return None
            h = d["holder"]
            record = LeaseRecord(
                token=str(d["token"]),
                holder=Holder(
                    str(h["host"]),
                    int(h["pid"]),
                    str(h["boot_id"]),
                    int(h["pid_ns"]),
                    int(h["proc_start"]),
                ),
                since=float(d["since"]),
                renewed_at=float(d["renewed_at"]),
                renewals=int(d["renewals"]),
                expiry_s=float(d["expiry_s"]),
                renew_s=float(d["renew_s"]),
                released=bool(d["released"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return None
        if not 0 < record.renew_s <= record.expiry_s <= _MAX_EXPIRY_S:
            return None  # nobody renews on such terms: no lease to respect
        return record


def describe_holder(record: LeaseRecord | str | None) -> str:
    """Who holds a lease, for messages: ``pid P on host 'H' since T (...)``."""
    if record is None:
        return "an unknown process (a lease object this version cannot read)"
    if isinstance(record, str):
        return record
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.since))
    return f"{record.holder.describe()} since {since} (lease renewed every {record.renew_s:g} s)"
