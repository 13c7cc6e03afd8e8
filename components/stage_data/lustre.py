"""Optional Lustre tuning for FSx: stripe large files, pre-load data-repository files.

Everything here is a no-op, said in one info line per stage, where it cannot work: the
`lfs` tool is absent (the component image has no Lustre client tools; a laptop or the test
environment neither), or the destination is not on a Lustre mount (read from
/proc/self/mountinfo). Striping a large file across OSTs lets many clients read it in
parallel; `lfs hsm_restore` asks FSx to pull the contents of files that a data repository
association linked lazily, so training does not pay for the first read.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

STRIPE_SIZE = "4M"
MOUNTINFO = Path("/proc/self/mountinfo")


def filesystem_type(path: str | Path, mountinfo: str) -> str | None:
    """The type of the file system holding `path` by /proc/self/mountinfo text; None when unknown."""
    target = os.path.realpath(path)
    best_point, best_type = "", None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if separator + 1 >= len(fields):
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # \040 is a space
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best_point):  # the deepest mount, the last one stacked on it
            best_point, best_type = point, fields[separator + 1]
    return best_type


class Lustre:
    def __init__(self, lfs: str | None = None, stripe_count: int = -1) -> None:
        self.lfs = lfs if lfs is not None else shutil.which("lfs")
        self.stripe_count = stripe_count
        self._said = False

    @property
    def available(self) -> bool:
        return bool(self.lfs)

    def check_destination(self, folder: Path, mountinfo: str | None = None) -> None:
        """Say once why striping is skipped, and skip it where `folder` is not on Lustre."""
        if self._said:
            return
        self._said = True
        if not self.available:
            log.info("lfs not found: Lustre striping and HSM pre-loading skipped (no Lustre client tools)")
            return
        if mountinfo is None:
            try:
                mountinfo = MOUNTINFO.read_text()
            except OSError:
                return
        kind = filesystem_type(folder, mountinfo)
        if kind is not None and kind != "lustre":
            log.info(
                "%s is not a Lustre mount (%s): Lustre striping and HSM pre-loading skipped", folder, kind
            )
            self.lfs = None

    def stripe_new_file(self, path: Path) -> None:
        """Create `path` empty with a layout striped over `stripe_count` OSTs (-1 = all)."""
        if not self.lfs:
            return
        command = [self.lfs, "setstripe", "-c", str(self.stripe_count), "-S", STRIPE_SIZE, str(path)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            log.warning(
                "lfs setstripe on %s failed (%s); keeping the default layout", path, result.stderr.strip()
            )

    def hsm_restore(self, paths: Sequence[Path], batch: int = 256) -> None:
        """Ask FSx to load released files from the data repository (asynchronous on its side)."""
        if not self.lfs:
            return
        for start in range(0, len(paths), batch):
            chunk = [str(p) for p in paths[start : start + batch]]
            result = subprocess.run(
                [self.lfs, "hsm_restore", *chunk], capture_output=True, text=True, check=False
            )
            if result.returncode != 0:
                log.warning("lfs hsm_restore failed for %d files: %s", len(chunk), result.stderr.strip())
