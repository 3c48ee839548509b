"""Two tiers: which copy of a checkpoint every rank restores from, the fast one or the durable one.

A checkpoint saved with ``durable_root`` has up to two copies: ``.../NAME`` (the fast tier) and
``<durable_root>/NAME``. The fast copy is used when *every* rank finds it complete; otherwise
every rank reads the durable copy. Who calls what (every rank of the process group when
torch.distributed is initialised; alone otherwise):

* :func:`choose_copy` (``solosave.load(..., durable_root=)``): :func:`complete_here` on this
  rank -> **one** 8-byte ``all_reduce`` (``DistChannel.agree_flags``) of a word with that bit and
  the checkpoint's identity -> the same path on every rank.
* :func:`choose_restore_point` (``integrations.find_restore_point``): candidates, newest first
  (each rank lists both tiers) -> per candidate, one 8-byte ``all_reduce`` of (complete on the
  fast tier here, published on the durable tier here, the step's identity) until a candidate is
  complete on the fast tier on every rank (-> fast) or published on the durable tier for every
  rank (-> durable). Normally the first candidate settles it: one ``all_reduce``. Ranks that
  list different newest steps (their fast tiers differ) see the identity mismatch alike and
  retry with the durable tier alone (which every rank lists alike).

"Complete here" (:func:`complete_here`): ``.metadata`` published and, when the checkpoint has a
load index that belongs to it, every data file the index names is present. It reads a listing
and the index's first bytes; nothing of the data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from solosave._src.coordination.channel import DistChannel
from solosave._src.coordination.status import save_identity
from solosave._src.core.errors import IndexUnusable
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
from solosave._src.index.reader import LoadIndex
from solosave._src.storage.registry import backend_for, storage_for
from solosave._src.tiers.paths import durable_copy_of

FAST, DURABLE = 0b01, 0b10

#: A candidate of :func:`choose_restore_point`: ``(step, fast path or None, durable path or None)``.
Candidate = tuple[int, "str | None", "str | None"]


def complete_here(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether this rank finds the checkpoint at ``path`` complete (see the module docstring).
    Never raises: an unreachable or missing copy is not complete."""
    try:
        st = storage_for(path, storage_options)
        directory = st.normalize(path)
        names = set(st.listdir(directory))
        if METADATA_FILE not in names:
            return False
        if INDEX_FILE not in names:
            return True
        idx = LoadIndex.open(directory, st)
    except IndexUnusable:  # a stale or damaged index: loads read .metadata, which is there
        return True
    except (OSError, ValueError, ImportError):
        return False
    if idx is None:
        return True
    try:
        return all(name in names for name in idx.files)
    finally:
        idx.close()


def published_here(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``path/.metadata`` exists as this rank sees it (never raises)."""
    try:
        st = storage_for(path, storage_options)
        return st.exists(st.join(st.normalize(path), METADATA_FILE))
    except (OSError, ValueError, ImportError):
        return False


def _agree(flags: int, step: int, name: str, process_group: Any) -> int | None:
    """The flags every rank holds for candidate ``step`` (``None``: the ranks were not all
    deciding about the same candidate). One 8-byte agreement."""
    if not (dist.is_available() and dist.is_initialized()):
        return flags
    ident = save_identity(step, name)
    return DistChannel(process_group).agree_flags(flags, ident)


def choose_copy(path: str | os.PathLike, durable_root: str | os.PathLike, process_group: Any = None,
                storage_options: Mapping[str, Any] | None = None) -> str:
    """The copy of ``path`` that every rank loads: ``path`` itself when every rank finds it
    complete, else its durable copy (whether or not that one exists: loading it then says so)."""
    fast = backend_for(path).normalize(path)
    durable = durable_copy_of(fast, durable_root)
    agreed = _agree(FAST if complete_here(fast, storage_options) else 0, 0, durable, process_group)
    if agreed is None:
        raise ValueError(f"the ranks load different checkpoints ({durable!r} on this rank); every rank must "
                         "pass the same path and durable_root")
    return fast if agreed & FAST else durable


def choose_restore_point(candidates: Sequence[Candidate], process_group: Any = None,
                         storage_options: Mapping[str, Any] | None = None) -> tuple[int, str] | None:
    """The newest candidate that is complete on the fast tier for every rank, or else published
    on the durable tier for every rank, as ``(step, path)``; ``None`` if none is (see the module
    docstring). Every rank must pass its own listing of the same directories."""
    todo = sorted(candidates, key=lambda c: c[0], reverse=True)
    for durable_only in (False, True):
        if durable_only:
            todo = [(s, None, d) for s, _, d in todo if d is not None]
        settled = _first_restorable(todo, process_group, storage_options)
        if settled != "mismatch":
            return settled  # type: ignore[return-value]
    raise RuntimeError("the ranks list different checkpoints on the durable tier; every rank must see "
                       "the same durable_root")


def _first_restorable(todo: Sequence[Candidate], process_group: Any,
                      storage_options: Mapping[str, Any] | None) -> tuple[int, str] | None | str:
    """The newest restorable candidate, ``None``, or ``"mismatch"`` (the ranks' lists differ)."""
    for step, fast, durable in todo:
        flags = (FAST if fast is not None and complete_here(fast, storage_options) else 0) | (
            DURABLE if durable is not None and published_here(durable, storage_options) else 0)
        agreed = _agree(flags, step, f"restore step {step}", process_group)
        if agreed is None:
            return "mismatch"
        if agreed & FAST:
            return step, fast  # type: ignore[return-value]
        if agreed & DURABLE:
            return step, durable  # type: ignore[return-value]
    return None


__all__ = ["choose_copy", "choose_restore_point", "complete_here", "durable_copy_of", "published_here"]
