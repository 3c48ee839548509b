"""solosave.save / async_save: DCP arguments solosave cannot honour are refused before anything
starts, each with a one-line error naming the solosave equivalent (no process group needed)."""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import solosave


@pytest.mark.parametrize("kwargs, needle", [
    ({"storage_writer": FileSystemWriter("x")}, "solosave.FileWriter"),
    ({"planner": DefaultSavePlanner()}, "DefaultSavePlanner does"),
    ({"async_checkpointer_type": AsyncCheckpointerType.PROCESS}, "persistent worker process"),
    ({"async_stager": object()}, "overlap_staging=True"),
    ({"no_dist": True}, "init_process_group"),
    ({"use_collectives": False}, "one 8-byte all_reduce"),
])
def test_dcp_arguments_solosave_cannot_honour_are_refused(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))}=.* is not supported") as e:
        solosave.async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "c", **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)
    if "async" not in next(iter(kwargs)):  # save() has no async_* arguments
        with pytest.raises(ValueError, match=needle):
            solosave.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "c", **kwargs)
    assert solosave.default_saver.checkpointer() is None  # refused before any set-up


def test_checkpoint_id_is_required():
    with pytest.raises(ValueError, match="checkpoint_id is required"):
        solosave.DcpSaver().save({"w": torch.ones(2)})


def test_options_are_validated_when_the_saver_is_made():
    with pytest.raises(ValueError, match="files_per_rank must be >= 1"):
        solosave.DcpSaver(workers=0)
    assert solosave.DcpSaver().options.assume_constant_structure  # steady saves reuse by default
