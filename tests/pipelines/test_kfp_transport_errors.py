"""The KFP client's TLS and protocol failures are one line and exit code 2, against local
loopback servers: https to a plain-http server, http to a TLS server, a certificate the
client cannot verify, an answer that is not HTTP, and answers that are not the API's JSON."""

from __future__ import annotations

import datetime as dt
import http.server
import os
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rtp_cli import kfp_checks
from rtp_cli.main import main
from tests.conftest import PROJECT_ROOT

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def isolated_environment(monkeypatch, tmp_path):
    for name in (kfp_checks.TOKEN_ENV, kfp_checks.NAMESPACE_ENV, kfp_checks.ENDPOINT_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(kfp_checks.TOKEN_PATH_ENV, str(tmp_path / "no-token-here"))
    # A CA bundle from the environment would change what "cannot verify" means.
    for name in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a failed TLS handshake is what these tests provoke


def _serve(handler_class: type, tls: ssl.SSLContext | None = None) -> Iterator[int]:
    server = _QuietServer(("127.0.0.1", 0), handler_class)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _answering(status: int, body: bytes, content_type: str = "application/json") -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


HEALTHY = _answering(200, b'{"commit_sha": "x", "tag_name": "2.5.0", "multi_user": false}')


@pytest.fixture
def plain_http_api() -> Iterator[int]:
    yield from _serve(HEALTHY)


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by nobody the client trusts."""
    pytest.importorskip("cryptography", reason="the certificate tests need the cryptography package")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rtp-test")])
    now = dt.datetime.now(dt.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return folder / "cert.pem", folder / "key.pem"


@pytest.fixture
def tls_api(self_signed) -> Iterator[int]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*self_signed)
    yield from _serve(HEALTHY, tls=context)


@pytest.fixture
def not_http() -> Iterator[int]:
    """A TCP server that answers every connection with bytes that are not HTTP."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            with connection:
                try:
                    connection.recv(4096)
                    connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\nthis is not HTTP\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def _one_line_error(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_https_to_a_plain_http_server(plain_http_api):
    """Run as a user runs it: nothing else on stderr (urllib3 logs a warning per retry)."""
    host = f"https://127.0.0.1:{plain_http_api}"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    rtp = subprocess.run(
        [sys.executable, "-m", "rtp_cli.main", "runs", "--host", host],
        capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=120,
    )  # fmt: skip
    assert rtp.returncode == 2, rtp.stderr
    [line] = rtp.stderr.strip().splitlines()
    assert line.startswith("rtp runs: error: ") and host in line
    assert "does not speak TLS" in line and f"--host http://127.0.0.1:{plain_http_api}" in line


def test_http_to_a_tls_server(tls_api, capsys):
    line = _one_line_error(capsys, "runs", "--host", f"http://127.0.0.1:{tls_api}")
    assert f"http://127.0.0.1:{tls_api}" in line and "https://" in line


def test_a_certificate_the_client_cannot_verify(tls_api, capsys):
    line = _one_line_error(capsys, "runs", "--host", f"https://127.0.0.1:{tls_api}")
    assert "certificate" in line and "could not be verified" in line
    assert "SSL_CERT_FILE" in line  # what to do: trust the cluster's CA


def test_an_answer_that_is_not_http(not_http, capsys):
    line = _one_line_error(capsys, "runs", "--host", f"http://127.0.0.1:{not_http}")
    assert f"http://127.0.0.1:{not_http}" in line and "not HTTP" in line


@pytest.mark.parametrize(
    "status,body",
    [
        (200, b"<html><body>Sign in</body></html>"),
        (200, b"[1, 2]"),
        (200, b'"healthy"'),
        (200, b"{not json"),
        (404, b"<html>\n<head><title>404</title></head>\n<body>no such page</body>\n</html>\n"),
    ],
    ids=["html", "list", "string", "broken-json", "404-html"],
)
def test_an_answer_that_is_not_the_apis_json(status, body, capsys):
    for port in _serve(
        _answering(status, body, "text/html" if body.startswith(b"<") else "application/json")
    ):
        line = _one_line_error(capsys, "runs", "--host", f"http://127.0.0.1:{port}")
        assert f"http://127.0.0.1:{port}" in line and "not the KFP API's JSON" in line
