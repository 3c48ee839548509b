"""The bottom layer: every exception, CRC32, progress bars, small utilities (no solosave imports)."""
