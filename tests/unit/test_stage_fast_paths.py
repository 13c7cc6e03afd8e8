"""The staging fast paths: lean S3 client (against moto over HTTP), timestamps, manifest text,
guessed part sizes, resumed small files re-hashed, worker default."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime

import pytest
from botocore.exceptions import ClientError
from botocore.utils import parse_timestamp

from components.stage_data.checksums import Expectation
from components.stage_data.lean_s3 import LeanS3Client, error_from_response, parse_list_page
from components.stage_data.s3_clients import parse_s3_timestamp, s3_client
from components.stage_data.settings import TransferSettings, default_max_workers
from components.stage_data.snapshot_store import manifest_text
from components.stage_data.source import LocalFolderClient, list_objects
from components.stage_data.stage import StageError, stage_dataset
from components.stage_data.transfer import Downloader, ObjectJob

MIB = 2**20


@pytest.mark.parametrize(
    "value",
    [
        "2026-11-30T01:42:00.123Z",
        "2026-11-30T01:42:00Z",
        "Sun, 30 Nov 2026 01:42:00 GMT",
        "Mon, 3 Feb 2025 23:59:59 GMT",
        "1700000000",  # not a spelling S3 uses: handed to botocore's parser
    ],
)
def test_fast_timestamps_agree_with_botocore(value):
    assert parse_s3_timestamp(value) == parse_timestamp(value)
    assert parse_s3_timestamp(value).tzinfo is not None


def test_manifest_text_is_json_with_one_entry_per_line():
    manifest = {"source": "s3://b/p/", "files": [{"key": "a", "size": 1}, {"key": "b\n", "size": 2}]}
    text = manifest_text(manifest)
    assert json.loads(text) == manifest
    assert len(text.splitlines()) == 4
    assert json.loads(manifest_text({"files": []})) == {"files": []}


def test_worker_default_is_bounded():
    assert 8 <= default_max_workers() <= 32
    assert TransferSettings().max_workers == default_max_workers()


def test_list_page_parsing_decodes_url_encoded_keys():
    body = b"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><EncodingType>url</EncodingType>
<IsTruncated>true</IsTruncated><NextContinuationToken>tok</NextContinuationToken>
<Contents><Key>p/a%20b%2Bc.txt</Key><Size>3</Size><ETag>&quot;abc&quot;</ETag>
<ChecksumAlgorithm>CRC32</ChecksumAlgorithm></Contents></ListBucketResult>"""
    page = parse_list_page(body)
    assert page["Contents"] == [
        {"Key": "p/a b+c.txt", "Size": 3, "ETag": '"abc"', "ChecksumAlgorithm": ["CRC32"]}
    ]
    assert page["IsTruncated"] and page["NextContinuationToken"] == "tok"


def test_error_answers_become_client_errors():
    error = error_from_response(
        503, b"<Error><Code>SlowDown</Code><Message>m</Message></Error>", {}, "GetObject"
    )
    assert isinstance(error, ClientError) and error.response["Error"]["Code"] == "SlowDown"
    assert error_from_response(404, b"", {}, "HeadObject").response["Error"]["Code"] == "404"


def test_lean_client_lists_gets_ranges_and_heads_like_botocore(bucket, s3_endpoint):
    client, name = bucket
    odd = "data/sub dir/odd+name%41é.txt"
    client.put_object(Bucket=name, Key=odd, Body=b"0123456789")
    lean = LeanS3Client(s3_endpoint)
    listed = list_objects(lean, name, "data/")
    assert listed == list_objects(client, name, "data/")
    assert odd in {o.key for o in listed}
    etag = client.head_object(Bucket=name, Key=odd)["ETag"]
    got = lean.get_object(Bucket=name, Key=odd, IfMatch=etag, Range="bytes=2-5")
    assert b"".join(got["Body"].iter_chunks(3)) == b"2345"
    assert lean.head_object(Bucket=name, Key=odd)["ContentLength"] == 10
    with pytest.raises(ClientError) as changed:
        lean.get_object(Bucket=name, Key=odd, IfMatch='"0000"')
    assert changed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    with pytest.raises(ClientError) as missing:
        lean.get_object(Bucket=name, Key="data/absent")
    assert missing.value.response["Error"]["Code"] == "NoSuchKey"


