"""`mlflow models serve` on a registered version, asked as a client of an OpenAI-style chat
endpoint asks: the tests' one way to prove that a registered model answers chat requests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from rtp_support.embedded_s3 import free_port

SERVE_START_TIMEOUT_S = 180.0


def served_chat_reply(
    model_uri: str, tracking_uri: str, cwd: Path, request: dict[str, Any]
) -> dict[str, Any]:
    """Serve `model_uri` (a models:/ URI resolved through `tracking_uri`) on a free loopback
    port, POST `request` to /invocations and return the chat completion; the server is stopped."""
    port = free_port()
    env = {"MLFLOW_TRACKING_URI": tracking_uri, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri]
    server = subprocess.Popen(
        [*command, "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + SERVE_START_TIMEOUT_S
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            assert time.monotonic() < deadline, "mlflow models serve did not come up"
            time.sleep(1)
        reply = requests.post(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps(request),
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        return dict(body[0] if isinstance(body, list) else body)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
