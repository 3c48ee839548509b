"""CheckpointerOptions: the new names, the old ones kept as aliases, and their flags."""

import argparse
import dataclasses
import pickle

import pytest

from solosave import CheckpointerOptions
from solosave._src.core.errors import OptionError
from solosave._src.save.options import add_option_flags, options_from_args


def test_new_names_and_defaults():
    o = CheckpointerOptions()
    assert (o.files_per_rank, o.worker) == (1, "process")
    assert (o.workers, o.persistent_worker) == (1, True)  # the old names read the new fields


@pytest.mark.parametrize("old, new", [
    ({"workers": 3}, {"files_per_rank": 3}),
    ({"persistent_worker": False}, {"worker": "thread"}),
    ({"persistent_worker": True}, {"worker": "process"}),
])
def test_old_names_are_aliases(old, new):
    assert CheckpointerOptions(**old) == CheckpointerOptions(**new)


@pytest.mark.parametrize("kwargs, needle", [
    ({"workers": 2, "files_per_rank": 2}, "workers is the old name of files_per_rank"),
    ({"persistent_worker": True, "worker": "process"}, "persistent_worker is the old name of worker"),
    ({"worker": "fork"}, "worker must be one of"),
    ({"files_per_rank": 0}, "files_per_rank must be >= 1"),
    ({"workers": 0}, "files_per_rank must be >= 1"),
])
def test_bad_names_and_values(kwargs, needle):
    with pytest.raises(OptionError, match=needle):
        CheckpointerOptions(**kwargs)


def test_copies_keep_the_class_and_values():
    o = CheckpointerOptions(workers=2, persistent_worker=False, timeout=5.0)
    assert pickle.loads(pickle.dumps(o)) == o
    r = dataclasses.replace(o, timeout=7.0)
    assert type(r) is CheckpointerOptions and (r.files_per_rank, r.worker, r.timeout) == (2, "thread", 7.0)
    assert "files_per_rank=2" in repr(o)


def test_megatron_flags_map_onto_the_new_fields():
    p = argparse.ArgumentParser()
    add_option_flags(p)
    on = options_from_args(p.parse_args(["--dist-ckpt-workers", "4", "--use-persistent-ckpt-worker"]))
    off = options_from_args(p.parse_args([]))
    assert (on.files_per_rank, on.worker) == (4, "process")
    assert (off.files_per_rank, off.worker) == (1, "thread")  # Megatron's flags are opt-in
    with pytest.raises(SystemExit):  # the flag takes no value
        p.parse_args(["--use-persistent-ckpt-worker", "thread"])
