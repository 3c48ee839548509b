"""An S3-compatible server for the object-store benchmark and the storage tests: moto's server
mode (``pip install 'moto[server]'``) on a free 127.0.0.1 port (``port``, or one from the
kernel), started and stopped here.

``with s3_server() as (endpoint, env):`` yields the endpoint URL and the standard AWS variables
that reach it (test credentials); the server is terminated (then killed) at the end. Starting is
bounded by ``start_timeout`` seconds."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from solosave._src.testing.ports import free_port


@contextlib.contextmanager
def s3_server(start_timeout: float = 30.0, port: int | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    port = free_port() if port is None else port
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],  # noqa: S603
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()  # noqa: S310 - our own server
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server (python -m moto.server) did not start within "
                                       f"{start_timeout} s; pip install 'moto[server]' s3fs") from None
                time.sleep(0.1)
        yield endpoint, {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                         "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
