"""Prepared metadata: a complete DCP ``Metadata`` reused by every save of a constant structure.

File format (version 1), written atomically by :func:`save_prepared_metadata`::

    b"SOLOSAVE-PREPARED\\n"  b"1\\n"  <one JSON line: the fingerprint>  <pickle of Metadata>

:func:`load_prepared_metadata` also accepts a plain pickled DCP ``Metadata`` (what other tools'
create modes write), a checkpoint's ``.metadata`` file, or a checkpoint directory. Every pickle
is loaded through the allowlist of :mod:`solosave._safe_pickle`.

A :class:`PreparedMetadata` indexes the metadata once by rank and file, so a reuse save's local
planning touches only this rank's items (independent of the world size).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from ._errors import FingerprintMismatchError, PreparedMetadataError
from ._format import METADATA_FILE, ItemKey, dtype_name, index_key, parse_file_name, storage_index
from ._layout import gc_paused
from ._plan import LocalPlan
from ._protocol import ItemKind, ItemSpec, PlacedItem, ReusePlan
from ._publish import MetadataTemplate, atomic_write
from ._safe_pickle import safe_loads

MAGIC = b"SOLOSAVE-PREPARED\n"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a prepared metadata is valid for. ``None`` fields are unknown (plain DCP files)."""

    world_size: int | None
    workers: int | None
    structure_hash: str
    torch_version: str | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps({
            "world_size": self.world_size, "workers": self.workers,
            "structure_hash": self.structure_hash, "torch_version": self.torch_version,
            "format_version": self.format_version,
        }, sort_keys=True)


def metadata_structure_hash(md: Metadata) -> str:
    """Hash of keys, shapes, dtypes, chunking and which file/offset/length holds each item."""
    h = hashlib.sha256()
    with gc_paused():  # millions of small tuples, no cycles
        for fqn in sorted(md.state_dict_metadata):
            m = md.state_dict_metadata[fqn]
            if isinstance(m, TensorStorageMetadata):
                chunks = sorted(zip(map(tuple, (c.offsets for c in m.chunks)),
                                    map(tuple, (c.sizes for c in m.chunks))))
                h.update(repr((fqn, str(m.properties.dtype), tuple(m.size), chunks)).encode())
            else:
                h.update(repr((fqn, "bytes")).encode())
        rows = sorted((k.fqn, tuple(k.offset) if k.offset is not None else (), v.relative_path, v.offset,
                       v.length) for k, v in (md.storage_data or {}).items())
        h.update(repr(rows).encode())
    return h.hexdigest()[:32]


def infer_world_workers(md: Metadata) -> tuple[int, int]:
    ranks, files = 0, 0
    for info in (md.storage_data or {}).values():
        parsed = parse_file_name(info.relative_path)
        if parsed is None:
            raise PreparedMetadataError(
                f"metadata names data file {info.relative_path!r}, which is not a "
                "'__{rank}_{n}.distcp' file; it was not written by a FileSystemWriter-style saver")
        ranks = max(ranks, parsed[0] + 1)
        files = max(files, parsed[1] + 1)
    return ranks, files


