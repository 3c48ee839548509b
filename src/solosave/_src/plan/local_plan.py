"""Step 1 of a save: local planning (calling thread, every rank, no collective).

``plan_local`` flattens a user state dict exactly as DCP's ``flatten_state_dict`` does (so that
stock ``torch.distributed.checkpoint.load`` finds every key), and describes every value this rank
holds as an :class:`ItemSpec`: the structure of the item, never its values.

* plain tensors: one chunk covering the whole tensor (offsets all zero); assumed replicated on
  every rank that holds the key, as DCP assumes (DDP); the background coordination decides who
  writes them.
* DTensors: the local shard's chunk; for replicated placements the owner among the replicas is
  chosen locally by :func:`dtensor_owner` so that non-owners need not stage the shard.
* ShardedTensors (``torch.distributed._shard``, which ``dcp.save`` saves): the local shard at its
  global offsets, as DCP's planner writes them (none on a rank without a shard).
* objects implementing DCP's ``_Checkpointable`` protocol (Megatron-core's
  ``CheckpointableShardedTensor`` and ``LocalShardsContainer``, or your own): one item per chunk
  their ``__create_write_items__`` lists, at its global offsets, holding what their
  ``__get_tensor_shard__`` returns for it; several chunks of one key on one rank are allowed
  (:func:`checkpointable_items`).
* :class:`WholeValue`: a value saved whole, as one record, even a list or a dict.
* anything else (``io.BytesIO`` included): a ``BYTES`` item, serialized with ``torch.save`` (what
  DCP's default planner writes and its loader expects).
"""

from __future__ import annotations

import hashlib
import io
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from solosave._src.coordination.protocol import ItemKind, ItemSpec
from solosave._src.formats.dcp import ItemKey, dtype_name

#: An object path inside a nested state dict: the key/index sequence DCP calls ``OBJ_PATH``.
ObjPath = tuple[str | int, ...]


@dataclass(slots=True)
class LocalPlan:
    """What this rank holds: specs in a deterministic order, values, and the flatten mapping.

    ``values`` maps a spec's fqn to the value to stage, except for the chunks of a checkpointable
    object, which are found under their key ``(fqn, offsets)`` (one fqn, several chunks); see
    :func:`value_key`."""

    specs: list[ItemSpec]
    values: dict[str | ItemKey, Any]
    planner_data: dict[str, ObjPath]
    by_key: dict[ItemKey, ItemSpec] = field(default_factory=dict)
    #: The DTensors by fqn (``values`` holds their local shards): in-place ops on a DTensor move
    #: its own version counter, not its shard's, so overlapped staging watches both.
    dtensors: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.by_key:
            self.by_key = {s.key: s for s in self.specs}

    @property
    def structure_hash(self) -> str:
        return structure_hash(self.specs)

    @property
    def owned(self) -> list[ItemSpec]:
        """The items this rank may write (all but DTensor replicas another replica writes)."""
        return [s for s in self.specs if s.owner]


