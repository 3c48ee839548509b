"""Export: a checkpoint's values as full, unsharded files for evaluation and serving.

Who calls what (one process, no torch.distributed; ``solosave export`` or :func:`export`):
:func:`export` reads ``.metadata`` once (allowlisted) -> :func:`_plan_entries` picks the keys to
write and what is left out (and why) -> :func:`_group` packs them into shards of at most
``max_shard_size`` bytes, as Hugging Face does -> for each shard, :func:`_read_shard` allocates
the full tensors from their metadata shapes and fills them with DCP's own load (``dcp.load``,
``no_dist=True``), through :class:`~solosave._src.load.load.SafeFileSystemReader` and a
:class:`~solosave._src.load.load.SafeLoadPlanner` (byte ranges checked, files confined to the checkpoint
directory, non-tensor records unpickled with ``weights_only=True``); DCP assembles every tensor
from the chunks that every rank saved -> the shard is written (through a temporary name and a
rename) and dropped before the next one is read -> the index file, last.

So the peak memory of an export is about one shard plus one saved chunk, whatever the size of
the checkpoint. DCP's ``format_utils.dcp_to_torch_save`` holds the whole checkpoint at once and
unpickles its records without ``weights_only``, and its ``HuggingFaceStorageWriter`` writes its
index per save, so neither fits a streamed export; solosave uses DCP's loading to assemble the
tensors and the ``safetensors`` library to write them.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from solosave._src.core.errors import CheckpointExistsError, CorruptCheckpointError
from solosave._src.formats.dcp import dtype_name
from solosave._src.load.load import SafeFileSystemReader, SafeLoadPlanner, parse_metadata, read_metadata_bytes

FORMATS = ("safetensors", "torch")
#: Hugging Face's default shard limit ("5GB", decimal units as in ``transformers``).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}
_EXPORT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.(safetensors|pt)(\.index\.json)?$")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What :func:`export` wrote.

    ``skipped`` lists, as ``(key, reason)``, every selected value that is not in the files:
    non-tensor values in the safetensors format, dtypes that safetensors cannot store."""

    checkpoint: str
    out: str
    format: str
    #: The files written, in shard order (file names inside ``out``).
    files: tuple[str, ...]
    #: ``model.safetensors.index.json`` / ``model.pt.index.json`` when sharded, else ``None``.
    index: str | None
    tensors: int
    #: Non-tensor values written (torch format only).
    values: int
    #: Bytes of tensor data written (the index's ``metadata.total_size``).
    total_size: int
    skipped: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "out": self.out, "format": self.format,
                "files": list(self.files), "index": self.index, "tensors": self.tensors,
                "values": self.values, "total_size": self.total_size,
                "skipped": [{"key": k, "reason": r} for k, r in self.skipped]}


@dataclass(frozen=True, slots=True)
class _Entry:
    key: str  # DCP's flattened key in the checkpoint
    name: str  # the name in the exported files (``key`` without ``prefix``)
    meta: TensorStorageMetadata | None  # None: a non-tensor value
    nbytes: int


