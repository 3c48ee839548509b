"""CRC32 (zip's polynomial, as ``zlib.crc32``) of record bytes: the zip entries of every record,
the checksum sidecars and ``solosave verify``.

It is the one pass over the staged bytes that a save adds to the write itself (the zip format of
DCP's records needs it), so its speed counts where the writers share few cores. ISA-L's CRC32
(the ``isal`` package, a dependency on x86-64 and ARM64) is several times faster than
``zlib.crc32`` (docs/benchmarks.md); both release the GIL on large buffers and give the same
values. Without ``isal``, or with the environment variable
``SOLOSAVE_CRC32=zlib`` (read once, at import: benchmarks compare the two), zlib's is used.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable

_Crc = Callable[..., int]


def _pick() -> tuple[str, _Crc]:
    if os.environ.get("SOLOSAVE_CRC32", "").strip().lower() != "zlib":
        try:
            from isal.isal_zlib import crc32 as isal_crc32

            return "isal", isal_crc32
        except ImportError:  # pragma: no cover - platforms without an isal wheel
            pass
    return "zlib", zlib.crc32


#: Which implementation ``crc32`` is: ``"isal"`` or ``"zlib"``.
IMPLEMENTATION, crc32 = _pick()

__all__ = ["IMPLEMENTATION", "crc32"]
