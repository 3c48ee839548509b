"""Which storage backend serves a path: chosen once, from the path's scheme.

A path with ``scheme://`` is a URL and is served by the backend registered for that scheme, or
by the one registered for :data:`ANY_URL` (fsspec, which knows many); anything else (a ``str``
without a scheme, an ``os.PathLike``) is served by the backend registered for :data:`PLAIN`
(local files). A backend is registered by the import path of its class (``"module:Class"``),
so its module, and any optional package it needs, is imported only when a path of its scheme is
first used; if that import fails, the error says what to install.

* :func:`backend_for` ``(path)``: the backend's class, for path operations and capabilities
  (``normalize``, ``join``, ``local_files``, ...): no connection, no client built, nothing that
  can fail for lack of credentials.
* :func:`storage_for` ``(path, options)``: a backend ready for I/O; ``options``: the user's
  ``storage_options``.

Adding a backend is one module and one line in the table at the bottom of this file (see
:mod:`solosave._src.storage.base`, "Adding a storage backend").
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from solosave._src.storage.base import Storage

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: The registry key of paths without a scheme.
PLAIN = ""
#: The registry key of the backend serving every URL scheme that no other backend registered.
ANY_URL = "*"


def scheme_of(path: Any) -> str | None:
    """The scheme of a URL (``"s3"`` for ``s3://b/x``, lower case), ``None`` for a local path
    (``runs/x``, ``C:\\x``, an ``os.PathLike``, and ``s3:/b/x``: a URL that ``pathlib`` mangled)."""
    head = _SCHEME.match(path) if isinstance(path, str) else None
    return head.group(1).lower() if head else None


@dataclass
class _Entry:
    target: str | type[Storage]  # "module:Class" until first resolved
    install: str | None


class StorageRegistry:
    """Schemes -> backends (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def register(self, schemes: Iterable[str], backend: str | type[Storage], *, install: str | None = None) -> None:
        """Serve ``schemes`` (lower case; :data:`PLAIN`, :data:`ANY_URL`) with ``backend``: a
        :class:`Storage` subclass or its import path ``"package.module:Class"`` (imported on first
        use). ``install``: what to run when that import fails (``"pip install 'solosave[x]'"``)."""
        if isinstance(backend, str) and ":" not in backend:
            raise ValueError(f"backend {backend!r}: give a Storage subclass or 'package.module:Class'")
        with self._lock:
            for scheme in schemes:
                self._entries[scheme.lower()] = _Entry(backend, install)

    def unregister(self, schemes: Iterable[str]) -> None:
        with self._lock:
            for scheme in schemes:
                self._entries.pop(scheme.lower(), None)

    def backend_for(self, path: Any) -> type[Storage]:
        """The class of the backend serving ``path`` (its module imported if it was not)."""
        scheme = scheme_of(path)
        key = PLAIN if scheme is None else scheme
        with self._lock:
            entry = self._entries.get(key) or (self._entries.get(ANY_URL) if scheme is not None else None)
        if entry is None:
            kind = f"{scheme}://" if scheme is not None else "local"
            raise ValueError(f"no storage backend serves {kind} paths ({os.fspath(path)!r}); "
                             "pass a local path or a URL of a registered scheme")
        if isinstance(entry.target, str):
            entry.target = _import(entry.target, entry.install, path)
        return entry.target

    def storage_for(self, path: Any, options: Mapping[str, Any] | None = None) -> Storage:
        """The backend serving ``path``, ready for I/O (``options``: its ``storage_options``)."""
        return self.backend_for(path).from_path(path, options)


def _import(target: str, install: str | None, path: Any) -> type[Storage]:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        fix = f": {install}" if install else ""
        raise ImportError(f"{os.fspath(path)} needs the storage backend {module_name}, which cannot be "
                          f"imported ({e}){fix}") from e
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Storage)):
        raise TypeError(f"internal: {target} is not a Storage subclass")
    return cls


#: The registry every call site uses.
REGISTRY = StorageRegistry()
REGISTRY.register((PLAIN,), "solosave._src.storage.local:LocalStorage")
REGISTRY.register((ANY_URL,), "solosave._src.storage.fsspec:FsspecStorage", install="pip install 'solosave[s3]'")


def backend_for(path: Any) -> type[Storage]:
    """:meth:`StorageRegistry.backend_for` of :data:`REGISTRY`."""
    return REGISTRY.backend_for(path)


def storage_for(path: Any, options: Mapping[str, Any] | None = None) -> Storage:
    """:meth:`StorageRegistry.storage_for` of :data:`REGISTRY`."""
    return REGISTRY.storage_for(path, options)


__all__ = ["ANY_URL", "PLAIN", "REGISTRY", "StorageRegistry", "backend_for", "scheme_of", "storage_for"]
