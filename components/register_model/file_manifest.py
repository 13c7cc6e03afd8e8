"""What a registered version's files are: a manifest written at registration, checked on download.

The register step writes `rtp_files.json` into the folder it logs (the byte LM's bundle, a
Hugging Face export): every file's path, size and SHA-256. The version's tag
`rtp.files_sha256` holds the SHA-256 of the manifest's bytes, so the registry database,
not the artifact store, vouches for it: a changed file fails its hash, a changed manifest
fails the tag. `verify_folder` is what the stage-model step runs on a downloaded version.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MANIFEST_FILE = "rtp_files.json"
FILES_TAG = "rtp.files_sha256"
_HASH_THREADS = 8  # hashlib releases the GIL: shards of a large export hash in parallel


class ManifestError(RuntimeError):
    """A downloaded version does not match what was registered; the message names the file."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _payload(folder: Path) -> list[Path]:
    return sorted(
        path
        for path in folder.rglob("*")
        if path.is_file() and path.name != MANIFEST_FILE and not path.name.startswith(f".{MANIFEST_FILE}.")
    )


def write_manifest(folder: str | Path) -> str:
    """Write `folder`/rtp_files.json over the folder's other files; returns its SHA-256 (the tag)."""
    folder = Path(folder)
    files = _payload(folder)
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        digests = list(pool.map(file_sha256, files))
    entries = [
        {"path": path.relative_to(folder).as_posix(), "size": path.stat().st_size, "sha256": digest}
        for path, digest in zip(files, digests, strict=True)
    ]
    data = json.dumps({"format": 1, "files": entries}, indent=1, sort_keys=True).encode()
    staging = folder / f".{MANIFEST_FILE}.{os.getpid()}"
    staging.write_bytes(data)
    staging.replace(folder / MANIFEST_FILE)
    return hashlib.sha256(data).hexdigest()


def read_manifest(folder: str | Path, expected_sha256: str) -> list[dict[str, Any]]:
    """The manifest's entries, once its bytes match the tag."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(
            f"{MANIFEST_FILE} is missing from the version's files: it was not registered by rtp"
        )
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != expected_sha256:
        raise ManifestError(
            f"{MANIFEST_FILE} does not match the version's {FILES_TAG} tag: the artifact store's copy was changed"
        )
    entries: list[dict[str, Any]] = json.loads(data)["files"]
    for entry in entries:
        relative = Path(entry["path"])
        if relative.is_absolute() or ".." in relative.parts:
            raise ManifestError(f"{MANIFEST_FILE} names {entry['path']!r}, outside the version's folder")
    return entries


def verify_folder(folder: str | Path, expected_sha256: str, *, hashes: bool = True) -> list[dict[str, Any]]:
    """Every file of the manifest present with its size (and SHA-256 when `hashes`); returns
    the entries. ManifestError names the first file that differs."""
    folder = Path(folder)
    entries = read_manifest(folder, expected_sha256)
    for entry in entries:
        path = folder / entry["path"]
        if not path.is_file():
            raise ManifestError(f"{entry['path']} is missing from the version's files")
        if path.stat().st_size != entry["size"]:
            raise ManifestError(
                f"{entry['path']} is {path.stat().st_size} bytes, registered as {entry['size']}: the file was changed"
            )
    if hashes:
        with ThreadPoolExecutor(_HASH_THREADS) as pool:
            digests = list(pool.map(file_sha256, (folder / e["path"] for e in entries)))
        for entry, digest in zip(entries, digests, strict=True):
            if digest != entry["sha256"]:
                raise ManifestError(
                    f"{entry['path']} has SHA-256 {digest[:12]}…, registered as {entry['sha256'][:12]}…: "
                    "the file was changed in the artifact store"
                )
    return entries
