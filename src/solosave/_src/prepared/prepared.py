"""Prepared metadata: the layout of a constant structure, reused by every save.

File format version 4 (:mod:`solosave._src.prepared.sections`, written atomically; version-2 and -3 files
are still read as they are): a small header, offset tables, and sections, so that a rank reads only its
own part (a few KiB, whatever the world size) and the coordinator also the ``.metadata``
template it publishes.
:func:`load_prepared_metadata` also accepts version-1 files (one pickle of the whole
``Metadata``), a plain pickled DCP ``Metadata`` (what other tools' create modes write), a
checkpoint's ``.metadata`` file, or a checkpoint directory: those are converted in memory (a
read of the whole file; ``solosave prepare`` converts them to version 4 once). Every pickle is
loaded through the allowlist of :mod:`solosave._src.formats.safe_pickle`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from solosave._src.coordination.protocol import ItemKind, ItemSpec, PlacedItem, ReusePlan
from solosave._src.core.errors import FingerprintMismatchError, PreparedMetadataError
from solosave._src.core.gc_pause import gc_paused
from solosave._src.formats.dcp import (
    CHECKSUM_SUFFIX,
    INDEX_FILE,
    METADATA_FILE,
    ItemKey,
    data_file_problem,
    dtype_name,
    index_key,
    local_file_problem,
    parse_file_name,
)
from solosave._src.formats.metadata_check import loads_metadata, metadata_problem
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.formats.safe_pickle import safe_loads
from solosave._src.plan.layout import check_results_cover
from solosave._src.plan.local_plan import LocalPlan
from solosave._src.prepared.buckets import key_bucket
from solosave._src.prepared.convert import sections_from_metadata
from solosave._src.prepared.sections import READ_VERSIONS, RankLayout, SectionReader, is_sectioned
from solosave._src.storage.registry import storage_for
from solosave._src.storage.sources import BytesSource, Source, StorageSource

MAGIC = b"SOLOSAVE-PREPARED\n"
FORMAT_VERSION = 4


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a prepared metadata is valid for. ``None`` fields are unknown (plain DCP files)."""

    world_size: int | None
    workers: int | None
    structure_hash: str
    torch_version: str | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(self.fields(), sort_keys=True)

    def fields(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "workers": self.workers,
                "structure_hash": self.structure_hash, "torch_version": self.torch_version,
                "format_version": self.format_version}


def metadata_structure_hash(md: Metadata) -> str:
    """Hash of keys, shapes, dtypes, chunking and which file/offset/length holds each item (the
    structure hash of version-1 files; version 2 hashes its sections)."""
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


def _restore(reader: SectionReader, source: str) -> PreparedMetadata:
    return PreparedMetadata(reader, source)