def parse_size(size: int | str) -> int:
    """Bytes from ``5000000``, ``"5GB"`` (10**9), ``"500MiB"`` (2**20 each), ``"1.5GB"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", str(size), re.IGNORECASE)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read the size {size!r}: give bytes or a number with a unit "
                             "(KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB of 1024), e.g. '5GB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"the shard size must be at least 1 byte, got {size!r}")
    return n


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:
        raise ImportError("exporting to safetensors needs the safetensors package: "
                          "pip install 'solosave[export]' (or export with format='torch' / --format torch)") from e
    return safetensors.torch


def _dtype_writable(st: Any, dtype: torch.dtype, cache: dict[torch.dtype, bool]) -> bool:
    """Whether safetensors can store ``dtype`` (asked once per dtype, with an empty tensor)."""
    if dtype not in cache:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # complex32, quantized dtypes: "experimental"
                st.save({"probe": torch.empty(0, dtype=dtype)})
            cache[dtype] = True
        except (KeyError, ValueError, TypeError, RuntimeError):
            cache[dtype] = False
    return cache[dtype]


def _selector(keys: Collection[str] | Callable[[str], bool] | None, md: Metadata) -> Callable[[str], bool]:
    if keys is None:
        return lambda key: True
    if callable(keys):
        return keys
    wanted = {keys} if isinstance(keys, str) else set(keys)
    missing = sorted(wanted - set(md.state_dict_metadata))
    if missing:
        raise KeyError(f"not in the checkpoint: {', '.join(missing[:10])}"
                       + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
                       + "; `solosave inspect CKPT` lists its keys")
    return wanted.__contains__


def _tensor_entry(key: str, name: str, m: TensorStorageMetadata) -> _Entry:
    numel = 1
    for d in m.size:
        numel *= int(d)
    covered = 0
    for chunk in m.chunks:
        n = 1
        for d in chunk.sizes:
            n *= int(d)
        covered += n
    if covered < numel:
        raise CorruptCheckpointError(
            f"{key}: its saved chunks hold {covered} of its {numel} elements, so the full tensor cannot "
            "be assembled; `solosave verify` checks the checkpoint", [f"{key}: {covered} of {numel} elements saved"])
    itemsize = torch.empty(0, dtype=m.properties.dtype).element_size()
    return _Entry(key, name, m, numel * itemsize)


def _plan_entries(md: Metadata, fmt: str, select: Callable[[str], bool],
                  prefix: str) -> tuple[list[_Entry], list[tuple[str, str]]]:
    """The values to write, in the metadata's order, and ``(key, reason)`` for those left out."""
    st = _safetensors() if fmt == "safetensors" else None
    byte_lengths: dict[str, int] = {}
    for index, info in md.storage_data.items():
        byte_lengths[index.fqn] = byte_lengths.get(index.fqn, 0) + int(info.length)
    writable: dict[torch.dtype, bool] = {}
    entries: list[_Entry] = []
    skipped: list[tuple[str, str]] = []
    for key, m in md.state_dict_metadata.items():
        if not key.startswith(prefix) or not select(key):
            continue
        name = key[len(prefix):]
        if isinstance(m, BytesStorageMetadata):
            if st is not None:
                skipped.append((key, "non-tensor value (safetensors stores tensors only; --format torch keeps it)"))
            else:
                entries.append(_Entry(key, name, None, byte_lengths.get(key, 0)))
        elif st is not None and not _dtype_writable(st, m.properties.dtype, writable):
            skipped.append((key, f"dtype {dtype_name(m.properties.dtype)} is not supported by safetensors "
                                 "(--format torch keeps it)"))
        else:
            entries.append(_tensor_entry(key, name, m))
    return entries, skipped


def _group(entries: Sequence[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Shards in order: a value joins the current shard unless that would take it past
    ``max_bytes``; a value larger than ``max_bytes`` is a shard of its own (as Hugging Face)."""
    shards: list[list[_Entry]] = []
    size = 0
    for e in entries:
        if not shards or (shards[-1] and size + e.nbytes > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _file_names(fmt: str, n: int) -> list[str]:
    suffix = _SUFFIX[fmt]
    if n == 1:
        return [f"model{suffix}"]
    return [f"model-{i:05d}-of-{n:05d}{suffix}" for i in range(1, n + 1)]


class _CountingPlanner(SafeLoadPlanner):
    """A :class:`SafeLoadPlanner` that reports every byte it puts in place (for progress)."""

    def __init__(self, safe_globals: Sequence[Any], advance: Callable[[int], None]) -> None:
        super().__init__(safe_globals, flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=True)
        self.advance = advance

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        self.advance(tensor.numel() * tensor.element_size())

    def load_bytes(self, read_item: Any, value: Any) -> None:
        n = value.getbuffer().nbytes
        super().load_bytes(read_item, value)
        self.advance(n)


def _read_shard(directory: str, md: Metadata, shard: Sequence[_Entry], safe_globals: Sequence[Any],
                advance: Callable[[int], None]) -> dict[str, Any]:
    """The full values of ``shard``, keyed by their export names: empty tensors of the saved
    shapes and dtypes, filled by DCP's load from every chunk that covers them."""
    state: dict[str, Any] = {}
    for e in shard:
        state[e.key] = None if e.meta is None else torch.empty(e.meta.size, dtype=e.meta.properties.dtype)
    reader = SafeFileSystemReader(directory)
    reader.metadata = md
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=reader, planner=_CountingPlanner(safe_globals, advance), no_dist=True)
    except CheckpointException as e:
        # DCP wraps the error in a BaseException: raise the underlying one (ours keep their type)
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, Exception):
                raise inner from e
        raise
    return {e.name: state[e.key] for e in shard}


def _write_file(fmt: str, values: dict[str, Any], out: str, name: str) -> None:
    """``values`` to ``out/name`` through a temporary name and a rename: a failed export never
    leaves a truncated file under an export name."""
    tmp = os.path.join(out, f".{name}.tmp")
    try:
        if fmt == "safetensors":
            _safetensors().save_file(values, tmp, metadata={"format": "pt"})
        else:
            torch.save(values, tmp)
        os.replace(tmp, os.path.join(out, name))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_index(fmt: str, out: str, total_size: int, weight_map: dict[str, str]) -> str:
    name = f"model{_SUFFIX[fmt]}.index.json"
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, os.path.join(out, name))
    return name


