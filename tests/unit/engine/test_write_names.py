"""The engine writes only this rank's data files, directly inside the checkpoint directory,
whatever layout reaches it (a second line behind the prepared file's own name check)."""

import dataclasses

from solosave._src.coordination.protocol import ErrorKind
from solosave._src.prepared.prepared import PreparedMetadata
from tests.unit.engine.test_engine import Ranks, state


def test_a_layout_naming_a_file_outside_the_checkpoint_is_never_written(tmp_path, monkeypatch):
    rk = Ranks(2, tmp_path, assume_constant_structure=True)
    try:
        assert all(o.ok for o in rk.save(state, "c0"))
        real = PreparedMetadata.layout

        def crafted(self, rank):  # what a crafted prepared file would give rank 0 if nothing checked it
            layout = real(self, rank)
            if rank != 0:
                return layout
            files = tuple(("../pwned.distcp", items) for _, items in layout.files)
            return dataclasses.replace(layout, files=files)

        monkeypatch.setattr(PreparedMetadata, "layout", crafted)
        for s in rk.sessions:  # plan again from the (patched) layout
            s.prepared._layouts.clear()
            s.token += 1
            s._sent_token = 0
        outs = rk.save(state, "c1")
        assert all(not o.ok and o.error_kind is ErrorKind.FAILED for o in outs), outs
        assert all("refusing to write '../pwned.distcp' is not a data file name" in o.failures[0] for o in outs)
        assert not (tmp_path / "pwned.distcp").exists() and not (tmp_path / "c1" / ".metadata").exists()
    finally:
        rk.close()