def structure_hash(specs: list[ItemSpec]) -> str:
    """A hash of the structure only: keys, kinds, shapes, dtypes, chunking (never values)."""
    h = hashlib.sha256()
    for s in specs:
        h.update(repr((s.fqn, int(s.kind), s.offsets, s.sizes, s.global_size, s.dtype,
                       s.owner)).encode())
    return h.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Flattening (mirrors torch.distributed.checkpoint's flatten_state_dict, torch >= 2.4)
# ---------------------------------------------------------------------------------------------

def _is_terminal(value: Any) -> bool:
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def flatten_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, ObjPath]]:
    """Flatten nested dicts/lists into ``{"a.b.0": value}`` plus the key -> path mapping.

    Mappings are always traversed; lists are traversed when they contain tensors or
    non-terminal containers; tuples and everything else are leaves (DCP's rules).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a dict (a mapping of str to values), got {type(state_dict).__name__}"
        )
    flat: dict[str, Any] = {}
    mapping: dict[str, ObjPath] = {}

    def visit(path: ObjPath, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(path + (str(k),), v)
        elif _is_terminal(value):
            key = ".".join(map(str, path))
            if key in flat:
                raise ValueError(f"two entries of the state dict flatten to the same key {key!r}; "
                                 "rename one of them")
            flat[key] = value
            mapping[key] = path
        else:
            for i, v in enumerate(value):
                visit(path + (i,), v)

    for k, v in state_dict.items():
        visit((str(k),), v)
    return flat, mapping


# ---------------------------------------------------------------------------------------------
# Item specs
# ---------------------------------------------------------------------------------------------

def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(value, DTensor)


def local_shard(value: Any) -> torch.Tensor:
    """A DTensor's local shard: the tensor it holds (``_local_tensor``), not ``to_local()``,
    which runs an autograd ``Function`` to return a view of it, twice per leaf and per save
    (its cost: CHANGELOG, the DTensor entry). Staging
    copies the bytes without autograd, so the view adds nothing. A DTensor without that
    attribute takes ``to_local()``."""
    local = getattr(value, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else value.to_local()


def dtensor_owner(fqn: str, value: Any) -> bool:
    """Whether this rank writes its replica of DTensor ``value`` (a local, deterministic rule).

    Replicas of a shard are the mesh coordinates that differ only on ``Replicate`` dimensions.
    Among them the owner is the replica whose linear index equals ``crc32(fqn) % replicas``, so
    replicated state is spread over the replicas rather than all written by one.
    """
    from torch.distributed.tensor import Replicate

    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    rep_dims = [d for d, p in enumerate(value.placements) if isinstance(p, Replicate)]
    if not rep_dims:
        return True
    n = 1
    linear = 0
    for d in rep_dims:
        linear = linear * mesh.size(d) + coord[d]
        n *= mesh.size(d)
    return linear == zlib.crc32(fqn.encode()) % n


def _tensor_spec(fqn: str, local: torch.Tensor, offsets: tuple[int, ...],
                 global_size: tuple[int, ...], owner: bool, exclusive: bool = False) -> ItemSpec:
    sizes = tuple(int(s) for s in local.shape)
    return ItemSpec(fqn, ItemKind.TENSOR, offsets, sizes, global_size, dtype_name(local.dtype),
                    local.numel() * local.element_size(), owner, exclusive)


def _is_sharded_tensor(value: Any) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return False
    return isinstance(value, ShardedTensor)


def _sharded_tensor_spec(fqn: str, value: Any) -> tuple[ItemSpec | None, Any]:
    """A ShardedTensor's local shard as one chunk at its global offsets, what DCP's planner
    writes for it; ``(None, None)`` on a rank that holds no shard of it."""
    shards = value.local_shards()
    if len(shards) > 1:
        raise TypeError(f"state_dict[{fqn!r}]: ShardedTensor with {len(shards)} local shards on this "
                        "rank is not supported; save it with at most one shard per rank")
    if not shards:
        return None, None
    local = shards[0].tensor.detach()
    offsets = tuple(int(o) for o in shards[0].metadata.shard_offsets)
    return _tensor_spec(fqn, local, offsets, tuple(int(s) for s in value.metadata().size), True, True), local


def make_spec(fqn: str, value: Any) -> tuple[ItemSpec | None, Any]:
    """Describe one flattened value; returns the spec and the local value to stage (``None``
    for a ShardedTensor of which this rank holds no shard: nothing to save here)."""
    if _is_dtensor(value):
        from torch.distributed.tensor import Partial

        if any(isinstance(p, Partial) for p in value.placements):
            raise TypeError(
                f"state_dict[{fqn!r}] is a DTensor with a Partial placement; reduce it first "
                "(e.g. value.redistribute(placements=[Replicate()]*mesh.ndim)) before saving"
            )
        local = local_shard(value)
        chunks = value.__create_chunk_list__()
        if len(chunks) != 1:
            raise TypeError(f"state_dict[{fqn!r}]: DTensor with {len(chunks)} local chunks is "
                            "not supported; save it with one local shard per rank")
        offsets = tuple(int(o) for o in chunks[0].offsets)
        owner = dtensor_owner(fqn, value)
        return _tensor_spec(fqn, local, offsets, tuple(int(s) for s in value.shape), owner, owner), local
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            if _is_sharded_tensor(value):
                return _sharded_tensor_spec(fqn, value)
            raise TypeError(
                f"state_dict[{fqn!r}] is a {type(value).__name__}, a tensor subclass solosave "
                "cannot save; convert it to a plain tensor or a DTensor"
            )
        if value.is_quantized:
            raise TypeError(f"state_dict[{fqn!r}] is a quantized tensor ({value.dtype}), which solosave "
                            "cannot stage; save value.dequantize() (and its scale/zero point) instead")
        if value.is_sparse or value.layout != torch.strided:
            raise TypeError(f"state_dict[{fqn!r}] has layout {value.layout}; only strided "
                            "(dense) tensors are supported: call .to_dense() first")
        if value.device.type == "meta":
            raise TypeError(f"state_dict[{fqn!r}] is on the meta device and has no data to save")
        shape = tuple(int(s) for s in value.shape)
        return _tensor_spec(fqn, value.detach(), (0,) * len(shape), shape, True), value.detach()
    if callable(getattr(value, "state_dict", None)) and not isinstance(value, (dict, list)):
        raise TypeError(
            f"state_dict[{fqn!r}] is a {type(value).__name__} object with a state_dict() method; "
            "only top-level values may be Stateful objects (DCP's rule): put obj.state_dict() here, "
            "or move the object to the top level of the state dict"
        )
    return ItemSpec(fqn, ItemKind.BYTES), value


def serialize_bytes(fqn: str, value: Any) -> bytes:
    """Serialize a non-tensor value as DCP does (``torch.save``), with a clear error; a
    :class:`WholeValue` as the value it holds."""
    if type(value) is WholeValue:
        value = value.value
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:  # noqa: BLE001 - any pickling error is reported with the key
        raise TypeError(
            f"state_dict[{fqn!r}] ({type(value).__name__}) cannot be serialized: {e}. "
            "Store only tensors and picklable Python values (numbers, strings, lists, dicts)."
        ) from e
    return buf.getvalue()


def _is_stateful(value: Any) -> bool:
    return (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
            and not isinstance(value, (Mapping, list, torch.Tensor)))


def plan_local(state_dict: Mapping[str, Any]) -> LocalPlan:
    """Flatten ``state_dict`` and describe every item (calling thread, no collective).

    A top-level value with ``state_dict()`` and ``load_state_dict()`` (a module, an optimizer,
    a dataloader: DCP's ``Stateful``) is replaced by its ``state_dict()``, taken now, as DCP's
    ``save`` does."""
    if isinstance(state_dict, Mapping):
        state_dict = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state_dict.items()}
    flat, mapping = flatten_state_dict(state_dict)
    specs: list[ItemSpec] = []
    values: dict[str | ItemKey, Any] = {}
    dtensors: dict[str, Any] = {}
    for fqn in sorted(flat):
        if is_checkpointable(flat[fqn]):
            for spec, local in checkpointable_items(fqn, flat[fqn]):
                specs.append(spec)
                values[spec.key] = local
            continue
        made, local = make_spec(fqn, flat[fqn])
        if made is None:
            continue
        specs.append(made)
        values[fqn] = local
        if local is not flat[fqn] and _is_dtensor(flat[fqn]):
            dtensors[fqn] = flat[fqn]
    return LocalPlan(specs, values, mapping, dtensors=dtensors)


# ---------------------------------------------------------------------------------------------
# DCP's checkpointable objects, and values serialized by their caller
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WholeValue:
    """A value saved as one record, ``torch.save(value)``, even a list or a dict (which the
    flattening of a state dict would otherwise split into items): what Megatron-core's DCP
    planner writes for its ``ShardedObject`` s (the ``io.BytesIO`` it hands DCP holds
    ``torch.save`` of their list), so a DCP load returns the value itself. Serialized while
    staging, like every non-tensor value (an error there fails the save on every rank)."""

    value: Any


def is_checkpointable(value: Any) -> bool:
    """Whether ``value`` implements the save side of DCP's ``_Checkpointable`` protocol
    (``__create_write_items__`` and ``__get_tensor_shard__``). DTensors implement it too, but
    have rules of their own here (:func:`make_spec`)."""
    t = type(value)
    return hasattr(t, "__create_write_items__") and hasattr(t, "__get_tensor_shard__") and not _is_dtensor(value)


def value_key(spec: ItemSpec, values: Mapping[str | ItemKey, Any]) -> str | ItemKey:
    """Where ``values`` (a :class:`LocalPlan`'s) holds the value of ``spec``: its fqn, or its
    key for a chunk of a checkpointable object."""
    return spec.fqn if spec.fqn in values else spec.key


def checkpointable_items(fqn: str, value: Any) -> list[tuple[ItemSpec, torch.Tensor]]:
    """The chunks of checkpointable object ``value`` (saved as ``fqn``) that this rank holds,
    each as a spec and the tensor to stage: what DCP's planner and writer do with it
    (``__create_write_items__(fqn, value)``, then ``__get_tensor_shard__(item.index)``).

    Every chunk must be a dense tensor of its write item's dtype and chunk size; the chunks'
    global offsets say where it lies, as they do for a DTensor. Chunks are written by the rank
    that holds them (another rank holding the same chunk is a replica, as DCP treats it). An
    object holding no chunk on this rank gives none."""
    what = f"state_dict[{fqn!r}] ({type(value).__name__}, a DCP checkpointable object)"
    try:
        write_items = list(value.__create_write_items__(fqn, value))
    except Exception as e:  # noqa: BLE001 - any failure of the object's own code, reported with its key
        raise TypeError(f"{what}: its __create_write_items__ raised {type(e).__name__}: {e}") from e
    out: list[tuple[ItemSpec, torch.Tensor]] = []
    seen: set[tuple[int, ...]] = set()
    for item in write_items:
        data = getattr(item, "tensor_data", None)
        if data is None:
            raise TypeError(f"{what}: write item {getattr(item, 'index', item)} carries no tensor (a "
                            "BYTE_IO item); solosave saves the tensor chunks of checkpointable objects: "
                            "put a non-tensor value in the state dict as a value of its own")
        offsets = tuple(int(o) for o in data.chunk.offsets)
        sizes = tuple(int(s) for s in data.chunk.sizes)
        global_size = tuple(int(s) for s in data.size)
        if offsets in seen:
            raise TypeError(f"{what}: two of its write items are the chunk at offsets {list(offsets)}; "
                            "each chunk must be listed once")
        seen.add(offsets)
        if not len(offsets) == len(sizes) == len(global_size) or any(
                o < 0 or o + n > g for o, n, g in zip(offsets, sizes, global_size)):
            raise TypeError(f"{what}: the chunk at offsets {list(offsets)} of size {list(sizes)} does not "
                            f"lie inside its global size {list(global_size)}")
        shard = _checkpointable_shard(what, value, item, sizes, data)
        out.append((_tensor_spec(fqn, shard, offsets, global_size, True), shard))
    return out


def _checkpointable_shard(what: str, value: Any, item: Any, sizes: tuple[int, ...], data: Any) -> torch.Tensor:
    """The tensor ``value.__get_tensor_shard__`` gives for write item ``item``, checked."""
    try:
        shard = value.__get_tensor_shard__(item.index)
    except Exception as e:  # noqa: BLE001 - the object's own code, reported with its key
        raise TypeError(f"{what}: its __get_tensor_shard__({item.index}) raised {type(e).__name__}: {e}") from e
    where = f"{what}: the chunk at offsets {list(item.index.offset or ())}"
    if type(shard) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{where} is a {type(shard).__name__}; __get_tensor_shard__ must return a plain tensor")
    if shard.layout != torch.strided or shard.device.type == "meta" or shard.is_quantized:
        raise TypeError(f"{where} is not a dense tensor with data (layout {shard.layout}, device "
                        f"{shard.device}); __get_tensor_shard__ must return one")
    if tuple(shard.shape) != sizes:
        raise TypeError(f"{where} has shape {list(shard.shape)}, but its write item says {list(sizes)}")
    dtype = getattr(getattr(data, "properties", None), "dtype", None)
    if dtype is not None and dtype != shard.dtype:
        raise TypeError(f"{where} is {shard.dtype}, but its write item says {dtype}")
    return shard.detach()
