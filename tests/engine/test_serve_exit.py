"""`sparrow serve` exits 1 when its engine dies (a supervisor restarts it) and 0 on a normal
shutdown: cmd_serve in process, uvicorn's server replaced by one that waits for its exit
flag as uvicorn's main loop does."""

import asyncio
import threading

import pytest
import torch

from sparrow import cli
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine import async_engine
from sparrow.engine.client import EngineError
from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = PRESETS["qwen3.6-tiny"].replace(vocab_size=512)
    return write_random_checkpoint(
        tmp_path_factory.mktemp("serve"), cfg, seed=1, dtype=torch.float32, progress=False
    )


def serve(model_dir, monkeypatch, run) -> int:
    """cmd_serve with `run(server, engine)` in place of uvicorn's serving loop."""
    import uvicorn

    engines = []

    class Recorded(async_engine.AsyncEngine):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            engines.append(self)

    class FakeServer:
        def __init__(self, config):
            self.config, self.should_exit = config, False

        def run(self):
            run(self, engines[0])

    monkeypatch.setattr(async_engine, "AsyncEngine", Recorded)
    monkeypatch.setattr(uvicorn, "Server", FakeServer)
    code = cli.main(
        [
            "serve",
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--port",
            "0",
            "--max-model-len",
            "128",
            "--num-blocks",
            "16",
        ]
    )
    asyncio.run(engines[0].shutdown(timeout=30))
    return code


def test_serve_exits_1_when_the_engine_dies(model_dir, monkeypatch):
    def run(server, engine):
        def broken():
            raise RuntimeError("scheduler state broken")

        monkeypatch.setattr(engine._llm, "step", broken)

        async def add():
            stream = await engine.add("a", [5, 6, 7], SamplingParams(max_tokens=2))
            with pytest.raises(EngineError, match="scheduler state broken"):
                await asyncio.wait_for(anext(stream), 30)

        asyncio.run(add())
        for _ in range(1000):  # on_fatal sets the flag from the engine thread
            if server.should_exit:
                return
            threading.Event().wait(0.01)
        raise AssertionError("the engine died and the server was not told to exit")

    assert serve(model_dir, monkeypatch, run) == 1


def test_serve_exits_0_on_a_normal_shutdown(model_dir, monkeypatch):
    def run(server, engine):
        assert engine.health().alive and not server.should_exit

    assert serve(model_dir, monkeypatch, run) == 0
