"""Pre-imported ranks (the rtp_prefork launcher plugin) with a real zygote and real stand-in processes.

A `sleep` process plays the launcher (the zygote serves its ranks and ends with it); the
stand-ins are `python -c` processes that call `run_forked` as `python -m rtp_prefork` does,
and the rank they get forked runs a small module of this test's (`rank_target`) instead
of the trainer, so each behaviour a launcher relies on can be checked on its own.
"""

from __future__ import annotations

import contextlib
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

from rtp_prefork import zygote as prefork

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
        "sigpipe_ignored": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
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
    "import os, sys; from rtp_prefork import zygote as prefork; "
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
    # Waited for as a restarted rank waits: at nice 19 on a saturated machine the imports
    # took over 120 s (two busy loops beside the suite); the wait has them run at normal priority.
    assert prefork._wait_until_serving(path, timeout_s=120), log.read_text()
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
    # As in a new interpreter: a write to a closed connection raises BrokenPipeError, it
    # does not kill the rank (nor, through its fork server, the NVRx results Manager).
    assert report["sigpipe_ignored"]


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
    assert prefork._wait_until_serving(path, timeout_s=120)  # as a restarted rank waits (above)
    launcher.kill()
    launcher.wait()
    assert process.wait(timeout=30) == 0
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".lock")
    log = (tmp_path / "prefork.log").read_text()
    assert "serving" in log and "ended; forked 0 ranks" in log


SERVE_SLOWLY = (
    "import sys; from rtp_prefork import zygote as prefork; "
    "prefork.WARM_MODULES = ('slow_import',); sys.exit(prefork.serve(int(sys.argv[1]), '{}', 3))"
)


def test_a_zygote_still_importing_ends_with_its_launcher(tmp_path):
    """A busy node can starve the zygote's low-priority imports past a short run's end: it
    must not outlive its launcher until they finish (here: an import that sleeps 10 minutes)."""
    (tmp_path / "slow_import.py").write_text(
        "import pathlib, sys, time\npathlib.Path(sys.argv[2]).touch()\ntime.sleep(600)\n"
    )
    launcher = subprocess.Popen(["sleep", "600"])
    lock = prefork.socket_path(launcher.pid) + ".lock"
    Path(lock).touch()
    importing = tmp_path / "importing"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    zygote = subprocess.Popen(
        [sys.executable, "-c", SERVE_SLOWLY, str(launcher.pid), str(importing)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its autogroup at nice 19, not the test process's
    )
    try:
        deadline = time.monotonic() + 60
        while not importing.exists():
            assert zygote.poll() is None and time.monotonic() < deadline, zygote.stdout
            time.sleep(0.05)
        time.sleep(0.2)
        assert zygote.poll() is None  # importing
        launcher.kill()
        launcher.wait()
        assert zygote.wait(timeout=10) == 0
        assert "launcher ended while importing" in zygote.stdout.read()
        assert not os.path.exists(lock)
    finally:
        for process in (launcher, zygote):
            process.kill()
            process.wait()
        with contextlib.suppress(OSError):
            os.unlink(lock)


SERVE_SLOWLY_LOCKED = (
    "import fcntl, os, sys; from rtp_prefork import zygote as prefork; "
    "lock = os.open(sys.argv[3], os.O_RDWR | os.O_CREAT); fcntl.flock(lock, fcntl.LOCK_EX); "
    "prefork.WARM_MODULES = ('slow_import',); sys.exit(prefork.serve(int(sys.argv[1]), '{}', lock))"
)


def _nice_of_session(pid: int) -> str | None:
    """The nice of `pid`'s session ("/autogroup-7 nice 0"); None where the kernel has no
    autogroup, or for a process still in the boot session (the kernel prints nothing for it)."""
    with contextlib.suppress(OSError):
        words = Path(f"/proc/{pid}/autogroup").read_text().split()  # [] in the boot session
        return words[2] if len(words) == 3 else None
    return None


# A new session gets an autogroup of its own wherever the kernel has them, though the test
# process may be in the boot session, which has none to show (CI's container: PID 1's session).
AUTOGROUPS = Path("/proc/self/autogroup").exists()


def test_a_restarted_rank_waiting_for_a_zygote_has_it_import_at_normal_priority(tmp_path):
    """At the lowest priority, other work on a busy node can starve the zygote's imports for
    the whole of a restarted rank's wait (seen under load: 60 s, then the rank imported by
    itself): a rank that waits has the zygote go back to the priority it started with."""
    original = os.getpriority(os.PRIO_PROCESS, 0)
    if not prefork._may_restore_priority(original):
        pytest.skip("this user may not raise a priority again: the zygote imports at its own")
    (tmp_path / "slow_import.py").write_text(
        "import pathlib, sys, time\npathlib.Path(sys.argv[2]).touch()\ntime.sleep(600)\n"
    )
    launcher = subprocess.Popen(["sleep", "600"])
    path = prefork.socket_path(launcher.pid)
    importing = tmp_path / "importing"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    zygote = subprocess.Popen(
        [sys.executable, "-c", SERVE_SLOWLY_LOCKED, str(launcher.pid), str(importing), path + ".lock"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as `start_zygote` starts it: a session (autogroup) of its own
    )
    try:
        deadline = time.monotonic() + 60
        while not importing.exists():
            assert zygote.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, zygote.pid) == 19
        assert _nice_of_session(zygote.pid) == ("19" if AUTOGROUPS else None)
        assert not prefork._wait_until_serving(path, timeout_s=0.5)  # importing all the while
        # The zygote takes the request (removes the file) once it has raised both priorities;
        # its watcher thread still runs at nice 19, so on a busy machine that may take a while.
        deadline = time.monotonic() + 60
        while os.path.exists(prefork.hurry_path(path)):
            assert time.monotonic() < deadline, "the zygote never took the request"
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, zygote.pid) == original
        assert _nice_of_session(zygote.pid) == ("0" if AUTOGROUPS else None)  # a new session's
        launcher.kill()
        launcher.wait()
        assert zygote.wait(timeout=60) == 0
        assert "importing at normal priority" in zygote.stdout.read()
    finally:
        for process in (launcher, zygote):
            process.kill()
            process.wait()
        for leftover in (path + ".lock", prefork.hurry_path(path)):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


