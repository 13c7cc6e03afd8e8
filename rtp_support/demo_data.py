"""The demo corpus: Python standard-library sources that ship with the interpreter.

No downloads: the text is already on every machine that runs Python. The selection is
deterministic (sorted top-level modules up to a byte budget), so a given Python version
always produces the same corpus, and therefore the same dataset snapshot id.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

DEFAULT_BUDGET_BYTES = 1_500_000


def demo_corpus(budget_bytes: int = DEFAULT_BUDGET_BYTES) -> list[tuple[str, Path]]:
    """(S3 key suffix, file) pairs of stdlib sources, sorted, up to `budget_bytes` in total."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chosen: list[tuple[str, Path]] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        size = path.stat().st_size
        if size == 0 or size > 200_000:
            continue  # skip empty stubs and a few giant modules that would dominate the corpus
        if total + size > budget_bytes:
            break
        chosen.append((path.name, path))
        total += size
    if len(chosen) < 2:
        raise RuntimeError(f"found too few standard-library sources under {stdlib} for a demo corpus")
    return chosen


DEMO_SHARD_BYTES = 128 * 1024  # small shards, so the demo corpus splits into train and holdout shards


def upload_demo_corpus(
    client: object, bucket: str, prefix: str, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> int:
    """Shard the corpus as `rtp prepare-data` does and upload it under `prefix`; returns the object count."""
    import tempfile

    from components.stage_data.prepare_data import upload_shards, write_document_shards

    with tempfile.TemporaryDirectory(prefix="rtp-demo-shards-") as tmp:
        write_document_shards(demo_corpus(budget_bytes), Path(tmp), DEMO_SHARD_BYTES)
        return upload_shards(client, Path(tmp), bucket, prefix)


def write_local_dataset(folder: Path, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Path:
    """The demo corpus as a dataset snapshot folder (the stage step's format), no S3 needed."""
    for name, source in demo_corpus(budget_bytes):
        target = folder / "files" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    return write_local_manifest(folder, key_prefix="corpus/", snapshot_id="local-demo")


def write_local_manifest(snapshot: Path, key_prefix: str, snapshot_id: str) -> Path:
    """manifest.json for the files under `<snapshot>/files`, as the stage step writes it, so a
    local folder is a dataset snapshot for tests and benchmarks; returns `snapshot`."""
    import hashlib
    import json

    files = []
    for path in sorted((snapshot / "files").iterdir()):
        data = path.read_bytes()
        files.append(
            {
                "key": f"{key_prefix}{path.name}",
                "size": len(data),
                "etag": hashlib.md5(data).hexdigest(),
                "path": f"files/{path.name}",
            }
        )
    (snapshot / "manifest.json").write_text(json.dumps({"snapshot_id": snapshot_id, "files": files}))
    return snapshot
