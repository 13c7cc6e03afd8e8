"""The zygote: a pre-imported process per node from which restarted ranks are forked.

Local rank 0 of a worker group that finds none starts it (`rtp_prefork.__main__`): it
imports torch, NVRx and the trainer once, freezes them out of the garbage collector's
passes, then waits on a Unix socket. A rank the launcher starts later asks it first; when
it answers, the new process (standard library only) stays a thin stand-in and the rank
proper is forked from the zygote with the stand-in's arguments, environment, working
directory and streams (docs/fault-tolerance.md has the process tree):

- the stand-in forwards the launcher's signals to the rank's process group and exits as
  the rank did, so the launcher, the rank monitors and the event log see an ordinary rank;
- the waiter, forked per rank, SIGKILLs the rank's process group when the stand-in dies;
  the rank dies with the waiter, the waiter with the zygote, the zygote with the launcher.

A restarted rank that finds the zygote still importing waits for it (`run_forked`); where
none lives, a rank starts the usual way. Fork safety: the zygote runs no torch operation,
initializes no CUDA and holds no Python thread when it forks (it checks: the thread that
ends it with the launcher while it imports is joined first), and imports at the lowest CPU
priority.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import gc
import importlib
import io
import json
import os
import resource
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

PREFORKED_ENV = "RTP_PREFORKED"
"""Set in a rank forked from the zygote (to the launcher's pid); the trainer reports it
(`preforked` in its attempt records), and such a rank starts no zygote."""
ZYGOTE_WAIT_S = 60.0
"""How long a restarted rank waits for a zygote that is still importing: no longer than a
new process would take to import the same, with the restarted ranks' CPUs idle."""

WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "nvidia_resiliency_ext.inprocess",
    "nvidia_resiliency_ext.fault_tolerance",
    "nvidia_resiliency_ext.checkpointing.async_ckpt.core",
    "trainer.resilience",
    "trainer.loop",
    "trainer.checkpointing",
    "trainer.checkpointing.local_tier",
    "trainer.checkpointing.replicas",
    "trainer.models",
)
"""What a rank imports on its way to the first step (the modules that cost; their imports
bring the rest). Hugging Face models add `transformers` (see `modules_for`)."""

FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_HEADER = struct.Struct("!I")


def socket_path(launcher_pid: int, folder: str | None = None) -> str:
    """The zygote's address for the ranks of one launcher (its pid) on this machine, in the
    temporary folder (`folder`: the zygote's, where it differs from this process's)."""
    return os.path.join(folder or tempfile.gettempdir(), f"rtp-prefork-{os.getuid()}-{launcher_pid}.sock")


