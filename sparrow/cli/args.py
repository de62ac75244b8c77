"""The `sparrow` command line's flags: every command's parser, the engine flags (defaults
from the engine's configs) and the flags commands share."""

from __future__ import annotations

import argparse

from sparrow.config import (
    DTYPES,
    INDEX_CACHE_DTYPES,
    LOAD_FORMATS,
    RECURRENT_STATE_DTYPES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from sparrow.engine.resolve import TORCH_DTYPES
from sparrow.logs import LEVELS
from sparrow.server.drain import DRAIN_S
from sparrow.server.middleware import BODY_TIMEOUT_S
from sparrow.server.reasoning import PARSERS
from sparrow.server.response_store import MAX_MB as RESPONSES_MAX_MB
from sparrow.server.response_store import TTL_S as RESPONSES_TTL_S
from sparrow.server.tool_parsers import PARSERS as TOOL_PARSERS

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
        revision=args.revision,
        download_dir=args.download_dir,
        quantize=args.quantize,
        load_format=args.load_format,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_prefix_caching=not args.no_prefix_caching,
        index_cache_dtype=args.index_cache_dtype,
        recurrent_state_dtype=args.recurrent_state_dtype,
        **settings,
    )


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        help="checkpoint directory or Hugging Face Hub id (owner/name); None: the built-in "
        "small model",
    )
    _add_hub_args(group)
    group.add_argument(
        "--quantization",
        "--quantize",
        dest="quantize",
        choices=[*_QUANT, "fp8"],
        default=None,
        help="quantise a float checkpoint on load: 4bit / 8bit (group-affine, MLX layout) or "
        "fp8 (e4m3 in 128x128 blocks, HF's fp8 layout); quantised checkpoints load as stored",
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
        "--recurrent-state-dtype",
        choices=RECURRENT_STATE_DTYPES,
        default=CacheConfig.recurrent_state_dtype,
        help="Gated DeltaNet state between steps: float32 (as HF) or bfloat16 (half the "
        "bytes decode reads and writes for it, updated in fp32); models with GDN layers only",
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
        "--batch-invariant",
        action="store_true",
        help="CPU only: a sequence's logits the same bits whatever else its steps hold, "
        "however its prompt is chunked, decoded or recomputed (resumed streams match)",
    )
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt from scratch (no reuse of cached KV blocks)",
    )
    for flag, field, config, kind, text in _ENGINE_FLAGS:
        default = getattr(config, field)
        group.add_argument(flag, dest=field, type=kind, default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparrow", description="Sparrow: an inference engine for sparse MoE LLMs."
    )
    common = argparse.ArgumentParser(add_help=False)  # the flags of every command
    common.add_argument(
        "--log-level", choices=LEVELS, default="info", help="the least severe records logged"
    )
    sub = _Commands(parser.add_subparsers(dest="command", required=True), common)
    _add_generate(sub)
    _add_serve(sub)
    _add_worker(sub)
    _add_gateway(sub)
    ckpt = sub.add_parser("checkpoint", help="checkpoint tools")
    _add_checkpoint(
        _Commands(ckpt.add_subparsers(dest="checkpoint_command", required=True), common)
    )
    return parser


class _Commands:
    """Subparsers whose every command takes the common flags."""

    def __init__(self, sub, common: argparse.ArgumentParser):
        self.sub, self.common = sub, common

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self.sub.add_parser(name, parents=[self.common], **kwargs)


