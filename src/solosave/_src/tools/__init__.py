"""Tools over published checkpoints: verify, export, retention; what framework adapters share."""
