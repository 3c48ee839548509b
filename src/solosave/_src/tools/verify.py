"""Checking a published checkpoint against its ``.metadata`` (``solosave verify``, and
:func:`solosave.load` before it reads any value).

One process, no collective. What is checked, in order:

1. ``.metadata`` is readable (allowlisted unpickling) and every tensor chunk / bytes item it
   declares has exactly one storage entry;
2. every byte range ``(file, offset, length)`` it names lies inside an existing data file;
3. if the data files have checksum sidecars (``AsyncCheckpointer(checksums=True)``, read by
   ``formats/checksum_sidecar.py``): the CRC32 of every range equals the recorded one;
4. optionally, a prepared-metadata file places every item exactly where this checkpoint has it;
5. a load index (``.solosave-index``) holds exactly the entries of
   ``.metadata``: one that belongs to another ``.metadata`` is reported as stale (loads ignore
   it), one that belongs to this one but differs or is damaged is a problem.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from solosave._src.core.checksum import crc32
from solosave._src.core.errors import IndexStale, IndexUnusable, PreparedMetadataError
from solosave._src.formats.checksum_sidecar import parse_sidecar, sidecar_limit
from solosave._src.formats.dcp import (
    CHECKSUM_SUFFIX,
    INDEX_FILE,
    METADATA_FILE,
    check_ranges,
    checksum_path,
    confined_path,
    index_key,
    local_file_problem,
    ranges_by_file,
)
from solosave._src.index.reader import LoadIndex
from solosave._src.load.load import parse_metadata, read_metadata_bytes
from solosave._src.plan.layout import check_results_cover
from solosave._src.prepared.prepared import infer_world_workers, load_prepared_metadata
from solosave._src.storage.base import Storage
from solosave._src.storage.registry import backend_for, storage_for

_READ_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The findings of :func:`verify_checkpoint`; ``ok`` when ``problems`` is empty."""

    path: str
    items: int
    records: int
    files: dict[str, int]
    #: "verified" (every record has a matching CRC32), "absent" (no checksum files), "partial"
    #: (some data files have none; every record checked matches), "failed" (a record's CRC32
    #: differs, or a record could not be checked: unreadable checksum file, none recorded for
    #: it, data file truncated or not safe to read).
    checksums: str
    #: Records whose CRC32 was computed and matches the recorded one.
    checksummed_records: int
    #: None (not asked), "matches" or "differs".
    prepared: str | None
    problems: tuple[str, ...] = field(default_factory=tuple)
    #: The load index: None (none), "matches", "stale", "differs" or "damaged".
    index: str | None = None
    #: Records whose CRC32 differs from the recorded one.
    checksum_mismatches: int = 0
    #: Records of data files with a checksum file that could not be checked (see ``checksums``).
    checksum_unchecked: int = 0
    #: Records of data files without a checksum file.
    checksum_unrecorded: int = 0

    def checksum_summary(self) -> str:
        """One line that says what the checksum pass found.

        For example ``failed (7 of 9 records match, 2 could not be checked)``."""
        if self.checksums == "absent":
            return "absent"
        total = (self.checksummed_records + self.checksum_mismatches + self.checksum_unchecked
                 + self.checksum_unrecorded)
        parts = [f"{self.checksummed_records} of {total} records match"]
        parts += [f"{n} {what}" for n, what in ((self.checksum_mismatches, "differ"),
                                                (self.checksum_unchecked, "could not be checked"),
                                                (self.checksum_unrecorded, "have no checksum file"))
                  if n]
        return f"{self.checksums} ({', '.join(parts)})"

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "items": self.items, "records": self.records,
                "files": self.files, "checksums": self.checksums,
                "checksummed_records": self.checksummed_records, "checksum_mismatches": self.checksum_mismatches,
                "checksum_unchecked": self.checksum_unchecked, "checksum_unrecorded": self.checksum_unrecorded,
                "prepared": self.prepared,
                "index": self.index, "problems": list(self.problems)}


def check_files_tiled(directory: str, per_file: dict[str, list[tuple[int, int, str]]],
                      storage: Storage) -> list[str]:
    """The records of each data file follow each other from offset 0 to its end, as every
    FileSystemWriter-style saver writes them: a ``.metadata`` of another layout (a prepared
    file copied over a checkpoint's own) shows up as a gap, an overlap or a wrong end."""
    problems = []
    for rel in sorted(per_file, key=str):
        path = confined_path(directory, rel)
        if path is None or not storage.exists(path):
            continue  # reported by check_ranges
        pos = 0
        for off, n, name in sorted(per_file[rel]):
            if off != pos:
                problems.append(f"{rel}: {name} starts at {off}, but the records before it end at "
                                f"{pos}: .metadata does not describe this file")
                break
            pos = off + n
        else:
            size = storage.size(path)
            if pos != size:
                problems.append(f"{rel}: its records end at {pos} but the file has {size} bytes: "
                                ".metadata does not describe this file")
    return problems


