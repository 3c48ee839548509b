"""Saving: the checkpointer and its handles, options, staging, the worker, the engine, the writer, publishing."""
