"""Fixtures shared by the suite: a small dataset snapshot, a one-rank process group, a real
MLflow server on loopback, and the upstream schemas the fakes validate against (tests/specs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rtp_cli.demo_data import write_local_dataset
from rtp_cli.embedded_s3 import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_SPECS = Path(__file__).resolve().parent / "specs"
"""Upstream CRDs and the KFP swagger, copied into the repository (see tests/specs/README.md)."""


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_local_dataset(tmp_path_factory.mktemp("dataset"), budget_bytes=300_000)


@pytest.fixture(scope="session")
def upstream_specs() -> Path:
    return UPSTREAM_SPECS


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    """A real one-rank gloo process group, so collective code runs in-process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` (sqlite backend, proxied artifacts) on a free loopback port."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log_file = (root / "server.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--serve-artifacts",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # its own process group: the server's workers end with it
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"mlflow server exited with {process.returncode}: {(root / 'server.log').read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("mlflow server did not answer /health within 90 s")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log_file.close()
