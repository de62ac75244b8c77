"""A worker on 127.0.0.1: the gRPC service in a thread of its own with its own event loop,
over the tiny Qwen model (packaged tokenizer) seeing through a stand-in tower."""

import asyncio
import threading
import time

import pytest
import torch

from sparrow.engine.async_engine import AsyncEngine
from sparrow.engine.llm import LLM
from sparrow.loader.random_checkpoint import PRESETS, random_model
from sparrow.rpc.worker import make_server
from sparrow.tokenizer import load_tokenizer

pytest.importorskip("grpc")

CFG = PRESETS["qwen3.6-tiny"]


class Tower(torch.nn.Module):
    """Patches [N, D] -> [N / 4, hidden]: the mean of each 2 x 2 group, tiled; records the
    patches and grids it sees."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.seen: list[tuple[torch.Tensor, list]] = []

    def forward(self, patches, grid):
        self.seen.append((patches.clone(), grid.tolist()))
        means = patches.reshape(-1, 4 * patches.shape[1]).mean(-1, keepdim=True)
        return means.expand(-1, CFG.hidden_size) * 0.01


class WorkerThread:
    """`make_server(engine)` served on a background event loop; `call(coro)` runs a
    coroutine there (where the engine's streams live)."""

    def __init__(self, engine):
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server, self.port = self.call(self._start())
        self.target = f"127.0.0.1:{self.port}"

    async def _start(self):
        server, port = make_server(self.engine, "127.0.0.1:0")
        await server.start()
        return server, port

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def tiny_llm() -> LLM:
    model = random_model(CFG, 0, "cpu", torch.float32)
    model.visual = Tower()
    llm = LLM(model, max_model_len=2048, block_size=16, num_blocks=160)
    llm.tokenizer = load_tokenizer(None)  # the packaged Qwen vocabulary and template
    return llm


@pytest.fixture(scope="session")
def worker():
    """(WorkerThread over an AsyncEngine, its LLM)."""
    llm = tiny_llm()
    engine = AsyncEngine(llm, max_waiting=8)
    thread = WorkerThread(engine)
    yield thread, llm
    thread.stop()
    asyncio.run(engine.shutdown(timeout=30))


def settled(engine, timeout: float = 10.0) -> bool:
    """Whether the engine comes to hold no request (waiting or running) within `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        stats = engine.stats()
        if stats.waiting == 0 and stats.running == 0:
            return True
        time.sleep(0.02)
    return False
