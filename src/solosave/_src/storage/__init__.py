"""Where the bytes go: the Storage protocol (``base``), chosen from the path by ``registry``; the
backends (``local``, ``fsspec`` with object uploads in ``upload``); DCP's read path over any of
them (``dcp_filesystem``); read sources of prepared files; write-back (``writev``, early flush)."""
