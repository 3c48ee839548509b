"""Where the bytes go: local paths and fsspec URLs, object uploads, read sources, write-back."""
