"""A real Cloud Storage protocol on loopback: the `gcp-storage-emulator` package serves the
GCS JSON API (ranged reads, resumable uploads, listings) from memory.

`emulator(bucket)` starts one and yields the environment that points the project's two
doors to Cloud Storage at it: gcsfs (fsspec's gs://, through which epath and so the
project reach a bucket) and TensorStore's gcs driver (Orbax's arrays). Programs run with
that environment in subprocesses, so nothing of it leaks into the test process. Skips
with a reason when gcsfs or the emulator is not installed (requirements-gcs.txt,
requirements-dev.txt). Test-only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

from support import free_port

# The emulator, with what TensorStore's gcs driver needs of a download and the emulator
# leaves out: the object's generation in the response headers, as Cloud Storage sends it
# (without it TensorStore reports "Malformed StorageGeneration").
_SERVER = """
import sys
from gcp_storage_emulator.handlers import objects
served = objects.download
def download(request, response, storage, *args, **kwargs):
    served(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # not found: the handler has answered 404
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])
objects.download = download  # before the server's routing table is built from it
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


def _command() -> list[str]:
    pytest.importorskip("gcsfs", reason="gcsfs is not installed (requirements-gcs.txt)")
    pytest.importorskip("gcp_storage_emulator",
                        reason="gcp-storage-emulator is not installed (requirements-dev.txt)")
    return [sys.executable, "-c", _SERVER]


@contextlib.contextmanager
def emulator(bucket: str):
    """A fresh in-memory emulator holding the empty `bucket`; yields the environment (a
    copy of os.environ plus its settings) for the subprocesses that use it."""
    command = _command()
    port = free_port()
    proc = subprocess.Popen(command + ["start", "--host=127.0.0.1", f"--port={port}",
                                       "--in-memory", f"--default-bucket={bucket}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, "the GCS emulator exited at start"
                assert time.monotonic() < deadline, "the GCS emulator did not start"
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        yield dict(os.environ,
                   STORAGE_EMULATOR_HOST=url,  # gcsfs and google-cloud-storage
                   TENSORSTORE_GCS_HTTP_URL=url,  # Orbax's arrays
                   GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator",
                   # gcsfs would first ask the bucket's type over gRPC, which the emulator
                   # does not serve (a 60-s timeout per bucket).
                   GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
