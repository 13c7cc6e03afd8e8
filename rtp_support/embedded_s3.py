"""`EmbeddedS3`, the stand-in for S3 that `rtp local` starts on loopback, and `free_port()`.

`EmbeddedS3` runs moto's S3 server in a subprocess: an in-memory, S3-compatible endpoint
that lets the demo stage data exactly as on AWS, without an account. It is a test double
for S3, used only when no `--source` bucket is given. `free_port()` asks the OS for an
unused loopback port (the tests and benchmarks that start servers use it too).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import TracebackType

DEMO_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "rtp-local-demo",
    "AWS_SECRET_ACCESS_KEY": "rtp-local-demo",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""moto accepts any keys; these are only used against the embedded endpoint."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedS3:
    """`with EmbeddedS3() as s3: s3.endpoint_url` — a moto S3 server on 127.0.0.1."""

    def __init__(self, start_timeout_s: float = 30.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint_url = ""

    def start(self) -> EmbeddedS3:
        port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        self.endpoint_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the embedded S3 server (moto) exited with code {self.process.returncode}; "
                    "is moto[server] installed? (`make demo` installs it)"
                )
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1).close()
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"the embedded S3 server did not answer on {self.endpoint_url} within {self.start_timeout_s}s"
        )

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
