"""The lean reader's own SigV4 signer (against botocore's) and its HTTP/1.1 pool (against a scripted server)."""

from __future__ import annotations

import hmac
import socket
import threading

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from components.stage_data import sigv4
from components.stage_data.http_pool import ConnectFailed, IncompleteBody, Pool
from components.stage_data.settings import is_retryable
from components.stage_data.sigv4 import CredentialSource, Keys, Signer, canonical_query

CASES = [
    ("GET", "/bucket/data/sub%20dir/odd%2Bname%C3%A9.txt", {}, {"If-Match": '"abc"', "Range": "bytes=0-9"}),
    ("GET", "/bucket/", {"list-type": "2", "prefix": "c4/train/", "continuation-token": "a+b=/c"}, {}),
    ("HEAD", "/bucket/k", {"partNumber": "1"}, {"x-amz-checksum-mode": "ENABLED"}),
]


@pytest.mark.parametrize("token", ["", "session-token/+="])
@pytest.mark.parametrize(("method", "path", "query", "headers"), CASES)
def test_the_signature_is_botocores(method, path, query, headers, token):
    netloc = "127.0.0.1:9000"
    query_text = canonical_query(query)
    url = f"http://{netloc}{path}" + (f"?{query_text}" if query_text else "")
    theirs = AWSRequest(method=method, url=url, headers=dict(headers))
    S3SigV4Auth(Credentials("AKID", "secret/key", token or None), "s3", "eu-west-1").add_auth(theirs)
    ours = Signer("eu-west-1").sign(
        method, netloc, path, query_text, headers, Keys("AKID", "secret/key", token),
        amz_date=theirs.headers["X-Amz-Date"],
    )  # fmt: skip
    assert ours["Authorization"] == theirs.headers["Authorization"]
    assert ours["x-amz-content-sha256"] == theirs.headers["X-Amz-Content-SHA256"]
    assert ours.get("x-amz-security-token") == theirs.headers.get("X-Amz-Security-Token")
    assert "%2F" in canonical_query({"prefix": "a/b"})  # SigV4 encodes "/" in query values


def test_the_derived_key_is_made_once_a_day(monkeypatch):
    made = []
    real = hmac.digest
    monkeypatch.setattr(sigv4.hmac, "digest", lambda *a: made.append(a) or real(*a))
    signer, keys = Signer("us-east-1"), Keys("AKID", "s")
    for _ in range(3):
        signer.sign("GET", "h", "/b/k", "", {}, keys, amz_date="20261203T000000Z")
    assert len(made) == 4  # date, region, service, "aws4_request": once
    signer.sign("GET", "h", "/b/k", "", {}, keys, amz_date="20261204T000000Z")
    signer.sign("GET", "h", "/b/k", "", {}, Keys("AKID", "rotated"), amz_date="20261204T000000Z")
    assert len(made) == 12


def test_credentials_come_from_the_environment_else_from_botocores_chain(tmp_path, monkeypatch):
    env = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"}
    assert CredentialSource(env).keys() == Keys("a", "s", "t")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    shared = tmp_path / "credentials"
    shared.write_text("[default]\naws_access_key_id = fromfile\naws_secret_access_key = filesecret\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    source = CredentialSource({})
    assert source.found and source.keys() == Keys("fromfile", "filesecret", "")


class ScriptedServer:
    """Answers each connection's requests from a script: a list of raw answers per connection
    (an answer of None closes the connection without answering)."""

    def __init__(self, script: list[list[bytes | None]]) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for answers in self.script:
            conn, _ = self.sock.accept()
            with conn:
                for answer in answers:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    self.requests.append(data)
                    if answer is None:
                        break
                    conn.sendall(answer)

    def close(self) -> None:
        self.sock.close()


def _get(pool: Pool, port: int, method: str = "GET"):
    return pool.request(method, "http", "127.0.0.1", port, "/b/k", {"Host": f"127.0.0.1:{port}"})


def test_the_pool_reads_lengths_chunks_and_heads_on_one_kept_alive_connection():
    server = ScriptedServer(
        [
            [
                b'HTTP/1.1 200 OK\r\nContent-Length: 5\r\nETag: "e"\r\n\r\nhello',
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nT: v\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n",  # a HEAD's length, no body
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\nConnection: close\r\n\r\nnop",
            ]
        ]
    )
    pool = Pool()
    first = _get(pool, server.port)
    assert (first.status, first.headers["etag"], b"".join(first.stream(2))) == (200, '"e"', b"hello")
    assert _get(pool, server.port).read() == b"abcde"
    head = _get(pool, server.port, "HEAD")
    assert head.headers["content-length"] == "99" and head.read() == b""
    missing = _get(pool, server.port)
    assert (missing.status, missing.read()) == (404, b"nop")
    assert len(server.requests) == 4 and server.requests[2].startswith(b"HEAD /b/k HTTP/1.1\r\nHost: ")
    assert not pool._idle.get(("http", "127.0.0.1", server.port))  # "Connection: close" was honoured
    server.close()


def test_a_stale_kept_alive_connection_is_replaced_and_a_short_body_is_a_retryable_error():
    server = ScriptedServer(
        [
            [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", None],  # then closes the idle connection
            [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"],
        ]
    )
    pool = Pool(read_timeout_s=5)
    assert _get(pool, server.port).read() == b"ok"
    # The server reads this request on the kept-alive connection and closes it unanswered;
    # the pool sends it again on a new connection.
    response = _get(pool, server.port)
    with pytest.raises(IncompleteBody) as short:
        response.read()
    assert is_retryable(short.value) and len(server.requests) == 3
    assert not pool._idle.get(("http", "127.0.0.1", server.port))  # a half-read connection is not kept
    server.close()
    with pytest.raises(ConnectFailed):
        _get(pool, server.port)
