"""The load index beside .metadata: its writer and its reader."""
