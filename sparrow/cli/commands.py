"""What each `sparrow` command does, given its parsed flags (`cli.args`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from sparrow.cli.args import engine_config
from sparrow.config import DeviceConfig
from sparrow.engine.resolve import TORCH_DTYPES, resolve_device
from sparrow.logs import uvicorn_settings
from sparrow.server.reasoning import PARSERS

logger = logging.getLogger(__name__)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one request through the engine (scheduler + runner)."""
    from sparrow.core.sampling_params import SamplingParams
    from sparrow.engine.llm import LLM
    from sparrow.generate import GenerationStats

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(config=engine_config(args), progress=True)
    text = args.prompt
    if not args.raw:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids = llm.tokenizer.encode(text)
    warm_s = 0.0
    if llm.model.device.type == "cuda":  # compile this prompt's kernels outside the timing
        t0 = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))
        warm_s = time.perf_counter() - t0
    request = llm.add_request(ids, params)
    processor = llm.output_processor()  # decodes a short window per token
    processor.add(request.request_id, request.params)
    stats = GenerationStats(prompt_tokens=len(request.prompt_token_ids))
    start = time.perf_counter()
    first = None
    while llm.has_unfinished():
        for delta in processor.process(llm.step()):
            if first is None and delta.token_ids:
                first = time.perf_counter()
                stats.prefill_s = first - start
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    stats.decode_tokens = len(request.output_token_ids)
    stats.decode_s = time.perf_counter() - first
    compiled = f" (after a {warm_s:.1f} s warm-up that compiles the kernels)" if warm_s else ""
    print(f"\n{stats.summary()}{compiled}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """The OpenAI-compatible server over the engine (single process). Exits 1 if the engine
    fails beyond repair, so that a supervisor restarts it; 0 on a normal shutdown (SIGTERM:
    once the drain is over)."""

    from sparrow.engine.async_engine import AsyncEngine
    from sparrow.engine.llm import LLM
    from sparrow.loader.model import checkpoint_dir
    from sparrow.server.app import build_app

    llm = LLM(config=engine_config(args), progress=True)
    if llm.model.device.type == "cuda":
        llm.warmup()  # first requests do not wait for kernels to compile
    name = served_name(args)
    engine = AsyncEngine(llm, max_waiting=args.max_waiting)
    model_dir = checkpoint_dir(llm.config)
    media = media_pipeline(args, model_dir) if llm.info().media else None
    app = build_app(
        engine,
        llm.tokenizer,
        name,
        args.api_key,
        args.max_body_bytes,
        max_waiting=args.max_waiting,
        media=media,
        reasoning=reasoning_format(args, model_dir),
        rate_limit=args.rate_limit,
        tool_parser=tool_format(args, model_dir),
        drain_s=args.drain_timeout,
        body_timeout_s=args.body_timeout or None,
        response_store=response_store(args),
    )
    server = draining_server(app, args)

    def stop(error: BaseException) -> None:  # on the engine thread; uvicorn polls the flag
        server.should_exit = True

    engine.on_fatal = stop
    if engine.dead.is_set():
        server.should_exit = True
    logger.info("serving %r on http://%s:%d", name, args.host, args.port)
    server.run()
    if engine.dead.is_set():
        logger.error("the engine failed: exiting with status 1")
        return 1
    return 0


def served_name(args: argparse.Namespace) -> str:
    """The model id an HTTP server answers to: `--served-model-name`, else the checkpoint
    directory's name, a Hub id as given (as vLLM), "default" for the built-in model."""
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return "default"
    return Path(args.model).name if Path(args.model).is_dir() else args.model


def draining_server(app, args: argparse.Namespace):
    """uvicorn's server for `app` (`server.app.build_app`), told to stop only once the app's
    drain is over: uvicorn closes its listener as soon as it is told, and the listener stays
    open through the drain to answer 503s."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=30,  # for the streams' error ends, once the drain is over
        **uvicorn_settings(args.log_level),
    )
    server = uvicorn.Server(config)
    app.state.drain.on_drained = lambda: setattr(server, "should_exit", True)
    return server


def speaks(model_dir: Path | str | None):
    """What the checkpoint's family speaks (`models.interface.Speaks`): parsers, media."""
    from sparrow.assets import default_checkpoint
    from sparrow.models import architecture_for_dir

    return architecture_for_dir(model_dir or default_checkpoint()).SPEAKS


def tool_format(args: argparse.Namespace, model_dir: Path | None):
    """The tool-call parser `--tool-call-parser` names ("auto": the checkpoint's family's)."""
    from sparrow.server.tool_parsers import PARSERS as TOOL_PARSERS

    name = args.tool_call_parser
    if name == "auto":
        name = speaks(model_dir).tool_parser
    return TOOL_PARSERS[name] if name and name != "none" else None


def reasoning_format(args: argparse.Namespace, model_dir: Path | None):
    """The reasoning parser `--reasoning-parser` names ("auto": the checkpoint's family's;
    None: all text is content)."""
    name = args.reasoning_parser
    if name == "auto":
        name = speaks(model_dir).reasoning_parser
    return PARSERS[name] if name else None


def media_pipeline(args: argparse.Namespace, model_dir: Path | None):
    """The media pipeline of the checkpoint's family, with the media flags' limits."""
    from sparrow.multimodal.pipeline import MediaPipeline

    fmt = speaks(model_dir).media
    if fmt is None:
        return None
    return MediaPipeline.for_checkpoint(
        model_dir, fmt.image, fmt.video, media_limits(args), fmt.wrap_images
    )


def response_store(args: argparse.Namespace):
    """The ResponseStoreSettings the `--responses-*` flags of `serve` / `gateway` give."""
    from sparrow.server.response_store import ResponseStoreSettings

    return ResponseStoreSettings(
        args.responses_db, args.responses_db_max_mb, args.responses_ttl or None
    )


def media_limits(args: argparse.Namespace):
    """The MediaLimits the media flags of `serve` / `gateway` describe."""
    from sparrow.multimodal import MediaLimits

    allowed = Path(args.allowed_media_dir).resolve() if args.allowed_media_dir else None
    return MediaLimits(allowed_dir=allowed, allow_private_urls=args.allow_private_media_urls)


def cmd_gateway(args: argparse.Namespace) -> int:
    """The OpenAI API over gRPC workers: routing, retries, media preprocessing on the CPU."""

    from sparrow.gateway.app import GatewaySettings, build_gateway
    from sparrow.gateway.router import RouterSettings
    from sparrow.loader.hub import resolve_model

    # a Hub id is resolved here, its tokenizer and preprocessing files only; each worker
    # resolves its own --model
    model_dir = resolve_model(args.model, args.revision, args.download_dir, weights=False)
    settings = GatewaySettings(
        workers=args.worker,
        model_dir=model_dir,
        policy=args.policy,
        model_name=served_name(args),
        api_keys=args.api_key or (),
        rate_limit=args.rate_limit,
        max_body_bytes=args.max_body_bytes,
        media=media_pipeline(args, model_dir),
        router=RouterSettings(request_timeout_s=args.request_timeout or None),
        reasoning=reasoning_format(args, model_dir),
        tool_parser=tool_format(args, model_dir),
        drain_s=args.drain_timeout,
        body_timeout_s=args.body_timeout or None,
        response_store=response_store(args),
    )
    app, router, pool = build_gateway(settings)
    logger.info(
        "gateway for %r over %s (%s) on http://%s:%d",
        settings.model_name,
        ", ".join(args.worker),
        args.policy,
        args.host,
        args.port,
    )
    try:
        draining_server(app, args).run()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """The engine behind the gRPC `Worker` service (`sparrow/proto/worker.proto`) for a
    gateway. Exits 1 if the engine fails beyond repair; 0 on SIGTERM / SIGINT, once the
    requests in flight are done."""
    import asyncio

    from sparrow.engine.async_engine import AsyncEngine
    from sparrow.engine.llm import LLM
    from sparrow.rpc.worker import serve

    llm = LLM(config=engine_config(args), progress=True)
    if llm.model.device.type == "cuda":
        llm.warmup()
    engine = AsyncEngine(llm, max_waiting=args.max_waiting)
    asyncio.run(serve(engine, f"{args.host}:{args.port}"))
    if engine.dead.is_set():
        logger.error("the engine failed: exiting with status 1")
        return 1
    return 0


def cmd_checkpoint_quantize(args: argparse.Namespace) -> int:
    from sparrow.config import QuantConfig
    from sparrow.loader.hub import resolve_model
    from sparrow.loader.mlx_writer import save_mlx_checkpoint
    from sparrow.loader.weights import load_checkpoint

    device, dtype = resolve_device(DeviceConfig(args.device, args.dtype))
    src = resolve_model(args.src, args.revision, args.download_dir)
    model = load_checkpoint(src, device, dtype, quantize=QuantConfig.from_name(args.quantize))
    out = save_mlx_checkpoint(model, args.out, tokenizer_dir=src)
    print(f"wrote {out} ({args.quantize}, MLX layout)")
    return 0


def cmd_checkpoint_random(args: argparse.Namespace) -> int:
    from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint

    cfg = PRESETS[args.preset]
    changes = {
        "num_layers": args.layers,
        "hidden_size": args.hidden,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_intermediate,
        "shared_expert_intermediate_size": args.moe_intermediate,  # Qwen's name
        "shared_intermediate_size": args.moe_intermediate,
        "vocab_size": args.vocab,  # M3's
    }
    cfg = cfg.replace(**{k: v for k, v in changes.items() if v is not None and hasattr(cfg, k)})
    out = write_random_checkpoint(
        args.out,
        cfg,
        seed=args.seed,
        dtype=TORCH_DTYPES[args.dtype],
        shard_bytes=int(args.shard_gb * (1 << 30)),
        per_expert=args.per_expert,
    )
    print(
        f"wrote {out} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts)"
    )
    return 0
