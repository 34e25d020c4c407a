"""A fault-injecting TCP proxy for HTTP (S3) traffic on loopback.

:class:`FaultProxy` listens on ``127.0.0.1`` (an ephemeral port; ``endpoint_url``) and
forwards bytes both ways to a loopback target, e.g. a
:class:`~quicksave_tools.testing.seaweed.SeaweedServer`'s S3 port. Its *mode*, switchable at
any time from any thread, decides what happens to each HTTP request:

``"pass"``
    forward unchanged;
``"delay"``
    forward, sleeping ``delay_s`` before forwarding each chunk (both directions);
``"slowdown"``
    never reach the server: read and discard the request's headers, answer
    ``HTTP/1.1 503 Slow Down`` with S3's ``SlowDown`` XML error body and
    ``Connection: close``, then close (a request body is read and discarded, bounded);
``"drop"``
    reset the connection (TCP RST): a new connection is reset as soon as it is
    accepted, a kept-alive one when its next request starts;
``"blackhole"``
    accept and read everything, forward nothing, never answer: the server "stops
    answering" (the client's read timeout fires). The connection stays silent until
    the client gives up or the proxy closes.

The mode is applied per *request*, at its first bytes: a connection kept alive by the
client's pool (boto3 reuses connections) gets the new mode at its next request, while a
request already under way keeps the mode it started with. A client chunk starts a new
request if it is the connection's first or the server has answered since the previous
client chunk (``100 Continue`` does not count), which is exact for HTTP/1.1 without
pipelining (what botocore does).

:meth:`FaultProxy.fail_next` applies a mode to the next ``n`` requests only, after which
the proxy's own mode (``"pass"`` unless set otherwise) applies again.
:meth:`FaultProxy.drop_existing` resets every open connection now. ``stats`` counts
connections, requests and faults served.

Every loop is bounded: sockets are polled with short timeouts, blocking sends have
``io_timeout_s``, and :meth:`FaultProxy.close` (or leaving the ``with`` block) stops all
threads within about a second. The proxy only ever talks to loopback addresses.
"""

from __future__ import annotations

import ipaddress
import select
import socket
import struct
import threading
import time
import uuid

__all__ = ["MODES", "FaultProxy"]

MODES = ("pass", "drop", "delay", "slowdown", "blackhole")

_CHUNK = 64 * 1024
_POLL_S = 0.05
_MAX_HEADER_BYTES = 64 * 1024
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>%s</RequestId></Error>"
)
_STAT_KEYS = (
    "connections",  # accepted
    "requests",  # request starts seen
    "passed",
    "delayed",
    "slowdowns",
    "dropped",
    "blackholed",
    "resets",  # connections reset by drop_existing()
    "upstream_errors",  # the target refused or broke a connection
)


_MODE_STAT = {
    "pass": "passed",
    "delay": "delayed",
    "slowdown": "slowdowns",
    "drop": "dropped",
    "blackhole": "blackholed",
}


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown FaultProxy mode {mode!r}; one of {', '.join(MODES)}")
    return mode


def _loopback(host: str) -> str:
    """``host`` as a loopback address literal; anything else is refused (no lookups)."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"FaultProxy targets loopback only; {host!r} is not an IP") from None
    if not addr.is_loopback:
        raise ValueError(f"FaultProxy targets loopback only; {host} is not loopback")
    return str(addr)


def _reset(sock: socket.socket | None) -> None:
    """Close ``sock`` with a TCP RST (SO_LINGER 0) instead of a FIN."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _readable(socks: list[socket.socket], timeout_s: float) -> list[socket.socket]:
    """Those of ``socks`` with data (or EOF) to read, waiting up to ``timeout_s``.

    ``poll``, not ``select``: a test process may hold descriptors above FD_SETSIZE.
    """
    poller = select.poll()
    by_fd = {}
    for sock in socks:
        by_fd[sock.fileno()] = sock
        poller.register(sock, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(timeout_s * 1000) if fd in by_fd]


