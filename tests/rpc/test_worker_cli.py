"""`sparrow worker` in process: it serves the built-in model over gRPC on the port it is given,
answers a request through `RemoteEngine`, and exits 0 on SIGTERM."""

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest

from sparrow import cli
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.client import EngineError
from sparrow.net import free_port
from sparrow.rpc.client import RemoteEngine


def connect(target: str, timeout: float = 120.0) -> RemoteEngine:
    end = time.monotonic() + timeout
    while True:
        try:
            return RemoteEngine(target, lambda ids: " ".join(map(str, ids)), timeout_s=1.0)
        except EngineError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_worker_serves_then_exits_0_on_sigterm():
    port = free_port()
    seen = {}

    def client() -> None:
        try:
            engine = connect(f"127.0.0.1:{port}")

            async def run():
                stream = await engine.add(
                    "a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)
                )
                seen["tokens"] = [t async for d in stream for t in d.token_ids]
                await engine.shutdown()

            asyncio.run(run())
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    code = cli.main(
        [
            "worker",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--max-model-len",
            "128",
            "--num-blocks",
            "16",
        ]
    )
    thread.join(30)
    assert code == 0 and len(seen["tokens"]) == 3
    # the port is closed: nothing answers there
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=0.5)