LOWER_THEN_RESTORE = (
    "import threading; from pathlib import Path; from rtp_prefork import zygote as prefork; "
    "before = prefork._lower_session_priority(); "
    "lowered = Path('/proc/self/autogroup').read_text().split('nice')[1].strip(); "
    "prefork._restore_priority(threading.get_native_id(), None, before); "
    "print(before, lowered, Path('/proc/self/autogroup').read_text().split('nice')[1].strip())"
)


def test_the_session_priority_comes_back_though_the_kernel_refuses_a_second_write_within_0_1_s():
    """Without CAP_SYS_ADMIN the kernel refuses a session-priority write (EAGAIN) within
    0.1 s of any other on the machine (two zygotes starting at once in CI): the zygote's
    session stayed at nice 19 after a restarted rank asked it to hurry."""
    if not AUTOGROUPS:
        pytest.skip("no autogroup scheduling on this kernel")
    command = [sys.executable, "-c", LOWER_THEN_RESTORE]
    if prefork.has_capability(prefork.CAP_SYS_ADMIN):  # which lifts the limit: drop it for the child
        command = ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", *command]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=60, start_new_session=True
        )
    except FileNotFoundError:
        pytest.skip("setpriv is not installed: cannot run without CAP_SYS_ADMIN")
    if done.returncode != 0 and "setpriv" in done.stderr:
        pytest.skip(f"cannot drop CAP_SYS_ADMIN here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    before, lowered, after = done.stdout.split()
    assert (lowered, after) == ("19", before), done.stdout


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


def test_a_restarted_rank_waits_for_a_zygote_still_importing_and_not_for_a_missing_one(tmp_path):
    import fcntl

    path = str(tmp_path / "zygote.sock")
    assert not prefork._wait_until_serving(path, timeout_s=30)  # none lives: no wait
    lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a zygote lives and imports
    try:
        threading.Timer(0.5, lambda: Path(path).touch()).start()  # ...and serves 0.5 s later
        started = time.monotonic()
        assert prefork._wait_until_serving(path, timeout_s=30)
        assert 0.4 < time.monotonic() - started < 10
        Path(path).unlink()
        started = time.monotonic()
        assert not prefork._wait_until_serving(path, timeout_s=0.3)  # one that never serves: bounded
        assert time.monotonic() - started < 5
        threading.Timer(0.3, lambda: os.close(lock)).start()  # it dies while importing
        started = time.monotonic()
        assert not prefork._wait_until_serving(path, timeout_s=30)
        assert time.monotonic() - started < 10
    finally:
        with contextlib.suppress(OSError):
            os.close(lock)


def test_the_entry_reads_the_config_inline_or_from_its_file_and_runs_the_trainer(tmp_path):
    from rtp_prefork.__main__ import _config_json, _workdir

    (tmp_path / "config.json").write_text('{"run": {"workdir": "/w"}}')
    assert _config_json([f"--config={tmp_path / 'config.json'}"]) == '{"run": {"workdir": "/w"}}'
    assert _config_json(["--config", '{"a": 1}']) == '{"a": 1}'
    assert _config_json(["--preset=tiny-cpu"]) == "{}"
    assert _workdir('{"run": {"workdir": "/w"}}') == Path("/w") and _workdir("{}") == Path(".")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    shown = subprocess.run(
        [sys.executable, "-m", "rtp_prefork", "--help"], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert "usage: python -m trainer" in shown.stdout  # no launcher: the trainer itself ran here


def test_the_launcher_starts_ranks_through_the_plugin_unless_turned_off():
    import rtp_prefork
    from trainer.config import resolve_config
    from trainer.launch import LauncherSettings, build_launch_command

    on = resolve_config(preset="tiny-cpu", named={"dataset_dir": "/d"})
    off = resolve_config(
        preset="tiny-cpu", named={"dataset_dir": "/d"}, overrides=["resilience.prefork_workers=false"]
    )
    settings = rtp_prefork.launcher_settings(on, LauncherSettings(max_restarts=7))
    assert settings.max_restarts == 7
    assert build_launch_command(2, ["--config=c"], settings=settings)[-3:] == [
        "-m",
        "rtp_prefork",
        "--config=c",
    ]
    assert build_launch_command(2, ["--config=c"], settings=rtp_prefork.launcher_settings(off))[-3:] == [
        "-m",
        "trainer",
        "--config=c",
    ]


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
