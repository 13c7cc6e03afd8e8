"""Writing under the dataset folder without following links, and making the writes durable.

Staging writes only below the dataset folder on a shared volume that other people and pods
can also write to, so it never follows a symlink there: `SafeTree` creates folders one
component at a time and refuses any that is a link or a file, and files are opened with
`O_NOFOLLOW`. Durability is paid for once per stage, not per file: `sync_filesystem` is one
`syncfs(2)` of the destination before a snapshot is committed, and `fsync_dir` makes a
rename or a new link in a folder durable. Running out of space is turned into a
`StageError` that names the fix, before the stage starts where it can be foreseen
(`check_free_space`) and where it happens otherwise (`disk_full_as_stage_error`); so is a
folder the pod's user may not create (`create_folder`: a new FSx for Lustre is root's).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from components.stage_data.errors import StageError


class SafeTree:
    """Creates folders under `root` and refuses any path component that is a symlink."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._checked: set[Path] = set()
        self._lock = threading.Lock()

    def target(self, relative: str) -> Path:
        path = self.root / relative
        self.ensure_dir(path.parent)
        if path.is_symlink():
            raise StageError(f"{path} is a symlink; staging never follows links: remove it and re-stage")
        return path

    def ensure_dir(self, folder: Path) -> None:
        if folder in self._checked:
            return
        relative = folder.relative_to(self.root)
        current = self.root
        for part in relative.parts:
            current = current / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(current)
            if current.is_symlink() or not current.is_dir():
                raise StageError(
                    f"{current} is a symlink or a file where a folder belongs; staging never follows "
                    "links out of the dataset folder: remove it and re-stage"
                )
        with self._lock:
            self._checked.add(folder)


FSX_INIT_JOB = "deploy/eks/fsx-init-job.yaml"
"""The one-off Job that creates <mount>/rtp on a new FSx volume and gives it to the image's user."""


def create_folder(folder: Path, mount: str | Path) -> None:
    """`mkdir -p folder`; a permission failure becomes one line naming the folder, the uid and the fix."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except PermissionError as exc:
        blocked = Path(exc.filename).parent if exc.filename else folder.parent
        raise StageError(
            f"cannot create {folder}: uid {os.geteuid()} (gid {os.getegid()}) may not write in {blocked} "
            f"(a new FSx for Lustre is owned by root and Lustre ignores fsGroup): run {FSX_INIT_JOB} once "
            f"(kubectl apply -f {FSX_INIT_JOB}) to create {Path(mount) / 'rtp'} owned by the image's user"
        ) from exc


def open_no_follow(path: Path, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def create_fresh(path: Path) -> int:
    """A new file at `path` for writing. One already there is unlinked first, never written
    through: it may be a hard link into an older snapshot."""
    try:
        return open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        path.unlink()
        return open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(folder: Path) -> None:
    """Make everything written on `folder`'s file system durable: one syncfs(2), else sync(2).

    One call instead of an fsync per file: thousands of small-file fsyncs cost more than the
    downloads themselves (each waits for a journal commit), while durability only matters
    at the point the snapshot is committed and `current` switches.
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc_syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _libc_syncfs(fd: int) -> int:
    """syncfs(2) through libc (Linux); -1 where it does not exist."""
    import ctypes

    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return -1
    return int(syncfs(fd))


def link_or_copy(old: Path, target: Path) -> None:
    """Hard-link `old` as `target` (replacing it), copying where the file system cannot link."""
    try:
        os.link(old, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            target.unlink()
            os.link(old, target, follow_symlinks=False)
        else:
            shutil.copy2(old, target, follow_symlinks=False)


def check_free_space(folder: Path, needed_bytes: int) -> None:
    free = shutil.disk_usage(folder).free
    if needed_bytes > free:
        raise StageError(
            f"the destination has {free / 2**30:.2f} GiB free but this stage needs {needed_bytes / 2**30:.2f} GiB: "
            "free space on the volume, grow the FSx file system, or stage a smaller prefix"
        )


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def disk_full_as_stage_error(path: Path, errnos: tuple[int, ...] = NO_SPACE_ERRNOS) -> Iterator[None]:
    """Turn running out of space while writing `path` into a StageError that names the fix."""
    try:
        yield
    except OSError as exc:
        if exc.errno in errnos:
            raise StageError(
                f"the destination is full while writing {path} ({exc.strerror}): free space on the volume, "
                "grow the FSx file system, or stage to a larger one"
            ) from exc
        raise
