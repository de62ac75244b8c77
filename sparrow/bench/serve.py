"""The HTTP server under load: time to first token and output tok/s by concurrency, and the
cost of the HTTP path against the offline engine at concurrency 1.

First the offline engine (`sparrow.LLM`, in this process) runs the same requests one at a
time; then `sparrow serve` starts in a subprocess on the same model and C streaming clients
(`/v1/completions` with token-id prompts, greedy, `ignore_eos`) each send `--requests`
requests back to back. Per request: time to the first streamed token, decode tok/s after
it; per concurrency: output tok/s of all clients together.

    python -m sparrow.bench.serve --preset qwen3.6-35b-a3b --quantize 4bit \\
        --concurrency 1,8,32 --out bench-out/serve.json

`--workload image`: time to first token of chat requests with one 1280x720 JPEG each (a
different image every time: no prefix-cache hit) against the same chat without it, one at a
time.

`--preset` serves random weights for a built-in config (`--load-format dummy` on a directory
holding only its config.json; the tokenizer is the packaged Qwen3.5/3.6 vocabulary).

`--workload agent`: conversations sharing a long prefix, several turns each, against a server with
prefix caching and one without, alternating (`sparrow.bench.agent`):

    python -m sparrow.bench.serve --workload agent --preset qwen3.6-35b-a3b --quantize 4bit \\
        --concurrency 1,8,32 --out bench-out/agent.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import httpx
import torch

from sparrow.bench import agent
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.eval.report import write_report
from sparrow.loader.random_checkpoint import PRESETS, preset_dir
from sparrow.net import free_port

# prompt token ids are drawn from this range: ids of every served vocabulary (the built-in
# model has 4,096)
PROMPT_IDS = (100, 4000)


def offline(args, prompt: list[int]) -> dict:
    """Decode tok/s of the engine in this process, one request at a time."""
    llm = LLM(
        args.model,
        quantize=args.quantize,
        load_format=args.load_format,
        enable_prefix_caching=False,
    )  # the requests repeat one prompt
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for _ in range(args.requests + 1):  # the first warms up
        llm.add_request(prompt, params)
        t0 = time.perf_counter()
        first = None
        while llm.has_unfinished():
            if any(o.new_token_ids for o in llm.step()) and first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        rows.append((first - t0, (args.max_tokens - 1) / (end - first)))
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    rows = rows[1:]
    return {
        "ttft_s": statistics.median(r[0] for r in rows),
        "decode_tok_s": statistics.median(r[1] for r in rows),
    }


def start_server(
    args, extra: tuple[str, ...] = ("--no-prefix-caching",)
) -> tuple[subprocess.Popen, str]:
    """`sparrow serve` on the benchmark's model (by default without prefix caching: the
    requests repeat one prompt), once /health answers."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sparrow",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--max-waiting",
        "4096",
        "--load-format",
        args.load_format,
        *extra,
    ]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--quantize", args.quantize] if args.quantize else []
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, args.start_timeout)
    return proc, base


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    """Return once the server at `base` answers /health; RuntimeError (the process killed)
    if it exits or does not answer within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout} s")


async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int):
    """Stream one completion. Returns (time to first token, decode tok/s after it, tokens)."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first or last
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return first - t0, decode, tokens


