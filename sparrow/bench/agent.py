"""Agent-shaped traffic through the HTTP server, with and without prefix caching, alternating
in one run (`python -m sparrow.bench.serve --workload agent`).

Two `sparrow serve` processes share the device (each with `--gpu-memory-utilization` of
`--memory-share`): one with prefix caching, one with `--no-prefix-caching`. C conversations run
at once against one of them, `--turns` turns each: turn 1 is a prefix every conversation shares
(`--prefix-len` tokens: a system prompt and tool definitions) plus the conversation's own
`--turn-len` tokens; turn k + 1 is turn k's prompt, the tokens it generated (sent back as
generated: `return_token_ids`) and `--turn-len` new ones. Each turn streams `--output-len`
tokens. `--api responses`: the same conversations as OpenAI Responses requests, text (a
word per drawn id), the prefix as `instructions`, turns chained by `previous_response_id`
(the server keeps each conversation; its next prompt extends the turn before), and at
concurrency 1 the prompt tokens each turn found in the prefix cache. Reported per server and
concurrency: time to first token of all turns, of first turns (the shared prefix at most
cached; the server's very first one also compiles kernels) and of later turns (each resumes
after the turn before: with prefix caching only its new tokens are computed), inter-token
latency (p50, p99), output tok/s of all conversations, and the server's
prefix-cache hit rate since it started and recurrent-state snapshots filed.

`python -m sparrow.bench.agent` (GPU): the engine alone, in this process, without HTTP: a
conversation's later turns on the cached prefix, each timed from `add_request` to its first
token (median of `--turns - 1` turns), with the Triton kernels each turn compiled; one such
turn's steps under the profiler: wall time against kernel time and launches, kernel time by
group (`bench.batch.GROUPS`), the host calls that wait for the device; and one under
cProfile (the host's Python).

    python -m sparrow.bench.agent --preset qwen3.6-35b-a3b --quantize 4bit \\
        --out bench-out/agent-engine.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import math
import pstats
import random
import statistics
import time
from collections import defaultdict

import httpx

VOCAB = (1000, 100000)  # prompt token ids are drawn in this range
# `--api responses` sends text: a word per drawn id
WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my"
).split()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


async def _turn(client: httpx.AsyncClient, base: str, prompt: list[int], output_len: int):
    """One streamed turn: (time to first token, inter-token gaps, generated ids)."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
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
    if args.api == "responses":
        return await _responses_conversation(client, base, prefix, rng, args)
    prompt, turns = list(prefix), []
    for _ in range(args.turns):
        prompt += [rng.randrange(*VOCAB) for _ in range(args.turn_len)]
        ttft, gaps, ids = await _turn(client, base, prompt, args.output_len)
        turns.append((ttft, gaps, len(ids), len(prompt), None))
        prompt += ids
    return turns


def words(ids: list[int]) -> str:
    """Token ids as text the server tokenises again: a word per id (`--api responses`)."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


async def _responses_conversation(
    client, base: str, prefix: list[int], rng: random.Random, args
) -> list:
    """The turns as OpenAI Responses requests: the shared prefix as `instructions`, each turn
    `--turn-len` new words as `input`, chained by `previous_response_id` (the server keeps
    the conversation). At concurrency 1 each turn also records the prompt tokens the server's
    prefix cache served (its hit-rate gauge before and after the turn)."""
    previous, turns = None, []
    for _ in range(args.turns):
        body = {
            "model": "bench",
            "instructions": words(prefix),
            "input": words([rng.randrange(*VOCAB) for _ in range(args.turn_len)]),
            "max_output_tokens": args.output_len,
            "temperature": 0,
            "stream": True,
            "previous_response_id": previous,
        }
        solo = args.concurrency_now == 1
        before = _hits(base) if solo else None
        t0 = time.perf_counter()
        stamps, done = [], None
        async with client.stream("POST", f"{base}/v1/responses", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: ") :])
                if event["type"].endswith(".delta"):
                    stamps.append(time.perf_counter())
                elif event["type"] in ("response.completed", "response.incomplete"):
                    done = event["response"]
        usage, previous = done["usage"], done["id"]
        hit = _hits(base) - before if solo else None
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        turns.append((stamps[0] - t0, gaps, usage["output_tokens"], usage["input_tokens"], hit))
    return turns


def repeat(base: str, prefix: list[int]) -> dict:
    """One Responses request (`store` false), then the same again: the prompt tokens the
    second found in the prefix cache."""
    body = {
        "model": "bench",
        "instructions": words(prefix),
        "input": words(prefix[:64]),
        "max_output_tokens": 1,
        "store": False,
    }
    hits = []
    for _ in range(2):
        before = _hits(base)
        r = httpx.post(f"{base}/v1/responses", json=body, timeout=None)
        r.raise_for_status()
        hits.append(_hits(base) - before)
    tokens = r.json()["usage"]["input_tokens"]
    return {"prompt_tokens": tokens, "first_hit_tokens": round(hits[0])} | {
        "second_hit_tokens": round(hits[1])
    }


def _hits(base: str) -> float:
    """Prompt tokens the server's prefix cache has served since it started: its hit rate
    over the prompt tokens it admitted (one client at a time: no preemption)."""
    found = gauges(base, "sparrow_prefix_cache_hit_rate", "sparrow_prompt_tokens_total")
    return (found["sparrow_prefix_cache_hit_rate"] or 0) * (
        found["sparrow_prompt_tokens_total"] or 0
    )


def gauges(base: str, *names: str) -> dict[str, float | None]:
    """The server's gauges of these names (None where it has none)."""
    found: dict[str, float | None] = dict.fromkeys(names)
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in found:
            found[name] = float(value)
    return found


