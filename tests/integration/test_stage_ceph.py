"""Staging against a real S3 server (Ceph RGW on loopback), with faults injected by a proxy."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.stage_data.stage import StageError, TransferSettings, s3_client, stage_dataset
from tests.integration.fault_proxy import FaultProxy

# One Ceph cluster per session: under `make test`'s two workers these run on the same one.
pytestmark = pytest.mark.integration

MIB = 2**20
SMALL_OBJECTS = 40
# Small thresholds so the ranged (parallel, resumable) path runs on small test data.
SETTINGS = TransferSettings(
    max_workers=8,
    multipart_threshold_bytes=4 * MIB,
    part_size_bytes=4 * MIB,
    backoff_base_s=0.01,
    backoff_max_s=0.05,
)


def _body(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (64 + i)


def _seed(client, bucket: str) -> dict[str, bytes]:
    from boto3.s3.transfer import TransferConfig

    client.create_bucket(Bucket=bucket)
    expected = {}
    for i in range(SMALL_OBJECTS):
        key = f"data/obj-{i:03d}.bin"
        client.put_object(Bucket=bucket, Key=key, Body=_body(i))
        expected[key] = _body(i)
    big = os.urandom(20 * MIB)  # uploaded in 8 MiB parts: a 3-part multipart ETag
    client.upload_fileobj(
        __import__("io").BytesIO(big),
        bucket,
        "data/big.bin",
        Config=TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB),
    )
    expected["data/big.bin"] = big
    single = os.urandom(9 * MIB)  # one PUT: a plain MD5 ETag, downloaded in ranges
    client.put_object(Bucket=bucket, Key="data/nested/single.bin", Body=single)
    expected["data/nested/single.bin"] = single
    return expected


@pytest.fixture(scope="module")
def seeded(ceph_s3):
    client = s3_client(ceph_s3.endpoint_url)
    return ceph_s3, _seed(client, "stage-read"), "stage-read"


def _assert_snapshot(snapshot: Path, expected: dict[str, bytes]) -> None:
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert sorted(e["key"] for e in manifest["files"]) == sorted(expected)
    for entry in manifest["files"]:
        assert (snapshot / entry["path"]).read_bytes() == expected[entry["key"]], entry["key"]
    assert not [p for p in snapshot.rglob("*") if p.name.endswith((".part", ".part.ranges"))]


def test_full_stage_then_unchanged_changed_and_deleted(ceph_s3, tmp_path, monkeypatch):
    from components.stage_data import source

    monkeypatch.setattr(source, "LIST_PAGE_KEYS", 2)  # re-stages list in ranges of two known keys
    client = s3_client(ceph_s3.endpoint_url)
    expected = _seed(client, "stage-mutate")
    first = stage_dataset(
        "s3://stage-mutate/data/", str(tmp_path), "ds", ceph_s3.endpoint_url, settings=SETTINGS
    )
    assert first.files == len(expected) and first.bytes_downloaded == sum(map(len, expected.values()))
    current = tmp_path / "rtp/datasets/ds/current"
    _assert_snapshot(current, expected)
    assert "-3" in {e["etag"][-2:] for e in json.loads((current / "manifest.json").read_text())["files"]}

    again = stage_dataset(
        "s3://stage-mutate/data/", str(tmp_path), "ds", ceph_s3.endpoint_url, settings=SETTINGS
    )
    assert (again.snapshot_id, again.bytes_downloaded, again.files_downloaded) == (first.snapshot_id, 0, 0)

    client.put_object(Bucket="stage-mutate", Key="data/obj-001.bin", Body=b"changed")
    client.delete_object(Bucket="stage-mutate", Key="data/obj-002.bin")
    expected["data/obj-001.bin"] = b"changed"
    del expected["data/obj-002.bin"]
    third = stage_dataset(
        "s3://stage-mutate/data/", str(tmp_path), "ds", ceph_s3.endpoint_url, settings=SETTINGS
    )
    assert third.snapshot_id != first.snapshot_id
    assert (third.bytes_downloaded, third.files_downloaded) == (len(b"changed"), 1)
    _assert_snapshot(current, expected)
    old = tmp_path / "rtp/datasets/ds/snapshots" / first.snapshot_id
    assert (old / "obj-002.bin").read_bytes() == _body(2)  # readers of the old snapshot undisturbed


def test_throttling_resets_and_stalls_are_retried(seeded, tmp_path):
    server, expected, bucket = seeded
    with FaultProxy(server.endpoint_url, stall_s=0.3) as proxy:
        proxy.plan["obj-003.bin"] = ["503", "503"]
        proxy.plan["obj-004.bin"] = ["reset"]
        proxy.plan["big.bin"] = ["reset", "503"]
        proxy.plan["obj-007.bin"] = ["stall"]
        result = stage_dataset(
            f"s3://{bucket}/data/", str(tmp_path), "ds", proxy.endpoint_url, settings=SETTINGS
        )
    assert proxy.counts["503"] == 3 and proxy.counts["reset"] == 2 and proxy.counts["stall"] == 1
    assert result.files == len(expected)
    _assert_snapshot(tmp_path / "rtp/datasets/ds/current", expected)


def test_a_body_that_never_verifies_fails_naming_the_key(seeded, tmp_path):
    server, _, bucket = seeded
    with FaultProxy(server.endpoint_url) as proxy:
        proxy.always["obj-005.bin"] = "corrupt"
        with pytest.raises(StageError, match=r"obj-005\.bin.*did not match"):
            stage_dataset(f"s3://{bucket}/data/", str(tmp_path), "ds", proxy.endpoint_url, settings=SETTINGS)
    assert proxy.counts["corrupt"] == SETTINGS.verify_attempts
    assert not (tmp_path / "rtp/datasets/ds/current").exists()  # nothing half-staged is visible


def test_killed_stage_resumes_without_downloading_again(seeded, tmp_path):
    server, expected, bucket = seeded
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    staging = tmp_path / "rtp/datasets/ds/.staging"
    with FaultProxy(server.endpoint_url, stall_s=0.25) as proxy:
        proxy.always[".bin"] = "stall"  # every body GET is slow, so the kill lands mid-stage
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rtp_cli.main",
                "stage",
                "--source",
                f"s3://{bucket}/data/",
                "--endpoint-url",
                proxy.endpoint_url,
                "--fsx-mount-path",
                str(tmp_path),
                "--dataset-name",
                "ds",
                "--max-workers",
                "4",
                "--multipart-threshold-mib",
                "4",
                "--part-size-mib",
                "4",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        done: list[Path] = []
        while time.monotonic() < deadline and process.poll() is None:
            # A file counts once it has all its bytes: a small object is written under its
            # final name after it was verified in memory, so a kill may land between the two.
            done = [
                p
                for p in (staging.rglob("obj-*.bin") if staging.exists() else [])
                if p.stat().st_size == len(expected[f"data/{p.name}"])
            ]
            if len(done) >= 10:
                break
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert len(done) >= 10, "the stage finished or stalled before it could be killed"
    assert not (tmp_path / "rtp/datasets/ds/current").exists()
    resumed = stage_dataset(
        f"s3://{bucket}/data/", str(tmp_path), "ds", server.endpoint_url, settings=SETTINGS
    )
    assert resumed.files_reused >= 10
    assert resumed.bytes_downloaded < sum(map(len, expected.values()))
    _assert_snapshot(tmp_path / "rtp/datasets/ds/current", expected)


def test_a_damaged_local_file_is_fetched_again_on_restage(seeded, tmp_path):
    server, expected, bucket = seeded
    stage_dataset(f"s3://{bucket}/data/", str(tmp_path), "ds", server.endpoint_url, settings=SETTINGS)
    damaged = tmp_path / "rtp/datasets/ds/current/obj-010.bin"
    data = bytearray(damaged.read_bytes())
    data[0] ^= 0xFF
    time.sleep(0.01)
    damaged.write_bytes(bytes(data))  # same size, different bytes, new mtime
    result = stage_dataset(
        f"s3://{bucket}/data/", str(tmp_path), "ds", server.endpoint_url, settings=SETTINGS
    )
    assert (result.files_repaired, result.bytes_downloaded) == (1, len(expected["data/obj-010.bin"]))
    _assert_snapshot(tmp_path / "rtp/datasets/ds/current", expected)
    # a full re-hash also finds damage that kept the mtime
    info = damaged.stat()
    data = bytearray(damaged.read_bytes())
    data[1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    os.utime(damaged, ns=(info.st_atime_ns, info.st_mtime_ns))
    full = stage_dataset(
        f"s3://{bucket}/data/",
        str(tmp_path),
        "ds",
        server.endpoint_url,
        settings=SETTINGS,
        verify_local="full",
    )
    assert full.files_repaired == 1
    _assert_snapshot(tmp_path / "rtp/datasets/ds/current", expected)


def test_missing_bucket_empty_prefix_and_denied_access_are_clear(seeded, tmp_path, monkeypatch):
    server, _, bucket = seeded
    with pytest.raises(StageError, match="does not exist"):
        stage_dataset("s3://no-such-bucket/x/", str(tmp_path), "ds", server.endpoint_url)
    with pytest.raises(StageError, match="holds no objects"):
        stage_dataset(f"s3://{bucket}/nothing/", str(tmp_path), "ds", server.endpoint_url)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(StageError, match="denied"):
        stage_dataset(f"s3://{bucket}/data/", str(tmp_path), "ds", server.endpoint_url)
