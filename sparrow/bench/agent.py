"""Agent-shaped traffic through the HTTP server, with and without prefix caching, alternating
in one run (`python -m sparrow.bench.serve --workload agent`).

Two `sparrow serve` processes share the device (each with `--gpu-memory-utilization` of
`--memory-share`): one with prefix caching, one with `--no-prefix-caching`. C conversations run
at once against one of them, `--turns` turns each: turn 1 is a prefix every conversation shares
(`--prefix-len` tokens: a system prompt and tool definitions) plus the conversation's own
`--turn-len` tokens; turn k + 1 is turn k's prompt, the tokens it generated (sent back as
generated: `return_token_ids`) and `--turn-len` new ones. Each turn streams `--output-len`
tokens. Reported per server and concurrency: time to first token of all turns, of first turns
(the shared prefix at most cached; the server's very first one also compiles kernels) and of
later turns (each resumes after the turn before: with prefix caching only its new tokens are
computed), inter-token latency (p50, p99), output tok/s of all conversations, and the server's
prefix-cache hit rate since it started.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time

import httpx

VOCAB = (1000, 100000)  # prompt token ids are drawn in this range


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


async def _turn(client: httpx.AsyncClient, base: str, prompt: list[int], output_len: int):
    """One streamed turn: (time to first token, inter-token gaps, generated ids)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    stamps, ids = [], []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :]).get("choices", []):
                if choice.get("token_ids"):
                    ids += choice["token_ids"]
                    stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - t0, gaps, ids


async def _conversation(client, base: str, prefix: list[int], rng: random.Random, args) -> list:
    prompt, turns = list(prefix), []
    for _ in range(args.turns):
        prompt += [rng.randrange(*VOCAB) for _ in range(args.turn_len)]
        ttft, gaps, ids = await _turn(client, base, prompt, args.output_len)
        turns.append((ttft, gaps, len(ids)))
        prompt += ids
    return turns


def hit_rate(base: str) -> float | None:
    """The server's `sparrow_prefix_cache_hit_rate` gauge."""
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("sparrow_prefix_cache_hit_rate "):
            return float(line.split()[1])
    return None


async def run(base: str, concurrency: int, prefix: list[int], seed: int, args) -> dict:
    """C conversations at once on one server; their turns' latencies and throughput."""
    rngs = [random.Random(seed * 1000 + i) for i in range(concurrency)]
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        chats = await asyncio.gather(*(_conversation(client, base, prefix, r, args)
                                          for r in rngs))  # fmt: skip
        wall = time.perf_counter() - t0
    turns = [t for c in chats for t in c]
    ttft = [t[0] for t in turns]
    first = [c[0][0] for c in chats]
    later = [t[0] for c in chats for t in c[1:]]
    gaps = [g for t in turns for g in t[1]]
    return {"concurrency": concurrency, "turns": len(turns),
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": _pct(ttft, 0.99),
            "ttft_first_p50_s": _pct(first, 0.5), "ttft_later_p50_s": _pct(later, 0.5),
            "ttft_later_p99_s": _pct(later, 0.99),
            "itl_p50_s": _pct(gaps, 0.5), "itl_p99_s": _pct(gaps, 0.99),
            "output_tok_s": sum(t[2] for t in turns) / wall,
            "prefix_hit_rate": hit_rate(base)}  # fmt: skip


def workload(servers: dict[str, str], args) -> dict:
    """Every concurrency on every server, alternating servers round by round; medians of the
    rounds' rates, every round's rows kept."""
    prefix = [random.Random(args.seed).randrange(*VOCAB) for _ in range(args.prefix_len)]
    rows: dict[str, list[dict]] = {name: [] for name in servers}
    for c in map(int, args.concurrency.split(",")):
        for r in range(args.rounds):
            for name, base in servers.items():
                row = asyncio.run(run(base, c, prefix, args.seed + 7 * r + c, args))
                rows[name].append(row | {"round": r})
                print(f"[agent] {name:>10} c={c:<3} round {r}: ttft p50 first turns "
                      f"{row['ttft_first_p50_s'] * 1e3:8.1f} ms, later turns "
                      f"{row['ttft_later_p50_s'] * 1e3:8.1f} ms (p99 "
                      f"{row['ttft_later_p99_s'] * 1e3:8.1f}) | itl p50 "
                      f"{row['itl_p50_s'] * 1e3:6.1f} ms | {row['output_tok_s']:8.1f} tok/s | "
                      f"hit rate {row['prefix_hit_rate']}", flush=True)  # fmt: skip
    return {"workload": "agent", "prefix_len": args.prefix_len, "turn_len": args.turn_len,
            "output_len": args.output_len, "turns": args.turns, "rows": rows,
            "speedup": _speedups(rows)}  # fmt: skip


def _speedups(rows: dict[str, list[dict]]) -> dict[int, float]:
    """Output tok/s with the cache over without it, per concurrency (medians of rounds)."""
    def median_rate(name: str, c: int) -> float:
        return statistics.median(r["output_tok_s"] for r in rows[name] if r["concurrency"] == c)

    if set(rows) != {"cached", "uncached"}:
        return {}
    return {c: median_rate("cached", c) / median_rate("uncached", c)
            for c in sorted({r["concurrency"] for r in rows["cached"]})}  # fmt: skip
