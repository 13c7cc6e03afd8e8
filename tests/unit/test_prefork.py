"""Pre-imported ranks (trainer/prefork.py) with a real zygote and real stand-in processes.

A `sleep` process plays the launcher (the zygote serves its ranks and ends with it); the
stand-ins are `python -c` processes that call `run_forked` as `python -m trainer` does,
and the rank they get forked runs a small module of this test's (`rank_target`) instead
of the trainer, so each behaviour a launcher relies on can be checked on its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from trainer import prefork

REPO = Path(__file__).resolve().parents[2]

TARGET = """
import json, os, signal, sys, time
from pathlib import Path

mode = sys.argv[1]
if mode == "report":
    print(json.dumps({
        "pid": os.getpid(),
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "value": os.environ.get("RTP_TEST_VALUE"),
        "preforked": os.environ.get("RTP_PREFORKED"),
        "torch_imported": "torch" in sys.modules,
        "own_session": os.getsid(0) == os.getpid(),
        "main": sys.modules["__main__"].__spec__.name,
    }))
    sys.exit(int(sys.argv[2]))
if mode == "wait-for-sigterm":
    def on_term(signum, frame):
        Path(sys.argv[3]).write_text("got SIGTERM")
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    Path(sys.argv[2]).write_text(str(os.getpid()))
    time.sleep(120)
if mode == "kill-self":
    os.kill(os.getpid(), signal.SIGKILL)
"""

STAND_IN = (
    "import os, sys; from trainer import prefork; "
    "code = prefork.run_forked(sys.argv, module='rank_target', launcher_pid=int(os.environ['FAKE_LAUNCHER'])); "
    "sys.exit(99 if code is None else code)"
)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A zygote serving a `sleep` launcher, importing what a rank imports."""
    folder = tmp_path_factory.mktemp("prefork")
    (folder / "rank_target.py").write_text(TARGET)
    launcher = subprocess.Popen(["sleep", "600"])
    log = folder / "prefork.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHELASTIC_RUN_ID", "test")
        patch.setenv("LOCAL_RANK", "0")
        patch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(REPO)]))
        patch.delenv(prefork.PREFORKED_ENV, raising=False)
        process = prefork.start_zygote("{}", log, launcher_pid=launcher.pid)
        assert process is not None
        # While it lives (importing, then serving), a second one is not started.
        assert prefork.start_zygote("{}", log, launcher_pid=launcher.pid) is None
    path = prefork.socket_path(launcher.pid)
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.exists(path), log.read_text()
    yield {"launcher": launcher, "process": process, "folder": folder, "log": log, "path": path}
    launcher.kill()
    launcher.wait()
    process.wait(timeout=30)