class PreparedMetadata:
    """A prepared metadata (format version 4, or 3 or 2), read by sections on demand.

    A rank's reuse plan reads its own section (:meth:`rank_files`), the coordinator the template
    it publishes (:attr:`template`); :attr:`metadata` rebuilds the whole DCP ``Metadata`` (tools,
    tests).

    Pickled (to the worker, in the create save's broadcast) as a reference to its file, or as
    its bytes when it lives in memory; the sections read so far are not sent.
    """

    def __init__(self, reader: SectionReader, source: str | None = None) -> None:
        self._reader = reader
        #: Where it came from (a path, ``"created"`` or ``"object"``), for messages.
        self.source = source or reader.source.where
        fp = reader.header["fingerprint"]
        self.fingerprint = Fingerprint(fp.get("world_size"), fp.get("workers"), fp["structure_hash"],
                                       fp.get("torch_version"), fp.get("format_version", FORMAT_VERSION))
        self._layouts: dict[int, RankLayout] = {}
        self._buckets: dict[int, frozenset[ItemKey]] = {}
        self._structure: dict[str, tuple] | None = None
        self._template: MetadataTemplate | None = None
        self._template_error: str | None = None
        self._template_lock = threading.Lock()  # the coordinator's publishing thread and its engine
        self._index_body: bytes | None = None
        #: Set when a version-1 file's recorded structure hash does not match its contents.
        self.tampered = False

    def __reduce__(self) -> tuple:
        return (_restore, (self._reader, self.source))

    @classmethod
    def from_metadata(cls, metadata: Metadata, world_size: int | None = None,
                      workers: int | None = None, source: str = "object") -> PreparedMetadata:
        """Convert a DCP ``metadata`` into a prepared metadata.

        World size / workers are inferred from the file names when not given: a lower bound,
        since a rank may have written nothing. Reads every entry."""
        fields = {"world_size": world_size, "workers": workers,
                  "torch_version": torch.__version__ if world_size is not None else None}
        return cls(SectionReader(BytesSource(sections_from_metadata(metadata, fields, source), source)), source)

    @property
    def bytes_read(self) -> int:
        """Bytes this object read from its file (or buffer) so far."""
        return self._reader.source.bytes_read

    def to_bytes(self) -> bytes:
        """The whole file (rebuilt from :attr:`metadata` if it was not read whole)."""
        src = self._reader.source
        if isinstance(src, BytesSource):
            return src.data
        fields = {k: v for k, v in self.fingerprint.fields().items() if k != "structure_hash"}
        return sections_from_metadata(self.metadata, fields, self.source)

    # -- per-rank index --------------------------------------------------------------------
    def layout(self, rank: int) -> RankLayout:
        got = self._layouts.get(rank)
        if got is None:
            got = self._layouts[rank] = self._reader.rank_layout(rank)
        return got

    def rank_files(self, rank: int) -> tuple[tuple[str, tuple[PlacedItem, ...]], ...]:
        """The files the metadata places on ``rank``, each with its items in offset order."""
        return self.layout(rank).files

    @property
    def structure(self) -> dict[str, tuple]:
        """``{fqn: (kind, dtype name, global size)}`` of every item."""
        if self._structure is None:
            self._structure = self._reader.structure()
        return self._structure

    def placed(self, key: ItemKey) -> bool:
        """Whether some rank's files hold ``key`` (one directory bucket read, cached)."""
        b = key_bucket(key, self._reader.buckets)
        keys = self._buckets.get(b)
        if keys is None:
            keys = self._buckets[b] = self._reader.bucket(b)
        return key in keys

    def spec_matches(self, spec: ItemSpec, own: set[ItemKey] | frozenset = frozenset()) -> str | None:
        """Check ``spec`` against the metadata: ``None`` if it is consistent, else why not.

        ``own``: keys known to be placed, this rank's layout."""
        m = self.structure.get(spec.fqn)
        if m is None:
            return f"{spec.fqn}: not in the prepared metadata (a new item)"
        kind, dtype, size = m
        if spec.kind is ItemKind.BYTES:
            return None if kind == 1 else f"{spec.fqn}: now a non-tensor, prepared as a tensor"
        if kind != 0:
            return f"{spec.fqn}: now a tensor, prepared as a non-tensor"
        if tuple(size) != spec.global_size or dtype != spec.dtype:
            return f"{spec.fqn}: now {spec.dtype}{list(spec.global_size or ())}, prepared as {dtype}{list(size)}"
        if spec.key in own:
            return None
        if not self.placed(spec.key):
            return f"{spec.fqn}: chunk at {list(spec.offsets or ())} is not in the prepared metadata (resharded?)"
        if spec.exclusive:  # only this rank stages it, so a fallback could not find it elsewhere
            return (f"{spec.fqn}: chunk at {list(spec.offsets or ())} is this rank's now, prepared on "
                    "another rank (resharded?)")
        return None

    # -- publishing (coordinator) -----------------------------------------------------------
    @property
    def template(self) -> MetadataTemplate:
        """The ``.metadata`` pickle with placeholders, for publishing (coordinator).

        See :meth:`checked_template`."""
        return self.checked_template()

    def checked_template(self) -> MetadataTemplate:
        """The ``.metadata`` pickle with placeholders, for publishing (coordinator).

        Publish only what reads back: a template read from the file is rendered and parsed once,
        before its first use, and checked against what loaders expect and what this file
        describes (:meth:`_read_back`); after that it is trusted. One that fails raises
        :class:`PreparedMetadataError` now and on every later use (the engine then takes the
        fallback path, which publishes a ``.metadata`` built from the write results and
        refreshes the prepared file). A template this process built itself
        (:meth:`adopt_template`) needs no check."""
        with self._template_lock:
            if self._template is None:
                if self._template_error is not None:
                    raise PreparedMetadataError(self._template_error)
                tpl = self._template_from_file()
                try:
                    self._read_back(tpl)
                except PreparedMetadataError as e:
                    self._template_error = str(e)
                    raise
                self._template = tpl
            return self._template

    def _template_from_file(self) -> MetadataTemplate:
        parts = self._reader.template_parts()
        if parts is None:
            raise PreparedMetadataError(f"{self.source}: has no metadata template; recreate it")
        return MetadataTemplate.from_parts(parts)

    def _read_back(self, template: MetadataTemplate) -> None:
        """Render ``template`` as a publication would, parse it as a loader would (allowlist,
        shape: :func:`~solosave._src.formats.metadata_check.loads_metadata`), and check that it
        is the ``.metadata`` this file describes: its ``storage_meta`` is what was rendered into
        it (the placeholders are where the header says), its items are those of the structure
        section, every chunk has exactly one storage entry, and every file it names is a data
        file of a rank of this file. Raises :class:`PreparedMetadataError` naming the problem."""
        what = f"{self.source}: its .metadata template does not read back as a checkpoint's .metadata"
        probe = ("solosave-read-back", uuid.uuid4().hex)
        try:
            with gc_paused():
                md = safe_loads(template.render(*probe), what="it")
        except PreparedMetadataError as e:  # UnsafeMetadataError too: its first sentence says it all
            why = f"{type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ is not None else str(e).split(". ")[0]
            raise PreparedMetadataError(f"{what} ({why}); {_RECREATE}") from None
        problem = metadata_problem(md)
        if problem:
            raise PreparedMetadataError(f"{what} ({problem}); {_RECREATE}")
        sm = md.storage_meta
        if sm is None or (sm.checkpoint_id, sm.save_id) != probe:
            raise PreparedMetadataError(f"{what} (its storage_meta is not where the header places it); {_RECREATE}")
        problem = _structure_problem(md, self.structure)
        if problem is None:
            results = [(index_key(k), v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()]
            problem = "; ".join(check_results_cover(md.state_dict_metadata, results)[:3]) or None
        if problem is None:
            world = int(self._reader.header["world"])
            for rel in sorted({v.relative_path for v in md.storage_data.values()}):
                problem = data_file_problem(rel)
                if problem is None and parse_file_name(rel)[0] >= world:  # type: ignore[index]
                    problem = f"{rel!r} is a data file of a rank beyond the file's {world}"
                if problem:
                    break
        if problem:
            raise PreparedMetadataError(f"{what} ({problem}); {_RECREATE}")

    @property
    def index_body(self) -> bytes | None:
        """The body of the load index written beside every ``.metadata`` (coordinator).

        ``None``: this prepared file predates the index, and saves write none."""
        if self._index_body is None:
            self._index_body = self._reader.index_body() or b""
        return self._index_body or None

    def adopt_template(self, save_id: str, template: MetadataTemplate, index_body: bytes | None = None) -> bool:
        """Use the coordinator's own ``template`` and ``index_body`` instead of reading them.

        ``template`` and ``index_body`` were built by the coordinator when it published with
        ``save_id``; they are used instead of reading their sections if this prepared metadata
        was made by that publication (its ``save_id``, a fresh uuid per publication); returns
        whether it did."""
        sm = self._reader.header.get("storage_meta")
        if self._template is not None or not sm or not save_id or sm[1] != save_id:
            return False
        self._template = template
        if index_body is not None:
            self._index_body = index_body
        return True

    @property
    def metadata(self) -> Metadata:
        """The whole DCP ``Metadata``, rebuilt from the template.

        Reads and unpickles the template: O(world size); checked as every loader's ``.metadata``
        is (:func:`~solosave._src.formats.metadata_check.loads_metadata`)."""
        sm = self._reader.header.get("storage_meta")
        template = self._template if self._template is not None else self._template_from_file()
        data = template.render(*(sm or ("", "")))
        with gc_paused():
            md = loads_metadata(data, f"{self.source} (its .metadata template)")
        return md if sm else dataclasses.replace(md, storage_meta=None)

    # -- reuse planning (every rank, locally) -----------------------------------------------
    def plan_reuse(self, plan: LocalPlan, rank: int) -> tuple[ReusePlan, list[ItemSpec]]:
        """This rank's local plan of a reuse save.

        The plan is the layout the prepared metadata gives it, the reasons it cannot write that
        layout (a drift found before writing), and the items to stage: the layout's items, or
        every item it owns when it drifted (the save then falls back to the collective path,
        which may assign it any of them).

        A DTensor chunk is staged by its owner only, so its owner must be its writer: a chunk this
        rank owns that the layout puts elsewhere, or one in this rank's layout that another replica
        owns, is a drift (the placements changed). Otherwise a rank whose own items still match
        would stage only those, and the fallback that another rank's drift starts would find the
        moved chunk staged by no rank."""
        mine = self.layout(rank)
        drift: list[str] = []
        own: set[ItemKey] = set()
        for _, items in mine.files:
            for p in items:
                own.add(p.key)
                s = plan.by_key.get(p.key)
                if s is None:
                    drift.append(f"{p.key[0]}: prepared on this rank but not in its state dict")
                elif s.offsets is not None and mine.sizes.get(p.key) != s.sizes:
                    drift.append(f"{s.fqn}: chunk size {list(s.sizes or ())} differs from the prepared one")
                elif not s.owner:  # its owner stages it: a fallback must not also find it here
                    drift.append(f"{s.fqn}: chunk at {list(s.offsets or ())} is prepared on this rank, "
                                 "another replica owns it now")
        for s in plan.specs:
            msg = self.spec_matches(s, own)
            if msg:
                drift.append(msg)
        if drift:
            return ReusePlan(mine.files, tuple(drift)), plan.owned
        return ReusePlan(mine.files), [plan.by_key[p.key] for _, items in mine.files for p in items]

    # -- validation ------------------------------------------------------------------------
    def check_compatible(self, world_size: int, workers: int) -> None:
        """Raise :class:`FingerprintMismatchError` naming the field that differs and the fix."""
        fp, h = self.fingerprint, self._reader.header
        fix = ("Delete the file (or point prepared_metadata elsewhere) and run with "
               "create_prepared_metadata=True, or run `solosave prepare` from a checkpoint of this run.")
        if fp.format_version not in READ_VERSIONS:
            raise FingerprintMismatchError(
                f"{self.source}: prepared-metadata format version {fp.format_version}, this "
                f"solosave reads {', '.join(map(str, READ_VERSIONS))}. {fix}")
        if fp.world_size is not None and fp.world_size != world_size:
            raise FingerprintMismatchError(
                f"{self.source}: world_size differs: prepared for {fp.world_size} ranks, this run "
                f"has {world_size}. {fix}")
        if int(h["ranks_with_files"]) and int(h["world"]) > world_size:
            raise FingerprintMismatchError(
                f"{self.source}: world_size differs: the metadata has files of {h['world']} "
                f"ranks, this run has {world_size}. {fix}")
        if fp.workers is not None and fp.workers != workers:
            raise FingerprintMismatchError(
                f"{self.source}: workers differs: prepared with workers={fp.workers}, this "
                f"checkpointer has workers={workers}. Use workers={fp.workers} or: {fix}")
        if int(h["max_files"]) > workers:
            raise FingerprintMismatchError(
                f"{self.source}: workers differs: the metadata has {h['max_files']} files per "
                f"rank, this checkpointer has workers={workers}. {fix}")
        if self.tampered:
            raise FingerprintMismatchError(
                f"{self.source}: structure hash differs from the one recorded in the file (the "
                f"file was modified). {fix}")


_RECREATE = "delete the file and recreate it (create_prepared_metadata=True or `solosave prepare`)"


def _structure_problem(md: Metadata, structure: Mapping[str, tuple]) -> str | None:
    """Whether ``md`` holds exactly the items of ``structure`` (kind, dtype, global size)."""
    sdm = md.state_dict_metadata
    if sdm.keys() != structure.keys():
        diff = sorted(set(sdm) ^ set(structure))
        return f"{len(diff)} key(s) differ from the structure section, e.g. {diff[0]!r}"
    for fqn, (kind, dtype, size) in structure.items():
        m = sdm[fqn]
        if kind == 1:
            ok = isinstance(m, BytesStorageMetadata)
        else:
            ok = (isinstance(m, TensorStorageMetadata) and dtype_name(m.properties.dtype) == dtype
                  and tuple(m.size) == tuple(size))
        if not ok:
            want = "bytes" if kind == 1 else f"{dtype}{list(size)} tensor"
            return f"{fqn!r} is not the {want} of the structure section"
    return None


def _converted(md: Any, fp: Fingerprint | None, where: str) -> PreparedMetadata:
    """A version-1 file's or plain ``Metadata``'s contents as a version-4 prepared metadata."""
    if not isinstance(md, Metadata):
        raise PreparedMetadataError(f"{where}: holds a {type(md).__name__}, not a DCP Metadata")
    infer_world_workers(md)  # validates the data file names
    fields = {"world_size": fp.world_size if fp else None, "workers": fp.workers if fp else None,
              "torch_version": fp.torch_version if fp else None}
    out = PreparedMetadata(SectionReader(BytesSource(sections_from_metadata(md, fields, where), where)), where)
    out.tampered = fp is not None and metadata_structure_hash(md) != fp.structure_hash
    return out


def open_sectioned(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                   source: Source | None = None) -> PreparedMetadata | None:
    """The sectioned (version 4, 3 or 2) prepared file at ``path`` (header read only), or ``None`` if ``path`` is
    not one (a directory, another format, missing: the caller reads it whole and explains)."""
    if source is None:
        source = StorageSource(path, storage_options)
        try:
            head = source.read(0, len(MAGIC) + 2)
        except (OSError, PreparedMetadataError):
            return None
        if not is_sectioned(head):
            return None
    return PreparedMetadata(SectionReader(source), source.where)


def load_prepared_metadata(path: str | os.PathLike, *,
                           storage_options: Mapping[str, Any] | None = None) -> PreparedMetadata:
    """Load a prepared metadata from ``path`` and return it as a :class:`PreparedMetadata`.

    ``path`` is a prepared-metadata file, a plain pickled DCP ``Metadata``, a ``.metadata`` file
    or a checkpoint directory; a local path or a URL (``storage_options``: keyword arguments of
    its fsspec filesystem). Raises :class:`PreparedMetadataError` (or a subclass) with the reason.
    A sectioned file is opened by its header only; the rest is read by sections on demand."""
    sectioned = open_sectioned(path, storage_options)
    if sectioned is not None:
        return sectioned
    p, data = _read_whole(path, storage_options)
    if data.startswith(MAGIC):
        return _parse_prepared(p, data)
    if not data:
        raise PreparedMetadataError(f"{p}: file is empty")
    with gc_paused():
        md = loads_metadata(data, p)
    return _converted(md, None, p)


def _read_whole(path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> tuple[str, bytes]:
    """``(where, bytes)`` of a prepared file, ``.metadata`` or checkpoint directory at ``path``."""
    st = storage_for(path, storage_options)
    where = st.normalize(path)
    try:
        why = local_file_problem(os.path.dirname(where) or ".", where)  # local files only
        if why == "not a regular file" and not st.isdir(where):  # a FIFO would block the read forever
            raise PreparedMetadataError(f"{where}: {why}")
        return where, st.read(where)
    except (FileNotFoundError, IsADirectoryError):
        pass
    except OSError as e:
        raise PreparedMetadataError(f"{where}: cannot read ({e})") from e
    if not st.isdir(where):
        raise PreparedMetadataError(f"{where}: no such file")
    inner = st.join(where, METADATA_FILE)
    why = local_file_problem(where, inner)  # local files only: a URL is never found there
    if why is not None:
        raise PreparedMetadataError(f"{inner}: {why}; refusing to read it")
    try:
        return inner, st.read(inner)
    except FileNotFoundError:
        raise PreparedMetadataError(
            f"{where}: directory has no {METADATA_FILE} (not a published checkpoint; a save that failed "
            "or is still running leaves none)") from None
    except IsADirectoryError:
        raise PreparedMetadataError(f"{inner}: is a directory without {METADATA_FILE}") from None
    except OSError as e:
        raise PreparedMetadataError(f"{inner}: cannot read ({e})") from e


def _parse_prepared(p: str, data: bytes) -> PreparedMetadata:
    rest = data[len(MAGIC):]
    try:
        version_line, json_line, payload = rest.split(b"\n", 2)
        version = int(version_line)
        fpd: dict[str, Any] = json.loads(json_line)
    except ValueError as e:
        raise PreparedMetadataError(f"{p}: prepared-metadata header is truncated or corrupt ({e}); "
                                    "delete the file and recreate it") from e
    if version != 1:  # versions 2 to 4 are opened by sections (open_sectioned)
        raise FingerprintMismatchError(
            f"{p}: prepared-metadata format version {version}; this solosave reads 1, "
            f"{', '.join(map(str, READ_VERSIONS))}. Recreate it with create_prepared_metadata=True")
    with gc_paused():
        md = loads_metadata(payload, str(p))
    try:
        fp = Fingerprint(fpd["world_size"], fpd["workers"], fpd["structure_hash"], fpd.get("torch_version"))
    except KeyError as e:
        raise PreparedMetadataError(f"{p}: fingerprint lacks field {e}; recreate the file") from e
    return _converted(md, fp, str(p))


def prepared_target_problem(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """``None`` if a prepared file may be written at ``path``; else why not: ``path`` is a file
    of a checkpoint (its ``.metadata``, which neither loader could read afterwards, its load
    index, a data file or a checksum file) or a directory (a checkpoint given as prepared
    metadata). Every writer of prepared files asks: the engine when it refreshes the prepared
    metadata, :func:`save_prepared_metadata` and ``solosave prepare``."""
    path = os.fspath(path)
    name = storage_for(path, storage_options).basename(path)
    if name == METADATA_FILE:
        return f"{path} is a checkpoint's {METADATA_FILE}: no loader could read that checkpoint afterwards"
    if name == INDEX_FILE or name.endswith(CHECKSUM_SUFFIX) or parse_file_name(name) is not None:
        return f"{path} is a file of a checkpoint"
    if storage_for(path, storage_options).isdir(path):
        return f"{path} is a directory (a checkpoint is never written into)"
    return None


def check_prepared_target(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> None:
    """:class:`PreparedMetadataError` if :func:`prepared_target_problem` finds one."""
    why = prepared_target_problem(path, storage_options)
    if why is not None:
        raise PreparedMetadataError(f"refusing to write a prepared-metadata file there: {why}. Write it elsewhere "
                                    "(e.g. prepared.metadata beside the checkpoints)")


def save_prepared_metadata(prepared: PreparedMetadata | Metadata, path: str | os.PathLike, *,
                           storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``prepared`` to ``path`` (format version 4) atomically.

    Atomically: temp file, fsync, rename, directory fsync; on an object store one single-object
    write. Refuses a ``path`` that is a checkpoint's file or a directory
    (:func:`prepared_target_problem`)."""
    check_prepared_target(path, storage_options)  # before the conversion, which may take long
    if isinstance(prepared, Metadata):
        prepared = PreparedMetadata.from_metadata(prepared)
    write_prepared_bytes(path, prepared.to_bytes(), storage_options=storage_options)


def write_prepared_bytes(path: str | os.PathLike, data: bytes,
                         storage_options: Mapping[str, Any] | None = None) -> None:
    """Write the bytes of a prepared file atomically (the storage's commit), creating its
    directory if needed; never over a checkpoint's file or a directory
    (:func:`prepared_target_problem`: :class:`PreparedMetadataError`)."""
    check_prepared_target(path, storage_options)
    st = storage_for(path, storage_options)
    where = st.normalize(path)
    st.makedirs(st.dirname(where) or ".")
    st.commit(where, data)
