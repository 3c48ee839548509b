"""Which reads of a load need no DCP planning: with a load index (:mod:`solosave._src.index.reader`) and
a planner that plans, resolves and commits as DCP's default load planner does
(:func:`reads_in_place`), every plain tensor of the state dict that the checkpoint holds as one
whole record of its shape, and every DTensor whose local shard the checkpoint holds as one
record (the sharding it was saved with), is a :class:`WholeRead` (:func:`whole_reads`), read
straight into the tensor by :mod:`solosave._src.load.read_path`; DCP's planner plans the rest
(:func:`planning_the_rest`).

Called by :func:`solosave._src.load.load._load_local` on every loading rank, alone, before DCP's planning.
Measurements: docs/benchmarks.md, section 4.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor

from solosave._src.index.reader import LoadIndex
from solosave._src.plan.local_plan import local_shard

__all__ = ["WholeRead", "keeps_default", "planning_the_rest", "reads_in_place", "whole_reads"]


@dataclass(frozen=True, slots=True)
class WholeRead:
    """A read that DCP's planner did not plan: the whole record of ``fqn`` into ``target``, a
    plain tensor of the saved shape (:meth:`solosave._src.index.reader.LoadIndex.whole_records` found the
    record). It answers what the read path asks of a DCP ``ReadItem``."""

    fqn: str
    target: torch.Tensor

    @property
    def storage_index(self) -> MetadataIndex:
        return MetadataIndex(self.fqn)

    @property
    def storage_offsets(self) -> tuple[int, ...]:
        return (0,) * self.target.dim()

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.target.shape)


_PLANNING = ("create_local_plan", "create_global_plan", "finish_plan", "resolve_tensor", "lookup_tensor",
             "transform_tensor", "commit_tensor")


def keeps_default(planner: Any, *steps: str) -> bool:
    """Whether ``planner`` is a DCP ``DefaultLoadPlanner`` whose ``steps`` (method names) are
    DCP's own: neither its class nor the instance overrides them."""
    cls, own = type(planner), getattr(planner, "__dict__", {})
    return isinstance(planner, DefaultLoadPlanner) and all(
        getattr(cls, name) is getattr(DefaultLoadPlanner, name) and name not in own for name in steps)


def reads_in_place(planner: Any) -> bool:
    """Whether ``planner`` plans, resolves and commits tensors as DCP's default load planner
    does (a plain tensor is read in place, whole when its saved chunk is whole): then such
    tensors need none of its planning (:func:`whole_reads`)."""
    return keeps_default(planner, *_PLANNING)


@contextmanager
def planning_the_rest(planner: Any, whole: Sequence[tuple[WholeRead, Any]]) -> Iterator[None]:
    """While DCP's ``planner`` plans and loads, its ``state_dict`` holds only what ``whole``
    does not read; then the whole one is back, with what the planner set in the narrowed one
    meanwhile (``load_bytes`` of an unflattened planner writes into it)."""
    if not whole:
        yield
        return
    flat = planner.state_dict
    done = {read.fqn for read, _ in whole}
    planner.state_dict = {k: v for k, v in flat.items() if k not in done}
    try:
        yield
    finally:
        flat.update(planner.state_dict)
        planner.state_dict = flat


def whole_reads(flat: Mapping[str, Any], index: LoadIndex) -> list[tuple[WholeRead, Any]]:
    """The tensors of the flattened state dict ``flat`` that the checkpoint holds as one record
    each (the index says so), with their storage entries: read straight into them, without DCP's
    per-item planning objects (docs/benchmarks.md, section 4). A plain tensor needs its
    whole self saved as one chunk; a DTensor (its rank in the mesh) its one local shard saved as
    one chunk, at the sharding it is loaded with. Resharded, resized, absent, other tensor types
    and non-tensor values are left to DCP's planner."""
    wanted: dict[str, tuple[Any, Any, Any]] = {}
    targets: dict[str, torch.Tensor] = {}
    #: this rank's chunks of a DTensor by (global shape, placements, mesh), which decide them:
    #: DTensor.__create_chunk_list__ is worked out once per geometry, not once per DTensor
    chunks_of: dict[tuple, Any] = {}
    for k, v in flat.items():
        kind = type(v)
        if kind in _PLAIN:
            wanted[k] = (v.shape, (0,) * v.dim(), v.shape)
            targets[k] = v
        elif kind is DTensor and k in index.keys:
            local = local_shard(v)  # the shard itself: to_local() costs an autograd Function per call
            if type(local) is torch.Tensor:  # its chunk follows from the key below
                shape_key = (v.shape, v.placements, v.device_mesh)
                chunks = chunks_of.get(shape_key, False)
                if chunks is False:
                    chunks = chunks_of[shape_key] = _local_chunks(v)
            else:  # a local tensor that names its own chunks (e.g. LocalShardsWrapper)
                chunks = _local_chunks(v)
            if chunks is None:
                continue
            if len(chunks) == 1 and tuple(local.shape) == tuple(chunks[0].sizes):
                wanted[k] = (v.shape, chunks[0].offsets, chunks[0].sizes)
                targets[k] = local
    if not wanted:
        return []
    found = index.whole_records(wanted)
    return [(WholeRead(k, targets[k].detach()), info) for k, info in found.items()]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _local_chunks(v: DTensor) -> list[Any] | None:
    """This rank's chunks of the DTensor ``v``; ``None``: the rank is outside its mesh, or ``v``
    has no chunks to offer (e.g. a Partial placement: DCP's planner reports it, after its own
    checks)."""
    if v.device_mesh.get_coordinate() is None:
        return None
    try:
        return v.__create_chunk_list__()
    except (ValueError, RuntimeError, NotImplementedError):
        return None
