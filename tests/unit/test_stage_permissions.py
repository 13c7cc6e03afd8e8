"""A volume the pod's user may not write (a new FSx for Lustre is root's, mode 755): one line that names the fix.

The folder is made read-only for real; where the tests run as root, permissions do not
bite, so `os.mkdir` refuses in it the way the kernel would (EACCES) instead.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from components.stage_data.errors import StageError
from components.stage_data.fs_safety import FSX_INIT_JOB
from components.stage_data.stage import stage_dataset

pytestmark = [pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def read_only_mount(tmp_path, monkeypatch):
    mount = tmp_path / "fsx"
    mount.mkdir()
    mount.chmod(0o555)
    if os.access(mount, os.W_OK):  # root: refuse new folders in it as the kernel does for others
        real_mkdir = os.mkdir

        def mkdir(path, mode=0o777, *, dir_fd=None):
            if Path(path).parent == mount and not mount.stat().st_mode & 0o200:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_mkdir(path, mode, dir_fd=dir_fd)

        monkeypatch.setattr(os, "mkdir", mkdir)
    yield mount
    mount.chmod(0o755)


@pytest.fixture
def source(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "part-0.txt").write_text("hello\n")
    return folder


def test_a_volume_the_user_cannot_write_names_the_path_the_uid_and_the_init_job(read_only_mount, source):
    with pytest.raises(StageError) as raised:
        stage_dataset(str(source), str(read_only_mount), "ds")
    message = str(raised.value)
    assert "\n" not in message
    assert f"cannot create {read_only_mount / 'rtp/datasets/ds'}" in message
    assert f"uid {os.geteuid()} (gid {os.getegid()}) may not write in {read_only_mount}" in message
    assert f"run {FSX_INIT_JOB} once" in message and str(read_only_mount / "rtp") in message
    assert (ROOT / FSX_INIT_JOB).is_file()
    assert list(read_only_mount.iterdir()) == []


def test_once_the_rtp_folder_is_writable_staging_goes_ahead(read_only_mount, source):
    read_only_mount.chmod(0o755)
    (read_only_mount / "rtp").mkdir()  # what the init Job leaves behind
    result = stage_dataset(str(source), str(read_only_mount), "ds")
    assert result.files == 1
    assert (read_only_mount / "rtp/datasets/ds/current/part-0.txt").read_text() == "hello\n"
