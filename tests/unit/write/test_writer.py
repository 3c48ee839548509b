"""Tests of ``solosave._src.write.writer``: padding of BYTES records, write errors that say what happened."""

import io
import os
import subprocess
import sys
import types

import pytest
import torch

from solosave._src.write.writer import bytes_slot, padded_payload
from tests.support import can_mount_private_tmpfs


def test_a_value_of_a_class_the_worker_cannot_import_keeps_its_padded_slot():
    # a class of the trainer's main script: importable where it is saved, not in the worker
    script = types.ModuleType("a_training_script")
    exec("class Schedule:\n    def __init__(self, n):\n        self.history = list(range(n))\n", script.__dict__)
    sys.modules["a_training_script"] = script
    try:
        buf = io.BytesIO()
        torch.save({"sched": script.Schedule(10), "step": 3}, buf)
    finally:
        del sys.modules["a_training_script"]
    payload = buf.getvalue()
    padded = padded_payload(payload, bytes_slot(len(payload)))
    assert padded is not None and len(padded) == bytes_slot(len(payload))
    assert padded.startswith(payload) and not padded[len(payload):].strip(b"\0")


def test_seam_d4_a_value_holding_cuda_tensors_keeps_its_padded_slot_without_cuda():
    """D4, through torch's serialization registry: a value whose storage is tagged ``cuda:0`` (as
    a CUDA tensor's is) is checked for padding on the CPU (``map_location``), so the worker never
    initialises CUDA for it, and on a machine without CUDA the value keeps its padded slot
    instead of drifting on every save."""
    t = torch.arange(16, dtype=torch.float32)
    marked = t.untyped_storage().data_ptr()

    def tag_as_cuda(storage):
        return "cuda:0" if storage.data_ptr() == marked else None

    def never(storage, location):
        return None

    torch.serialization.register_package(1, tag_as_cuda, never)
    try:
        buf = io.BytesIO()
        torch.save({"ema": (t, 0.999), "step": 3}, buf)
    finally:
        registry = torch.serialization._package_registry  # the test's tagger goes again
        registry[:] = [e for e in registry if e[1] is not tag_as_cuda]
    payload = buf.getvalue()
    assert b"cuda:0" in payload
    padded = padded_payload(payload, bytes_slot(len(payload)))
    assert padded is not None and len(padded) == bytes_slot(len(payload))
    assert not torch.cuda.is_initialized()


def test_padding_beyond_the_payload_size_is_refused():
    buf = io.BytesIO()
    torch.save(3, buf)
    payload = buf.getvalue()
    assert padded_payload(payload, 3 * len(payload)) is None
    assert padded_payload(payload, len(payload)) == payload


@pytest.mark.skipif(not can_mount_private_tmpfs(), reason="needs root and unshare for a private 1 MiB tmpfs")
def test_a_full_disk_is_no_space_left_on_device_naming_the_item(tmp_path):
    # torch's zip writer reports a full disk as "inline_container.cc ... unexpected pos"
    code = ("import torch\nfrom solosave._src.write.writer import FileWriter, Record\n"
            f"FileWriter().write_file({str(tmp_path)!r}, '__0_0.distcp', "
            "[Record(('model.w', (0,)), tensor=torch.ones(1 << 20))])\n")
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path} && "
                        f"{sys.executable} -c \"$CODE\""], env=dict(os.environ, CODE=code),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("OSError: [Errno 28] No space left on device while writing 'model.w'"), r.stderr