def stand_in(zygote: dict, *args: str, value: str = "v", **kwargs) -> subprocess.Popen[str]:
    cwd = zygote["folder"] / "cwd"
    cwd.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "TORCHELASTIC_RUN_ID": "test",
        "FAKE_LAUNCHER": str(zygote["launcher"].pid),
        "RTP_TEST_VALUE": value,
        "PYTHONPATH": str(REPO),
    }
    env.pop(prefork.PREFORKED_ENV, None)
    return subprocess.Popen(
        [sys.executable, "-c", STAND_IN, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as torch elastic starts ranks; signals go to the group
        **kwargs,
    )


def test_the_forked_rank_runs_with_the_stand_ins_arguments_environment_and_streams(zygote):
    process = stand_in(zygote, "report", "3", value="from-the-stand-in")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 3, err  # the rank's exit code is the stand-in's
    report = json.loads(out)
    assert report["pid"] != process.pid
    assert report["argv"][1:] == ["report", "3"]
    assert report["cwd"] == str(zygote["folder"] / "cwd")
    assert report["value"] == "from-the-stand-in"
    assert report["preforked"] == str(zygote["launcher"].pid)
    assert report["torch_imported"], "the rank did not start from the pre-imported process"
    assert report["own_session"]
    assert report["main"] == "rank_target"


def test_a_rank_killed_by_a_signal_ends_its_stand_in_by_the_same_signal(zygote):
    process = stand_in(zygote, "kill-self")
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


def test_the_launchers_sigterm_reaches_the_rank(zygote):
    pid_file, term_file = zygote["folder"] / "pid", zygote["folder"] / "term"
    process = stand_in(zygote, "wait-for-sigterm", str(pid_file), str(term_file))
    _wait_for(pid_file)
    os.killpg(process.pid, signal.SIGTERM)  # what torch elastic does to stop a rank
    process.communicate(timeout=60)
    assert term_file.read_text() == "got SIGTERM"
    assert process.returncode == 143


def test_a_sigkilled_stand_in_takes_its_rank_along(zygote):
    pid_file, term_file = zygote["folder"] / "pid-killed", zygote["folder"] / "term-killed"
    process = stand_in(zygote, "wait-for-sigterm", str(pid_file), str(term_file))
    rank = psutil.Process(int(_wait_for(pid_file)))
    assert rank.pid != process.pid and rank.is_running()
    process.kill()  # what the launcher does to a rank that ignores SIGTERM
    # The rank would sleep 120 s on its own; the waiter must kill it once the stand-in is gone.
    _, alive = psutil.wait_procs([rank], timeout=30)
    assert alive == [], f"rank {rank.pid} outlived its SIGKILLed stand-in"
    assert not term_file.exists(), "the rank was stopped with SIGTERM, not killed"
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


def test_without_a_zygote_or_a_launcher_the_rank_starts_the_usual_way(zygote):
    other = subprocess.Popen(["sleep", "600"])
    try:
        process = stand_in(zygote, "report", "0")
        process.communicate(timeout=60)
        assert process.returncode == 0
        env = {**os.environ, "FAKE_LAUNCHER": str(other.pid), "TORCHELASTIC_RUN_ID": "test"}
        no_zygote = subprocess.run([sys.executable, "-c", STAND_IN], env=env, cwd=REPO, check=False)
        assert no_zygote.returncode == 99
        env = {**os.environ, "FAKE_LAUNCHER": str(zygote["launcher"].pid)}
        env.pop("TORCHELASTIC_RUN_ID", None)
        no_launcher = subprocess.run([sys.executable, "-c", STAND_IN], env=env, cwd=REPO, check=False)
        assert no_launcher.returncode == 99
    finally:
        other.kill()
        other.wait()


def test_the_zygote_ends_with_its_launcher_and_leaves_no_socket(tmp_path):
    launcher = subprocess.Popen(["sleep", "600"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHELASTIC_RUN_ID", "test")
        patch.setenv("LOCAL_RANK", "0")
        patch.delenv(prefork.PREFORKED_ENV, raising=False)
        process = prefork.start_zygote("{}", tmp_path / "prefork.log", launcher_pid=launcher.pid)
    assert process is not None
    path = prefork.socket_path(launcher.pid)
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.exists(path)
    launcher.kill()
    launcher.wait()
    assert process.wait(timeout=30) == 0
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".lock")
    log = (tmp_path / "prefork.log").read_text()
    assert "serving" in log and "ended; forked 0 ranks" in log


def _wait_for(path: Path) -> str:
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


def test_a_zygote_whose_imports_started_a_thread_does_not_serve():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "started threads" in (prefork._fork_hazard() or "")
    finally:
        stop.set()
        thread.join()


def test_a_drill_waits_for_a_serving_zygote_and_not_for_a_missing_one(zygote, monkeypatch):
    monkeypatch.setenv(prefork.PREFORKED_ENV, str(zygote["launcher"].pid))
    assert prefork.wait_until_serving(timeout_s=5)
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setenv(prefork.PREFORKED_ENV, str(gone.pid))
    started = time.monotonic()
    assert not prefork.wait_until_serving(timeout_s=30)  # no zygote starting: no wait
    assert time.monotonic() - started < 5


def test_addresses_left_by_a_killed_zygote_are_removed_once_their_launcher_is_gone():
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = os.getpid()
    paths = [
        prefork.socket_path(gone.pid),
        prefork.socket_path(gone.pid) + ".lock",
        prefork.socket_path(live),
    ]
    for path in paths:
        Path(path).touch()
    try:
        prefork._remove_stale_addresses()
        assert [os.path.exists(p) for p in paths] == [False, False, True]
    finally:
        for path in paths:
            Path(path).unlink(missing_ok=True)
