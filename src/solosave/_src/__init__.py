"""solosave's implementation: private, may change in any release. The public API is ``solosave`` (``__init__.py``).

One folder per concern, lowest first; a module imports only from its own folder or from folders
below it (``tests/unit/test_layering.py`` enforces it)::

    core       exceptions, CRC32, progress, small utilities
    formats    DCP file names and keys, safe unpickling, the .metadata template, torch.save's zip layout
               and records, the checksum sidecar
    storage    the Storage protocol, its registry, local files, fsspec URLs and uploads, read sources, write-back
    coordination  the protocol's messages, the status word, the Channel (every collective), rendezvous
    plan       pure planning: local plan, structure cache, chunks, global plan, columns, layout
    index      the load index: writer and reader
    prepared   the prepared-metadata file and PreparedMetadata
    save       checkpointer, handle, options, staging, worker, engine, writer, publishing
    load       loading: the reader, whole reads, the read path
    tools      verify, export, retention
    testing    test doubles shared by tests and benchmarks (never imported by the library)
"""
