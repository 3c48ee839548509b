"""Writes prepared_v2.bin: a version-2 prepared file, made by solosave at commit 3a4c78b (the
last that wrote version 2), for tests/unit/prepared/test_prepared.py::test_version_2_files_are_still_read.

    git archive 3a4c78b src/solosave | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python tests/unit/prepared/data/make_prepared_v2.py tests/unit/prepared/data/prepared_v2.bin
"""

import sys

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)


def metadata() -> Metadata:
    """Two ranks, two files each: a weight sharded on dim 0 (an empty trailing chunk), a 3-D
    tensor sharded on dim 1, a replicated bias, a scalar and a non-tensor item."""
    sdm, storage = {}, {}
    at = {}

    def put(fqn, offsets, rank, file, length):
        rel = f"__{rank}_{file}.distcp"
        off = at.get(rel, 0)
        at[rel] = off + length
        storage[MetadataIndex(fqn, offsets)] = _StorageInfo(rel, off, length)

    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([5, 4])),
              ChunkStorageMetadata(torch.Size([5, 0]), torch.Size([0, 4]))]
    sdm["w"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([5, 4]), chunks)
    put("w", torch.Size([0, 0]), 0, 0, 80 + 900)
    put("w", torch.Size([5, 0]), 1, 0, 0 + 900)
    cube = [ChunkStorageMetadata(torch.Size([0, r * 3, 0]), torch.Size([2, 3, 2])) for r in range(2)]
    sdm["cube"] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([2, 6, 2]), cube)
    put("cube", torch.Size([0, 0, 0]), 0, 1, 24 + 900)
    put("cube", torch.Size([0, 3, 0]), 1, 1, 24 + 900)
    sdm["b"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]),
                                     [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])
    put("b", torch.Size([0]), 1, 0, 16 + 900)
    sdm["step"] = TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([]),
                                        [ChunkStorageMetadata(torch.Size([]), torch.Size([]))])
    put("step", torch.Size([]), 0, 0, 8 + 900)
    sdm["extra"] = BytesStorageMetadata()
    put("extra", None, 1, 1, 333)
    return Metadata(state_dict_metadata=sdm, planner_data={"w": ("w",)}, storage_data=storage)


if __name__ == "__main__":
    from solosave._src.prepared.prepared import FORMAT_VERSION, PreparedMetadata

    assert FORMAT_VERSION == 2, "run with solosave at commit 3a4c78b on PYTHONPATH"
    data = PreparedMetadata.from_metadata(metadata(), world_size=2, workers=2).to_bytes()
    with open(sys.argv[1], "wb") as f:
        f.write(data)
