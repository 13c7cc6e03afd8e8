"""A real `mlflow server` on loopback that a test can stop and start again on the same port,
and a flaky HTTP proxy (a stand-in, named as such) that answers 503 to the first requests,
or forwards a request and then drops the server's answer (the server did the work, the
client never hears of it)."""

from __future__ import annotations

import http.client
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from rtp_support.embedded_s3 import free_port


class RestartableMlflowServer:
    """sqlite backend and proxied artifacts under `root`; state survives a stop/start."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 90.0) -> RestartableMlflowServer:
        log_file = (self.root / "server.log").open("a")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination",
                str(self.root / "artifacts"),
                "--serve-artifacts",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            start_new_session=True,  # its own process group: the workers end with it
        )
        log_file.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {self.process.returncode}: "
                    f"{(self.root / 'server.log').read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not answer /health within {timeout_s} s")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None


class FlakyProxy:
    """A fake front end for a real MLflow server: answers 503 to the first `failures`
    requests, forwards everything after that. Stands in for an overloaded ingress.

    With `drop_answers_to`, the first `drops` requests whose path contains it are forwarded
    and answered by the server, but the answer is dropped: the connection closes instead.
    """

    def __init__(self, upstream_port: int, failures: int, drop_answers_to: str = "", drops: int = 1) -> None:
        self.failures_left = failures
        self.failed = 0
        self.drop_answers_to = drop_answers_to
        self.drops_left = drops if drop_answers_to else 0
        self.dropped = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy.lock:
                    fail = proxy.failures_left > 0
                    if fail:
                        proxy.failures_left -= 1
                        proxy.failed += 1
                if fail:
                    payload = b"upstream overloaded"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                with proxy.lock:
                    drop = proxy.drops_left > 0 and proxy.drop_answers_to in self.path
                    if drop:
                        proxy.drops_left -= 1
                        proxy.dropped += 1
                if drop:  # the server has done the work; the client never hears of it
                    upstream.close()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FlakyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