def _prepare_out(out: str, checkpoint: str, overwrite: bool) -> None:
    """Make ``out``, or check that it may be written: empty, or ``overwrite`` (which removes the
    files of an earlier export there, and nothing else)."""
    if os.path.realpath(out) == os.path.realpath(checkpoint):
        raise ValueError(f"{out}: the export must go to another directory than the checkpoint")
    if not os.path.exists(out):
        os.makedirs(out)
        return
    if not os.path.isdir(out):
        raise NotADirectoryError(f"{out}: exists and is not a directory; choose a new or empty directory")
    names = os.listdir(out)
    if names and not overwrite:
        raise CheckpointExistsError(
            f"{out}: not empty ({len(names)} entries); choose a new or empty directory, or pass "
            "overwrite=True (--overwrite) to replace an earlier export there")
    for name in names:
        if _EXPORT_FILE.match(name):
            os.unlink(os.path.join(out, name))


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, format: str = "safetensors",  # noqa: A002 - the CLI's name
           max_shard_size: int | str | None = None, keys: Collection[str] | Callable[[str], bool] | None = None,
           prefix: str = "", overwrite: bool = False, safe_globals: Sequence[Any] = (),
           progress: Callable[[int, int], None] | None = None) -> ExportReport:
    """Write the checkpoint's values as full, unsharded files in ``out``.

    One process, no collective: inside a distributed job, call it from one rank only.

    Names are DCP's flattened keys (``"model.layers.0.weight"``, ``"optim.state.0.exp_avg"``),
    as ``solosave inspect`` lists them; ``prefix`` (e.g. ``"model."``) exports only the keys that
    start with it, written without it, so that the names match the module's ``state_dict()``.
    ``keys``: exact keys (a missing one is a ``KeyError``) or a predicate, applied before
    ``prefix`` is stripped. Tensors keep their dtype (bfloat16, integers, float8 ...).

    * ``format="safetensors"``: ``model.safetensors``, or when the tensors exceed
      ``max_shard_size`` (default ``"5GB"``) ``model-00001-of-0000N.safetensors`` and
      ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), as Hugging Face
      shards. Non-tensor values, and tensors of dtypes safetensors cannot store, are not written:
      they are listed in the report's ``skipped``. Needs ``pip install 'solosave[export]'``.
    * ``format="torch"``: ``torch.save`` of a flat ``{name: value}`` dict, non-tensor values
      included (read with ``torch.load(weights_only=True)``; ``safe_globals`` admits your own
      types). By default one ``model.pt``, which holds the whole selection in memory at once;
      with ``max_shard_size`` it is sharded like safetensors (``model.pt.index.json``).

    Memory: the values are read shard by shard, straight from the data files, and each shard is
    written and freed before the next one is read; the peak is about one shard plus the largest
    saved chunk. ``progress(n, total)`` is called as each saved chunk is read (``n`` bytes of
    ``total``). ``out`` must be a new or empty directory unless ``overwrite`` (which replaces an
    earlier export there). A checkpoint without ``.metadata`` raises
    :class:`~solosave.PreparedMetadataError`, a non-empty ``out``
    :class:`~solosave.CheckpointExistsError`; a failed export removes the files it wrote.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "safetensors":
        _safetensors()
    if max_shard_size is None:
        max_shard_size = DEFAULT_MAX_SHARD_SIZE if format == "safetensors" else 2**63 - 1
    limit = parse_size(max_shard_size)
    directory, out = os.fspath(checkpoint), os.fspath(out)
    md = parse_metadata(read_metadata_bytes(directory), directory)
    entries, skipped = _plan_entries(md, format, _selector(keys, md), prefix)
    if not entries:
        raise ValueError(f"{directory}: nothing to export (no key selected"
                         + (f" starts with {prefix!r}" if prefix else "") + "); `solosave inspect CKPT` lists the keys")
    shards = _group(entries, limit)
    names = _file_names(format, len(shards))
    _prepare_out(out, directory, overwrite)
    total = sum(e.nbytes for e in entries)
    advance = (lambda n: progress(n, total)) if progress is not None else (lambda n: None)
    written: list[str] = []
    try:
        for shard, name in zip(shards, names):
            _write_file(format, _read_shard(directory, md, shard, safe_globals, advance), out, name)
            written.append(name)
        index = None
        if len(shards) > 1:
            weight_map = {e.name: name for shard, name in zip(shards, names) for e in shard}
            index = _write_index(format, out, sum(e.nbytes for e in entries if e.meta is not None), weight_map)
    except BaseException:
        for name in written:
            os.unlink(os.path.join(out, name))
        raise
    tensors = sum(1 for e in entries if e.meta is not None)
    return ExportReport(directory, out, format, tuple(names), index, tensors, len(entries) - tensors,
                        sum(e.nbytes for e in entries if e.meta is not None), tuple(skipped))
