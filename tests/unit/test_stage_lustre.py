"""Why the stage step skips Lustre striping: no `lfs` in the image, or a destination that is not Lustre.

The two are different facts and get different lines: the component image has no Lustre
client tools, so on FSx the line must not claim the volume is not Lustre.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from components.stage_data.lustre import Lustre, filesystem_type

MOUNTINFO = """\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw
25 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
31 22 0:45 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs shm rw,size=268435456k
40 22 0:52 / /fsx rw,relatime shared:20 - lustre 172.31.1.1@tcp:/abcdefgh rw,flock,lazystatfs
41 22 0:53 / /mnt/my\\040data rw,relatime shared:21 - xfs /dev/nvme1n1 rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/fsx", "lustre"),
        ("/fsx/rtp/datasets/ds", "lustre"),
        ("/fsxother/rtp", "ext4"),  # a sibling with the same prefix is not inside /fsx
        ("/home/rtp", "ext4"),
        ("/dev/shm/x", "tmpfs"),
        ("/mnt/my data/rtp", "xfs"),  # mountinfo writes a space as \040
    ],
)
def test_filesystem_type_is_the_deepest_mount_holding_the_path(path, kind):
    assert filesystem_type(path, MOUNTINFO) == kind


def test_filesystem_type_is_unknown_without_a_readable_table():
    assert filesystem_type("/fsx", "") is None
    assert filesystem_type("/fsx", "garbage line without separator\n") is None


def test_without_lfs_the_line_says_lfs_is_missing_not_that_the_volume_is_not_lustre(caplog):
    lustre = Lustre(lfs="")
    with caplog.at_level(logging.INFO, logger="components.stage_data.lustre"):
        lustre.check_destination(Path("/fsx/rtp/datasets/ds"), MOUNTINFO)
        lustre.check_destination(Path("/fsx/rtp/datasets/ds"), MOUNTINFO)
    [line] = caplog.messages
    assert line.startswith("lfs not found: Lustre striping and HSM pre-loading skipped")
    assert "not a Lustre mount" not in line and "not an FSx" not in line
    assert not lustre.available


def test_with_lfs_a_destination_off_lustre_is_said_and_skipped(caplog):
    lustre = Lustre(lfs="/usr/bin/lfs")
    with caplog.at_level(logging.INFO, logger="components.stage_data.lustre"):
        lustre.check_destination(Path("/home/rtp/datasets/ds"), MOUNTINFO)
    [line] = caplog.messages
    assert (
        line
        == "/home/rtp/datasets/ds is not a Lustre mount (ext4): Lustre striping and HSM pre-loading skipped"
    )
    assert "lfs not found" not in line
    assert not lustre.available  # no lfs call per file that would fail there


def test_with_lfs_on_lustre_nothing_is_skipped(caplog):
    lustre = Lustre(lfs="/usr/bin/lfs")
    with caplog.at_level(logging.INFO, logger="components.stage_data.lustre"):
        lustre.check_destination(Path("/fsx/rtp/datasets/ds"), MOUNTINFO)
    assert caplog.messages == [] and lustre.available
