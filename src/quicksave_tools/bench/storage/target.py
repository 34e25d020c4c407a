"""Where ``quicksave bench --storage`` writes: the S3 endpoint (:class:`Target`), the
SeaweedFS the bench starts and stops when no ``--endpoint`` is given
(:func:`open_target`, SIGTERM turned into KeyboardInterrupt so that the server is
stopped however the run ends), the CPUs that server runs on during the training part
(:func:`server_on`) and its version for the report (:func:`weed_version`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from quicksave_tools.bench.methods import pid_cpu_s
from quicksave_tools.bench.storage.config import StorageBenchConfig
from quicksave_tools.bench.storage.log import say


@dataclass
class Target:
    """Where the benchmark writes: an S3 endpoint, its region and credentials (``None``:
    from the AWS chain), and the :class:`SeaweedServer` behind it if this run started
    one."""

    endpoint_url: str
    region: str
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    server: Any = None
    kind: str = "external"

    @classmethod
    def from_server(cls, server: Any, kind: str = "SeaweedFS on loopback") -> Target:
        """The target of a running :class:`~quicksave_tools.testing.seaweed.SeaweedServer`
        (``server`` is used for its CPU time, never stopped by the benchmark)."""
        return cls(
            server.endpoint_url,
            server.region,
            server.access_key_id,
            server.secret_access_key,
            server=server,
            kind=kind,
        )

    def env(self) -> dict[str, str]:
        """AWS_* variables that point SDKs (boto3, the CRT of s3torchconnector, MSC) here."""
        out = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }
        if self.access_key_id is not None and self.secret_access_key is not None:
            out["AWS_ACCESS_KEY_ID"] = self.access_key_id
            out["AWS_SECRET_ACCESS_KEY"] = self.secret_access_key
        return out

    def client(self, concurrency: int = 8) -> Any:
        """A boto3 S3 client: path style, no request/response checksums, enough
        connections for ``concurrency`` parts in flight."""
        import boto3
        from botocore.config import Config

        config = Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            max_pool_connections=max(2 * concurrency, 10),
            retries={"max_attempts": 3, "mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        kwargs: dict[str, Any] = {}
        if self.access_key_id is not None:
            kwargs["aws_access_key_id"] = self.access_key_id
            kwargs["aws_secret_access_key"] = self.secret_access_key
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config, **kwargs
        )

    def server_pid(self) -> int | None:
        """The process id of the server this bench runs against (None: not ours)."""
        running = getattr(self.server, "_running", None)
        proc = getattr(running, "proc", None)
        return None if proc is None else proc.pid

    def server_cpu_s(self) -> float | None:
        """CPU seconds the server's process has used so far (None: not ours)."""
        pid = self.server_pid()
        return None if pid is None else pid_cpu_s(pid)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while inside (so that ``finally`` blocks stop
    the server); only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def open_target(config: StorageBenchConfig, log: Any = None) -> Iterator[Target]:
    """The target of ``config``: ``config.endpoint`` (AWS chain), or a SeaweedFS started
    here and stopped (process group killed) when the block ends, however it ends."""
    if config.endpoint:
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        yield Target(
            config.endpoint,
            region or "us-east-1",
            os.environ.get("AWS_ACCESS_KEY_ID"),
            os.environ.get("AWS_SECRET_ACCESS_KEY"),
            kind="external",
        )
        return
    from quicksave_tools.testing.seaweed import SeaweedServer

    server = SeaweedServer(nice=config.server_nice)
    try:
        with sigterm_as_interrupt():
            server.start()
            say(log, f"SeaweedFS started at {server.endpoint_url} in {server.startup_s:.1f} s")
            yield Target.from_server(server, kind="SeaweedFS on loopback (started by the bench)")
    finally:
        server.stop()


@contextlib.contextmanager
def server_on(target: Target, cpus: list[int] | None) -> Iterator[None]:
    """Every thread of the server this bench started runs on ``cpus`` inside the block
    (as it was, after); nothing to do for another endpoint or ``None``."""
    running = getattr(target.server, "_running", None)
    proc = getattr(running, "proc", None)
    if not cpus or proc is None:
        yield
        return

    def place(where: Any) -> None:
        for task in os.listdir(f"/proc/{proc.pid}/task"):  # Go's threads: each one
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task), where)

    before = os.sched_getaffinity(proc.pid)
    place(cpus)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            place(before)


def weed_version(server: Any) -> str | None:
    try:
        from quicksave_tools.testing.seaweed_process import find_weed

        out = subprocess.run(
            [str(find_weed()), "version"], capture_output=True, text=True, timeout=10
        ).stdout
    except Exception:  # noqa: BLE001
        return None
    m = re.search(r"version\s+(\S+)\s+(\d\S*)", out)  # "version 8000GB 4.48 pypi ..."
    if m:
        return f"{m.group(2)} ({m.group(1)} build)"
    return out.strip().splitlines()[0] if out.strip() else None
