"""A real S3-protocol server (moto's standalone server) on 127.0.0.1, and the AWS variables that
point boto3 and pyarrow at it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.helpers.mlflow_server import free_port


@contextlib.contextmanager
def s3_server(log: Path, bucket: str = "raytron"):
    """Yield the environment (``AWS_ENDPOINT_URL``, credentials, region) of a fresh server with
    ``bucket`` created; stop the server on exit."""
    port = free_port()
    moto = str(Path(sys.executable).with_name("moto_server"))
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "raytron",
           "AWS_SECRET_ACCESS_KEY": "raytron", "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.3)
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="raytron",
                     aws_secret_access_key="raytron", region_name="us-east-1").create_bucket(Bucket=bucket)
        yield env
    finally:
        proc.terminate()
        proc.wait(20)


def keys(env: dict, bucket: str, prefix: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="raytron",
                          aws_secret_access_key="raytron", region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def with_env(env: dict) -> dict:
    return {**os.environ, **env}
