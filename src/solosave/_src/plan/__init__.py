"""Pure planning: local plans, the structure cache, chunks, the global plan, columns, the layout guard."""
