"""`sparrow` command line: generate text, serve the engine (HTTP or gRPC), the gateway over
workers, checkpoint tools."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sparrow.config import (
    DTYPES,
    INDEX_CACHE_DTYPES,
    LOAD_FORMATS,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from sparrow.engine.resolve import TORCH_DTYPES, resolve_device
from sparrow.server.reasoning import PARSERS

_QUANT = ["4bit", "8bit"]
# Engine flags: (flag, sub-config field, its config class, type, help). Defaults are the
# config's own, so `--help` shows what runs.
_ENGINE_FLAGS = (
    (
        "--max-model-len",
        "max_model_len",
        SchedulerConfig,
        int,
        "prompt + output tokens per request; None: the model's context",
    ),
    ("--max-num-seqs", "max_num_seqs", SchedulerConfig, int, "sequences in a batch at most"),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        SchedulerConfig,
        int,
        "token budget of one step (longer prompts are chunked)",
    ),
    (
        "--block-size",
        "block_size",
        CacheConfig,
        int,
        "tokens per KV-cache block; None: the model's MSA block, else 128",
    ),
    (
        "--num-blocks",
        "num_blocks",
        CacheConfig,
        int,
        "KV-cache blocks; None: what fits in --gpu-memory-utilization",
    ),
    (
        "--gpu-memory-utilization",
        "gpu_memory_utilization",
        CacheConfig,
        float,
        "fraction of GPU memory for weights, cache and activations",
    ),
    (
        "--num-state-snapshots",
        "num_state_snapshots",
        CacheConfig,
        int,
        "saved recurrent states prefix caching resumes from; None: one per sequence",
    ),
    (
        "--tensor-parallel-size",
        "tensor_parallel_size",
        ParallelConfig,
        int,
        "processes (GPUs) per engine, each with a share of every layer",
    ),
    ("--device", "device", DeviceConfig, str, "auto, cpu, cuda or cuda:N"),
)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags of `generate` / `serve` describe."""
    settings = {field: getattr(args, field) for _, field, *_ in _ENGINE_FLAGS}
    return EngineConfig.from_kwargs(
        model=args.model,
        quantize=args.quantize,
        load_format=args.load_format,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_prefix_caching=not args.no_prefix_caching,
        index_cache_dtype=args.index_cache_dtype,
        **settings,
    )


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", help="checkpoint directory; None: the built-in small model")
    group.add_argument(
        "--quantize",
        choices=_QUANT,
        default=None,
        help="quantise a float checkpoint on load (group-affine, MLX layout)",
    )
    group.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="dummy: the checkpoint's config.json with random weights",
    )
    group.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on a GPU, float32 on a CPU"
    )
    group.add_argument(
        "--index-cache-dtype",
        choices=INDEX_CACHE_DTYPES,
        default="auto",
        help="MSA index keys: auto (the activation dtype) or fp8_e4m3 (e4m3 "
        "codes, a scale per token); models with MSA layers only",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: share the routed experts out whole "
        "among the processes instead of by their columns",
    )
    group.add_argument(
        "--enforce-eager", action="store_true", help="run decode steps eagerly, without CUDA graphs"
    )
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt from scratch (no reuse of cached KV blocks)",
    )
    for flag, field, config, kind, text in _ENGINE_FLAGS:
        default = getattr(config, field)
        group.add_argument(flag, dest=field, type=kind, default=default, help=text)


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
    fails beyond repair, so that a supervisor restarts it; 0 on a normal shutdown."""
    import uvicorn

    from sparrow.engine.async_engine import AsyncEngine
    from sparrow.engine.llm import LLM
    from sparrow.server.app import build_app

    llm = LLM(config=engine_config(args), progress=True)
    if llm.model.device.type == "cuda":
        llm.warmup()  # first requests do not wait for kernels to compile
    name = args.served_model_name or (Path(args.model).name if args.model else "default")
    engine = AsyncEngine(llm, max_waiting=args.max_waiting)
    media = None
    if llm.info().media:  # the checkpoint has a vision tower
        from sparrow.multimodal.pipeline import MediaPipeline

        media = MediaPipeline.for_checkpoint(args.model, media_limits(args))
    app = build_app(
        engine,
        llm.tokenizer,
        name,
        args.api_key,
        args.max_body_bytes,
        max_waiting=args.max_waiting,
        media=media,
        reasoning=PARSERS[args.reasoning_parser] if args.reasoning_parser else None,
        rate_limit=args.rate_limit,
        tool_parser=tool_format(args, args.model and Path(args.model)),
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30
    )
    server = uvicorn.Server(config)

    def stop(error: BaseException) -> None:  # on the engine thread; uvicorn polls the flag
        server.should_exit = True

    engine.on_fatal = stop
    if engine.dead.is_set():
        server.should_exit = True
    print(f"[sparrow] serving {name!r} on http://{args.host}:{args.port}", file=sys.stderr)
    server.run()
    if engine.dead.is_set():
        print("[sparrow] the engine failed: exiting with status 1", file=sys.stderr)
        return 1
    return 0


def tool_format(args: argparse.Namespace, model_dir: Path | None):
    """The tool-call parser `--tool-call-parser` names ("auto": the checkpoint's family)."""
    import json

    from sparrow.assets import default_checkpoint
    from sparrow.server.tool_parsers import PARSERS as TOOL_PARSERS
    from sparrow.server.tool_parsers import parser_for

    name = args.tool_call_parser
    if name == "auto":
        config = (model_dir or default_checkpoint()) / "config.json"
        name = parser_for(json.loads(config.read_text()).get("model_type", ""))
    return TOOL_PARSERS[name] if name and name != "none" else None


def media_limits(args: argparse.Namespace):
    """The MediaLimits the media flags of `serve` / `gateway` describe."""
    from sparrow.multimodal import MediaLimits

    allowed = Path(args.allowed_media_dir).resolve() if args.allowed_media_dir else None
    return MediaLimits(allowed_dir=allowed, allow_private_urls=args.allow_private_media_urls)


def cmd_gateway(args: argparse.Namespace) -> int:
    """The OpenAI API over gRPC workers: routing, retries, media preprocessing on the CPU."""
    import uvicorn

    from sparrow.assets import default_checkpoint
    from sparrow.gateway.app import GatewaySettings, build_gateway
    from sparrow.gateway.router import RouterSettings

    model_dir = Path(args.model) if args.model else default_checkpoint()
    settings = GatewaySettings(
        workers=args.worker,
        model_dir=model_dir,
        policy=args.policy,
        model_name=args.served_model_name or (model_dir.name if args.model else "default"),
        api_keys=args.api_key or (),
        rate_limit=args.rate_limit,
        max_body_bytes=args.max_body_bytes,
        media_limits=media_limits(args),
        router=RouterSettings(request_timeout_s=args.request_timeout or None),
        reasoning=PARSERS[args.reasoning_parser] if args.reasoning_parser else None,
        tool_parser=tool_format(args, model_dir),
    )
    app, router, pool = build_gateway(settings)
    print(
        f"[sparrow] gateway for {settings.model_name!r} over {', '.join(args.worker)} "
        f"({args.policy}) on http://{args.host}:{args.port}",
        file=sys.stderr,
    )
    try:
        uvicorn.run(
            app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30
        )
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
        print("[sparrow] the engine failed: exiting with status 1", file=sys.stderr)
        return 1
    return 0


def cmd_checkpoint_quantize(args: argparse.Namespace) -> int:
    from sparrow.config import QuantConfig
    from sparrow.loader.weights import load_checkpoint
    from sparrow.quant.mlx_layout import save_mlx_checkpoint

    device, dtype = resolve_device(DeviceConfig(args.device, args.dtype))
    model = load_checkpoint(args.src, device, dtype, quantize=QuantConfig.from_name(args.quantize))
    out = save_mlx_checkpoint(model, args.out, tokenizer_dir=args.src)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparrow", description="Sparrow: an inference engine for sparse MoE LLMs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_worker(sub)
    _add_gateway(sub)
    ckpt = sub.add_parser("checkpoint", help="checkpoint tools")
    _add_checkpoint(ckpt.add_subparsers(dest="checkpoint_command", required=True))
    return parser


def _add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text from a prompt, streaming to stdout",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    srv.add_argument("--served-model-name", help="the model id clients use (default: dir name)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    _add_http_args(srv)
    srv.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="queued requests before new ones get 503 + Retry-After",
    )
    _add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` and `gateway` share: limits, parsers, media sources."""
    parser.add_argument(
        "--rate-limit",
        type=float,
        default=None,
        help="requests per minute per API key (429 + Retry-After past it)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="request body limit (default: 64 MiB for a model that takes "
        "images and videos as data URLs, else 1 MiB)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(PARSERS),
        default=None,
        help="split chat completions into reasoning_content and content at "
        "the model's think markers (default: all text is content)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["auto", "none", "qwen3", "minimax_m3"],
        default="auto",
        help="parse the model's tool calls into tool_calls (auto: by the checkpoint's model_type)",
    )
    parser.add_argument(
        "--allowed-media-dir",
        default=None,
        help="local image and video files are read only under this directory (default: none are)",
    )
    parser.add_argument(
        "--allow-private-media-urls",
        action="store_true",
        help="fetch media URLs that resolve to private, loopback or link-local "
        "addresses (default: refused)",
    )


def _add_gateway(sub) -> None:
    from sparrow.gateway.policies import POLICIES

    gw = sub.add_parser(
        "gateway",
        help="serve the OpenAI API over gRPC workers",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gw.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="a worker's address (repeat for each)",
    )
    gw.add_argument(
        "--model",
        help="the checkpoint the workers serve (its tokenizer, chat "
        "template and preprocessing configs are read, not its "
        "weights); None: the built-in small model",
    )
    gw.add_argument("--policy", choices=POLICIES, default="cache_aware")
    gw.add_argument("--served-model-name", help="the model id clients use (default: dir name)")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a key clients may send as 'Authorization: Bearer KEY' (repeat for "
        "more; 'sha256:<hex>' gives its digest instead)",
    )
    gw.add_argument(
        "--request-timeout",
        type=float,
        default=1800.0,
        help="seconds a request may run (0: no limit)",
    )
    _add_http_args(gw)
    gw.set_defaults(func=cmd_gateway)


def _add_worker(sub) -> None:
    wrk = sub.add_parser(
        "worker",
        help="serve the engine over gRPC for a gateway",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    wrk.add_argument("--host", default="127.0.0.1")
    wrk.add_argument("--port", type=int, default=50051)
    wrk.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="queued requests before new ones get RESOURCE_EXHAUSTED",
    )
    _add_engine_args(wrk)
    wrk.set_defaults(func=cmd_worker)


def _add_checkpoint(sub) -> None:
    from sparrow.loader.random_checkpoint import PRESETS

    rnd = sub.add_parser(
        "random", help="write a random-weight checkpoint in exact HF layout (with tokenizer)"
    )
    rnd.add_argument("out", help="output directory")
    rnd.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.6-35b-a3b")
    rnd.add_argument(
        "--layers",
        type=int,
        help="number of layers (Qwen: every 4th is "
        "attention; M3: the first 3 full attention + dense, then sparse + MoE)",
    )
    rnd.add_argument("--hidden", type=int, help="hidden size")
    rnd.add_argument("--experts", type=int, help="number of routed experts")
    rnd.add_argument("--top-k", type=int, help="experts per token")
    rnd.add_argument("--moe-intermediate", type=int, help="expert (and shared expert) width")
    rnd.add_argument("--vocab", type=int, help="vocabulary size")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bfloat16")
    rnd.add_argument("--shard-gb", type=float, default=4.0, help="maximum shard size in GiB")
    rnd.add_argument(
        "--per-expert",
        action="store_true",
        help="write experts.E.{gate,up,down}_proj instead of fused tensors",
    )
    rnd.set_defaults(func=cmd_checkpoint_random)

    qnt = sub.add_parser(
        "quantize", help="quantise a float checkpoint and save it in MLX layout (4-bit default)"
    )
    qnt.add_argument("src", help="float checkpoint directory")
    qnt.add_argument("out", help="output directory")
    qnt.add_argument("--quantize", choices=_QUANT, default="4bit")
    _add_device_args(qnt)
    qnt.set_defaults(func=cmd_checkpoint_quantize)


def _add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on a GPU, float32 on a CPU"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from sparrow.loader.weights import CheckpointError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"sparrow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the server has stopped (and said so)
        return 130


if __name__ == "__main__":
    sys.exit(main())