def _under_launcher() -> bool:
    """Started by a torch elastic agent (torchrun, ft_launcher): our parent is the launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ and PREFORKED_ENV not in os.environ


# --- in a new rank process (the stand-in) ------------------------------------------------


def run_forked(
    argv: list[str], module: str = "trainer", launcher_pid: int | None = None, wait_s: float = 0.0
) -> int | None:
    """Have the zygote fork this rank (`python -m <module> <argv[1:]>`) and stand in for it
    until it ends; returns the exit code to leave with (a rank killed by a signal: this
    process is killed by the same one). None when no zygote answers: the caller starts the
    rank itself. `launcher_pid`: whose zygote (default: the parent, the launcher). `wait_s`:
    how long to wait for one that is still importing."""
    if not _under_launcher():
        return None
    launcher = os.getppid() if launcher_pid is None else launcher_pid
    path = socket_path(launcher)
    if not _wait_until_serving(path, wait_s):
        return None
    # A signal from the launcher before the forwarding handlers are in place would end this
    # stand-in alone (and with it, by the waiter, its rank with SIGKILL): held until then.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    rank = ask_for_rank(path, argv, dict(os.environ), os.getcwd(), launcher, module)
    if rank is None:  # no zygote answered: start the usual way
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # what came meanwhile acts as usual
        return None

    def forward(signum: int, frame: object) -> None:
        rank.signal(signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)  # what came meanwhile is forwarded now
    status = rank.wait()
    if status is None:
        print("trainer: error: the pre-imported process ended before the rank did", file=sys.stderr)
        return 1
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return code
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), -code)  # end as the rank ended: killed by the same signal
    return 128 - code  # that signal is ignored here


class ForkedRank:
    """A rank the zygote forked, as the process that asked for it sees it: its pid, the
    signals to pass on to it, and its end (which the rank's waiter reports)."""

    def __init__(self, sock: socket.socket, replies: BinaryIO, pid: int) -> None:
        self.sock, self.replies, self.pid = sock, replies, pid

    def signal(self, signum: int) -> None:
        """Have the waiter send `signum` to the rank's process group (as a launcher signals a rank)."""
        with contextlib.suppress(OSError):
            self.sock.sendall(f"signal {signum}\n".encode())

    def wait(self) -> int | None:
        """The rank's wait status once it ended; None if the zygote's side ended first."""
        with contextlib.suppress(OSError, ValueError):  # ValueError: closed meanwhile
            for line in self.replies:
                kind, _, value = line.partition(b" ")
                if kind == b"exit":
                    return int(value)
        return None

    def close(self) -> None:
        self.replies.close()
        self.sock.close()


def ask_for_rank(
    path: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    launcher_pid: int,
    module: str = "trainer",
    fds: tuple[int, int, int] = (0, 1, 2),
) -> ForkedRank | None:
    """Ask the zygote at `path` to fork `python -m <module> <argv[1:]>` with this environment,
    working directory and standard streams (`fds`: stdin, stdout, stderr) for the ranks of
    `launcher_pid`; None when no zygote answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        request = json.dumps(
            {"module": module, "argv": argv, "env": env, "cwd": cwd, "launcher_pid": launcher_pid}
        ).encode()
        socket.send_fds(sock, [b"R"], list(fds))
        sock.sendall(_HEADER.pack(len(request)) + request)
        replies = sock.makefile("rb")
        first = replies.readline().split()
    except OSError:
        first = []
    if first[:1] != [b"pid"] or len(first) < 2:
        sock.close()
        return None
    return ForkedRank(sock, replies, int(first[1]))


_zygote: subprocess.Popen[bytes] | None = None


def start_zygote(
    config_json: str, log_path: Path, launcher_pid: int | None = None
) -> subprocess.Popen[bytes] | None:
    """From local rank 0 of a worker group that found no zygote: start this node's in the
    background (a session of its own: the launcher's SIGTERM to the rank must not reach
    it). A lock the zygote holds for its life keeps a second one from starting beside one
    that is still importing. `launcher_pid`: whose ranks it serves (default: the parent)."""
    global _zygote
    if not _under_launcher() or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    launcher_pid = os.getppid() if launcher_pid is None else launcher_pid
    _remove_stale_addresses()
    lock = os.open(socket_path(launcher_pid) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a zygote lives (importing, or serving ranks that found it busy)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            _zygote = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rtp_prefork.zygote",
                    f"--launcher-pid={launcher_pid}",
                    f"--lock-fd={lock}",
                    f"--config={config_json}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                pass_fds=(lock,),
            )
        return _zygote
    finally:
        os.close(lock)  # the zygote's copy keeps the lock


def _remove_stale_addresses() -> None:
    """A zygote killed outright (SIGKILL) leaves its socket and lock file behind: remove
    those of launchers that are gone."""
    prefix = f"rtp-prefork-{os.getuid()}-"
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix) :].split(".")[0]
            if not pid.isdigit() or _process_exists(int(pid)):
                continue
            if entry.name.endswith(".lock") and _zygote_alive(entry.path):
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_until_serving(path: str, timeout_s: float) -> bool:
    """Whether the zygote at `path` serves, waiting up to `timeout_s` while one is starting
    (it holds its lock); no wait when none lives. A waiting rank asks the zygote to finish its
    imports at normal priority (`hurry_path`): at the lowest, other work on a busy node can
    starve them for the whole wait."""
    deadline = time.monotonic() + timeout_s
    hurried = False
    while not os.path.exists(path):
        if time.monotonic() > deadline or not _zygote_alive(path + ".lock"):
            return os.path.exists(path)
        if not hurried and timeout_s > 0:
            hurried = True
            with contextlib.suppress(OSError):
                Path(hurry_path(path)).touch()
        time.sleep(0.05)
    return True


def hurry_path(path: str) -> str:
    """A file a waiting rank creates beside the zygote's address: import at normal priority."""
    return path + ".hurry"


def _zygote_alive(lock_path: str) -> bool:
    try:
        lock = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(lock)  # also drops the lock if this probe took it
    return False


# --- the zygote ----------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} prefork[{os.getpid()}]: {message}", flush=True)


CAP_SYS_ADMIN, CAP_SYS_NICE = 21, 23  # bits of linux/capability.h


def has_capability(bit: int) -> bool:
    """Whether this process holds capability `bit` (its effective set; False if unreadable)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return bool(int(Path("/proc/self/status").read_text().split("CapEff:")[1].split()[0], 16) >> bit & 1)
    return False


def _may_restore_priority(original: int) -> bool:
    """Whether a process at nice 19 may go back to `original`: with CAP_SYS_NICE (which root
    in a container may lack) or a high enough `RLIMIT_NICE`."""
    if has_capability(CAP_SYS_NICE):
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20 - original


def _lower_session_priority() -> str | None:
    """With the kernel's autogroup scheduling (common on desktops and VMs) CPU time is shared
    between sessions first, and a process's nice only ranks it within its session: the
    zygote, alone in its session, would get a rank's share however nice it is. Its session's
    own priority is lowered instead (any process may lower its own); a rank forked from it
    starts a session of its own, at normal priority. Returns the session's nice before
    (None without autogroup)."""
    with contextlib.suppress(OSError, IndexError):
        before = Path("/proc/self/autogroup").read_text().split("nice")[1].strip()  # "/autogroup-7 nice 0"
        _set_session_nice("19")
        return before
    return None


def _set_session_nice(nice: str, patience_s: float = 5.0) -> None:
    """Write this session's nice. Without CAP_SYS_ADMIN the kernel takes one such write per
    0.1 s from the whole machine and refuses others with EAGAIN (two zygotes starting at once
    met that in CI): retry until `patience_s` has passed, then raise."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            Path("/proc/self/autogroup").write_text(nice)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _restore_priority(importer: int, nice: int | None, autogroup: str | None) -> None:
    """Back to the priority the zygote started with: its importing thread (`importer`, a
    thread id) and its session, where allowed (raising a priority takes CAP_SYS_NICE or
    `RLIMIT_NICE`)."""
    if nice is not None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, importer, nice)
    if autogroup is not None:
        with contextlib.suppress(OSError):
            _set_session_nice(autogroup)


