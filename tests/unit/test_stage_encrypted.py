"""Encrypted objects (SSE-KMS, DSSE-KMS, SSE-C) and non-MD5 ETags stage on the first attempt.

moto stores an SSE-KMS object's encryption header but keeps the MD5 as its ETag; AWS does
not. The `FaultProxy` test double in front of moto rewrites every ETag into an opaque value
(as AWS does for such objects) so the end-to-end tests see what AWS would answer.
"""

import io
import json
import logging
import os

import pytest
from boto3.s3.transfer import TransferConfig

from components.stage_data.checksums import Digester, Expectation, etag_encryption, verify_file
from components.stage_data.errors import StageError
from components.stage_data.settings import MIB, TransferSettings
from components.stage_data.stage import stage_dataset
from tests.integration.fault_proxy import FaultProxy

MD5_OF_HELLO = "5d41402abc4b2a76b9719d911017c592"


# ---------------------------------------------------------------- the decision, pure


@pytest.mark.parametrize(
    ("answer", "encryption"),
    [
        ({"ServerSideEncryption": "aws:kms"}, "SSE-KMS"),
        ({"ServerSideEncryption": "aws:kms:dsse"}, "DSSE-KMS"),
        ({"SSECustomerAlgorithm": "AES256", "ServerSideEncryption": "AES256"}, "SSE-C"),
        ({"ServerSideEncryption": "AES256"}, ""),  # SSE-S3: the ETag still is the MD5
        ({}, ""),
    ],
)
def test_the_answer_headers_say_whether_the_etag_is_an_md5(answer, encryption):
    assert etag_encryption(answer) == encryption


def test_an_encrypted_objects_etag_is_not_checked_but_its_checksum_is(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"hello")
    opaque = "0123456789abcdef0123456789abcdef"  # hex, 32 digits, yet no MD5 of the body
    assert verify_file(path, Expectation(5, opaque))  # without the encryption known: a mismatch
    kms = Expectation(5, opaque, encryption="SSE-KMS")
    assert not Digester(kms).checks_content and verify_file(path, kms) == ""
    assert "SSE-KMS" in kms.why_size_only()
    # a multipart-looking KMS ETag is not a multipart MD5 either
    assert Expectation(5, f"{opaque}-3", encryption="SSE-KMS").etag_parts == 0
    # with an additional checksum, the body is checked by it
    sha = "LPJNul+wow4m6DsqxbninhsWHlwfp0JecwQzYpOLmCQ="  # SHA-256 of b"hello"
    assert Digester(Expectation(5, opaque, "SHA256", sha, encryption="SSE-C")).checks_content
    assert verify_file(path, Expectation(5, opaque, "SHA256", sha, encryption="SSE-C")) == ""
    assert verify_file(path, Expectation(5, opaque, "SHA256", sha.replace("L", "M"), encryption="SSE-C"))
    # the plain MD5 ETag still checks the body
    assert verify_file(path, Expectation(5, MD5_OF_HELLO)) == ""


def test_a_non_hex_etag_is_never_taken_for_a_multipart_md5():
    assert Expectation(5, "v1.abc-3").etag_parts == 0
    assert not Expectation(5, "v1.abc-3").needs_parts()
    assert "not an MD5" in Expectation(5, "v1.abc").why_size_only()
    assert Expectation(5, f"{MD5_OF_HELLO}-3").etag_parts == 3


# ---------------------------------------------------------------- end to end, both clients


@pytest.fixture
def kms_bucket(s3_endpoint, request):
    """Two small SSE-KMS objects, one large single-part and one multipart one, under enc/."""
    from components.stage_data.s3_clients import s3_client

    client = s3_client(s3_endpoint)
    name = request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:60]
    client.create_bucket(Bucket=name)
    bodies = {
        "enc/a.txt": b"alpha\n" * 100,
        "enc/b.txt": b"beta\n" * 100,
        "enc/big.bin": os.urandom(3 * MIB + 7),
    }
    for key, body in bodies.items():
        client.put_object(
            Bucket=name, Key=key, Body=body, ServerSideEncryption="aws:kms", ChecksumAlgorithm="SHA256"
        )
    # a 2-part upload: its KMS ETag looks like "<hex>-2" but is no multipart MD5 either
    parts = os.urandom(10 * MIB + 3)
    client.upload_fileobj(
        io.BytesIO(parts),
        name,
        "enc/parts.bin",
        ExtraArgs={"ServerSideEncryption": "aws:kms", "ChecksumAlgorithm": "SHA256"},
        Config=TransferConfig(multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB),
    )
    bodies["enc/parts.bin"] = parts
    return name, bodies