async def run(base: str, concurrency: int, prefix: list[int], seed: int, args) -> dict:
    """C conversations at once on one server; their turns' latencies and throughput."""
    rngs = [random.Random(seed * 1000 + i) for i in range(concurrency)]
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        chats = await asyncio.gather(*(_conversation(client, base, prefix, r, args) for r in rngs))
        wall = time.perf_counter() - t0
    turns = [t for c in chats for t in c]
    per_turn = [
        {"turn": i + 1, "prompt_tokens": t[3], "hit_tokens": round(t[4])}
        | {"hit_rate": t[4] / t[3]}
        for c in chats
        for i, t in enumerate(c)
        if t[4] is not None
    ]
    ttft = [t[0] for t in turns]
    first = [c[0][0] for c in chats]
    later = [t[0] for c in chats for t in c[1:]]
    gaps = [g for t in turns for g in t[1]]
    return (
        {
            "concurrency": concurrency,
            "turns": len(turns),
            "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": _pct(ttft, 0.99),
            "ttft_first_p50_s": _pct(first, 0.5),
            "ttft_later_p50_s": _pct(later, 0.5),
            "ttft_later_p99_s": _pct(later, 0.99),
            "itl_p50_s": _pct(gaps, 0.5),
            "itl_p99_s": _pct(gaps, 0.99),
            "output_tok_s": sum(t[2] for t in turns) / wall,
        }
        | ({"per_turn": per_turn} if per_turn else {})
        | _cache_gauges(base)
    )


def _cache_gauges(base: str) -> dict:
    """The prefix cache's hit rate and recurrent-state snapshots filed, as the server reports
    them."""
    names = {
        "sparrow_prefix_cache_hit_rate": "prefix_hit_rate",
        "sparrow_prefix_cache_state_snapshots": "state_snapshots",
    }
    return {names[k]: v for k, v in gauges(base, *names).items()}


def workload(servers: dict[str, str], args) -> dict:
    """Every concurrency on every server, alternating servers round by round; medians of the
    rounds' rates, every round's rows kept."""
    prefix = [random.Random(args.seed).randrange(*VOCAB) for _ in range(args.prefix_len)]
    rows: dict[str, list[dict]] = {name: [] for name in servers}
    repeats = {}
    if args.api == "responses":
        for name, base in servers.items():
            repeats[name] = repeat(base, prefix)
            print(f"[agent] {name:>10} an identical request again: {repeats[name]}", flush=True)
    for c in map(int, args.concurrency.split(",")):
        args.concurrency_now = c
        for r in range(args.rounds):
            for name, base in servers.items():
                row = asyncio.run(run(base, c, prefix, args.seed + 7 * r + c, args))
                rows[name].append(row | {"round": r})
                print(
                    f"[agent] {name:>10} c={c:<3} round {r}: ttft p50 first turns "
                    f"{row['ttft_first_p50_s'] * 1e3:8.1f} ms, later turns "
                    f"{row['ttft_later_p50_s'] * 1e3:8.1f} ms (p99 "
                    f"{row['ttft_later_p99_s'] * 1e3:8.1f}) | itl p50 "
                    f"{row['itl_p50_s'] * 1e3:6.1f} ms | {row['output_tok_s']:8.1f} tok/s | "
                    f"hit rate {row['prefix_hit_rate']}, {row['state_snapshots']} snapshots",
                    flush=True,
                )
                for t in row.get("per_turn", []):
                    print(
                        f"[agent] {name:>10}   turn {t['turn']}: {t['hit_tokens']} of "
                        f"{t['prompt_tokens']} prompt tokens from the cache "
                        f"({t['hit_rate']:.1%})",
                        flush=True,
                    )
    return {
        "workload": "agent",
        "api": args.api,
        "prefix_len": args.prefix_len,
        "turn_len": args.turn_len,
        "output_len": args.output_len,
        "turns": args.turns,
        "rows": rows,
        "identical_repeat": repeats,
        "speedup": _speedups(rows),
    }


def _speedups(rows: dict[str, list[dict]]) -> dict[int, float]:
    """Output tok/s with the cache over without it, per concurrency (medians of rounds)."""

    def median_rate(name: str, c: int) -> float:
        return statistics.median(r["output_tok_s"] for r in rows[name] if r["concurrency"] == c)

    if set(rows) != {"cached", "uncached"}:
        return {}
    return {
        c: median_rate("cached", c) / median_rate("uncached", c)
        for c in sorted({r["concurrency"] for r in rows["cached"]})
    }


