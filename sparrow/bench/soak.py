"""A soak test of the HTTP server: minutes of mixed traffic from C clients, every outcome
classified, the server's resident memory sampled throughout.

Each client loops over a seeded mix: chat and text completions, whole and streamed, with
max_tokens 1-64, n 1-2, stop strings and logprobs; streams the client hangs up on after a
few events; whole requests it cancels before the answer; and bad requests (malformed JSON,
wrong types, unknown model, over-long prompts, out-of-range parameters) that must get a 4xx.
Outcomes: ok (by what was sent), expected 4xx (by status) and unexpected (5xx, connection
errors, malformed bodies or SSE, a stream without [DONE], timeouts, bad requests accepted)
by kind. RSS comes from /proc/<pid>/status (VmRSS).

    python -m sparrow.bench.soak --spawn --minutes 10 --concurrency 16
    python -m sparrow.bench.soak --url http://127.0.0.1:8000 --pid 1234 --minutes 60

The exit code is 1 when any outcome was unexpected.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sparrow.eval.report import write_report
from sparrow.net import free_port

WORDS = (
    "the",
    "a",
    "river",
    "stone",
    "quick",
    "model",
    "token",
    "seven",
    "blue",
    "and",
    "of",
    "under",
    "light",
    "cache",
    "night",
    ".",
    ",",
    "\n",
)
STOPS = ("\n", ".", " the", "a", "ing", ",")
MAX_EXAMPLES = 20  # unexpected outcomes kept in the report with what was sent


class Unexpected(Exception):
    """An outcome the server should never give: its kind names it in the report."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind, self.detail = kind, detail


@dataclass
class Tally:
    """Outcome counts by class and kind, plus the first unexpected ones in full."""

    counts: dict[str, collections.Counter] = field(
        default_factory=lambda: {
            "ok": collections.Counter(),
            "expected_4xx": collections.Counter(),
            "unexpected": collections.Counter(),
        }
    )
    examples: list[dict] = field(default_factory=list)

    def add(self, cls: str, kind: str, action: str = "", detail: str = "") -> None:
        self.counts[cls][kind] += 1
        if cls == "unexpected" and len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"kind": kind, "action": action, "detail": detail[:500]})

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    def report(self, model: str, wall: float, health: int | str) -> dict:
        """The run's traffic and outcomes, as the soak and chaos reports state them."""
        return {
            "model": model,
            "duration_s": round(wall, 2),
            "requests": self.total,
            "requests_per_s": self.total / wall,
            "health_after": health,
            "outcomes": {cls: dict(sorted(c.items())) for cls, c in self.counts.items()},
            "unexpected_total": sum(self.counts["unexpected"].values()),
            "unexpected_examples": self.examples,
        }


