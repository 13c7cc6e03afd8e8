"""Optional Lustre tuning for FSx: stripe large files, pre-load data-repository files.

Everything here is a no-op (with one info line per stage) where the `lfs` tool is absent,
as on a laptop or in the test environment. Striping a large file across OSTs lets many
clients read it in parallel; `lfs hsm_restore` asks FSx to pull the contents of files that
a data repository association linked lazily, so training does not pay for the first read.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

STRIPE_SIZE = "4M"


class Lustre:
    def __init__(self, lfs: str | None = None, stripe_count: int = -1) -> None:
        self.lfs = lfs if lfs is not None else shutil.which("lfs")
        self.stripe_count = stripe_count
        self._said = False

    @property
    def available(self) -> bool:
        return bool(self.lfs)

    def say_once_if_absent(self) -> None:
        if not self.available and not self._said:
            log.info(
                "lfs not found: Lustre striping and HSM pre-loading skipped (not an FSx for Lustre mount)"
            )
            self._said = True

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
