"""Fixtures of the RL tests: moto's real S3 server on loopback for the s3:// weight store."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def s3_endpoint():
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        pytest.skip(f"the S3 cases need boto3 and moto[s3,server] (the dev extra): {e}")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket="kiln")
    yield endpoint
    server.stop()
