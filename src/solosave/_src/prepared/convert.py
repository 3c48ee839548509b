"""Prepared files from rows, one item at a time: the conversion of a whole DCP ``Metadata``
(``solosave prepare``, a plain pickled ``Metadata`` or a version-1 file given as prepared
metadata) into the :class:`~solosave._src.prepared.sections.LayoutColumns` that
:func:`~solosave._src.prepared.sections.build_prepared` writes. (A create save builds its prepared file from
columns: :func:`prepared_from_columns`, below.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from solosave._src.core.errors import PreparedMetadataError
from solosave._src.core.gc_pause import gc_paused
from solosave._src.formats.dcp import ItemKey, index_key, parse_file_name
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.index.writer import body_from_metadata
from solosave._src.plan.columns import ChunkTable, ResultColumns, sorted_rows
from solosave._src.prepared.sections import (
    VERSION,
    LayoutColumns,
    Row,
    _file_order,
    _template_section,
    build_prepared,
    structure_of,
)


def columns_from_rows(names: Sequence[str], rank_rows: Sequence[Sequence[tuple[str, Sequence[Row]]]]) -> LayoutColumns:
    """The :class:`LayoutColumns` of rows (``rank_rows[r]``: rank ``r``'s files, each with its
    rows in offset order); raises ``KeyError`` for an fqn not in ``names``."""
    fid_of = {n: i for i, n in enumerate(names)}
    width = max((len(r[1]) for files in rank_rows for _, rows in files for r in rows if r[1] is not None), default=0)
    flat: list[list[int]] = []
    files_of: list[list[tuple[str, int]]] = []
    for files in rank_rows:
        files_of.append([(rel, len(rows)) for rel, rows in files])
        for _, rows in files:
            for fqn, offsets, off, length, sz in rows:
                o, z = tuple(offsets or ()), tuple(sz or ())
                flat.append([fid_of[fqn], -1 if offsets is None else len(o), int(off), int(length),
                             *o, *(0,) * (width - len(o)), *z, *(0,) * (width - len(z))])
    rows_t = torch.tensor(flat, dtype=torch.int64) if flat else torch.zeros((0, 4 + 2 * width), dtype=torch.int64)
    return LayoutColumns(rows_t, files_of)


def _chunk_sizes(state_dict_metadata: Mapping[str, Any]) -> dict[ItemKey, tuple[int, ...]]:
    sizes: dict[ItemKey, tuple[int, ...]] = {}
    for fqn, m in state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            for c in m.chunks:
                sizes[(fqn, tuple(c.offsets))] = tuple(c.sizes)  # torch.Size: a tuple of ints
    return sizes


def _rows_of(files: Mapping[str, list]) -> list[tuple[str, list]]:
    return [(rel, sorted(files[rel], key=lambda r: r[2])) for rel in sorted(files, key=_file_order)]


def sections_from_metadata(md: Metadata, fields: dict[str, Any], where: str = "metadata") -> bytes:
    """A prepared file converted from a whole ``Metadata`` (every entry is read)."""
    if not isinstance(md, Metadata):
        raise PreparedMetadataError(f"{where}: expected a torch.distributed.checkpoint Metadata, got "
                                    f"{type(md).__name__}")
    if not md.storage_data and md.state_dict_metadata:
        raise PreparedMetadataError(
            f"{where}: the metadata has no storage_data (it is not a complete, published "
            "checkpoint metadata); use the .metadata of a finished save")
    with gc_paused():
        sizes = _chunk_sizes(md.state_dict_metadata)
        by_rank: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for idx, info in md.storage_data.items():
            rel = info.relative_path
            parsed = parse_file_name(rel)
            if parsed is None:
                raise PreparedMetadataError(f"{where}: unexpected data file name {rel!r}; it was not "
                                            "written by a FileSystemWriter-style saver")
            key = index_key(idx)
            by_rank[parsed[0]][rel].append((key[0], key[1], int(info.offset), int(info.length),
                                            sizes.get(key) if key[1] is not None else None))
        world = max(fields.get("world_size") or 0, max(by_rank, default=-1) + 1)
        rank_rows = [_rows_of(by_rank[r]) if r in by_rank else [] for r in range(world)]
        sm = md.storage_meta
        structure = structure_of(md.state_dict_metadata)
        try:
            layout = columns_from_rows(list(structure), rank_rows)
        except KeyError as e:
            raise PreparedMetadataError(f"{where}: storage_data has an entry of {e}, which is not in "
                                        "state_dict_metadata (not a consistent DCP metadata)") from None
        return build_prepared({**fields, "format_version": VERSION}, structure, layout,
                              _template_section(MetadataTemplate(md)),
                              (str(sm.checkpoint_id), str(sm.save_id)) if sm is not None else None,
                              index_body=body_from_metadata(md))[0]


def prepared_from_columns(sdm: Mapping[str, object], table: ChunkTable, res: ResultColumns,
                          template: MetadataTemplate, storage_meta: tuple[str, str] | None,
                          fields: dict[str, Any], index_body: bytes | None = None) -> bytes:
    """The prepared file of a collective save from the columns: rows sorted by rank, file and
    offset with array operations and written as the column sections (version 3 on)
    (``prepared/sections.build_prepared``)."""
    file_pos = torch.tensor([p for p, _ in sorted(enumerate(res.files), key=lambda x: _file_order(x[1]))],
                            dtype=torch.int64).argsort()
    order = sorted_rows(res.rank, file_pos[res.file] if res.n else res.file, res.offset)
    uid, rank, file = res.uid[order], res.rank[order], res.file[order]
    fids = table.fids()[uid]
    nd = torch.tensor(table.nd, dtype=torch.int64)[fids] if res.n else fids
    rows = torch.cat([fids[:, None], nd[:, None], res.offset[order][:, None], res.length[order][:, None],
                      table.offs[uid], table.sizes[uid]], dim=1)
    files: list[list[tuple[str, int]]] = [[] for _ in range(res.world)]
    if res.n:
        cut = torch.nonzero((rank.diff() != 0) | (file.diff() != 0)).flatten().add(1).tolist()
        starts, ranks, file_ids = [0] + cut, rank.tolist(), file.tolist()
        for a, b in zip(starts, cut + [res.n]):
            files[ranks[a]].append((res.files[file_ids[a]], b - a))
    structure = structure_of(sdm)
    if table.names != list(structure):  # the rows' fqn ids are positions in the structure
        raise ValueError("internal: the chunk table's fqns are not in the order of state_dict_metadata")
    return build_prepared({**fields, "format_version": VERSION}, structure, LayoutColumns(rows, files),
                          _template_section(template), storage_meta, index_body)[0]


