"""Where a save's copies live: the one path rule of the tiers.

A save to ``.../NAME`` on the fast tier is copied to ``<durable_root>/NAME`` (:func:`durable_copy_of`);
the checkpointer (before a save), the copier (before it writes) and the restore (choosing a tier)
all derive it here. :func:`durable_target_problem` refuses a durable root that reaches the fast
checkpoint itself: through a symbolic link, ``..`` or a bind mount the "copy" would then remove
the fast ``.metadata`` and truncate each data file it reads from."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from solosave._src.storage.registry import backend_for, storage_for

__all__ = ["durable_copy_of", "durable_target_problem"]


def durable_copy_of(path: str | os.PathLike, durable_root: str | os.PathLike) -> str:
    """``<durable_root>/<name of path>``: where the copy of ``path`` lives on the durable tier."""
    root = backend_for(durable_root).normalize(durable_root)
    return backend_for(root).join(root, backend_for(path).basename(backend_for(path).normalize(path)))


def durable_target_problem(directory: str, durable_root: str,
                           storage_options: Mapping[str, Any] | None = None) -> str | None:
    """``None`` if the durable copy of the fast checkpoint ``directory`` is another location;
    else why not (the text of the error). Compares resolved locations where both are on one
    storage (:meth:`~solosave._src.storage.base.Storage.same_location`)."""
    target = durable_copy_of(directory, durable_root)
    if backend_for(target) is not backend_for(directory):
        return None
    st = storage_for(directory, storage_options)
    parent = st.dirname(st.normalize(directory))
    if st.same_location(target, directory) or st.same_location(st.normalize(durable_root), parent):
        return (f"the durable copy of {directory!r} would be the checkpoint itself: durable_root "
                f"({durable_root!r}) reaches the save's own parent directory ({parent!r}); choose a durable "
                "root on another directory (or storage)")
    return None