def _add_listen_args(parser: argparse.ArgumentParser, port: int) -> None:
    """Where a server listens (`serve`, `gateway`, `worker`)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)


def _add_queue_args(parser: argparse.ArgumentParser, refusal: str) -> None:
    """How many requests an engine server queues (`serve`, `worker`)."""
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help=f"queued requests before new ones get {refusal}",
    )


def _add_name_args(parser: argparse.ArgumentParser) -> None:
    """The model id an HTTP server answers to (`serve`, `gateway`)."""
    parser.add_argument("--served-model-name", help="the model id clients use (default: dir name)")


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
    gen.set_defaults(func="generate")


def _add_serve(sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_name_args(srv)
    _add_listen_args(srv, 8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    _add_http_args(srv)
    _add_queue_args(srv, "503 + Retry-After")
    _add_engine_args(srv)
    srv.set_defaults(func="serve")


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` and `gateway` share: limits, shutdown, parsers, media sources."""
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_S,
        help="seconds requests in flight get to finish after SIGTERM / SIGINT; meanwhile new "
        "ones get 503 + Retry-After and /health 503, then streams still open end with an error",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help="seconds a request body may take to arrive (408 past it; 0: no limit)",
    )
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
        choices=["auto", *sorted(PARSERS)],
        default=None,
        help="split chat completions into reasoning_content and content at "
        "the model's think markers (auto: the checkpoint's family's; default: all text is "
        "content)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["auto", "none", *sorted(TOOL_PARSERS)],
        default="auto",
        help="parse the model's tool calls into tool_calls (auto: the checkpoint's family's)",
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
    _add_response_store_args(parser)


def _add_response_store_args(parser: argparse.ArgumentParser) -> None:
    """Where /v1/responses keeps `store: true` responses (`serve`, `gateway`)."""
    parser.add_argument(
        "--responses-db",
        metavar="PATH",
        default=None,
        help="SQLite file of stored responses, kept across restarts (default: in memory, "
        "lost when the server stops, as vLLM's store)",
    )
    parser.add_argument(
        "--responses-db-max-mb",
        type=float,
        default=RESPONSES_MAX_MB,
        help="MiB of stored responses (their JSON) at most; the oldest are evicted first",
    )
    parser.add_argument(
        "--responses-ttl",
        type=float,
        default=RESPONSES_TTL_S,
        help="seconds a stored response is kept (0: no expiry)",
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
        help="the checkpoint the workers serve, a directory or Hub id (its tokenizer, chat "
        "template and preprocessing configs are read or downloaded, not its weights); "
        "None: the built-in small model",
    )
    _add_hub_args(gw)
    gw.add_argument("--policy", choices=POLICIES, default="cache_aware")
    _add_name_args(gw)
    _add_listen_args(gw, 8000)
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
    gw.set_defaults(func="gateway")


def _add_worker(sub) -> None:
    wrk = sub.add_parser(
        "worker",
        help="serve the engine over gRPC for a gateway",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_listen_args(wrk, 50051)
    _add_queue_args(wrk, "RESOURCE_EXHAUSTED")
    _add_engine_args(wrk)
    wrk.set_defaults(func="worker")


def _add_checkpoint(sub) -> None:
    from sparrow.loader.random_checkpoint import PRESETS

    rnd = sub.add_parser(
        "random",
        help="write a random-weight checkpoint in the layout of the family's release "
        "(with tokenizer)",
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
        help="experts the release keeps fused (Qwen3.5/3.6) as experts.E.{gate,up,down}_proj, "
        "as HF's save_pretrained writes them",
    )
    rnd.set_defaults(func="checkpoint_random")

    qnt = sub.add_parser(
        "quantize", help="quantise a float checkpoint and save it in MLX layout (4-bit default)"
    )
    qnt.add_argument("src", help="float checkpoint directory or Hub id (owner/name)")
    qnt.add_argument("out", help="output directory")
    _add_hub_args(qnt)
    qnt.add_argument("--quantize", choices=_QUANT, default="4bit")
    _add_device_args(qnt)
    qnt.set_defaults(func="checkpoint_quantize")


def _add_hub_args(parser) -> None:
    """Which snapshot of a Hub id and where it is kept (as vLLM's flags)."""
    parser.add_argument(
        "--revision", default=None, help="a Hub id's branch, tag or commit; None: main"
    )
    parser.add_argument(
        "--download-dir",
        default=None,
        help="where Hub snapshots are kept; None: the Hugging Face cache (HF_HUB_CACHE, else "
        "HF_HOME/hub). HF_HUB_OFFLINE=1 uses what is there, HF_TOKEN reads gated repos",
    )


def _add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on a GPU, float32 on a CPU"
    )