def modules_for(config_json: str) -> list[str]:
    modules = list(WARM_MODULES)
    with contextlib.suppress(ValueError, AttributeError):
        model = json.loads(config_json).get("model", {})
        if model.get("kind") == "hf" or model.get("model_dir"):
            modules += ["transformers", "trainer.models.hf_causal_lm"]
    return modules


def warm_up(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a module a rank would not need here: it imports it itself
            _log(f"not pre-imported: {name} ({type(exc).__name__}: {exc})")


def _fork_hazard() -> str | None:
    """What would make forking ranks from this process unsafe, if anything."""
    if threading.active_count() != 1:
        return f"importing started threads {threading.enumerate()} (a fork keeps only the calling one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "importing initialized CUDA (a forked process cannot use it)"
    return None


def serve(launcher_pid: int, config_json: str, lock_fd: int | None = None) -> int:
    """Import, then fork a rank for every stand-in that asks, until the launcher ends.

    In a forked rank this call does not return: the rank's own end (its SystemExit, or an
    error) unwinds through here to the interpreter's exit, as in any `python -m` process."""
    path = socket_path(launcher_pid)
    zygote = os.getpid()
    original_nice = os.getpriority(os.PRIO_PROCESS, 0)
    restore = original_nice if _may_restore_priority(original_nice) else None
    if restore is not None:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    autogroup = _lower_session_priority()
    started = time.monotonic()
    try:
        try:
            launcher = os.pidfd_open(launcher_pid)
        except ProcessLookupError:
            return 0
        hurry = functools.partial(_restore_priority, threading.get_native_id(), restore, autogroup)
        with _ending_with(launcher, path + ".lock" if lock_fd is not None else None, hurry_path(path), hurry):
            warm_up(modules_for(config_json))
        unsafe = _fork_hazard()
        if unsafe:
            _log(f"not serving: {unsafe}")
            return 1
        # Everything imported stays for good: out of the forked ranks' garbage-collector
        # passes, which would otherwise write to (and so copy) every page of it.
        gc.collect()
        gc.freeze()
        staging = f"{path}.{zygote}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(staging)
        listener.listen(64)
        os.replace(staging, path)  # ranks see the socket only once it listens
        address = os.stat(path).st_ino
        _log(f"serving {path}: imports took {time.monotonic() - started:.2f} s (launcher {launcher_pid})")
        try:
            served = _fork_on_request(listener, launcher, lock_fd, restore)
        finally:
            if os.getpid() == zygote:
                with contextlib.suppress(OSError):  # unless a newer zygote took the address over
                    if os.stat(path).st_ino == address:
                        os.unlink(path)
        _log(f"launcher {launcher_pid} ended; forked {served} ranks")
        return 0
    finally:
        if lock_fd is not None and os.getpid() == zygote:
            for leftover in (path + ".lock", hurry_path(path)):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)