def _close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Conn:
    """One proxied connection; only its handler thread touches its sockets (except
    ``shutdown`` from :meth:`FaultProxy.close`)."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.stop = threading.Event()  # set by drop_existing() / close()
        self.reset_requested = False
        self.mode = "pass"  # the current request's mode
        self.answered = True  # the server answered since the last client chunk
        self.blackholed = False


class FaultProxy:
    """A threaded TCP proxy on ``127.0.0.1`` with switchable faults (module docstring).

    Args:
        target_host: loopback address of the server (``"127.0.0.1"``, ``"::1"``,
            ``"localhost"``).
        target_port: its port.
        mode: the initial mode (default ``"pass"``).
        delay_s: the delay of ``"delay"`` mode, per forwarded chunk.
        connect_timeout_s: timeout connecting to the target.
        io_timeout_s: timeout of one blocking send (a peer that stops reading).
        drain_s: how long ``"slowdown"`` keeps reading a request body it discards.

    Attributes: ``host``, ``port``, ``endpoint_url`` (``http://127.0.0.1:<port>``),
    ``target`` (``(host, port)``); ``mode`` and ``delay_s`` are read/write properties.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        mode: str = "pass",
        delay_s: float = 0.5,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        drain_s: float = 5.0,
    ) -> None:
        self.target = (_loopback(target_host), int(target_port))
        self.connect_timeout_s = float(connect_timeout_s)
        self.io_timeout_s = float(io_timeout_s)
        self.drain_s = float(drain_s)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._mode = _check_mode(mode)
        self._delay_s = float(delay_s)
        self._fail_left = 0
        self._fail_mode = "pass"
        self._stats = dict.fromkeys(_STAT_KEYS, 0)
        self._conns: dict[_Conn, threading.Thread] = {}
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            listener.settimeout(_POLL_S * 2)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.host, self.port = listener.getsockname()[:2]
        self.endpoint_url = f"http://{self.host}:{self.port}"
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"FaultProxy-{self.port}-accept", daemon=True
        )
        self._acceptor.start()

    # -- control (any thread) -------------------------------------------------------

    @property
    def mode(self) -> str:
        with self._lock:
            return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self.set_mode(mode)

    def set_mode(self, mode: str, *, delay_s: float | None = None) -> None:
        """Switch mode for the next requests; ``delay_s`` also sets the delay."""
        _check_mode(mode)
        with self._lock:
            self._mode = mode
            if delay_s is not None:
                self._delay_s = float(delay_s)

    @property
    def delay_s(self) -> float:
        with self._lock:
            return self._delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        with self._lock:
            self._delay_s = float(value)

    def fail_next(self, n: int, mode: str) -> None:
        """Apply ``mode`` to the next ``n`` requests (replacing any pending count), then
        the proxy's own mode again. ``n=0`` cancels."""
        _check_mode(mode)
        if n < 0:
            raise ValueError("fail_next: n must be >= 0")
        with self._lock:
            self._fail_left = int(n)
            self._fail_mode = mode

    @property
    def pending_failures(self) -> int:
        """How many of the requests armed by :meth:`fail_next` are still to come."""
        with self._lock:
            return self._fail_left

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters (see ``_STAT_KEYS`` in the source for their meaning)."""
        with self._lock:
            return dict(self._stats)

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = dict.fromkeys(_STAT_KEYS, 0)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def drop_existing(self, timeout_s: float = 2.0) -> int:
        """Reset (TCP RST) every open connection; returns how many. Waits up to
        ``timeout_s`` for them to be gone."""
        with self._lock:
            items = list(self._conns.items())
        for conn, _ in items:
            conn.reset_requested = True
            conn.stop.set()
        deadline = time.monotonic() + timeout_s
        for _, thread in items:
            thread.join(max(0.0, deadline - time.monotonic()))
        return len(items)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, close every connection and join all threads (bounded)."""
        self._closed.set()
        deadline = time.monotonic() + timeout_s
        self._acceptor.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        with self._lock:
            items = list(self._conns.items())
        for conn, _ in items:
            conn.stop.set()
            for sock in (conn.client, conn.upstream):
                if sock is not None:
                    try:  # wakes a send blocked on a peer that does not read
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        for _, thread in items:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FaultProxy({self.endpoint_url} -> {self.target[0]}:{self.target[1]}, {self.mode})"

    # -- internals --------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(_POLL_S)  # e.g. EMFILE: back off, bounded by close()
                continue
            with self._lock:
                self._stats["connections"] += 1
                drop = self._mode == "drop" and self._fail_left == 0
                if drop:
                    self._stats["dropped"] += 1
            if drop or self._closed.is_set():
                _reset(sock)
                continue
            sock.settimeout(self.io_timeout_s)
            conn = _Conn(sock)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"FaultProxy-{self.port}", daemon=True
            )
            with self._lock:
                self._conns[conn] = thread
            thread.start()

    def _next_request_mode(self) -> tuple[str, float]:
        with self._lock:
            if self._fail_left > 0:
                self._fail_left -= 1
                mode = self._fail_mode
            else:
                mode = self._mode
            self._stats["requests"] += 1
            self._stats[_MODE_STAT[mode]] += 1
            return mode, self._delay_s

    def _serve(self, conn: _Conn) -> None:
        reset = False
        try:
            reset = self._pump(conn)
        except OSError:
            reset = True  # a peer vanished, or a send timed out: cut the other side too
        finally:
            if conn.reset_requested:
                self._count("resets")
                reset = True
            if reset:
                _reset(conn.client)
                _reset(conn.upstream)
            else:
                _close(conn.client)
                _close(conn.upstream)
            with self._lock:
                self._conns.pop(conn, None)

    def _pump(self, conn: _Conn) -> bool:
        """Move bytes until a side closes or a fault ends the connection; True: reset it."""
        client = conn.client
        delay = 0.0
        while not conn.stop.is_set():
            socks = [client] if conn.upstream is None else [client, conn.upstream]
            readable = _readable(socks, _POLL_S)
            if client in readable:
                data = client.recv(_CHUNK)
                if not data:
                    return False  # the client is done
                if conn.answered:  # a new request starts
                    conn.answered = False
                    conn.mode, delay = self._next_request_mode()
                    if conn.mode == "drop":
                        return True
                    if conn.mode == "slowdown":
                        self._slow_down(conn, data)
                        return False
                    if conn.mode == "blackhole":
                        conn.blackholed = True
                if conn.blackholed:
                    continue  # read and discard, forever
                if conn.mode == "delay" and conn.stop.wait(delay):
                    return False
                if conn.upstream is None:
                    try:
                        conn.upstream = socket.create_connection(
                            self.target, timeout=self.connect_timeout_s
                        )
                    except OSError:
                        self._count("upstream_errors")
                        return True
                    conn.upstream.settimeout(self.io_timeout_s)
                conn.upstream.sendall(data)
            if conn.upstream is not None and conn.upstream in readable:
                try:
                    data = conn.upstream.recv(_CHUNK)
                except OSError:
                    self._count("upstream_errors")
                    return True
                if not data:
                    if conn.blackholed:  # stay silent: the client must time out
                        _close(conn.upstream)
                        conn.upstream = None
                        continue
                    return False  # the server closed: close the client's side too
                if conn.blackholed:
                    continue
                if conn.mode == "delay" and conn.stop.wait(delay):
                    return False
                client.sendall(data)
                if not data.startswith((b"HTTP/1.1 100 ", b"HTTP/1.0 100 ")):
                    conn.answered = True
        return conn.reset_requested

    def _slow_down(self, conn: _Conn, first: bytes) -> None:
        """Read the request's headers, answer 503 SlowDown, drain the body (bounded)."""
        client = conn.client
        head = first
        deadline = time.monotonic() + self.drain_s
        while (
            b"\r\n\r\n" not in head
            and len(head) < _MAX_HEADER_BYTES
            and time.monotonic() < deadline
            and not conn.stop.is_set()
        ):
            if _readable([client], _POLL_S):
                chunk = client.recv(_CHUNK)
                if not chunk:
                    return
                head += chunk
        request_id = uuid.uuid4().hex[:16].upper().encode()
        body = _SLOWDOWN_BODY % request_id
        is_head = head.startswith(b"HEAD ")
        response = (
            b"HTTP/1.1 503 Slow Down\r\n"
            b"Content-Type: application/xml\r\n"
            b"Content-Length: %d\r\n"
            b"x-amz-request-id: %s\r\n"
            b"Connection: close\r\n"
            b"\r\n" % (len(body), request_id)
        )
        client.sendall(response if is_head else response + body)
        # Half-close, then read what the client still sends (a request body) until it
        # closes: closing with unread bytes would reset the connection, and the client
        # could lose the response.
        try:
            client.shutdown(socket.SHUT_WR)
        except OSError:
            return
        while time.monotonic() < deadline and not conn.stop.is_set():
            if _readable([client], _POLL_S) and not client.recv(_CHUNK):
                return
