"""Staging against moto's S3 server over real HTTP on loopback (fast unit level)."""

import io
import json

import pytest

from components.stage_data.checksums import Expectation
from components.stage_data.settings import TransferSettings
from components.stage_data.snapshot_store import relative_paths
from components.stage_data.source import parse_s3_uri
from components.stage_data.stage import StageError, stage_dataset
from components.stage_data.transfer import Downloader, ObjectJob


def _snapshot_files(result):
    return sorted(e["key"] for e in json.loads(open(f"{result.snapshot_dir}/manifest.json").read())["files"])


def test_stage_copies_verifies_and_writes_manifest(bucket, tmp_path, s3_endpoint):
    _, name = bucket
    result = stage_dataset(f"s3://{name}/data/", str(tmp_path), "ds", endpoint_url=s3_endpoint)
    assert result.files == 5 and result.bytes_downloaded == result.bytes_total > 0
    assert _snapshot_files(result) == [f"data/file{i}.txt" for i in range(5)]
    assert (tmp_path / "rtp/datasets/ds/current/file3.txt").read_bytes() == b"contents 3\n" * 100
    assert not list((tmp_path / "rtp/datasets/ds/.staging").iterdir())


def test_restaging_an_unchanged_prefix_transfers_nothing(bucket, tmp_path, s3_endpoint):
    _, name = bucket
    first = stage_dataset(f"s3://{name}/data/", str(tmp_path), "ds", endpoint_url=s3_endpoint)
    second = stage_dataset(f"s3://{name}/data/", str(tmp_path), "ds", endpoint_url=s3_endpoint)
    assert second.snapshot_id == first.snapshot_id
    assert second.bytes_downloaded == 0


def test_changed_prefix_makes_a_new_snapshot_reusing_unchanged_files(bucket, tmp_path, s3_endpoint):
    client, name = bucket
    first = stage_dataset(f"s3://{name}/data/", str(tmp_path), "ds", endpoint_url=s3_endpoint)
    client.put_object(Bucket=name, Key="data/file0.txt", Body=b"changed\n")
    client.delete_object(Bucket=name, Key="data/file4.txt")
    second = stage_dataset(f"s3://{name}/data/", str(tmp_path), "ds", endpoint_url=s3_endpoint)
    assert second.snapshot_id != first.snapshot_id
    assert second.bytes_downloaded == len(b"changed\n")
    assert second.files_reused == 3
    assert "data/file4.txt" not in _snapshot_files(second)
    current = tmp_path / "rtp/datasets/ds/current"
    assert (current / "file0.txt").read_bytes() == b"changed\n"
    # readers of the previous snapshot are undisturbed
    assert (tmp_path / "rtp/datasets/ds/snapshots" / first.snapshot_id / "file4.txt").is_file()


def test_missing_bucket_and_empty_prefix_are_clear(s3_endpoint, tmp_path, bucket):
    _, name = bucket
    with pytest.raises(StageError, match="does not exist"):
        stage_dataset("s3://no-such-bucket-rtp/x/", str(tmp_path), "ds", endpoint_url=s3_endpoint)
    with pytest.raises(StageError, match="holds no objects"):
        stage_dataset(f"s3://{name}/nothing-here/", str(tmp_path), "ds", endpoint_url=s3_endpoint)


@pytest.mark.parametrize("uri", ["data/x", "s3://", "https://bucket/x"])
def test_bad_source_uri(uri):
    with pytest.raises(StageError, match="s3://bucket/prefix"):
        parse_s3_uri(uri)


def test_keys_that_escape_or_collide_are_refused():
    assert relative_paths(["p/a/b.txt", "p/c.txt"], "p/") == {"p/a/b.txt": "a/b.txt", "p/c.txt": "c.txt"}
    with pytest.raises(StageError, match="outside"):
        relative_paths(["p/../../etc/passwd"], "p/")
    with pytest.raises(StageError, match="same file"):
        relative_paths(["p/A.txt", "p/a.txt"], "p/")
    with pytest.raises(StageError, match="manifest"):
        relative_paths(["p/manifest.json"], "p/")


class CorruptingS3Stub:
    """Stand-in client whose GET bodies never match the listed ETag (a bad transfer)."""

    def __init__(self):
        self.calls = 0

    def get_object(self, Bucket, Key, **_):
        self.calls += 1

        class Body(io.BytesIO):
            def iter_chunks(self, size):
                yield self.read()

        return {"Body": Body(b"garbage!")}


def test_mismatching_download_is_retried_then_fails_naming_the_key(tmp_path):
    stub = CorruptingS3Stub()
    job = ObjectJob("b", "data/f.txt", Expectation(8, "0123456789abcdef0123456789abcdef"), tmp_path / "f.txt")
    downloader = Downloader(stub, TransferSettings(verify_attempts=3))
    downloader.plan(job)
    with pytest.raises(StageError, match=r"data/f\.txt"):
        downloader.fetch_whole(job)
    assert stub.calls == 3
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
