"""Which rtp is running: the package version and, in a git checkout, the commit.

One place for what upload (pipeline version names), the pipeline (its version string) and
register (the model version's code-version tag) record.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]


def package_version(default: str = "0.0.0") -> str:
    try:
        return importlib.metadata.version("rtp")
    except importlib.metadata.PackageNotFoundError:
        return default


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout


def source_identity(commit_length: int = 7) -> tuple[str, str, bool]:
    """(package version, git commit, uncommitted changes); no commit outside a checkout."""
    try:
        commit = _git("rev-parse", f"--short={commit_length}", "HEAD").strip()
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return package_version(), "", False  # an installed copy, not a git checkout
    return package_version(), commit, dirty