SMALL_RANGES = TransferSettings(multipart_threshold_bytes=1 * MIB, part_size_bytes=1 * MIB, max_workers=4)


@pytest.mark.parametrize("kind", ["lean", "botocore"])
@pytest.mark.parametrize("etags", ["opaque", "nonhex"])
def test_encrypted_objects_without_a_checksum_stage_once_with_one_notice(
    kms_bucket, s3_endpoint, tmp_path, caplog, kind, etags
):
    name, bodies = kms_bucket
    caplog.set_level(logging.INFO, logger="components.stage_data")
    stage = dict(s3_client_kind=kind, settings=SMALL_RANGES)
    with FaultProxy(s3_endpoint, etags=etags, strip_checksums=True) as proxy:
        result = stage_dataset(f"s3://{name}/enc/", str(tmp_path), "ds", proxy.endpoint_url, **stage)
        served = proxy.bytes_served
        # a full re-check of the snapshot trusts its recorded encryption: nothing is fetched again
        again = stage_dataset(
            f"s3://{name}/enc/", str(tmp_path), "ds", proxy.endpoint_url, verify_local="full", **stage
        )
    current = tmp_path / "rtp/datasets/ds/current"
    for key, body in bodies.items():
        assert (current / key.removeprefix("enc/")).read_bytes() == body
    assert result.files == 4 and again.snapshot_id == result.snapshot_id
    assert served == sum(len(b) for b in bodies.values()), "every byte fetched once: no failed attempt"
    assert again.bytes_downloaded == 0
    assert not [r for r in caplog.records if "failed verification" in r.getMessage()]
    notices = [r.getMessage() for r in caplog.records if "checked by size only" in r.getMessage()]
    assert len(notices) == 1 and "3 more" in notices[0], notices
    if etags == "opaque":
        assert "SSE-KMS" in notices[0]
        manifest = json.loads((current / "manifest.json").read_text())
        assert {e["encryption"] for e in manifest["files"]} == {"SSE-KMS"}


@pytest.mark.parametrize("kind", ["lean", "botocore"])
def test_encrypted_objects_with_a_checksum_are_verified_by_it(
    kms_bucket, s3_endpoint, tmp_path, caplog, kind
):
    name, _bodies = kms_bucket
    caplog.set_level(logging.INFO, logger="components.stage_data")
    with FaultProxy(s3_endpoint, etags="opaque") as proxy:
        stage_dataset(
            f"s3://{name}/enc/",
            str(tmp_path / "ok"),
            "ds",
            proxy.endpoint_url,
            s3_client_kind=kind,
            settings=SMALL_RANGES,
        )
        assert not [r for r in caplog.records if "size only" in r.getMessage()]
        # corruption on the wire is caught by the checksum, since the ETag cannot catch it
        for corrupted in ("a.txt", "big.bin", "parts.bin"):  # whole, ranged, multipart
            proxy.always.clear()
            proxy.always[corrupted] = "corrupt"
            with pytest.raises(StageError, match=rf"{corrupted.replace('.', '[.]')}.*did not match"):
                stage_dataset(
                    f"s3://{name}/enc/",
                    str(tmp_path / corrupted),
                    "ds",
                    proxy.endpoint_url,
                    s3_client_kind=kind,
                    settings=SMALL_RANGES,
                )


# ---------------------------------------------------------------- names staging uses itself


def test_a_key_named_like_the_manifest_temporary_is_staged_as_data(bucket, s3_endpoint, tmp_path):
    client, name = bucket
    client.put_object(Bucket=name, Key="data/.manifest.json.tmp", Body=b"user data, not a manifest\n")
    result = stage_dataset(f"s3://{name}/data/", str(tmp_path), "ds", s3_endpoint)
    snapshot = tmp_path / "rtp/datasets/ds/snapshots" / result.snapshot_id
    assert (snapshot / ".manifest.json.tmp").read_bytes() == b"user data, not a manifest\n"
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert len(manifest["files"]) == 6
    assert sorted(p.name for p in (tmp_path / "rtp/datasets/ds").iterdir()) == [
        ".staging",
        "current",
        "snapshots",
    ]


# ---------------------------------------------------------------- rtp prepare-data --dest


