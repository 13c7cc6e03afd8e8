"""Which run folders on the shared volume may go: `rtp gc`'s rule, and removing them safely.

Nothing removes old `<mount>/rtp/runs/<run>/` folders by itself (checkpoint retention works
within a run), so nightly runs fill the file system. The rule, oldest runs first:

- keep every run a registered model version with a live alias (`champion`, `challenger`)
  came from: the version's `rtp.checkpoint_uri` tag names its checkpoint, which a rollback
  of the alias, a warm start or an audit needs;
- keep the newest `keep_newest` runs (by the last time anything in them changed);
- keep every run changed within `active_within_s`: it may still be going. The default (48 h)
  is twice the train step's default `job_timeout_s`, and a run writes to its folder at every
  training step and at the end of every pipeline step, so a live run is never older;
- the rest may go.

`plan_retention` is pure; `scan_runs` reads the folders and `aliased_runs` asks MLflow. A
removal first renames the folder to `<runs>/.removing-<run>` (atomic: a run is either whole
or marked), then deletes it; a later `remove` finishes what an interrupted one left.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

RUNS = ("rtp", "runs")
REMOVING_PREFIX = ".removing-"
DEFAULT_KEEP_NEWEST = 5
DEFAULT_ACTIVE_WITHIN_S = 48 * 3600.0
CHECKPOINT_TAG = "rtp.checkpoint_uri"


class RetentionError(ValueError):
    """The rule cannot be applied as asked; the message says what to do."""


@dataclass(frozen=True, slots=True)
class RunFolder:
    name: str
    path: Path
    changed_at: float
    """The newest modification time of anything in the folder (epoch seconds)."""
    bytes: int
    """What removing it frees: files with no other hard link."""


@dataclass(slots=True)
class RetentionPlan:
    keep: list[tuple[RunFolder, str]] = field(default_factory=list)
    """Kept runs, each with why."""
    remove: list[RunFolder] = field(default_factory=list)
    """Runs that may go, oldest first."""

    @property
    def frees_bytes(self) -> int:
        return sum(run.bytes for run in self.remove)

    def as_dict(self) -> dict[str, Any]:
        return {
            "keep": [{"run": run.name, "why": why} for run, why in self.keep],
            "remove": [
                {"run": run.name, "bytes": run.bytes, "changed_at": run.changed_at} for run in self.remove
            ],
            "frees_bytes": self.frees_bytes,
        }


def runs_root(mount: str | Path) -> Path:
    return Path(mount).joinpath(*RUNS)


def scan_runs(mount: str | Path) -> list[RunFolder]:
    """Every run folder under `<mount>/rtp/runs`, with its last change and size (one walk)."""
    root = runs_root(mount)
    if not root.is_dir():
        return []
    runs = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        if path.name.startswith(REMOVING_PREFIX):
            continue
        changed_at, size = path.lstat().st_mtime, 0
        for folder, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                stat = os.lstat(os.path.join(folder, name))
                changed_at = max(changed_at, stat.st_mtime)
                if name in files and stat.st_nlink == 1:
                    size += stat.st_size
        runs.append(RunFolder(path.name, path, changed_at, size))
    return runs


def run_of_checkpoint(checkpoint_uri: str) -> str:
    """The run name in a checkpoint's `file://…/rtp/runs/<run>/checkpoints/step_N` URI ('' if none).

    By the path under rtp/runs, not the whole path: the volume may be mounted elsewhere
    where `rtp gc` runs than in the pod that registered the version."""
    path = unquote(urlparse(checkpoint_uri).path) if "://" in checkpoint_uri else checkpoint_uri
    parts = Path(path).parts
    for index in range(len(parts) - 2):
        if parts[index : index + 2] == RUNS:
            return parts[index + 2]
    return ""


def aliased_runs(client: Any) -> dict[str, str]:
    """Run name -> why it is kept ('registered as <model> vN (alias)') for every version with an alias."""
    from components.mlflow_access import call_with_retries

    found: dict[str, str] = {}
    models = call_with_retries("list the registered models", lambda: list(_all_registered_models(client)))
    for model in models:
        for alias, version in sorted((getattr(model, "aliases", None) or {}).items()):
            detail = call_with_retries(
                f"read {model.name} version {version}", partial(client.get_model_version, model.name, version)
            )
            run = run_of_checkpoint(str((detail.tags or {}).get(CHECKPOINT_TAG, "")))
            if run:
                found.setdefault(run, f"registered as {model.name} v{version} ({alias})")
    return found


def _all_registered_models(client: Any) -> Iterable[Any]:
    token = None
    while True:
        page = client.search_registered_models(max_results=100, page_token=token)
        yield from page
        token = getattr(page, "token", None)
        if not token:
            return


def plan_retention(
    runs: list[RunFolder],
    protected: dict[str, str],
    *,
    keep_newest: int = DEFAULT_KEEP_NEWEST,
    active_within_s: float = DEFAULT_ACTIVE_WITHIN_S,
    now: float | None = None,
) -> RetentionPlan:
    """What stays and what may go; `protected` maps run names to why they stay (a live alias)."""
    if keep_newest < 0 or active_within_s < 0:
        raise RetentionError("--keep and --active-within-hours must be at least 0")
    now = time.time() if now is None else now
    plan = RetentionPlan()
    newest = sorted(runs, key=lambda run: run.changed_at, reverse=True)
    for rank, run in enumerate(newest):
        if run.name in protected:
            plan.keep.append((run, protected[run.name]))
        elif now - run.changed_at < active_within_s:
            plan.keep.append(
                (run, f"changed {(now - run.changed_at) / 3600:.1f} h ago: it may still be going")
            )
        elif rank < keep_newest:
            plan.keep.append((run, f"one of the newest {keep_newest}"))
        else:
            plan.remove.append(run)
    plan.remove.reverse()  # oldest first
    return plan


def remove(plan: RetentionPlan, mount: str | Path) -> list[str]:
    """Remove the plan's runs, oldest first (and what an interrupted removal left); returns their names."""
    root = runs_root(mount)
    for leftover in sorted(root.glob(f"{REMOVING_PREFIX}*")):
        shutil.rmtree(leftover)
    removed = []
    for run in plan.remove:
        marked = root / f"{REMOVING_PREFIX}{run.name}"
        run.path.rename(marked)  # atomic: the run is whole, or marked for removal
        shutil.rmtree(marked)
        removed.append(run.name)
    return removed


def collect(
    mount: str | Path,
    protected: dict[str, str],
    *,
    keep_newest: int = DEFAULT_KEEP_NEWEST,
    active_within_s: float = DEFAULT_ACTIVE_WITHIN_S,
    apply: bool = False,
) -> tuple[RetentionPlan, list[str]]:
    """Scan, plan and (with `apply`) remove: `rtp gc` and the pipeline's retain-runs step."""
    plan = plan_retention(
        scan_runs(mount), protected, keep_newest=keep_newest, active_within_s=active_within_s
    )
    return plan, (remove(plan, mount) if apply else [])
