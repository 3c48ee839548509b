"""Tools over published checkpoints: verify, export, retention."""