@contextlib.contextmanager
def _ending_with(
    launcher: int, lock_path: str | None, hurry_file: str, hurry: Callable[[], None]
) -> Iterator[None]:
    """End this process as soon as the launcher (its pidfd) ends while the block runs: the
    imports, which at nice 19 on a busy node can outlast the launcher by a minute. Call
    `hurry` once when `hurry_file` appears (a restarted rank waits; looked for every 0.2 s).
    The watcher thread is joined before the block returns: none is left to fork."""
    stop_r, stop_w = os.pipe()

    def watch() -> None:
        hurried = False
        while True:
            ready, _, _ = select.select([launcher, stop_r], [], [], None if hurried else 0.2)
            if stop_r in ready:
                return
            if launcher in ready:
                break
            if not hurried and os.path.exists(hurry_file):
                hurried = True
                hurry()
                with contextlib.suppress(OSError):
                    os.unlink(hurry_file)
                _log("a restarted rank waits: importing at normal priority")
        _log("launcher ended while importing")
        if lock_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
        os._exit(0)

    watcher = threading.Thread(target=watch, name="rtp-prefork-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.write(stop_w, b"x")
        watcher.join()
        os.close(stop_r)
        os.close(stop_w)


def _fork_on_request(listener: socket.socket, launcher: int, lock_fd: int | None, nice: int | None) -> int:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the waiters
    served = 0
    while True:
        ready, _, _ = select.select([listener.fileno(), launcher], [], [])
        if launcher in ready:
            return served
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError) as exc:
            _log(f"ignored a request: {exc}")
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            os.close(launcher)
            if lock_fd is not None:
                os.close(lock_fd)
            _wait_for_rank(conn, fds, request, nice)  # returns in the rank only, by raising
        served += 1
        for fd in fds:
            os.close(fd)
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(10)
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
    reader = conn.makefile("rb")
    (size,) = _HEADER.unpack(reader.read(_HEADER.size))
    request = json.loads(reader.read(size))
    conn.settimeout(None)
    return request, fds


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # the rank's session, as a launcher signals it
    except ProcessLookupError:  # not yet its own group leader
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _wait_for_rank(conn: socket.socket, fds: list[int], request: dict[str, Any], nice: int | None) -> None:
    """In the waiter: fork the rank, relay the stand-in's signals to it, report its end."""
    from trainer.lifecycle import die_with_parent

    die_with_parent(os.getppid())
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    rank = os.fork()
    if rank == 0:
        _become_rank(conn, fds, request, nice)
        raise SystemExit(0)
    try:
        for fd in fds:
            os.close(fd)
        _relay(conn, rank)
    finally:
        os._exit(0)


def _relay(conn: socket.socket, rank: int) -> None:
    rank_fd = os.pidfd_open(rank)
    conn.sendall(f"pid {rank}\n".encode())
    pending = b""
    while True:
        ready, _, _ = select.select([conn.fileno(), rank_fd], [], [])
        if rank_fd in ready:
            _, status = os.waitpid(rank, 0)
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {status}\n".encode())
            return
        data = conn.recv(4096)
        if not data:  # the stand-in is gone (SIGKILLed): so is the rank
            _signal_group(rank, signal.SIGKILL)
            os.waitpid(rank, 0)
            return
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            kind, _, value = line.partition(b" ")
            if kind == b"signal":
                _signal_group(rank, int(value))


def _become_rank(conn: socket.socket, fds: list[int], request: dict[str, Any], nice: int | None) -> None:
    """In the rank: take over the stand-in's streams, environment and arguments, and run."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    conn.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[PREFORKED_ENV] = str(request["launcher_pid"])
    for signum in (*FORWARDED_SIGNALS, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    # As a new interpreter starts: a write to a closed connection raises, it does not kill.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=unbuffered)
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))  # the OpenMP runtime read the zygote's at import
    sys.argv = list(request["argv"])
    # As `python -m <module>` runs it (sys.argv[0] and __main__ included: multiprocessing's
    # spawn re-imports __main__ in its children).
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rtp_prefork.zygote",
        description="This node's pre-imported process for restarted ranks (started by local "
        "rank 0 of a worker group that finds none; see rtp_prefork/zygote.py).",
    )
    parser.add_argument(
        "--launcher-pid", type=int, required=True, help="serve this launcher's ranks; end with it"
    )
    parser.add_argument("--lock-fd", type=int, help="an open file whose lock says this zygote lives")
    parser.add_argument("--config", default="{}", help="the run's config as JSON: what to pre-import")
    args = parser.parse_args(argv)
    return serve(args.launcher_pid, args.config, args.lock_fd)


if __name__ == "__main__":
    sys.exit(main())
