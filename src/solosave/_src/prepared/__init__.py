"""The prepared-metadata file (sections, key buckets, conversions) and PreparedMetadata."""
