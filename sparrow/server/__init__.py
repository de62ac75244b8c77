"""The single-process OpenAI-compatible HTTP server (`sparrow serve`)."""
