"""A test double of DCP's ``_Checkpointable`` protocol, for tests and benchmarks (the library
never imports it): several chunks of one global tensor held by one rank, as Megatron-core's
``LocalShardsContainer`` holds them, without Megatron.

It is a wrapper tensor subclass because DCP's own save and load look values up as tensors
(``find_state_dict_object``); its only tensor behaviour is its global size and dtype. Saving
asks it for ``__create_write_items__`` and ``__get_tensor_shard__``; loading (stock
``dcp.load`` and ``solosave.load``) asks for ``__create_chunk_list__`` and copies each chunk read
into the tensor ``__get_tensor_shard__`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class ChunkedTensor(torch.Tensor):
    """Chunks ``(offsets, tensor)`` of a tensor of ``global_size`` (every chunk one dtype)."""

    _chunks: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, global_size: Sequence[int], chunks: Sequence[tuple[Sequence[int], torch.Tensor]],
                dtype: torch.dtype | None = None) -> ChunkedTensor:
        dtype = dtype if dtype is not None else (chunks[0][1].dtype if chunks else torch.float32)
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_size), dtype=dtype)
        r._chunks = [(tuple(int(o) for o in off), t) for off, t in chunks]
        return r

    # torch types the base attribute as a plain function; its docs define the hook as a classmethod.
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise NotImplementedError(f"ChunkedTensor holds chunks for checkpointing only; {func} is not supported")

    @property
    def chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        return self._chunks

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off), i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t), size=self.size()))
                for i, (off, t) in enumerate(self._chunks)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()) for off, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self._chunks:
            if index.offset is not None and torch.Size(off) == index.offset:
                return t
        raise ValueError(f"no chunk of {index.fqn!r} at {index.offset}")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ChunkedTensor(size={list(self.size())}, chunks at {[list(o) for o, _ in self._chunks]})"


def row_chunks(full: torch.Tensor, rows: Sequence[tuple[int, int]]) -> ChunkedTensor:
    """A :class:`ChunkedTensor` holding copies of the row ranges ``[start, stop)`` of ``full``."""
    zeros = (0,) * (full.dim() - 1)
    return ChunkedTensor(full.shape, [((a, *zeros), full[a:b].clone()) for a, b in rows], dtype=full.dtype)
