"""Write-back: ``writev`` in batches and the early-flush hint."""

import os


def test_start_writeback_is_advisory(tmp_path):
    """``start_writeback`` asks Linux to start flushing a range and never raises (a bad file
    descriptor included): the ``fsync`` after it is what makes the bytes durable."""
    import sys

    from solosave._src.storage import writeback

    assert (writeback._SYNC_FILE_RANGE is not None) == sys.platform.startswith("linux")
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 8192)
        writeback.start_writeback(fd, 0, 8192)
        writeback.start_writeback(fd, 0, 0)
    finally:
        os.close(fd)
    writeback.start_writeback(fd, 0, 8192)  # closed: ignored
    assert path.read_bytes() == b"x" * 8192
