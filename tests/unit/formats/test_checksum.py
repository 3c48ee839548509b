"""The records' CRC32 (``solosave._src.core.checksum``): zlib's values, whichever implementation."""

import os
import subprocess
import sys
import zlib

import torch

from solosave._src.core.checksum import IMPLEMENTATION, crc32
from solosave._src.formats.record_writer import raw_bytes


def test_same_values_as_zlib_on_buffers_views_and_seeds():
    t = torch.randn(1 << 16)
    for data in (b"", b"abc", bytes(range(256)) * 1000, raw_bytes(t), raw_bytes(t)[3:70001]):
        assert crc32(data) == zlib.crc32(data)
        assert crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)


def test_isal_is_used_where_installed_and_zlib_on_request():
    try:
        import isal  # noqa: F401
        want = "isal"
    except ImportError:
        want = "zlib"
    assert want == IMPLEMENTATION
    code = "from solosave._src.core.checksum import IMPLEMENTATION; print(IMPLEMENTATION)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SOLOSAVE_CRC32": "zlib"},
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "zlib"