def test_lean_client_pages_through_long_listings(s3_endpoint):
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket="lean-pages")
    for i in range(1003):  # moto answers 1000 keys a page
        client.put_object(Bucket="lean-pages", Key=f"k/{i:05d}", Body=b"x")
    keys = [o.key for o in list_objects(LeanS3Client(s3_endpoint), "lean-pages", "k/")]
    assert keys == [f"k/{i:05d}" for i in range(1003)]


def test_key_ranges_cut_a_known_listing_every_page_and_cover_every_key_once():
    from components.stage_data.source import LIST_PAGE_KEYS, key_ranges

    assert key_ranges([], "p/") == [("", None)]
    known = [f"p/{i:05d}" for i in range(2 * LIST_PAGE_KEYS + 5)] + ["q/other"]
    cuts = [known[LIST_PAGE_KEYS - 1], known[2 * LIST_PAGE_KEYS - 1]]
    assert key_ranges(known, "p/") == [("", cuts[0]), (cuts[0], cuts[1]), (cuts[1], None)]


@pytest.mark.parametrize("kind", ["lean", "boto3"])
def test_a_listing_split_by_the_known_keys_finds_what_a_plain_one_does(s3_endpoint, monkeypatch, kind):
    """Ranges cut from an earlier listing are listed at once, one request each while the
    source is unchanged; keys added before, between and after the cuts and a removed cut key
    are listed as a plain listing lists them."""
    from concurrent.futures import ThreadPoolExecutor

    from components.stage_data import source

    monkeypatch.setattr(source, "LIST_PAGE_KEYS", 4)
    client = s3_client(s3_endpoint)
    name = f"ranges-{kind}"
    client.create_bucket(Bucket=name)
    for i in range(0, 40, 2):
        client.put_object(Bucket=name, Key=f"k/{i:03d}", Body=b"x")
    lister = LeanS3Client(s3_endpoint) if kind == "lean" else s3_client(s3_endpoint, kind="boto3")
    known = [o.key for o in list_objects(lister, name, "k/")]
    requests: list[str] = []
    if kind == "lean":
        listing = lister.list_objects_v2
        monkeypatch.setattr(
            lister, "list_objects_v2", lambda **kw: requests.append(kw["StartAfter"]) or listing(**kw)
        )
    with ThreadPoolExecutor(4) as pool:
        assert list_objects(lister, name, "k/", known, pool) == list_objects(lister, name, "k/")
        if kind == "lean":  # 20 keys, cut every 4th: 6 ranges, one answer each, then 1 plain one
            assert sorted(requests[:6]) == sorted(["", "k/006", "k/014", "k/022", "k/030", "k/038"])
            assert len(requests) == 7
        for key in ("k/", "k/001", "k/015", "k/0150", "k/999"):
            client.put_object(Bucket=name, Key=key, Body=b"y")
        client.delete_object(Bucket=name, Key="k/014")  # a cut
        plain = list_objects(lister, name, "k/")
        split = list_objects(lister, name, "k/", known, pool)
    assert split == plain and len({o.key for o in split}) == len(split) == 20 - 1 + 4  # "k/": a folder


def test_both_clients_stage_the_same_snapshot(bucket, tmp_path, s3_endpoint):
    _, name = bucket
    lean = stage_dataset(f"s3://{name}/data/", str(tmp_path / "a"), "ds", s3_endpoint)
    boto = stage_dataset(
        f"s3://{name}/data/", str(tmp_path / "b"), "ds", s3_endpoint, s3_client_kind="botocore"
    )
    assert (lean.snapshot_id, lean.files, lean.bytes_downloaded) == (
        boto.snapshot_id,
        boto.files,
        boto.bytes_downloaded,
    )
    for i in range(5):
        rel = f"rtp/datasets/ds/current/file{i}.txt"
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    with pytest.raises(StageError, match="s3_client_kind"):
        stage_dataset(f"s3://{name}/data/", str(tmp_path / "c"), "ds", s3_endpoint, s3_client_kind="x")
    with pytest.raises(StageError, match="boto3, lean, botocore"):
        s3_client(s3_endpoint, kind="x")