def test_prepare_data_never_creates_the_destination_bucket(s3_endpoint, tmp_path, capsys):
    from components.stage_data.s3_clients import s3_client
    from rtp_cli.main import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n" * 50)
    (corpus / "b.txt").write_text("other text\n" * 50)
    args = ["prepare-data", "--corpus", str(corpus), "--out-dir", str(tmp_path / "shards")]
    dest = ["--dest", "s3://rtp-absent-dest/corpus/", "--endpoint-url", s3_endpoint]
    assert main([*args, *dest]) != 0
    err = capsys.readouterr().err
    assert "rtp-absent-dest" in err and "does not exist" in err and "create it first" in err
    assert not (tmp_path / "shards").exists()  # checked before the corpus was read
    client = s3_client(s3_endpoint)
    assert "rtp-absent-dest" not in [b["Name"] for b in client.list_buckets()["Buckets"]]
    client.create_bucket(Bucket="rtp-present-dest")
    assert main([*args, "--dest", "s3://rtp-present-dest/corpus/", "--endpoint-url", s3_endpoint]) == 0


def test_someone_elses_bucket_is_an_error_not_success(tmp_path):
    from botocore.exceptions import ClientError

    from components.stage_data.prepare_data import PrepareError, upload_shards

    class TakenBucketS3:
        """Stand-in client: the bucket name belongs to another account."""

        def create_bucket(self, Bucket):
            raise ClientError({"Error": {"Code": "BucketAlreadyExists", "Message": "taken"}}, "CreateBucket")

        def head_bucket(self, Bucket):
            raise ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadBucket")

    (tmp_path / "index.json").write_text(json.dumps({"shards": []}))
    with pytest.raises(PrepareError, match="someone else"):
        upload_shards(TakenBucketS3(), tmp_path, "taken", "p/")
    with pytest.raises(PrepareError, match="denied"):
        upload_shards(TakenBucketS3(), tmp_path, "taken", "p/", create_bucket=False)


def test_repository_mode_checks_encrypted_files_by_what_their_head_says(kms_bucket, s3_endpoint, tmp_path):
    """An FSx data repository already shows the objects as files: a full check must not take
    an SSE-KMS ETag for an MD5."""
    name, bodies = kms_bucket
    repository = tmp_path / "fsx/repo"
    for key, body in bodies.items():
        (repository / key.removeprefix("enc/")).parent.mkdir(parents=True, exist_ok=True)
        (repository / key.removeprefix("enc/")).write_bytes(body)
    with FaultProxy(s3_endpoint, etags="opaque", strip_checksums=True) as proxy:
        result = stage_dataset(
            f"s3://{name}/enc/",
            str(tmp_path / "fsx"),
            "ds",
            proxy.endpoint_url,
            mode="repository",
            repository_dir=str(repository),
            verify_local="full",
        )
    manifest = json.loads((tmp_path / "fsx/rtp/datasets/ds/current/manifest.json").read_text())
    assert result.files == 4 and {e["encryption"] for e in manifest["files"]} == {"SSE-KMS"}
    # a file that differs from its object is still refused
    (repository / "a.txt").write_bytes(b"changed!" * 75)
    with (
        FaultProxy(s3_endpoint, etags="nonhex", strip_checksums=False) as proxy,
        pytest.raises(StageError, match=r"a\.txt does not match"),
    ):
        stage_dataset(
            f"s3://{name}/enc/",
            str(tmp_path / "fsx"),
            "ds2",
            proxy.endpoint_url,
            mode="repository",
            repository_dir=str(repository),
            verify_local="full",
        )


def test_an_sse_c_object_without_its_key_fails_saying_so(tmp_path):
    from botocore.exceptions import ClientError

    from components.stage_data.transfer import Downloader, ObjectJob

    class SseCS3:
        """Stand-in client: S3's answer to a GET of an SSE-C object without its key."""

        def get_object(self, **_):
            error = {
                "Code": "InvalidRequest",
                "Message": "The object was stored using a form of Server Side Encryption. "
                "The correct parameters must be provided to retrieve the object.",
            }
            raise ClientError({"Error": error}, "GetObject")

    job = ObjectJob("b", "data/f.bin", Expectation(5, MD5_OF_HELLO), tmp_path / "f.bin")
    downloader = Downloader(SseCS3(), TransferSettings())
    downloader.plan(job)
    with pytest.raises(StageError, match=r"data/f\.bin is encrypted with a customer-provided key \(SSE-C\)"):
        downloader.fetch_whole(job)
