"""`sparrow gateway`: the OpenAI HTTP API in front of gRPC workers.

The app is `sparrow serve`'s (`server.app.build_app`: the same protocol code, chat templates
and tokenisation) over a `Router` instead of an in-process engine. The gateway loads only
the checkpoint's tokenizer, chat template and preprocessing configs, never weights; it
fetches, decodes and preprocesses images and videos in a pool of processes (the event loop
never waits on them, and a slow video does not hold the GIL of the HTTP loop), so a
request reaches its worker with the patches ready.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from sparrow.gateway.metrics import RouterCollector
from sparrow.gateway.policies import make_policy
from sparrow.gateway.router import Router, RouterSettings
from sparrow.multimodal.pipeline import MediaPipeline
from sparrow.rpc.client import RemoteEngine
from sparrow.server.app import build_app
from sparrow.server.drain import DRAIN_S
from sparrow.server.middleware import BODY_TIMEOUT_S
from sparrow.server.reasoning import ReasoningFormat
from sparrow.server.response_store import ResponseStoreSettings
from sparrow.server.tool_parsers import ToolFormat
from sparrow.tokenizer import load_tokenizer


@dataclass(frozen=True)
class GatewaySettings:
    workers: Sequence[str]  # "host:port" of each worker
    model_dir: Path  # the checkpoint the workers serve (tokenizer, template, configs)
    model_name: str
    policy: str = "cache_aware"
    api_keys: Sequence[str] = ()  # plain or "sha256:<hex>"; none: no key required
    rate_limit: float | None = None  # requests per minute per key
    max_body_bytes: int | None = None  # None: 64 MiB with media, else 1 MiB
    router: RouterSettings = RouterSettings()
    # the family's media preprocessing (cli.media_pipeline); None: a text-only model
    media: MediaPipeline | None = None
    media_processes: int = min(4, os.cpu_count() or 1)
    reasoning: ReasoningFormat | None = None
    tool_parser: ToolFormat | None = None
    wait_s: float = 60.0  # for the first worker to answer
    drain_s: float = DRAIN_S  # after SIGTERM, for the requests in flight
    body_timeout_s: float | None = BODY_TIMEOUT_S  # for a request body to arrive; None: none
    # stored responses (/v1/responses) live here, in the gateway: workers keep no state
    response_store: ResponseStoreSettings = ResponseStoreSettings()


def build_gateway(settings: GatewaySettings) -> tuple[FastAPI, Router, ProcessPoolExecutor | None]:
    """The app, its router and its media process pool (None for a text-only model); shut
    the pool down after the app stops."""
    tokenizer = load_tokenizer(settings.model_dir)
    router = Router(
        settings.workers,
        lambda address: RemoteEngine(address, tokenizer.decode),
        make_policy(settings.policy),
        settings.router,
        wait_s=settings.wait_s,
        decode=tokenizer.decode,
        special_ids=tokenizer.skipped_ids,
    )
    media = pool = None
    if router.info.media and settings.media is not None:  # the workers' model sees
        from sparrow.multimodal.pipeline import media_pool

        media, pool = settings.media, media_pool(settings.media_processes)
    app = build_app(
        router,
        tokenizer,
        settings.model_name,
        list(settings.api_keys) or None,
        settings.max_body_bytes,
        media=media,
        reasoning=settings.reasoning,
        tool_parser=settings.tool_parser,
        rate_limit=settings.rate_limit,
        media_executor=pool,
        collectors=[RouterCollector(router)],
        drain_s=settings.drain_s,
        body_timeout_s=settings.body_timeout_s,
        response_store=settings.response_store,
    )
    return app, router, pool
