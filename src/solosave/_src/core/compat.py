"""The differences between the torch releases solosave runs on, in one place.

solosave supports torch 2.8 to 2.14 (``pyproject.toml``; ``make test-torch-versions`` runs the
core tests on the oldest, on 2.11 and on the newest). Each name below is one difference, with the
releases it applies to and where torch's source shows it; the rest of solosave asks here rather
than test torch itself.

Why the floor is 2.8: solosave's rendezvous store listens only on the training address, through a
listening socket it hands to ``TCPStore`` (``master_listen_fd``). Before 2.8 the libuv server
refuses one (``NotImplementedError`` from the ``TCPStore`` constructor,
``torch/csrc/distributed/c10d/TCPStore.cpp``), and the legacy server takes it but aborts the
process on its first poll ("Unexpected poll revent on the master's listening socket",
``TCPStoreMasterDaemon::run`` in ``torch/csrc/distributed/c10d/TCPStoreBackend.cpp``, torch 2.6
and 2.7).
"""

from __future__ import annotations

import re

import torch
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["METADATA_HAS_VERSION", "MIN_TORCH", "check_torch", "torch_release"]

#: The oldest torch release solosave runs on (the floor of ``pyproject.toml``'s requirement).
MIN_TORCH = (2, 8)

#: torch >= 2.9: DCP's ``Metadata`` has a ``version`` field, the format version of ``.metadata``
#: (``torch/distributed/checkpoint/metadata.py``, ``class Metadata``). torch 2.8 has none, and
#: ``Metadata(..., version=...)`` raises a ``TypeError`` there.
METADATA_HAS_VERSION: bool = "version" in Metadata.__dataclass_fields__


def torch_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string. A pre-release or a local build counts as its
    release: ``"2.8.0a0+git5228986"`` (NVIDIA's containers ship such builds) is ``(2, 8)``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m[1]), int(m[2])


def check_torch(version: str = torch.__version__) -> None:
    """Raise ``RuntimeError`` if ``version`` is older than :data:`MIN_TORCH`. Every rank calls it
    before the rendezvous store is made, so that every rank fails the same way instead of one
    rank's store aborting its process while the others wait for it."""
    if torch_release(version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise RuntimeError(f"solosave needs torch>={need}, this is torch {version}: its TCPStore cannot serve on "
                           f"the listening socket solosave hands it; upgrade torch (pip install 'torch>={need}')")