# -- requests ------------------------------------------------------------------------------


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def valid_body(rng: random.Random, model: str, chat: bool) -> dict:
    """A request the server must answer: varied lengths, n, stops, sampling and logprobs."""
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(1, 64),
        "n": rng.randint(1, 2),
        "temperature": rng.choice((0.0, 0.7, 1.0, 1.3)),
        "top_p": rng.choice((1.0, 0.9, 0.5)),
    }
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.2:
        body["top_k"] = rng.randint(1, 50)
    if chat:
        body["messages"] = [{"role": "user", "content": _text(rng, rng.randint(1, 40))}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": _text(rng, 5)})
        if rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
    else:
        ids = [rng.randint(0, 4095) for _ in range(rng.randint(1, 60))]  # the built-in's ids
        body["prompt"] = _text(rng, rng.randint(1, 40)) if rng.random() < 0.7 else ids
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
    return body


def bad_request(rng: random.Random, model: str, long_prompt: int) -> tuple[str, str, str]:
    """(name, path, raw body) of a request that must get a 4xx."""
    msg = [{"role": "user", "content": "hi"}]
    chat = {"model": model, "messages": msg, "max_tokens": 4}
    text = {"model": model, "prompt": "hi", "max_tokens": 4}
    cases = {
        "malformed_json": ("/v1/chat/completions", '{"model": "' + model + '", "messages": [}'),
        "not_an_object": ("/v1/completions", "[1, 2, 3]"),
        "wrong_type_max_tokens": ("/v1/chat/completions", chat | {"max_tokens": "ten"}),
        "wrong_type_messages": ("/v1/chat/completions", chat | {"messages": "hi"}),
        "wrong_type_prompt": ("/v1/completions", text | {"prompt": {"a": 1}}),
        "unknown_model": ("/v1/completions", text | {"model": "gpt-9"}),
        "over_long_prompt": ("/v1/completions", text | {"prompt": [7] * long_prompt}),
        "max_tokens_over_context": ("/v1/chat/completions", chat | {"max_tokens": 10**9}),
        "temperature_negative": ("/v1/chat/completions", chat | {"temperature": -1}),
        "top_p_zero": ("/v1/completions", text | {"top_p": 0}),
        "n_too_big": ("/v1/chat/completions", chat | {"n": 17}),
        "max_tokens_zero": ("/v1/completions", text | {"max_tokens": 0}),
        "top_logprobs_too_many": (
            "/v1/chat/completions",
            chat | {"logprobs": True, "top_logprobs": 21},
        ),
        "too_many_stops": ("/v1/completions", text | {"stop": ["a", "b", "c", "d", "e"]}),
        "empty_messages": ("/v1/chat/completions", chat | {"messages": []}),
        "token_id_out_of_vocab": ("/v1/completions", text | {"prompt": [-1, 10**9]}),
    }
    name = rng.choice(sorted(cases))
    path, body = cases[name]
    return name, path, body if isinstance(body, str) else json.dumps(body)


# -- checks --------------------------------------------------------------------------------


def check_whole(response: httpx.Response, body: dict) -> None:
    """A whole response: 200, JSON, n choices that each finished, usage within max_tokens."""
    if response.status_code != 200:
        raise Unexpected(_status_kind(response.status_code), response.text[:300])
    try:
        out = response.json()
    except ValueError as e:
        raise Unexpected("malformed_body", response.text[:300]) from e
    choices = out.get("choices") or []
    if len(choices) != body["n"] or any(
        c.get("finish_reason") not in ("stop", "length") for c in choices
    ):
        raise Unexpected("malformed_body", json.dumps(out)[:300])
    used = (out.get("usage") or {}).get("completion_tokens", -1)
    if not 0 <= used <= body["max_tokens"] * body["n"]:
        raise Unexpected("malformed_body", f"usage {out.get('usage')}")


def parse_event(line: str) -> dict | str | None:
    """One SSE line: the chunk, "[DONE]", or None for a blank line; Unexpected otherwise."""
    if not line:
        return None
    if not line.startswith("data: "):
        raise Unexpected("malformed_sse", line[:200])
    data = line[len("data: ") :]
    if data == "[DONE]":
        return data
    try:
        chunk = json.loads(data)
    except ValueError as e:
        raise Unexpected("malformed_sse", data[:200]) from e
    if "error" in chunk:
        raise Unexpected("stream_error", json.dumps(chunk["error"])[:300])
    if not isinstance(chunk.get("choices"), list):
        raise Unexpected("malformed_sse", data[:200])
    return chunk


def _status_kind(status: int) -> str:
    return f"http_{status}" if status >= 500 else f"rejected_valid_{status}"


# -- one worker ----------------------------------------------------------------------------


@dataclass
class Soak:
    """Shared state of a run: where, until when, what was seen."""

    client: httpx.AsyncClient
    base: str
    model: str
    deadline: float
    max_requests: int | None
    long_prompt: int
    tally: Tally = field(default_factory=Tally)
    started: int = 0

    def more(self) -> bool:
        if self.max_requests is not None and self.started >= self.max_requests:
            return False
        self.started += 1
        return time.monotonic() < self.deadline


async def stream(soak: Soak, path: str, body: dict, hang_up_after: int | None) -> str:
    """Stream a request to [DONE] (every choice must finish) or, with `hang_up_after`, close
    it after that many events. Returns the ok kind."""
    body = body | {"stream": True}
    seen, finished = 0, set()
    async with soak.client.stream("POST", soak.base + path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise Unexpected(_status_kind(response.status_code), response.text[:300])
        async for line in response.aiter_lines():
            event = parse_event(line)
            if event is None:
                continue
            if event == "[DONE]":
                if len(finished) < body["n"]:
                    raise Unexpected("unfinished_choice", f"{sorted(finished)} of n={body['n']}")
                return "stream"
            seen += 1
            finished |= {c["index"] for c in event["choices"] if c.get("finish_reason")}
            if hang_up_after is not None and seen >= hang_up_after:
                return "disconnect"  # leaving the block closes the connection mid-stream
    if hang_up_after is not None and finished:
        return "disconnect_after_end"  # the stream ended before the client hung up
    raise Unexpected("missing_done", f"{seen} events")


async def one(soak: Soak, rng: random.Random) -> tuple[str, str]:
    """Send one request drawn from the mix. Returns (class, kind); raises Unexpected."""
    roll, chat = rng.random(), rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = valid_body(rng, soak.model, chat)
    prefix = "chat_" if chat else "text_"
    if roll < 0.30:
        check_whole(await soak.client.post(soak.base + path, json=body), body)
        return "ok", prefix + "whole"
    if roll < 0.60:
        return "ok", prefix + await stream(soak, path, body, None)
    if roll < 0.72:
        body["max_tokens"] = rng.randint(16, 64)
        return "ok", prefix + await stream(soak, path, body, rng.randint(1, 4))
    if roll < 0.82:
        body["max_tokens"] = rng.randint(16, 64)
        request = soak.client.post(soak.base + path, json=body)
        try:
            response = await asyncio.wait_for(request, timeout=rng.uniform(0.005, 0.2))
        except TimeoutError:
            return "ok", prefix + "cancelled"
        check_whole(response, body)
        return "ok", prefix + "whole"
    name, path, raw = bad_request(rng, soak.model, soak.long_prompt)
    response = await soak.client.post(
        soak.base + path, content=raw, headers={"Content-Type": "application/json"}
    )
    if 400 <= response.status_code < 500:
        return "expected_4xx", str(response.status_code)
    kind = f"http_{response.status_code}" if response.status_code >= 500 else "bad_accepted"
    raise Unexpected(kind, f"{name}: {response.text[:300]}")


async def worker(soak: Soak, seed: int) -> None:
    rng = random.Random(seed)
    while soak.more():
        try:
            cls, kind = await one(soak, rng)
            soak.tally.add(cls, kind)
        except Unexpected as e:
            soak.tally.add("unexpected", e.kind, "request", e.detail)
        except httpx.TimeoutException as e:
            soak.tally.add("unexpected", "timeout", "request", repr(e))
        except httpx.HTTPError as e:
            soak.tally.add("unexpected", f"connection_{type(e).__name__}", "request", repr(e))


# -- memory --------------------------------------------------------------------------------


def rss_mb(pid: int) -> float | None:
    """Resident set size of `pid` in MB (VmRSS of /proc/<pid>/status); None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def sample_rss(pid: int, every_s: float, t0: float, series: list) -> None:
    while True:
        mb = rss_mb(pid)
        if mb is not None:
            series.append((round(time.monotonic() - t0, 2), round(mb, 1)))
        await asyncio.sleep(every_s)


def rss_summary(
    series: list[tuple[float, float]], warmup_s: float, window_s: float = 60.0
) -> dict | None:
    """The series; the first sample after warm-up against the max and the last; and the
    floor (lowest sample) of the first and the last `window_s` after warm-up: a step's
    temporaries (logits and sampling over the vocabulary) swing single samples by hundreds
    of MB, while what a request leaves behind raises the floor."""
    if not series:
        return None
    warm = next((mb for t, mb in series if t >= warmup_s), series[-1][1])
    peak, last = max(mb for _, mb in series), series[-1][1]
    after = [(t, mb) for t, mb in series if t >= warmup_s] or series[-1:]
    first = min(mb for t, mb in after if t < after[0][0] + window_s)
    final = min(mb for t, mb in after if t > after[-1][0] - window_s)
    return {
        "series": series,
        "warmup_s": warmup_s,
        "after_warmup_mb": warm,
        "max_mb": peak,
        "last_mb": last,
        "growth_pct": 100 * (last - warm) / warm,
        "max_growth_pct": 100 * (peak - warm) / warm,
        "floor_first_mb": first,
        "floor_last_mb": final,
        "floor_growth_pct": 100 * (final - first) / first,
    }


# -- the run -------------------------------------------------------------------------------


def spawn_server(timeout_s: float, log) -> tuple[subprocess.Popen, str]:
    """`sparrow serve` on the built-in model on a free port, once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "sparrow", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


async def soak_run(args, base: str, pid: int | None) -> dict:
    """Drive the traffic; returns the report (without the run's settings)."""
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        t0 = time.monotonic()
        soak = Soak(
            client, base, model, t0 + args.minutes * 60, args.requests, args.long_prompt_tokens
        )
        series: list = []
        sampler = asyncio.create_task(sample_rss(pid, args.sample_s, t0, series)) if pid else None
        await asyncio.gather(*(worker(soak, args.seed * 1000 + i) for i in range(args.concurrency)))
        wall = time.monotonic() - t0
        if sampler:
            sampler.cancel()
            if (mb := rss_mb(pid)) is not None:
                series.append((round(wall, 2), round(mb, 1)))
        health = await _health(client, base, soak.tally)
    warmup = args.warmup_s if args.warmup_s is not None else 0.2 * wall
    return soak.tally.report(model, wall, health) | {"rss": rss_summary(series, warmup)}


async def _health(client: httpx.AsyncClient, base: str, tally: Tally) -> int | str:
    """/health after the traffic; anything but 200 counts as unexpected."""
    try:
        status = (await client.get(f"{base}/health", timeout=10)).status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    if status != 200:
        tally.add("unexpected", "unhealthy_after", "GET /health", str(status))
    return status


def print_table(report: dict) -> None:
    rate, health = report["requests_per_s"], report["health_after"]
    print(
        f"{report['requests']} requests in {report['duration_s']:.1f} s ({rate:.1f}/s), "
        f"/health after: {health}"
    )
    print(f"{'class':<14}{'kind':<34}{'count':>8}")
    for cls, counts in report["outcomes"].items():
        for kind, n in counts.items():
            print(f"{cls:<14}{kind:<34}{n:>8}")
    for e in report["unexpected_examples"][:5]:
        print(f"  unexpected {e['kind']}: {e['detail'][:160]}")
    rss = report["rss"]
    if rss:
        print(
            f"RSS MB: after warm-up ({rss['warmup_s']:.0f} s) {rss['after_warmup_mb']:.1f}, "
            f"max {rss['max_mb']:.1f}, last {rss['last_mb']:.1f}, growth "
            f"{rss['growth_pct']:+.1f}% (max {rss['max_growth_pct']:+.1f}%); floor of the "
            f"first / last minute {rss['floor_first_mb']:.1f} / {rss['floor_last_mb']:.1f} "
            f"({rss['floor_growth_pct']:+.1f}%)"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    p.add_argument("--pid", type=int, default=None, help="its process id, for RSS (with --url)")
    p.add_argument(
        "--spawn",
        action="store_true",
        help="start `sparrow serve` (built-in model) on a free port, stop it after",
    )
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="RSS baseline: first sample after this (default: 20%% of the run)",
    )
    p.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling period")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=300_000,
        help="token ids in the over-long prompt (over the built-in's 262144)",
    )
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default="bench-out/soak.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print the table, write the report. Returns 1 on unexpected outcomes."""
    args = parse_args(argv)
    proc = None
    with tempfile.TemporaryFile("w+") as log:
        if args.spawn:
            proc, base = spawn_server(args.start_timeout, log)
            pid = proc.pid
        else:
            base, pid = args.url.rstrip("/"), args.pid
        try:
            report = asyncio.run(soak_run(args, base, pid))
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if proc is not None and report["unexpected_total"]:
            log.seek(0)
            report["server_log_tail"] = log.read()[-4000:]
    report = {
        "url": base,
        "spawned": args.spawn,
        "minutes": args.minutes,
        "requests_cap": args.requests,
        "concurrency": args.concurrency,
        "seed": args.seed,
    } | report
    print_table(report)
    write_report(args.out, report)
    return 1 if report["unexpected_total"] else 0


if __name__ == "__main__":
    sys.exit(main())