def _compiled() -> dict[str, int]:
    """Compiled variants per Triton kernel (specialisations by argument values included)."""
    import gc

    from triton.runtime.jit import JITFunction

    return {
        f"{fn.fn.__module__}.{fn.fn.__name__}": sum(
            len(cache[0]) for cache in fn.device_caches.values()
        )
        for fn in gc.get_objects()
        if isinstance(fn, JITFunction)
    }


def _first_token(llm, prompt: list[int], params) -> tuple[float, list[int]]:
    """Seconds from add_request to the first token, and every token generated."""
    t0 = time.perf_counter()
    llm.add_request(prompt, params)
    first, ids = None, []
    while llm.has_unfinished():
        for out in llm.step():
            ids += out.new_token_ids
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
    return first, ids


def engine_turns(args) -> dict:
    """Later turns' TTFT in the engine alone, and one later turn's steps profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sparrow.bench.batch import _group_of
    from sparrow.core.sampling_params import SamplingParams
    from sparrow.engine.llm import LLM
    from sparrow.loader.random_checkpoint import preset_dir

    model = {"model": str(preset_dir(args.preset)), "load_format": "dummy"} if args.preset else {}
    llm = LLM(
        **model,
        quantize=args.quantize,
        gpu_memory_utilization=args.memory_share,
        max_model_len=args.prefix_len + (args.turns + 2) * (args.turn_len + args.output_len),
    )
    rng, vocab = random.Random(args.seed), (100, min(VOCAB[1], llm.model.config.vocab_size))
    prompt = [rng.randrange(*vocab) for _ in range(args.prefix_len)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    first_tok = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    ttft, turns = [], []
    for turn in range(args.turns + 1):  # the last turn is profiled
        prompt += [rng.randrange(*vocab) for _ in range(args.turn_len)]
        if turn < args.turns:
            hits, before = llm.scheduler.kv.hits, _compiled()
            seconds, ids = _first_token(llm, prompt, params)
            new = {k: n - before.get(k, 0) for k, n in _compiled().items() if n > before.get(k, 0)}
            turns.append(
                {
                    "prompt": len(prompt),
                    "cached": llm.scheduler.kv.hits - hits,
                    "ttft_s": seconds,
                    "compiled": new,
                }
            )
            if turn > 0:
                ttft.append(seconds)
            print(
                f"[engine] turn {turn}: {len(prompt)} prompt tokens, "
                f"{turns[-1]['cached']} cached, TTFT {seconds * 1e3:.1f} ms, "
                f"compiled {new}",
                flush=True,
            )
            prompt += ids
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds, _ = _first_token(llm, prompt, first_tok)
        sync()
    groups: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(list)
    waits: dict[str, int] = defaultdict(int)  # host calls that wait for the device
    for event in prof.events():
        if any(w in event.name for w in ("Synchronize", "cudaMemcpy", "_local_scalar_dense")):
            waits[event.name] += 1
        if event.device_type.name == "CUDA":
            kernels[event.name].append(event.device_time_total)
            groups[_group_of(event.name)] += event.device_time_total
    prompt += [rng.randrange(*vocab) for _ in range(args.turn_len)]
    host = cProfile.Profile()
    host.enable()
    _first_token(llm, prompt, first_tok)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(40)
    busiest = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:25]
    report = {
        "preset": args.preset,
        "quantize": args.quantize,
        "prefix_len": args.prefix_len,
        "turn_len": args.turn_len,
        "output_len": args.output_len,
        "turns": turns,
        "ttft_later_s": ttft,
        "ttft_later_p50_s": statistics.median(ttft),
        "state_snapshots": llm.stats().state_snapshots,
        "profiled_ttft_s": seconds,
        "kernels": sum(len(t) for t in kernels.values()),
        "kernel_time_us": sum(groups.values()),
        "groups_us": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "top": [{"kernel": k[:90], "count": len(t), "us": round(sum(t), 1)} for k, t in busiest],
        "waits": dict(waits),
        "python_profile": text.getvalue(),
        "host_top": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
    }
    print(f"[engine] host calls that wait for the device: {dict(waits)}")
    print(
        f"[engine] later turns TTFT p50 {report['ttft_later_p50_s'] * 1e3:.1f} ms; profiled "
        f"turn {seconds * 1e3:.1f} ms wall, {report['kernel_time_us'] / 1e3:.1f} ms of "
        f"{report['kernels']} kernels: "
        + ", ".join(f"{k} {us / 1e3:.1f}" for k, us in report["groups_us"].items()),
        flush=True,
    )
    return report


def main(argv: list[str] | None = None) -> dict:
    from sparrow.eval.report import write_report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen3.6-35b-a3b", help="'' for the built-in model")
    p.add_argument("--quantize", default="4bit", help="'' for none")
    p.add_argument("--prefix-len", type=int, default=60000)
    p.add_argument("--turn-len", type=int, default=500)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--turns", type=int, default=4, help="turns before the profiled one")
    p.add_argument("--memory-share", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out/agent-engine.json")
    args = p.parse_args(argv)
    args.quantize = args.quantize or None
    report = engine_turns(args)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
