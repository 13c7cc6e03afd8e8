"""Fixtures shared by the unit tests: a moto S3 server on loopback with a small bucket."""

import os

import pytest

from components.stage_data.s3_clients import s3_client


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint, request):
    """A bucket named after the test holding five small files under data/."""
    client = s3_client(s3_endpoint)
    name = request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:60]
    client.create_bucket(Bucket=name)
    for i in range(5):
        client.put_object(Bucket=name, Key=f"data/file{i}.txt", Body=f"contents {i}\n".encode() * 100)
    return client, name
