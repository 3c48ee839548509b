"""``solosave._src.core.compat``: the torch releases solosave runs on, and the one difference
inside that range that the library works around."""

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from solosave._src.core.compat import METADATA_HAS_VERSION, MIN_TORCH, check_torch, torch_release
from solosave._src.formats.dcp import METADATA_VERSION


@pytest.mark.parametrize("version, release", [("2.8.0", (2, 8)), ("2.10.0+cu128", (2, 10)),
                                              ("2.14.1+cu130", (2, 14)), ("2.8.0a0+git5228986", (2, 8)),
                                              ("2.13.0+cpu", (2, 13)), ("3.0.0.dev20270101", (3, 0))])
def test_torch_release_of_release_prerelease_and_local_builds(version, release):
    assert torch_release(version) == release


def test_an_older_torch_is_refused_with_the_fix_and_supported_ones_pass():
    with pytest.raises(RuntimeError) as e:
        check_torch("2.7.1+cu126")
    msg = str(e.value)
    assert "\n" not in msg and "torch 2.7.1+cu126" in msg and "pip install 'torch>=2.8'" in msg, msg
    for ok in ("2.8.0", "2.8.0a0+git5228986", "2.11.0+cu130", torch.__version__):
        check_torch(ok)
    with pytest.raises(ValueError, match="not a torch version"):
        torch_release("unknown")


def test_the_floor_is_pyprojects():
    text = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    (floor,) = re.findall(r'"torch\s*>=\s*([\d.]+)', text)
    assert torch_release(floor) == MIN_TORCH


def test_metadata_is_built_with_the_version_field_only_where_torch_has_one():
    assert METADATA_HAS_VERSION is (torch_release(torch.__version__) >= (2, 9))
    md = Metadata(state_dict_metadata={}, **METADATA_VERSION)
    assert getattr(md, "version", None) == ("1.0.0" if METADATA_HAS_VERSION else None)