def _read_metadata(directory: str, storage_options: Mapping[str, Any] | None) -> Metadata:
    try:
        return parse_metadata(read_metadata_bytes(directory, storage_options), directory)  # allowlisted, clear errors
    except FileNotFoundError:
        raise PreparedMetadataError(f"{directory}: no such checkpoint directory") from None


def _crc_of_range(f: Any, off: int, n: int, progress: Callable[[int, int], None] | None,
                  total: int) -> int | None:
    """CRC32 of ``n`` bytes at ``off`` of ``f``; ``None`` if the file ends first."""
    f.seek(off)
    crc, left = 0, n
    while left > 0:
        buf = f.read(min(_READ_CHUNK, left))
        if not buf:
            return None
        crc = crc32(buf, crc)
        left -= len(buf)
        if progress is not None:
            progress(len(buf), total)
    return crc


@dataclass
class _Tally:
    """What the checksum pass found, per record."""

    sidecars: int = 0
    matched: int = 0
    mismatched: int = 0
    unchecked: int = 0
    unrecorded: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if not self.sidecars:
            return "absent"
        if self.mismatched or self.unchecked:
            return "failed"
        return "partial" if self.unrecorded else "verified"


def _checksums(directory: str, per_file: dict[str, list[tuple[int, int, str]]],
               progress: Callable[[int, int], None] | None, storage: Storage) -> _Tally:
    """Step 3: the CRC32 of every record of every data file that has a checksum file."""
    tally = _Tally()
    files = []
    for rel in sorted(per_file, key=str):
        if confined_path(directory, rel) is not None and storage.exists(checksum_path(storage.join(directory, rel))):
            files.append(rel)
        else:
            tally.unrecorded += len(per_file[rel])
    tally.sidecars = len(files)
    if not files:
        return tally
    total = sum(n for rel in files for _, n, _ in per_file[rel])
    for rel in files:
        data_path = storage.join(directory, rel)
        sidecar = checksum_path(data_path)
        records = sorted(per_file[rel])
        try:
            why = local_file_problem(directory, sidecar)
            if why is not None:
                raise ValueError(why)
            # one bounded read: a byte more than a sidecar of these records can hold is refused
            recorded = parse_sidecar(storage.read_range(sidecar, 0, sidecar_limit(len(records)) + 1), len(records))
        except ValueError as e:
            tally.problems.append(f"{rel}{CHECKSUM_SUFFIX}: unreadable checksum file ({e})")
            tally.unchecked += len(records)
            continue
        if not storage.exists(data_path) or local_file_problem(directory, data_path) is not None:
            tally.unchecked += len(records)  # reported by check_ranges
            continue
        with storage.open_read(data_path) as f:
            for off, n, name in records:
                want = recorded.get((off, n))
                if want is None:
                    tally.problems.append(f"{rel}: no checksum recorded for {name} at {off}+{n}")
                    tally.unchecked += 1
                    continue
                crc = _crc_of_range(f, off, n, progress, total)
                if crc is None:
                    tally.unchecked += 1  # truncated: reported by check_ranges
                elif crc != want:
                    tally.mismatched += 1
                    tally.problems.append(f"{rel}: checksum mismatch for {name} at {off}+{n} "
                                          f"(crc32 {crc:08x}, recorded {want:08x})")
                else:
                    tally.matched += 1
    return tally


