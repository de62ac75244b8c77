"""The worker's gRPC service around an `EngineClient` and `RemoteEngine`, the `EngineClient`
that reaches a worker over gRPC."""
