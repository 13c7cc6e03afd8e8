"""Fixtures shared by the suite: a small dataset snapshot, a one-rank process group, a real
MLflow server on loopback, and the upstream schemas the fakes validate against (tests/specs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rtp_support.demo_data import write_local_dataset
from rtp_support.embedded_s3 import free_port
from trainer.launch import launch_tempdir

PROJECT_ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_SPECS = Path(__file__).resolve().parent / "specs"
"""Upstream CRDs and the KFP swagger, copied into the repository (see tests/specs/README.md)."""


SHM = Path("/dev/shm")


@pytest.fixture(scope="session", autouse=True)
def shared_memory_of_killed_processes_removed() -> Iterator[None]:
    """Tests kill jobs whole (a pod's death) or let a launcher SIGKILL a rank's process
    group: torch's shared tensors (`file_system` sharing: `torch_<pid>_*`) and
    multiprocessing's named semaphores (`sem.mp-*`) then outlive them when their manager
    process or resource tracker was killed too. A pod's /dev/shm goes with the pod; this
    machine's stays. At the end of the session, the ones that appeared during it and that no
    live process maps any more (so none can use them) are removed."""
    before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    yield
    if not SHM.is_dir():
        return
    mapped = _mapped_in_shm()
    for name in set(os.listdir(SHM)) - before:
        if not name.startswith(("torch_", "sem.mp-")) or name in mapped:
            continue
        creator = name.split("_")[1] if name.startswith("torch_") else ""
        if creator.isdigit() and Path(f"/proc/{creator}").exists():
            continue
        (SHM / name).unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def temporary_folder_of_the_session(tmp_path_factory) -> Iterator[Path]:
    """The session's temporary folder (TMPDIR, and `tempfile`'s in this process, which
    computes paths its processes use too, such as the zygote's socket) is one of its own,
    removed when it ends: a job a test kills whole (a pod's death) cannot remove its launch
    folder (`trainer.launch.launch_tempdir`), as a pod's /tmp would go with the pod. The
    fault and end-to-end tests check, with a TMPDIR of their own, that runs leave nothing
    there. pytest's `tmp_path` folders stay where they were (kept for a look after a run)."""
    tmp_path_factory.getbasetemp()  # made before the temporary folder changes
    with launch_tempdir(os.environ, prefix="rtp-tests-") as folder:
        previous, tempfile.tempdir = tempfile.tempdir, str(folder)
        try:
            yield folder
        finally:
            tempfile.tempdir = previous


def _mapped_in_shm() -> set[str]:
    """Names under /dev/shm that some live process maps."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            where = line.find("/dev/shm/")
            if where >= 0:
                names.add(line[where + len("/dev/shm/") :].removesuffix(" (deleted)"))
    return names


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


@pytest.fixture(scope="session")
def plain_two_rank_run(dataset_dir, tmp_path_factory) -> dict:
    """One fault-free run shared by the modules that compare against it, trained through the
    user's command, `rtp train-local`: 2 ranks, seed 7, PLAIN_STEPS steps, asynchronous
    checkpoints (the default) every PLAIN_EVERY, low restart timeouts and metrics every step,
    no MLflow. None of these settings changes a weight. Its summary.

    tests/distributed: test_resume checks the run itself and resumes against it, test_faults and
    test_live_metrics compare runs with faults against it, test_training_modes runs with
    activation checkpointing and bf16 compute; tests/components/test_validate scores its
    checkpoint in one process against the training ranks' record."""
    from tests.distributed.conftest import PLAIN_EVERY, PLAIN_OVERRIDES, PLAIN_STEPS, train_local_command

    workdir = tmp_path_factory.mktemp("plain-two-rank")
    overrides = [arg for override in PLAIN_OVERRIDES for arg in ("--override", override)]
    command = train_local_command(dataset_dir, workdir, PLAIN_STEPS, PLAIN_EVERY, *overrides)
    env = {
        k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"
    }  # "no MLflow", whatever ran before
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=500, stdin=subprocess.DEVNULL, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    # The command prints the summary as its last output.
    assert json.loads(result.stdout[result.stdout.rindex("{") :])["model_sha256"] == summary["model_sha256"]
    return summary
