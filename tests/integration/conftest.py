"""A real S3 server (single-node Ceph RGW) for the staging integration tests, one per session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmarks.ceph_rgw import CephRGW


@pytest.fixture(scope="session")
def ceph_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CephRGW]:
    missing = CephRGW.missing()
    if missing:
        pytest.skip(f"Ceph RGW not installed ({', '.join(missing)} missing): run scripts/install-ceph.sh")
    server = CephRGW(tmp_path_factory.mktemp("ceph")).start()
    saved = {k: os.environ.get(k) for k in server.credentials()}
    os.environ.update(server.credentials())
    try:
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
