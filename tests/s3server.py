"""A real S3-protocol server (moto) on loopback for tests that exercise the S3 code path.

Its fixtures are every test module's (conftest imports them); boto3 and moto are imported
only when a test asks for the server, so that a machine without them (the GPU machine:
`pytest tests/test_cascade.py -k cuda`) still collects and runs the other tests.
"""

import uuid

import pytest

from lsreplay.core.storage import Store

BUCKET = "lsreplay-test"
KEY = "test-key-id"
# Distinctive so tests can assert that it never leaks into messages or reprs.
SECRET = "test-secret-do-not-print"


@pytest.fixture(scope="session")
def s3_endpoint():
    """Yield (endpoint_url, storage_options) for a fresh moto server holding BUCKET."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint_url = f"http://{host}:{port}"
        client_kwargs = {"endpoint_url": endpoint_url, "region_name": "us-east-1"}
        # s3fs's mkdir sends a location constraint that moto refuses for us-east-1.
        client = boto3.client(
            "s3", aws_access_key_id=KEY, aws_secret_access_key=SECRET, **client_kwargs
        )
        client.create_bucket(Bucket=BUCKET)
        yield endpoint_url, {"key": KEY, "secret": SECRET, "client_kwargs": client_kwargs}
    finally:
        server.stop()


# Each test that uses it runs twice: on a local folder and on the loopback S3 server.
@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store(str(tmp_path / "run"))
    _, options = request.getfixturevalue("s3_endpoint")
    return Store(f"s3://{BUCKET}/{uuid.uuid4().hex}", options)