async def load(base: str, prompt: list[int], concurrency: int, requests: int, max_tokens: int):
    async with httpx.AsyncClient(timeout=None) as client:

        async def worker():
            return [await one_request(client, base, prompt, max_tokens) for _ in range(requests)]

        # warm-up at this concurrency: the first prefill of C prompts together compiles
        # kernels for its shapes (seen on the H200: 1.5 s of TTFT at C = 8 without it)
        await asyncio.gather(*(one_request(client, base, prompt, 4) for _ in range(concurrency)))
        t0 = time.perf_counter()
        results = [
            r for rs in await asyncio.gather(*(worker() for _ in range(concurrency))) for r in rs
        ]
        wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": ttft[math.ceil(0.9 * len(ttft)) - 1],
        "decode_tok_s_per_request": statistics.median(r[1] for r in results),
        "output_tok_s": sum(r[2] for r in results) / wall,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: built-in)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="random weights for this config instead of a checkpoint",
    )
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    p.add_argument("--quantize", default=None)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument(
        "--workload",
        choices=("repeat", "agent", "image"),
        default="repeat",
        help="repeat: one prompt again and again; agent: chats on a shared prefix; "
        "image: chats with an image against chats without",
    )
    p.add_argument("--prefix-len", type=int, default=60000, help="agent: the shared prefix")
    p.add_argument("--turn-len", type=int, default=500, help="agent: new tokens per turn")
    p.add_argument("--output-len", type=int, default=200, help="agent: tokens per turn")
    p.add_argument("--turns", type=int, default=3, help="agent: turns per conversation")
    p.add_argument("--rounds", type=int, default=1, help="agent: rounds per concurrency")
    p.add_argument(
        "--api",
        choices=("completions", "responses"),
        default="completions",
        help="agent: token ids to /v1/completions, or text to /v1/responses (turns chained "
        "by previous_response_id)",
    )
    p.add_argument(
        "--memory-share",
        type=float,
        default=0.45,
        help="agent: --gpu-memory-utilization of each of the two servers",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out/serve.json")
    args = p.parse_args(argv)
    if args.preset:  # a directory with just the config: weights are drawn at load time
        args.model = str(preset_dir(args.preset))
        args.load_format = "dummy"
    if args.workload == "agent":
        return agent_main(args)
    if args.workload == "image":
        return image_main(args)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(*PROMPT_IDS, (args.prompt_len,), generator=gen).tolist()

    base_line = offline(args, prompt)
    proc, base = start_server(args)
    try:
        rows = [
            asyncio.run(load(base, prompt, int(c), args.requests, args.max_tokens))
            for c in args.concurrency.split(",")
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    c1 = next((r for r in rows if r["concurrency"] == 1), None)
    overhead = 1 - c1["decode_tok_s_per_request"] / base_line["decode_tok_s"] if c1 else None
    report = {
        "model": args.preset or args.model or "built-in default",
        "quantize": args.quantize,
        "load_format": args.load_format,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "offline": base_line,
        "server": rows,
        "http_decode_overhead_c1": overhead,
    }
    print(
        f"offline (c=1): ttft {base_line['ttft_s'] * 1e3:.1f} ms, decode "
        f"{base_line['decode_tok_s']:.1f} tok/s"
    )
    print(
        f"{'clients':>8}{'ttft med ms':>13}{'ttft p90 ms':>13}{'dec tok/s/req':>15}"
        f"{'output tok/s':>14}"
    )
    for r in rows:
        ttft, p90 = r["ttft_median_s"] * 1e3, r["ttft_p90_s"] * 1e3
        print(
            f"{r['concurrency']:>8}{ttft:>13.1f}{p90:>13.1f}"
            f"{r['decode_tok_s_per_request']:>15.1f}{r['output_tok_s']:>14.1f}"
        )
    if overhead is not None:
        print(f"HTTP path vs offline decode at concurrency 1: {overhead:+.1%} slower")
    write_report(args.out, report)
    return report


def _jpeg_data_url(seed: int, width: int = 1280, height: int = 720) -> str:
    """A data URL of a JPEG: gradients shifted by seed, plus noise."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:height, :width]
    pixels = np.stack(
        [
            (x + 7 * seed) % 256,
            (y + 3 * seed) % 256,
            (x + y + rng.integers(0, 16, (height, width))) % 256,
        ],
        -1,
    )
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


async def chat_ttft(
    client: httpx.AsyncClient, base: str, image: str | None, max_tokens: int
) -> float:
    """Seconds to the first streamed token of one chat, with an image part if given."""
    content = [{"type": "text", "text": "Describe this picture in one sentence."}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }  # a token's arrival, whatever text it decodes to
    t0 = time.perf_counter()
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if any(c.get("token_ids") for c in json.loads(line[6:]).get("choices", [])):
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def image_main(args) -> dict:
    """TTFT with one image per chat against the same chat without, alternating."""
    images = [_jpeg_data_url(i) for i in range(args.requests + 1)]
    proc, base = start_server(args)

    async def run() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {"image": [], "text": []}
        async with httpx.AsyncClient(timeout=None) as client:
            for i, image in enumerate(images):  # the first of each warms up
                with_image = await chat_ttft(client, base, image, args.max_tokens)
                text = await chat_ttft(client, base, None, args.max_tokens)
                if i:
                    times["image"].append(with_image)
                    times["text"].append(text)
        return times

    try:
        times = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    report = {
        "model": args.preset or args.model or "built-in default",
        "quantize": args.quantize,
        "image": "1280x720 JPEG, one per chat",
        "requests": args.requests,
        **{f"ttft_{k}_median_s": statistics.median(v) for k, v in times.items()},
        "ttft_s": times,
    }
    print(
        f"TTFT median: with an image {report['ttft_image_median_s'] * 1e3:.1f} ms, "
        f"without {report['ttft_text_median_s'] * 1e3:.1f} ms ({args.requests} each)"
    )
    write_report(args.out, report)
    return report


def agent_main(args) -> dict:
    """The agent workload against a cached and an uncached server side by side."""
    share = ("--gpu-memory-utilization", str(args.memory_share))
    procs, servers = [], {}
    try:
        for name, extra in (("cached", share), ("uncached", (*share, "--no-prefix-caching"))):
            proc, base = start_server(args, extra)
            procs.append(proc)
            servers[name] = base
        report = agent.workload(servers, args)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=120)
    report |= {"model": args.preset or args.model or "built-in default", "quantize": args.quantize}
    for c, ratio in report["speedup"].items():
        print(f"[agent] concurrency {c}: output tok/s with prefix caching {ratio:.2f}x without")
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