def compare_with_prepared(md: Metadata, prepared_path: str | os.PathLike,
                          storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Differences between a checkpoint's metadata and a prepared file's layout (empty: same)."""
    prepared = load_prepared_metadata(prepared_path, storage_options=storage_options)
    pm = prepared.metadata
    problems: list[str] = []
    ranks, files = infer_world_workers(md)
    fp = prepared.fingerprint
    if fp.world_size is not None and fp.world_size < ranks:
        problems.append(f"prepared: made for world_size={fp.world_size}, the checkpoint has files "
                        f"of {ranks} ranks")
    if fp.workers is not None and fp.workers < files:
        problems.append(f"prepared: made for workers={fp.workers}, the checkpoint has {files} files per rank")
    a, b = md.state_dict_metadata, pm.state_dict_metadata
    for fqn in sorted(a.keys() - b.keys()):
        problems.append(f"prepared: {fqn} is in the checkpoint but not in the prepared metadata")
    for fqn in sorted(b.keys() - a.keys()):
        problems.append(f"prepared: {fqn} is in the prepared metadata but not in the checkpoint")
    for fqn in sorted(a.keys() & b.keys()):
        if a[fqn] != b[fqn]:
            problems.append(f"prepared: {fqn} has another shape, dtype or chunking")
    sa = {index_key(k): (v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}
    sb = {index_key(k): (v.relative_path, v.offset, v.length) for k, v in pm.storage_data.items()}
    moved = sorted((k for k in sa.keys() & sb.keys() if sa[k] != sb[k]), key=lambda k: (k[0], k[1] or ()))
    for k in moved[:20]:
        problems.append(f"prepared: {k[0]} is at {sa[k]} in the checkpoint, {sb[k]} in the prepared file")
    if len(moved) > 20:
        problems.append(f"prepared: ... and {len(moved) - 20} more records placed differently")
    return problems


def check_index(directory: str, md: Metadata, storage: Storage | None = None) -> tuple[str | None, list[str]]:
    """Step 5: the load index's status and its problems (none where the storage keeps no index);
    ``storage``: the directory's, when it is not local files (the index is read by ranges)."""
    if not backend_for(directory).load_index:
        return None, []
    try:
        idx = LoadIndex.open(directory, storage)
        if idx is None:
            return None, []
        with idx:
            got = idx.metadata_for({k: None for k in md.state_dict_metadata})
    except IndexStale:
        return "stale", []
    except IndexUnusable as e:
        return "damaged", [f"load index: {e} (loads read {METADATA_FILE} instead)"]
    diffs = sorted(k for k in md.state_dict_metadata if got.state_dict_metadata.get(k) != md.state_dict_metadata[k])
    if got.storage_data != md.storage_data or (got.planner_data or {}) != (md.planner_data or {}):
        diffs = diffs or ["(storage entries or flattening paths)"]
    if not diffs:
        return "matches", []
    return "differs", [f"load index: {len(diffs)} key(s) differ from {METADATA_FILE}: {', '.join(diffs[:5])}; "
                       f"delete {INDEX_FILE} (loads then read {METADATA_FILE})"]


def verify_checkpoint(path: str | os.PathLike, *, prepared: str | os.PathLike | None = None,
                      checksums: bool = True,
                      progress: Callable[[int, int], None] | None = None,
                      storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check the checkpoint directory ``path`` and report what is wrong with it.

    ``path`` is a local path or a URL; ``storage_options``: keyword arguments of its fsspec
    filesystem; see the module docstring. Raises :class:`~solosave.PreparedMetadataError` if
    there is no readable ``.metadata``; every other finding is a line in the report's
    ``problems``. ``progress(n, total)`` is called with each block of bytes read while checking
    checksums and the total those reads add up to."""
    storage = storage_for(path, storage_options)
    directory = storage.normalize(path)
    md = _read_metadata(directory, storage_options)
    results = [(index_key(k), v.relative_path, int(v.offset), int(v.length)) for k, v in md.storage_data.items()]
    problems = check_results_cover(md.state_dict_metadata, results)
    problems += check_ranges(directory, md.storage_data, size_of=storage.size)
    problems += check_files_tiled(directory, ranges_by_file(md.storage_data), storage)
    per_file = ranges_by_file(md.storage_data)
    tally = _Tally(unrecorded=len(results))
    if checksums:
        tally = _checksums(directory, per_file, progress, storage)
        problems += tally.problems
    prepared_status = None
    if prepared is not None:
        diffs = compare_with_prepared(md, prepared, storage_options)
        prepared_status = "differs" if diffs else "matches"
        problems += diffs
    index_status, index_problems = check_index(directory, md, storage)
    problems += index_problems
    files = {rel: max(off + n for off, n, _ in rs) for rel, rs in sorted(per_file.items())}
    return VerifyReport(directory, len(md.state_dict_metadata), len(results), files, tally.status, tally.matched,
                        prepared_status, tuple(problems), index_status, tally.mismatched, tally.unchecked,
                        tally.unrecorded)


__all__ = ["VerifyReport", "check_files_tiled", "check_index", "compare_with_prepared",
           "verify_checkpoint"]