@dataclass(frozen=True, eq=False)
class PreparedMetadata:
    """A complete DCP ``Metadata`` plus the fingerprint of the run it is valid for."""

    metadata: Metadata
    fingerprint: Fingerprint
    #: Where it came from (a path, ``"created"`` or ``"object"``), for messages.
    source: str = "object"
    _by_rank: dict[int, tuple[tuple[str, tuple[PlacedItem, ...]], ...]] = field(
        init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        with gc_paused():
            self._index()

    def _index(self) -> None:
        if not isinstance(self.metadata, Metadata):
            raise PreparedMetadataError(
                f"{self.source}: expected a torch.distributed.checkpoint Metadata, got "
                f"{type(self.metadata).__name__}")
        if not self.metadata.storage_data and self.metadata.state_dict_metadata:
            raise PreparedMetadataError(
                f"{self.source}: the metadata has no storage_data (it is not a complete, published "
                "checkpoint metadata); use the .metadata of a finished save")
        by_file: dict[str, list[PlacedItem]] = defaultdict(list)
        for idx, info in self.metadata.storage_data.items():
            by_file[info.relative_path].append(
                PlacedItem(index_key(idx), info.relative_path, int(info.offset), int(info.length)))
        by_rank: dict[int, list[tuple[str, tuple[PlacedItem, ...]]]] = defaultdict(list)
        for rel in sorted(by_file, key=lambda r: parse_file_name(r) or (1 << 62, 0)):
            parsed = parse_file_name(rel)
            if parsed is None:
                raise PreparedMetadataError(f"{self.source}: unexpected data file name {rel!r}")
            items = tuple(sorted(by_file[rel], key=lambda p: p.offset))
            by_rank[parsed[0]].append((rel, items))
        self._by_rank.update({r: tuple(v) for r, v in by_rank.items()})

    @classmethod
    def from_metadata(cls, metadata: Metadata, world_size: int | None = None,
                      workers: int | None = None, source: str = "object") -> PreparedMetadata:
        """Wrap ``metadata`` and compute its fingerprint (world size / workers inferred from
        the file names when not given: a lower bound, since a rank may have written nothing)."""
        return cls(metadata, prepared_fingerprint(metadata, world_size, workers), source)

    # -- per-rank index --------------------------------------------------------------------
    def rank_files(self, rank: int) -> tuple[tuple[str, tuple[PlacedItem, ...]], ...]:
        """The files the metadata places on ``rank``, each with its items in offset order."""
        return self._by_rank.get(rank, ())

    def placed(self, key: ItemKey) -> bool:
        return storage_index(key) in self.metadata.storage_data

    def spec_matches(self, spec: ItemSpec) -> str | None:
        """``None`` if ``spec`` is consistent with the metadata, else why not."""
        m = self.metadata.state_dict_metadata.get(spec.fqn)
        if m is None:
            return f"{spec.fqn}: not in the prepared metadata (a new item)"
        if spec.kind is ItemKind.BYTES:
            if isinstance(m, BytesStorageMetadata):
                return None
            return f"{spec.fqn}: now a non-tensor, prepared as a tensor"
        if not isinstance(m, TensorStorageMetadata):
            return f"{spec.fqn}: now a tensor, prepared as a non-tensor"
        if tuple(m.size) != spec.global_size or dtype_name(m.properties.dtype) != spec.dtype:
            return (f"{spec.fqn}: now {spec.dtype}{list(spec.global_size or ())}, prepared as "
                    f"{dtype_name(m.properties.dtype)}{list(m.size)}")
        if not self.placed(spec.key):
            return f"{spec.fqn}: chunk at {list(spec.offsets or ())} is not in the prepared metadata (resharded?)"
        return None

    @cached_property
    def chunk_sizes(self) -> dict[ItemKey, tuple[int, ...]]:
        out: dict[ItemKey, tuple[int, ...]] = {}
        for fqn, m in self.metadata.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                for c in m.chunks:
                    out[(fqn, tuple(int(o) for o in c.offsets))] = tuple(int(s) for s in c.sizes)
        return out

    @cached_property
    def template(self) -> MetadataTemplate:
        """The metadata serialized once, for publishing (coordinator)."""
        return MetadataTemplate(self.metadata)

    def adopt_template(self, save_id: str, template: MetadataTemplate) -> bool:
        """Use ``template`` (built by the coordinator from the ``.metadata`` it published with
        ``save_id``) instead of serializing the metadata again, if this metadata was read back
        from that publication (its ``storage_meta.save_id``, a fresh uuid per publication);
        returns whether it did."""
        sm = self.metadata.storage_meta
        if "template" in self.__dict__ or sm is None or not save_id or sm.save_id != save_id:
            return False
        self.__dict__["template"] = template  # the cached_property's slot
        return True

    # -- reuse planning (every rank, locally) -----------------------------------------------
    def plan_reuse(self, plan: LocalPlan, rank: int) -> tuple[ReusePlan, list[ItemSpec]]:
        """This rank's local plan of a reuse save: the layout the prepared metadata gives it, the
        reasons it cannot write that layout (a drift found before writing), and the items to
        stage: the layout's items, or every item it owns when it drifted (the save then falls
        back to the collective path, which may assign it any of them)."""
        layout = self.rank_files(rank)
        drift: list[str] = []
        sizes = self.chunk_sizes
        for _, items in layout:
            for p in items:
                s = plan.by_key.get(p.key)
                if s is None:
                    drift.append(f"{p.key[0]}: prepared on this rank but not in its state dict")
                elif s.offsets is not None and sizes.get(p.key) != s.sizes:
                    drift.append(f"{s.fqn}: chunk size {list(s.sizes or ())} differs from the prepared one")
        for s in plan.specs:
            msg = self.spec_matches(s)
            if msg:
                drift.append(msg)
        if drift:
            return ReusePlan(layout, tuple(drift)), plan.owned
        return ReusePlan(layout), [plan.by_key[p.key] for _, items in layout for p in items]

    # -- validation ------------------------------------------------------------------------
    def check_compatible(self, world_size: int, workers: int) -> None:
        """Raise :class:`FingerprintMismatchError` naming the field that differs and the fix."""
        fp = self.fingerprint
        fix = ("Delete the file (or point prepared_metadata elsewhere) and run with "
               "create_prepared_metadata=True, or run `solosave prepare` from a checkpoint of this run.")
        if fp.format_version != FORMAT_VERSION:
            raise FingerprintMismatchError(
                f"{self.source}: prepared-metadata format version {fp.format_version}, this "
                f"solosave reads {FORMAT_VERSION}. {fix}")
        inferred_ranks, inferred_files = infer_world_workers(self.metadata)
        if fp.world_size is not None and fp.world_size != world_size:
            raise FingerprintMismatchError(
                f"{self.source}: world_size differs: prepared for {fp.world_size} ranks, this run "
                f"has {world_size}. {fix}")
        if inferred_ranks > world_size:
            raise FingerprintMismatchError(
                f"{self.source}: world_size differs: the metadata has files of {inferred_ranks} "
                f"ranks, this run has {world_size}. {fix}")
        if fp.workers is not None and fp.workers != workers:
            raise FingerprintMismatchError(
                f"{self.source}: workers differs: prepared with workers={fp.workers}, this "
                f"checkpointer has workers={workers}. Use workers={fp.workers} or: {fix}")
        if inferred_files > workers:
            raise FingerprintMismatchError(
                f"{self.source}: workers differs: the metadata has {inferred_files} files per "
                f"rank, this checkpointer has workers={workers}. {fix}")
        if metadata_structure_hash(self.metadata) != fp.structure_hash:
            raise FingerprintMismatchError(
                f"{self.source}: structure hash differs from the one recorded in the file (the "
                f"file was modified). {fix}")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PreparedMetadataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PreparedMetadataError(f"{path}: is a directory without {METADATA_FILE}") from None
    except OSError as e:
        raise PreparedMetadataError(f"{path}: cannot read ({e})") from e


def load_prepared_metadata(path: str | os.PathLike) -> PreparedMetadata:
    """Load a prepared-metadata file, a plain pickled DCP ``Metadata``, a ``.metadata`` file or a
    checkpoint directory. Raises :class:`PreparedMetadataError` (or a subclass) with the reason."""
    p = Path(path)
    if p.is_dir():
        if not (p / METADATA_FILE).exists():
            raise PreparedMetadataError(
                f"{p}: directory has no {METADATA_FILE} (not a published checkpoint; a save that "
                "failed or is still running leaves none)")
        p = p / METADATA_FILE
    data = _read(p)
    if data.startswith(MAGIC):
        return _parse_prepared(p, data)
    if not data:
        raise PreparedMetadataError(f"{p}: file is empty")
    with gc_paused():
        md = safe_loads(data, what=str(p))
    if not isinstance(md, Metadata):
        raise PreparedMetadataError(f"{p}: holds a {type(md).__name__}, not a DCP Metadata")
    infer_world_workers(md)  # validates the data file names
    fp = Fingerprint(None, None, metadata_structure_hash(md), None)
    return PreparedMetadata(md, fp, str(p))


def _parse_prepared(p: Path, data: bytes) -> PreparedMetadata:
    rest = data[len(MAGIC):]
    try:
        version_line, json_line, payload = rest.split(b"\n", 2)
        version = int(version_line)
        fpd: dict[str, Any] = json.loads(json_line)
    except ValueError as e:
        raise PreparedMetadataError(f"{p}: prepared-metadata header is truncated or corrupt ({e}); "
                                    "delete the file and recreate it") from e
    if version != FORMAT_VERSION:
        raise FingerprintMismatchError(
            f"{p}: prepared-metadata format version {version}; this solosave reads "
            f"{FORMAT_VERSION}. Recreate it with create_prepared_metadata=True")
    with gc_paused():
        md = safe_loads(payload, what=str(p))
    if not isinstance(md, Metadata):
        raise PreparedMetadataError(f"{p}: holds a {type(md).__name__}, not a DCP Metadata")
    try:
        fp = Fingerprint(fpd["world_size"], fpd["workers"], fpd["structure_hash"],
                         fpd.get("torch_version"), fpd.get("format_version", version))
    except KeyError as e:
        raise PreparedMetadataError(f"{p}: fingerprint lacks field {e}; recreate the file") from e
    return PreparedMetadata(md, fp, str(p))


def prepared_fingerprint(metadata: Metadata, world_size: int | None = None,
                         workers: int | None = None) -> Fingerprint:
    """The fingerprint :meth:`PreparedMetadata.from_metadata` records for ``metadata``."""
    return Fingerprint(world_size, workers, metadata_structure_hash(metadata), torch.__version__)


def save_prepared_metadata(prepared: PreparedMetadata | Metadata, path: str | os.PathLike) -> None:
    """Write ``prepared`` to ``path`` atomically (temp file, fsync, rename, directory fsync)."""
    if isinstance(prepared, Metadata):
        prepared = PreparedMetadata.from_metadata(prepared)
    write_prepared_file(path, prepared.fingerprint, pickle.dumps(prepared.metadata, protocol=2))


def write_prepared_file(path: str | os.PathLike, fingerprint: Fingerprint, pickled: bytes) -> None:
    """Write a prepared-metadata file (format version 1) atomically from the fingerprint and
    ``pickled``, a pickle of the ``Metadata`` (protocol 2, as :func:`save_prepared_metadata`
    writes it; e.g. the bytes of a published ``.metadata``, which are one)."""
    data = b"".join((MAGIC, f"{FORMAT_VERSION}\n".encode(), fingerprint.to_json().encode(), b"\n", pickled))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