def test_resumed_small_files_are_rehashed_not_trusted_by_size(bucket, tmp_path, s3_endpoint):
    """An interrupted stage's small files were not fsynced one by one: a resume checks their bytes."""
    _, name = bucket
    first = stage_dataset(f"s3://{name}/data/", str(tmp_path), "ds", s3_endpoint)
    root = tmp_path / "rtp/datasets/ds"
    staging = root / ".staging" / first.snapshot_id
    # Put the finished files back where an interrupted attempt would have left them.
    shutil.move(str(root / "snapshots" / first.snapshot_id), str(staging))
    (staging / "manifest.json").unlink()
    (root / "current").unlink()
    damaged = staging / "file2.txt"
    damaged.write_bytes(b"X" * damaged.stat().st_size)  # right size, wrong bytes (lost writes)
    resumed = stage_dataset(f"s3://{name}/data/", str(tmp_path), "ds", s3_endpoint)
    assert (resumed.files_reused, resumed.files_downloaded) == (4, 1)
    assert (root / "current/file2.txt").read_bytes() == b"contents 2\n" * 100


def _multipart_etag(data: bytes, part: int) -> str:
    digests = [hashlib.md5(data[i : i + part]).digest() for i in range(0, len(data), part)]
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


@pytest.mark.parametrize("upload_part_mib", [8, 10])
def test_ranged_download_at_a_guessed_part_size(tmp_path, upload_part_mib):
    """Ranges follow the likeliest upload part size (8 MiB), so the per-range MD5s check the ETag in
    one pass; when the upload used another size (10 MiB) the file is re-read at the other sizes."""
    data = os.urandom(14 * MIB)  # 2 parts of 8 MiB or of 10 MiB both fit
    (tmp_path / "src").mkdir()
    (tmp_path / "src/big.bin").write_bytes(data)
    settings = TransferSettings(max_workers=2, multipart_threshold_bytes=MIB, part_size_bytes=3 * MIB)
    downloader = Downloader(LocalFolderClient(), settings)
    expectation = Expectation(len(data), _multipart_etag(data, upload_part_mib * MIB))
    job = ObjectJob(str(tmp_path / "src"), "big.bin", expectation, tmp_path / "big.bin")
    downloader.plan(job)
    assert job.part_size_guessed and [length for _, length in job.ranges] == [8 * MIB, 6 * MIB]
    downloader.open_partial(job)
    assert [downloader.fetch_range(job, i) for i in job.pending_ranges()] == [False, True]
    assert downloader.finish_ranged(job) == ""
    assert (tmp_path / "big.bin").read_bytes() == data
    bad = ObjectJob(str(tmp_path / "src"), "big.bin", Expectation(len(data), _multipart_etag(data[::-1], 8 * MIB)),
                    tmp_path / "bad.bin")  # fmt: skip
    downloader.plan(bad)
    downloader.open_partial(bad)
    for i in bad.pending_ranges():
        downloader.fetch_range(bad, i)
    assert "ETag" in downloader.finish_ranged(bad) and not (tmp_path / "bad.bin").exists()


def test_timestamps_in_listings_are_aware_datetimes(bucket, s3_endpoint):
    _, name = bucket
    page = s3_client(s3_endpoint, kind="botocore").list_objects_v2(Bucket=name, Prefix="data/")
    stamp = page["Contents"][0]["LastModified"]
    assert isinstance(stamp, datetime) and abs((datetime.now(UTC) - stamp).total_seconds()) < 3600


