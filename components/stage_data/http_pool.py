"""A small HTTP/1.1 keep-alive client for the lean S3 reader: bodiless requests, streamed bodies.

urllib3 and http.client spend more interpreter time per request (header objects, the email
parser, layers of pools and retries) than the signing and the bookkeeping of a small
object together (docs/staging.md). Staging needs little of HTTP: a request line and a few
headers out; a status, headers and a body framed by Content-Length or chunked encoding
back. Connections are kept per (scheme, host, port) and reused only after a body was read
to its end. Errors are the built-in `ConnectionError` / `TimeoutError` kinds that
`settings.is_retryable` retries; failing to connect at all is `ConnectFailed`.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from typing import Any


class ConnectFailed(ConnectionError):
    """No connection to the endpoint could be opened."""


class IncompleteBody(ConnectionError):
    """The connection ended before the body's declared length."""


class _Connection:
    def __init__(self, scheme: str, host: str, port: int, timeouts: tuple[float, float], tls: Any) -> None:
        try:
            sock = socket.create_connection((host, port), timeout=timeouts[0])
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {scheme}://{host}:{port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if scheme == "https":
            sock = tls.wrap_socket(sock, server_hostname=host)
        sock.settimeout(timeouts[1])
        self.sock = sock
        self.reader = sock.makefile("rb", buffering=256 * 1024)
        self.used = False

    def close(self) -> None:
        try:
            self.reader.close()
            self.sock.close()
        except OSError:
            pass


class Response:
    """Status, lower-cased headers, and the body: `read()` whole or `stream(n)` in chunks."""

    def __init__(self, pool: Pool, key: tuple[str, str, int], conn: _Connection, method: str) -> None:
        self._pool, self._key = pool, key
        self._conn: _Connection | None = conn
        line = conn.reader.readline(65537)
        if not line:
            raise ConnectionResetError("the server closed the connection before answering")
        while True:
            parts = line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
                raise ConnectionError(f"not an HTTP answer: {line[:80]!r}")
            self.status = int(parts[1])
            self.version = parts[0]
            headers: dict[str, str] = {}
            while True:
                line = conn.reader.readline(65537)
                if line in (b"\r\n", b"\n"):
                    break
                if not line:
                    raise IncompleteBody("the connection ended inside the answer's headers")
                name, _, value = line.decode("latin-1").partition(":")
                name, value = name.strip().lower(), value.strip()
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            if self.status != 100:
                break
            line = conn.reader.readline(65537)  # an interim 100 Continue, then the answer
        self.headers = headers
        self._reusable = self.version == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        bodiless = method == "HEAD" or self.status in (204, 304)
        self._chunked = not bodiless and "chunked" in headers.get("transfer-encoding", "").lower()
        self._left = -1  # -1: until the connection closes (not reusable then)
        if bodiless or self._chunked:
            self._left = 0
        elif "content-length" in headers:
            self._left = int(headers["content-length"])
        else:
            self._reusable = False
        self._done = self._left == 0 and not self._chunked
        if self._done:
            self.release_conn()

    def _chunks(self, size: int) -> Iterator[bytes]:
        if self._conn is None:
            raise ConnectionError("the answer's connection was already given back")
        reader = self._conn.reader
        if self._chunked:
            while True:
                header = reader.readline(1024)
                if not header:
                    raise IncompleteBody("the connection ended inside a chunked body")
                length = int(header.split(b";", 1)[0].strip() or b"0", 16)
                if length == 0:
                    while reader.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                while length:
                    data = reader.read(min(size, length))
                    if not data:
                        raise IncompleteBody("the connection ended inside a chunk")
                    length -= len(data)
                    yield data
                reader.readline(3)
        elif self._left < 0:
            while data := reader.read(size):
                yield data
        else:
            while self._left:
                data = reader.read(min(size, self._left))
                if not data:
                    raise IncompleteBody(f"the connection ended {self._left} bytes short of the body")
                self._left -= len(data)
                yield data

    def stream(self, size: int) -> Iterator[bytes]:
        if self._done:
            return
        try:
            yield from self._chunks(size)
        except BaseException:
            self.close()  # a half-read connection must not be reused
            raise
        self._done = True
        self.release_conn()

    def read(self) -> bytes:
        return b"".join(self.stream(1024 * 1024))

    def release_conn(self) -> None:
        """Back to the pool if the body was read to its end, else closed."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._reusable:
            self._pool._put(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        self._done = False
        self.release_conn()


class Pool:
    """Keep-alive connections per endpoint; `request` sends one bodiless request."""

    def __init__(self, maxsize: int = 64, connect_timeout_s: float = 10, read_timeout_s: float = 30) -> None:
        self._maxsize = maxsize
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._lock = threading.Lock()
        self._tls: Any = None

    def _tls_context(self) -> Any:
        if self._tls is None:
            import ssl  # only for https endpoints

            self._tls = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
        return self._tls

    def _put(self, key: tuple[str, str, int], conn: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self._maxsize:
                conn.used = True
                idle.append(conn)
                return
        conn.close()

    def _get(self, key: tuple[str, str, int]) -> _Connection:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        scheme, host, port = key
        return _Connection(
            scheme, host, port, self._timeouts, self._tls_context() if scheme == "https" else None
        )

    def request(
        self, method: str, scheme: str, host: str, port: int, target: str, headers: dict[str, str]
    ) -> Response:
        """`target` is the path and query as sent; `headers` must include Host."""
        head = (
            f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        )
        data = head.encode("latin-1")
        key = (scheme, host, port)
        while True:
            conn = self._get(key)
            reused = conn.used
            try:
                conn.sock.sendall(data)
                return Response(self, key, conn, method)
            except (ConnectionError, BrokenPipeError) as exc:
                conn.close()
                if not reused or isinstance(exc, IncompleteBody):
                    raise
                # a kept-alive connection the server had already closed: again on another one
            except BaseException:
                conn.close()
                raise

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
