"""Two tiers: which copy of a checkpoint every rank restores from, the fast one or the durable one.

A checkpoint saved with ``durable_root`` has up to two copies: ``.../NAME`` (the fast tier) and
``<durable_root>/NAME``. The fast copy is used when *every* rank finds it complete and every
rank's fast copy is the same checkpoint (the same ``save_id``; where a rank also sees the durable
copy published, the durable one's too); otherwise every rank reads the durable copy. Who calls
what (every rank of the process group when torch.distributed is initialised; alone otherwise):

* :func:`choose_copy` (``solosave.load(..., durable_root=)``): :func:`complete_here` on this
  rank -> one 8-byte ``all_reduce`` (``DistChannel.agree_flags``) of a word with that bit and the
  path's identity -> when every rank has it complete, a second one of this rank's fast copy's
  ``save_id`` (:func:`_same_checkpoint`) -> the same path on every rank.
* :func:`choose_restore_point` (``integrations.find_restore_point``): candidates, newest first
  (each rank lists both tiers) -> per candidate, one 8-byte ``all_reduce`` of (complete on the
  fast tier here, published on the durable tier here, the step's identity) until a candidate is
  complete on the fast tier on every rank (-> fast) or published on the durable tier for every
  rank (-> durable); before either is taken, one more of the chosen copies' ``save_id``. Normally
  the first candidate settles it: two ``all_reduce``. Ranks that list different newest steps
  (their fast tiers differ) see the identity mismatch alike and retry with the durable tier alone
  (which every rank lists alike). A fast copy that is another job's checkpoint under the same
  name (another ``save_id`` on some rank) is never mixed with this job's: the durable copy is read.

"Complete here" (:func:`complete_here`): ``.metadata`` published and, when the checkpoint has a
load index that belongs to it, every data file the index names is present and at least as long
as its last record's end (a truncated or emptied file is not complete). It reads a listing and
the index's first bytes; nothing of the data.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from solosave._src.coordination.channel import DistChannel
from solosave._src.coordination.status import save_identity
from solosave._src.core.errors import IndexUnusable, SolosaveError
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
from solosave._src.formats.metadata_check import loads_metadata
from solosave._src.index.reader import LoadIndex
from solosave._src.storage.registry import backend_for, storage_for
from solosave._src.tiers.paths import durable_copy_of
from solosave._src.tiers.peer_copy import ranks_kept_here
from solosave._src.tiers.placement import owner_of

FAST, DURABLE = 0b01, 0b10

#: A candidate of :func:`choose_restore_point`: ``(step, fast path or None, durable path or None)``.
Candidate = tuple[int, "str | None", "str | None"]


def complete_here(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                  place: tuple[int, int] | None = None) -> bool:
    """Whether this rank finds the checkpoint at ``path`` complete (see the module docstring).
    With peer copies on more hosts than copies + 1 (a ``.solosave-peers`` sidecar), a host keeps
    only some ranks' files: given ``place``, this ``(rank, world size)``, and the world size the
    layout was saved at, only the files this rank's host should keep are checked (at another
    world size, every file). Never raises: an unreachable or missing copy is not complete."""
    try:
        st = storage_for(path, storage_options)
        directory = st.normalize(path)
        names = set(st.listdir(directory))
        if METADATA_FILE not in names:
            return False
        if INDEX_FILE not in names:
            return True
        keep = None if place is None else ranks_kept_here(st, directory, names, *place)
        idx = LoadIndex.open(directory, st)
    except IndexUnusable:  # a stale or damaged index: loads read .metadata, which is there
        return True
    except (OSError, ValueError, ImportError):
        return False
    if idx is None:
        return True
    try:
        files = list(idx.files)
        ends = list(idx.file_ends) if idx.file_ends is not None else [0] * len(files)
        wanted = [(f, e) for f, e in zip(files, ends) if keep is None or owner_of(f) in keep]
        if not all(name in names for name, _ in wanted):
            return False
        sizes = st.sizes(directory)
        return all(sizes.get(name, -1) >= end for name, end in wanted)
    except (OSError, ValueError):
        return False
    finally:
        idx.close()


def my_place(process_group: Any = None) -> tuple[int, int] | None:
    """This process's ``(rank, world size)`` in ``process_group`` (``None`` without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def identity_here(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The ``save_id`` of the checkpoint published at ``path`` as this rank sees it, from its load
    index (which belongs to that ``.metadata``) or else from the ``.metadata`` itself (a digest of
    it when it records none); ``None`` when it cannot be read. Never raises."""
    try:
        st = storage_for(path, storage_options)
        directory = st.normalize(path)
        try:
            idx = LoadIndex.open(directory, st)
        except IndexUnusable:
            idx = None
        if idx is not None:
            try:
                return str(idx.header["save_id"])
            finally:
                idx.close()
        where = st.join(directory, METADATA_FILE)
        data = st.read(where)
        save_id = getattr(loads_metadata(data, where).storage_meta, "save_id", None)
        return str(save_id) if save_id else "sha256:" + hashlib.sha256(data).hexdigest()
    except (OSError, ValueError, ImportError, SolosaveError):
        return None


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


def _same_checkpoint(step: int, chosen: str, other: str | None, process_group: Any,
                     storage_options: Mapping[str, Any] | None) -> bool | None:
    """Whether the copy ``chosen`` is one checkpoint on every rank: one 8-byte agreement of its
    ``save_id`` as each rank sees it. ``None``: the ranks see different ones; ``False``: the same
    (or none, unreadable everywhere) but not usable on some rank. Where this rank also sees
    ``other`` (the durable copy of a fast one) published, its ``save_id`` must be the same: a
    fast copy left by another job under the same name is not taken."""
    mine = identity_here(chosen, storage_options)
    ok = mine is not None
    if ok and other is not None and published_here(other, storage_options):
        ok = identity_here(other, storage_options) == mine
    agreed = _agree(int(ok), step, f"checkpoint {mine}", process_group)
    return None if agreed is None else bool(agreed & 1)


def choose_copy(path: str | os.PathLike, durable_root: str | os.PathLike, process_group: Any = None,
                storage_options: Mapping[str, Any] | None = None) -> str:
    """The copy of ``path`` that every rank loads: ``path`` itself when every rank finds it
    complete and the same checkpoint, else its durable copy (whether or not that one exists:
    loading it then says so)."""
    fast = backend_for(path).normalize(path)
    durable = durable_copy_of(fast, durable_root)
    agreed = _agree(FAST if complete_here(fast, storage_options, my_place(process_group)) else 0, 0, durable,
                    process_group)
    if agreed is None:
        raise ValueError(f"the ranks load different checkpoints ({durable!r} on this rank); every rank must "
                         "pass the same path and durable_root")
    if agreed & FAST and _same_checkpoint(0, fast, durable, process_group, storage_options):
        return fast
    return durable


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
        here = my_place(process_group)
        flags = (FAST if fast is not None and complete_here(fast, storage_options, here) else 0) | (
            DURABLE if durable is not None and published_here(durable, storage_options) else 0)
        agreed = _agree(flags, step, f"restore step {step}", process_group)
        if agreed is None:
            return "mismatch"
        if agreed & FAST and fast is not None and _same_checkpoint(step, fast, durable, process_group,
                                                                    storage_options):
            return step, fast
        if agreed & DURABLE and durable is not None:
            same = _same_checkpoint(step, durable, None, process_group, storage_options)
            if same is None:
                return "mismatch"  # the ranks read different durable copies: the durable-only pass says so
            if same:
                return step, durable  # else unreadable everywhere: an older step
    return None


__all__ = ["choose_copy", "choose_restore_point", "complete_here", "durable_copy_of", "identity_here", "my_place",
           "published_here"]