def test_a_composite_checksum_without_its_parts_suffix_is_accepted_only_when_it_matches(tmp_path):
    import base64
    import zlib

    from components.stage_data.checksums import verify_file

    data = os.urandom(9 * MIB)
    path = tmp_path / "f"
    path.write_bytes(data)
    parts = [zlib.crc32(data[: 8 * MIB]), zlib.crc32(data[8 * MIB :])]
    composite = base64.b64encode(zlib.crc32(b"".join(p.to_bytes(4, "big") for p in parts)).to_bytes(4, "big"))
    etag = _multipart_etag(data, 8 * MIB)
    assert verify_file(path, Expectation(len(data), etag, "CRC32", composite.decode(), 8 * MIB)) == ""
    assert "CRC32" in verify_file(path, Expectation(len(data), etag, "CRC32", "AAAAAA==", 8 * MIB))


class _FakeResponse:
    def __init__(self, status, headers=None, body=b""):
        self.status, self.headers, self._body = status, headers or {}, body

    def read(self):
        return self._body

    def release_conn(self):
        pass


def test_lean_client_addresses_aws_and_follows_the_bucket_region(monkeypatch):
    """On AWS: virtual-hosted names on the regional endpoint (path style for dotted buckets), and a
    bucket in another region is retried there once, signed for that region."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    lean = LeanS3Client()
    assert lean._base("my-bucket") == "https://my-bucket.s3.us-east-1.amazonaws.com"
    assert lean._base("my.dotted.bucket") == "https://s3.us-east-1.amazonaws.com/my.dotted.bucket"
    seen = []

    def request(method, scheme, host, port, target, headers):
        assert headers["Host"] == host and port == 443
        seen.append((f"{scheme}://{host}{target}", headers["Authorization"]))
        if len(seen) == 1:
            return _FakeResponse(301, {"x-amz-bucket-region": "eu-west-1"})
        return _FakeResponse(200, {"content-length": "7", "etag": '"e"'})

    monkeypatch.setattr(lean._pool, "request", request)
    assert lean.head_object(Bucket="my-bucket", Key="a b")["ContentLength"] == 7
    assert seen[0][0] == "https://my-bucket.s3.us-east-1.amazonaws.com/a%20b"
    assert seen[1][0] == "https://my-bucket.s3.eu-west-1.amazonaws.com/a%20b"
    assert "/eu-west-1/s3/" in seen[1][1] and "/us-east-1/s3/" in seen[0][1]


def test_a_small_object_is_written_through_a_fresh_file_never_through_a_hard_link(tmp_path):
    """The final name may be a hard link into an older snapshot (linked by an earlier attempt)."""
    from components.stage_data.fs_safety import create_fresh

    old, target = tmp_path / "old", tmp_path / "target"
    old.write_bytes(b"older snapshot")
    os.link(old, target)
    fd = create_fresh(target)
    os.write(fd, b"new")
    os.close(fd)
    assert (old.read_bytes(), target.read_bytes()) == (b"older snapshot", b"new")


def test_listed_keys_escaped_with_encoding_type_url_decode_as_unquote_does():
    from urllib.parse import quote, unquote

    from components.stage_data.lean_s3 import _url_decoded

    for key in ["data/small/000001.bin", "a b/c+d", "naïve/ü.txt", "100%/x", "a%2fb/c", "x/%41"]:
        for encoded in (quote(key, safe=""), quote(key, safe="/"), key.replace("/", "%2F")):
            assert _url_decoded(encoded) == unquote(encoded), encoded


def test_a_restage_of_an_unchanged_prefix_imports_no_botocore(bucket, tmp_path, s3_endpoint):
    """The lean client's success path needs none of botocore (about 10 ms of imports):
    its exceptions are imported only to raise or explain an error."""
    _, name = bucket
    stage_dataset(f"s3://{name}/data/", str(tmp_path / "fsx"), "ds", s3_endpoint)
    code = (
        "import sys\n"
        "from components.stage_data.stage import stage_dataset\n"
        f"result = stage_dataset('s3://{name}/data/', {str(tmp_path / 'fsx')!r}, 'ds', {s3_endpoint!r})\n"
        "assert result.bytes_downloaded == 0 and result.files == 5, result\n"
        "print(sorted(m for m in sys.modules if m.startswith(('botocore', 'boto3'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
