"""The gRPC contract between a gateway and a worker (`worker.proto`) and its generated
modules, which are checked in: `python -m sparrow.proto.generate` rewrites them."""

MAX_MESSAGE_BYTES = 256 << 20  # a prompt's media travel inline in one GenerateRequest
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a restarted worker is reconnected within about a second (gRPC's default backoff grows
    # to 120 s); clients only
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
