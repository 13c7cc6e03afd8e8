"""A failure-injecting HTTP proxy on 127.0.0.1 in front of a real S3 server (test double).

Forwards every request unchanged (the Host header too, so SigV4 signatures still match)
and, for GETs of object bodies, applies the next fault from a per-key plan: `"503"`
answers SlowDown, `"reset"` sends the headers and half the body then drops the
connection, `"stall"` sleeps before answering, `"corrupt"` flips one byte of the body.
`counts` records what was injected, so tests can assert that faults really happened.

`etags="opaque"` makes the proxy answer as AWS does for SSE-KMS objects: every ETag
(headers and listings) becomes a hex value that is not the body's MD5 (a multipart one
keeps its "-<parts>"), object answers carry `x-amz-server-side-encryption: aws:kms`, and
If-Match is translated back for the server behind (which changes a signed header: only
for a server that does not check SigV4 signatures, such as moto); `etags="nonhex"` gives non-hex ETags instead.
`strip_checksums` hides the additional checksums (headers and listings).
"""

from __future__ import annotations

import hashlib
import http.client
import re
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


SSE_HEADER = "x-amz-server-side-encryption"


class FaultProxy:
    def __init__(
        self, upstream: str, stall_s: float = 0.5, etags: str = "", strip_checksums: bool = False
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
        self.stall_s = stall_s
        self.plan: dict[str, list[str]] = defaultdict(list)  # key suffix -> faults to apply in turn
        self.always: dict[str, str] = {}  # key suffix -> fault applied to every GET
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.etags = etags
        self.strip_checksums = strip_checksums
        self.real_etags: dict[str, str] = {}  # rewritten ETag -> the server's
        self.gets = 0  # object GETs (not listings) forwarded
        self.bytes_served = 0  # body bytes of those GETs
        proxy = self

        def rewrite_etag(real: str) -> str:
            real = real.strip('"')
            _, dash, parts = real.partition("-")  # AWS keeps a multipart ETag's "-<parts>"
            digest = hashlib.md5(f"opaque:{real}".encode(), usedforsecurity=False).hexdigest()
            fake = (digest if proxy.etags == "opaque" else f"v1.{digest[:20]}") + (
                f"-{parts}" if dash else ""
            )
            with proxy.lock:
                proxy.real_etags[fake] = real
            return fake

        def rewrite_listing(data: bytes) -> bytes:
            text = data.decode()
            if proxy.etags:
                text = re.sub(
                    r"<ETag>(?:&quot;|\")?([^<&\"]*)(?:&quot;|\")?</ETag>",
                    lambda m: f"<ETag>&quot;{rewrite_etag(m.group(1))}&quot;</ETag>",
                    text,
                )
            if proxy.strip_checksums:
                text = re.sub(r"<ChecksumAlgorithm>[^<]*</ChecksumAlgorithm>", "", text)
                text = re.sub(r"<ChecksumType>[^<]*</ChecksumType>", "", text)
            return text.encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _fault(self) -> str:
                if self.command != "GET" or ("?" in self.path and "list-type" in self.path):
                    return ""
                path = self.path.split("?", 1)[0]
                with proxy.lock:
                    for suffix, fault in proxy.always.items():
                        if path.endswith(suffix):
                            proxy.counts[fault] += 1
                            return fault
                    for suffix, faults in proxy.plan.items():
                        if path.endswith(suffix) and faults:
                            fault = faults.pop(0)
                            proxy.counts[fault] += 1
                            return fault
                return ""

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length", 0) or 0)
                body = self.rfile.read(length) if length else None
                fault = self._fault()
                if fault == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                if fault == "stall":
                    time.sleep(proxy.stall_s)
                upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
                try:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() == "if-match" and proxy.etags:
                            with proxy.lock:
                                value = f'"{proxy.real_etags.get(value.strip(chr(34)), value)}"'
                        upstream.putheader(name, value)
                    upstream.endheaders(body)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                if fault == "corrupt" and data and response.status in (200, 206):
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                listing = "list-type" in self.path
                if listing and response.status == 200:
                    data = rewrite_listing(data)
                elif self.command == "GET" and response.status in (200, 206):
                    with proxy.lock:
                        proxy.gets += 1
                        proxy.bytes_served += len(data)
                self.send_response(response.status)
                head = self.command == "HEAD"
                for name, value in response.getheaders():
                    lower = name.lower()
                    if proxy.strip_checksums and lower.startswith("x-amz-checksum-"):
                        continue
                    if lower == "etag" and proxy.etags:
                        value = f'"{rewrite_etag(value)}"'
                    if lower not in ("transfer-encoding", "connection") and (
                        head or lower != "content-length"
                    ):
                        self.send_header(name, value)
                object_answer = not listing and response.status in (200, 206)
                if proxy.etags == "opaque" and object_answer and not response.getheader(SSE_HEADER):
                    self.send_header(SSE_HEADER, "aws:kms")  # what AWS adds for an SSE-KMS object
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if head:
                    return
                if fault == "reset" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
