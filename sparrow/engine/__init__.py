"""The step loop (`LLM`), the output processor and `EngineClient`, the interface servers and
the gateway talk to."""
