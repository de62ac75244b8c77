"""The gateway: media preprocessing throughput in its process pool, and routing over workers
by policy (CPU; the workers run the built-in model unless `--model` names another).

Preprocessing: a 1280x720 JPEG and a 10 s 720p H.264 clip (`bench.media.sample_media`) as
data URLs through `MediaPipeline.load` on a spawned process pool of each `--processes`
size, `--items` at once: images/s and clips/s.

Routing: `--workers` `sparrow worker` processes and a `sparrow gateway` per policy in front
of them (plus one over a single worker, the scaling baseline); C streaming clients each
send `--requests` completions whose token-id prompts share a `--prefix` and differ after it
(greedy, `ignore_eos`): time to first token p50 / p99 and output tok/s of all clients.

    python -m sparrow.bench.gateway --out bench-out/gateway.json

`--overhead` (GPU): the gateway's cost against `sparrow serve` on one model: `sparrow serve`
and one `sparrow worker` behind a `sparrow gateway`, both up on the same device, take the
same load in turn (C streaming clients at each `--concurrency` as above), `--rounds` times.
`--preset` serves random weights of a built-in config (`--quantize 4bit` for the 4-bit model):

    python -m sparrow.bench.gateway --overhead --preset qwen3.6-35b-a3b --quantize 4bit \
        --concurrency 1 8 32 64 --out bench-out/gateway-gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import math
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

from sparrow.assets import default_checkpoint
from sparrow.bench.media import sample_media
from sparrow.bench.serve import PROMPT_IDS, one_request, wait_healthy
from sparrow.eval.report import write_report
from sparrow.gateway.policies import POLICIES
from sparrow.loader.random_checkpoint import PRESETS, preset_dir
from sparrow.multimodal import QWEN3_5_MOE, MediaLimits
from sparrow.multimodal.pipeline import MediaPipeline, media_pool
from sparrow.multimodal.video import QWEN3_5_MOE_VIDEO
from sparrow.net import free_port


def preprocessing(processes: list[int], items: int) -> list[dict]:
    """Images/s and clips/s through the process pool at each size."""
    jpeg, clip = sample_media()
    urls = {
        False: "data:image/jpeg;base64," + base64.b64encode(jpeg).decode(),
        True: "data:video/mp4;base64," + base64.b64encode(clip).decode(),
    }
    pipeline = MediaPipeline(QWEN3_5_MOE, QWEN3_5_MOE_VIDEO, MediaLimits(max_bytes=64 << 20))
    rows = []
    for n in processes:
        with media_pool(n) as pool:
            row = {"processes": n}
            for video in (False, True):
                list(pool.map(pipeline.load, [video] * n, [urls[video]] * n))  # warm-up
                t0 = time.perf_counter()
                list(pool.map(pipeline.load, [video] * items, [urls[video]] * items))
                row["clips_per_s" if video else "images_per_s"] = items / (time.perf_counter() - t0)
            rows.append(row)
            print(
                f"[gateway] {n} processes: {row['images_per_s']:.1f} images/s, "
                f"{row['clips_per_s']:.2f} clips/s",
                flush=True,
            )
    return rows


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sparrow.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _load(
    base: str, prompts: list[list[int]], concurrency: int, requests: int, max_tokens: int
) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        queue = iter(prompts)

        async def client_loop():
            return [
                await one_request(client, base, next(queue), max_tokens) for _ in range(requests)
            ]

        t0 = time.perf_counter()
        results = [
            r
            for rs in await asyncio.gather(*(client_loop() for _ in range(concurrency)))
            for r in rs
        ]
        wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, math.ceil(0.99 * len(ttft)) - 1)],
        "output_tok_s": sum(r[2] for r in results) / wall,
    }


def routing(args) -> list[dict]:
    """Each policy over all workers, and round-robin over one, at each concurrency."""
    model = ["--model", args.model] if args.model else []
    ports = [free_port() for _ in range(args.workers)]
    workers = [
        _start("worker", "--device", "cpu", "--port", str(p), "--max-model-len", "4096", *model)
        for p in ports
    ]
    prompts_for = _prompts(args.prefix)
    rows = []
    try:
        runs = [(policy, ports) for policy in args.policies] + [("round_robin", ports[:1])]
        for policy, over in runs:
            port = free_port()
            gateway = _start(
                "gateway",
                "--port",
                str(port),
                "--policy",
                policy,
                *model,
                "--served-model-name",
                "bench",
                *[a for p in over for a in ("--worker", f"127.0.0.1:{p}")],
            )
            base = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(gateway, base, 300)
                time.sleep(2.0)  # every worker polled healthy
                for row in _measure(
                    base,
                    prompts_for,
                    args.concurrency,
                    args.requests,
                    args.max_tokens,
                    warm=4 * len(over),
                ):
                    row = {"policy": policy, "workers": len(over)} | row
                    rows.append(row)
                    print(
                        f"[gateway] {policy:>12} x{len(over)} C={row['concurrency']:<3} TTFT p50 "
                        f"{row['ttft_p50_s'] * 1e3:7.1f} ms p99 {row['ttft_p99_s'] * 1e3:7.1f}"
                        f" ms  {row['output_tok_s']:7.1f} tok/s",
                        flush=True,
                    )
            finally:
                gateway.terminate()
                gateway.wait(30)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)
    return rows


def _prompts(prefix_len: int):
    """n -> n token-id prompts sharing a random prefix of prefix_len, then 16 of their own."""
    rng = random.Random(0)
    prefix = [rng.randrange(*PROMPT_IDS) for _ in range(prefix_len)]
    return lambda n: [prefix + [rng.randrange(*PROMPT_IDS) for _ in range(16)] for _ in range(n)]


def _warm(base: str, prompts_for, n: int) -> None:
    """n short requests at once: kernels compiled, caches warm."""
    asyncio.run(_load(base, prompts_for(n), n, 1, 4))


def _measure(
    base: str, prompts_for, concurrency: list[int], requests: int, max_tokens: int, warm: int = 4
) -> list[dict]:
    """`warm` requests at once (`_warm`; 0: none), then the load at each concurrency
    (`prompts_for(n)`: n prompts)."""
    if warm:
        _warm(base, prompts_for, warm)
    return [
        asyncio.run(_load(base, prompts_for(c * requests), c, requests, max_tokens))
        for c in concurrency
    ]


def overhead(args) -> dict:
    """`sparrow serve`, and a worker behind a gateway, up at once on the same model (each
    with `--memory-share` of the device): the same load on each in turn, `--rounds` times
    alternating; rows per round, and the gateway's TTFT and tok/s against serve's at each
    concurrency (medians of the rounds)."""
    model = (
        ["--model", args.model]
        + (["--load-format", "dummy"] if args.preset else [])
        + (["--quantize", args.quantize] if args.quantize else [])
    )
    engine = [
        *model,
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        str(max(args.concurrency)),
        "--gpu-memory-utilization",
        str(args.memory_share),
    ]
    ports = {"serve": free_port(), "gateway": free_port()}
    worker_port = free_port()
    procs = {
        "serve": _start(
            "serve", "--port", str(ports["serve"]), "--served-model-name", "bench", *engine
        ),
        "worker": _start("worker", "--port", str(worker_port), *engine),
        "gateway": _start(
            "gateway",
            "--port",
            str(ports["gateway"]),
            "--model",
            args.model,
            "--served-model-name",
            "bench",
            "--worker",
            f"127.0.0.1:{worker_port}",
        ),
    }
    bases = {side: f"http://127.0.0.1:{port}" for side, port in ports.items()}
    rows: dict[str, list[dict]] = {side: [] for side in bases}
    prompts_for = _prompts(args.prefix)
    try:
        for side, base in bases.items():
            wait_healthy(procs[side], base, args.start_timeout)
        time.sleep(2.0)  # the gateway has polled its worker healthy
        for base in bases.values():
            _warm(base, prompts_for, 4)
        for c in args.concurrency:
            for r in range(args.rounds):
                for side, base in bases.items():
                    row = _measure(base, prompts_for, [c], args.requests, args.max_tokens, warm=0)[
                        0
                    ] | {"round": r}
                    rows[side].append(row)
                    print(
                        f"[gateway] {side:>8} C={c:<3} round {r}: TTFT p50 "
                        f"{row['ttft_p50_s'] * 1e3:7.1f} ms  {row['output_tok_s']:8.1f} tok/s",
                        flush=True,
                    )
    finally:
        for proc in reversed(procs.values()):
            proc.terminate()
            proc.wait(60)

    def median(side: str, c: int, key: str) -> float:
        return statistics.median(r[key] for r in rows[side] if r["concurrency"] == c)

    ratios = [
        {
            "concurrency": c,
            "ttft_added_ms": (median("gateway", c, "ttft_p50_s") - median("serve", c, "ttft_p50_s"))
            * 1e3,
            "output_tok_s_ratio": median("gateway", c, "output_tok_s")
            / median("serve", c, "output_tok_s"),
        }
        for c in args.concurrency
    ]
    return {
        "model": args.preset or args.model,
        "quantize": args.quantize,
        **rows,
        "gateway_vs_serve": ratios,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: built-in)")
    p.add_argument("--processes", type=int, nargs="*", default=[1, os.cpu_count() or 1])
    p.add_argument("--items", type=int, default=8, help="media items per measurement")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policies", nargs="*", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 8])
    p.add_argument("--requests", type=int, default=4, help="per client")
    p.add_argument("--prefix", type=int, default=512, help="tokens every prompt shares")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--skip-media", action="store_true")
    p.add_argument(
        "--overhead",
        action="store_true",
        help="the gateway against `sparrow serve` on one model (GPU)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="random weights of a built-in config (with --overhead)",
    )
    p.add_argument("--quantize", default=None, help="with --overhead: 4bit or 8bit")
    p.add_argument("--rounds", type=int, default=3, help="with --overhead: alternating rounds")
    p.add_argument(
        "--memory-share",
        type=float,
        default=0.45,
        help="with --overhead: --gpu-memory-utilization of serve and of the worker",
    )
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", default="bench-out/gateway.json")
    args = p.parse_args(argv)
    if args.overhead:
        if args.preset:
            args.model = str(preset_dir(args.preset))
        if args.model is None:
            args.model = str(default_checkpoint())
        report = overhead(args)
        write_report(args.out, report)
        return report
    report = {
        "preprocessing": [] if args.skip_media else preprocessing(args.processes, args.items),
        "routing": routing(args),
        "cpus": os.cpu_count(),
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
