"""Fixtures shared by the suite: a small dataset snapshot, a one-rank process group, a real
MLflow server on loopback, and the upstream schemas the fakes validate against (tests/specs);
and the check that only tests marked `launches` start training processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rtp_support.demo_data import write_local_dataset
from rtp_support.embedded_s3 import free_port
from tests.distributed import harness
from trainer.launch import launch_tempdir

PROJECT_ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_SPECS = Path(__file__).resolve().parent / "specs"
"""Upstream CRDs and the KFP swagger, copied into the repository (see tests/specs/README.md)."""


SHM = Path("/dev/shm")


# ---- `launches`: only tests marked so start training processes ---------------------------

LAUNCHER_MODULES = frozenset({"nvidia_resiliency_ext.fault_tolerance.launcher", "torch.distributed.run"})
RANK_MODULES = frozenset({"trainer", "rtp_prefork"})
TRAINING_COMMANDS = frozenset({"train-local", "local"})
"""`rtp` subcommands that start the launcher (the pipeline's train step, or train-local)."""
TRAINING_BENCHMARKS = frozenset({"checkpoint", "recovery", "scaling", "throughput"})
"""`rtp bench` kinds (and `python -m benchmarks.<kind>`) that train through the launcher."""


def training_launch(argv: list[str]) -> str | None:
    """What in a new process's `argv` starts training — the launcher, a rank, or an rtp
    command that runs them — or None. Help output trains nothing."""
    args = [str(arg) for arg in argv]
    if not args or {"-h", "--help"} & set(args):
        return None
    program = Path(args[0]).name
    if program in {"torchrun", "ft_launcher"}:
        return program
    rest = args[1:]
    if program == "rtp":
        module = "rtp_cli.main"
    elif "-m" in rest[:-1]:
        module = rest[rest.index("-m") + 1]
        rest = rest[rest.index("-m") + 2 :]
    else:
        return None
    if module in LAUNCHER_MODULES or module in RANK_MODULES:
        return f"python -m {module}"
    if module.removeprefix("benchmarks.") in TRAINING_BENCHMARKS and module.startswith("benchmarks."):
        return f"python -m {module}"
    if module != "rtp_cli.main":
        return None
    words = [arg for arg in rest if not arg.startswith("-")]
    if words[:1] and words[0] in TRAINING_COMMANDS:
        return f"rtp {words[0]}"
    if words[:2] and words[0] == "bench" and words[1:2] and words[1] in TRAINING_BENCHMARKS:
        return f"rtp bench {words[1]}"
    return None


class _LaunchGuard:
    """Refuses, in a test not marked `launches`, every new process that starts training,
    training ranks run by torch.multiprocessing, and the rank harness's ranks. Processes are seen where they start, in
    this process: an audit hook sees every `subprocess` and `os.exec*`/`posix_spawn`
    (whoever calls them: a test, `run_local_training`, a fixture), so a command that trains
    (`rtp local`) is refused by its own arguments, before anything it would start."""

    def __init__(self) -> None:
        self.refusing: str | None = None  # the running test's id while it may not launch
        self.refused: list[str] = []
        self._lock = threading.Lock()

    def audit(self, event: str, args: tuple) -> None:
        if self.refusing is None:
            return
        if event == harness.AUDIT_EVENT:
            self.refuse(f"{args[0]} ranks of the rank harness")
        if event == "subprocess.Popen":
            argv = shlex.split(args[1]) if isinstance(args[1], str) else list(args[1])
        elif event in {"os.exec", "os.posix_spawn"}:
            argv = list(args[1])
        else:
            return
        what = training_launch(list(argv))
        if what is not None:
            self.refuse(what)

    def refuse(self, what: str) -> None:
        message = f"{self.refusing} started training ({what}) but is not marked `launches`"
        with self._lock:
            self.refused.append(message)
        raise RuntimeError(message)


LAUNCH_GUARD = _LaunchGuard()


def pytest_addoption(parser: pytest.Parser) -> None:
    """The Makefile's phases, which compose with any `-m`/`-k` a user adds (PYTEST_ARGS)."""
    group = parser.getgroup("rtp")
    group.addoption(
        "--launches",
        choices=("all", "none", "only"),
        default="all",
        help="keep the tests that start training (`launches`) with the others, or none of them, or only them",
    )
    group.addoption(
        "--rank-harness",
        choices=("auto", "off"),
        default="auto",
        help="`auto`: runs that need no launcher fork their ranks from the session's pre-imported "
        "process (tests/distributed/harness.py); `off`: every run goes through ft_launcher",
    )
    group.addoption(
        "--suite",
        choices=("all", "test", "slow"),
        default="all",
        help="`test`: what `make test` runs; `slow`: the benchmark smoke runs and whole-system repeats (`bench`, `slow`)",
    )


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(LAUNCH_GUARD.audit)  # for the session: audit hooks cannot be removed


LAUNCHING_FIXTURES = frozenset({"plain_two_rank_run", "trained_run"})
"""Shared fixtures that train (whichever test asks first runs them): their users launch."""


SAME_WORKER = {
    "tests/integration/test_stage_ceph.py": "ceph-rgw",
    "tests/integration/test_stage_parts.py": "ceph-rgw",
}
"""Modules run on one worker, as one unit: they share a session's service (one Ceph RGW, which
takes ~25 s to start, instead of one per worker)."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with the modules of `SAME_WORKER` as one unit. (pytest-xdist's
    `loadgroup` marks have no effect under pytest 9.2: it renames `item._nodeid`, which pytest
    no longer reads.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return SAME_WORKER.get(module, module)

    return Scheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launches)
    launches, suite = config.getoption("launches"), config.getoption("suite")

    def kept(item: pytest.Item) -> bool:
        launching = item.get_closest_marker("launches") is not None
        slow = any(item.get_closest_marker(name) is not None for name in ("bench", "slow"))
        return (launches == "all" or launching == (launches == "only")) and (
            suite == "all" or slow == (suite == "slow")
        )

    deselected = [item for item in items if not kept(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if kept(item)]
    # The long poles first: `make test` hands whole modules to two workers (`--dist loadfile
    # --no-loadscope-reorder`) in this order, so the modules that launch training (the
    # whole-pipeline ones first) start early and the short ones fill in around them.
    cost = {}
    for item in items:
        module = item.nodeid.partition("::")[0]
        rank = 0 if item.get_closest_marker("e2e") else 1 if item.get_closest_marker("launches") else 2
        cost[module] = min(cost.get(module, 2), rank)
    items.sort(key=lambda item: cost[item.nodeid.partition("::")[0]])  # stable: file order kept


@pytest.fixture(autouse=True)
def launches_only_where_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A test not marked `launches` starts no training: `-m 'not launches'` starts no trainer.
    The refusal is raised where the process would start and recorded, so a test that
    swallows the error still fails here."""
    if request.node.get_closest_marker("launches") is not None:
        yield
        return
    import torch.multiprocessing as mp

    mp_spawn = sys.modules["torch.multiprocessing.spawn"]  # the module; `mp.spawn` is its function
    start_processes = mp_spawn.start_processes

    def start_processes_unless_training(fn, *args, **kwargs):
        if getattr(fn, "__module__", "").partition(".")[0] in RANK_MODULES:
            LAUNCH_GUARD.refuse(f"torch.multiprocessing ranks running {fn.__module__}.{fn.__qualname__}")
        return start_processes(fn, *args, **kwargs)

    monkeypatch.setattr(mp_spawn, "start_processes", start_processes_unless_training)  # mp.spawn calls this
    monkeypatch.setattr(mp, "start_processes", start_processes_unless_training)
    LAUNCH_GUARD.refusing, LAUNCH_GUARD.refused = request.node.nodeid, []
    try:
        yield
    finally:
        LAUNCH_GUARD.refusing = None
    if LAUNCH_GUARD.refused:
        pytest.fail("\n".join(LAUNCH_GUARD.refused), pytrace=False)


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
    # Listed before the maps are read: a name made meanwhile (another xdist worker's ranks
    # go on) is not a candidate, and one listed is mapped by its maker until it is done.
    candidates = set(os.listdir(SHM)) - before
    mapped = _mapped_in_shm()
    for name in candidates:
        if not name.startswith(("torch_", "sem.mp-")) or _inode(SHM / name) in mapped:
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


@pytest.fixture(scope="session", autouse=True)
def rank_harness(
    request: pytest.FixtureRequest, temporary_folder_of_the_session: Path
) -> Iterator[harness.RankHarness | None]:
    """The session's rank harness (its pre-imported process starts at the first run that
    uses it and ends before the session's temporary folder goes)."""
    enabled = request.config.getoption("rank_harness") == "auto"
    with harness.session_harness(temporary_folder_of_the_session, enabled) as session:
        yield session


def _mapped_in_shm() -> set[int]:
    """Inodes of the files under /dev/shm that some live process maps. By inode, not name:
    glibc maps a named semaphore under the temporary name it was made with (`sem.XXXXXX
    (deleted)`), not the name it is linked to (`sem.mp-*`), so a live run's semaphores would
    pass for unused (seen: another session's end removed a running rank's, and its writer
    could not start)."""
    inodes = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and fields[4].isdigit():
                inodes.add(int(fields[4]))
    return inodes


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


@contextlib.contextmanager
def made_once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[Path, Path | None]]:
    """A session fixture's product made once per test run, not once per xdist worker: yields
    (folder, record): the folder to make it in and, when an earlier worker already made it,
    the JSON file it recorded (else None: make it, then write the record). The other workers
    wait on a lock meanwhile (what they wait for, a training run, fills both cores)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each worker's own
    folder, record = shared / name, shared / f"{name}.json"
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if record.exists():
            yield folder, record
            return
        folder.mkdir(exist_ok=True)
        yield folder, None


def shared_json(tmp_path_factory: pytest.TempPathFactory, name: str, make) -> dict:
    """`make(folder)`'s JSON result, made once per test run (`made_once`)."""
    with made_once(tmp_path_factory, name) as (folder, record):
        if record is not None:
            return json.loads(record.read_text())
        value = make(folder)
        (folder.parent / f"{name}.json").write_text(json.dumps(value))
        return value


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    made = shared_json(
        tmp_path_factory,
        "dataset",
        lambda folder: {"path": str(write_local_dataset(folder, budget_bytes=300_000))},
    )
    return Path(made["path"])


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
    no MLflow, no zygote (nothing restarts). None of these settings changes a weight. Its summary.

    tests/distributed: test_resume checks the run itself and resumes against it, test_faults and
    test_live_metrics compare runs with faults against it, test_training_modes runs with
    activation checkpointing and bf16 compute; tests/components/test_validate scores its
    checkpoint in one process against the training ranks' record."""
    from tests.distributed.conftest import (
        NO_ZYGOTE,
        PLAIN_EVERY,
        PLAIN_OVERRIDES,
        PLAIN_STEPS,
        train_local_command,
    )

    def run(workdir: Path) -> dict:
        overrides = [arg for override in (*PLAIN_OVERRIDES, NO_ZYGOTE) for arg in ("--override", override)]
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
        printed = json.loads(result.stdout[result.stdout.rindex("{") :])
        assert printed["model_sha256"] == summary["model_sha256"]
        return summary

    return shared_json(tmp_path_factory, "plain-two-rank", run)  # one run for both xdist workers
