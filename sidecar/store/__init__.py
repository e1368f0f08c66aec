"""Storage: the store (embedding cache, file digests) and the metrics store (tool calls, feedback)."""
