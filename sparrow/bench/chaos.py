"""A chaos run of the gateway: `sparrow gateway` over N `sparrow worker` processes on loopback
(the built-in model, CPU), the soak's mixed traffic from C clients, and every few seconds a
fault at a random worker: SIGKILL (then a restart on the same port) or SIGSTOP (SIGCONT after
2-10 s). At most N-1 workers are down at once; a struck worker counts as down until the
gateway routes to it again (alive by its health polls, its circuit breaker not open).

Half the requests are compared streams: a fixed set of distinct bodies (greedy or seeded,
n=1), each run once before the faults start as its reference; every run of a body carries
the reference's token ids, text and finish reason. The workers run batch-invariant
(`--batch-invariant`, the default): a stream's logits are the same bits whatever batch it
runs in and when it is resumed elsewhere as a prompt; with `--no-batch-invariant` a run may
differ first at a near tie (see `difference`). The other half is the soak's mix (`soak.one`:
sampled, whole, hung up on, cancelled, bad requests). Reported: outcomes by class and kind,
compared streams by difference, faults by kind, the seconds until the gateway ejects a
struck worker and routes to it again, streams resumed at another worker (the gateway's
`sparrow_gateway_worker_resumed_total`; its log names each), the time they lost (latency
over the median of the same body's undisturbed runs; the longest pause between events) and
the gateway's RSS.

    python -m sparrow.bench.chaos --workers 3 --minutes 10 --concurrency 32

The exit code is 1 on any unexpected outcome, compared stream that differs (batch-invariant
or with --strict: at a near tie too), or worker that does not come back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sparrow.bench import soak
from sparrow.bench.soak import Unexpected
from sparrow.eval.report import write_report
from sparrow.net import free_port

WORKER = ["--device", "cpu", "--max-model-len", "4096", "--num-blocks", "256"]
WORKER += ["--max-num-seqs", "16"]
LONG_PROMPT = 8192  # token ids in the over-long bad request (over --max-model-len)
COMPARED_SHARE = 0.5
REQUEST_TIMEOUT_S = 120.0
RECOVER_S = 180.0  # for a struck worker to be routed to again
NEAR_TIE = 1e-3  # logprobs this close: a greedy choice that rounding can flip
RESUMED = re.compile(r"request (\S+)-\d+: resuming after")  # the router's log line


class Cluster:
    """The worker processes and the gateway in front of them; their logs under `logs`."""

    def __init__(self, workers: int, logs: Path, batch_invariant: bool = True):
        self.logs, self.ports = logs, [free_port() for _ in range(workers)]
        self.worker_args = WORKER + ["--batch-invariant"] * batch_invariant
        self.procs = [self._worker(i) for i in range(workers)]
        self.port = free_port()
        addresses = [a for p in self.ports for a in ("--worker", f"127.0.0.1:{p}")]
        self.gateway = self._start("gateway", "--port", str(self.port), *addresses)
        self.base = f"http://127.0.0.1:{self.port}"
        self.gateway_log = logs / f"gateway-{self.port}.log"

    def _start(self, *args: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "sparrow.cli", *args]
        with open(self.logs / f"{args[0]}-{args[2]}.log", "a") as log:  # the child keeps it
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def _worker(self, i: int) -> subprocess.Popen:
        return self._start("worker", "--port", str(self.ports[i]), *self.worker_args)

    async def states(self, client: httpx.AsyncClient) -> list[str]:
        """Each worker as the gateway sees it: "down" (its health polls fail), "open" (alive,
        behind an open breaker) or "up" (routed to)."""
        text = (await client.get(f"{self.base}/metrics")).text
        line = 'sparrow_gateway_worker_{}{{worker="127.0.0.1:{}"}} {}'

        def state(port: int) -> str:
            if line.format("healthy", port, "1.0") not in text:
                return "down"
            return "open" if line.format("breaker_state", port, "2.0") in text else "up"

        return [state(p) for p in self.ports]

    async def wait(self, client: httpx.AsyncClient, ready, timeout: float) -> bool:
        """Until `ready(self.states())`; False past `timeout`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError):
                if ready(await self.states(client)):
                    return True
            await asyncio.sleep(0.2)
        return False

    async def fault(self, client, i: int, kind: str, pause_s: float, ending: asyncio.Event):
        """Strike worker i (SIGKILL, or SIGSTOP for `pause_s` or until `ending`), bring it
        back. Returns the seconds until the gateway ejects it and until it routes to it again
        (once `ending`: until it is alive) (None: not within 10 s / RECOVER_S)."""
        t0, proc = time.monotonic(), self.procs[i]
        proc.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        ejected = await self.wait(client, lambda s: s[i] == "down", 10)
        ejected_s = round(time.monotonic() - t0, 2) if ejected else None
        if kind == "kill":
            await asyncio.to_thread(proc.wait)
            self.procs[i] = self._worker(i)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ending.wait(), max(0.0, t0 + pause_s - time.monotonic()))
            proc.send_signal(signal.SIGCONT)
        back = await self.wait(
            client, lambda s: s[i] == "up" or ending.is_set() and s[i] != "down", RECOVER_S
        )
        return ejected_s, round(time.monotonic() - t0, 2) if back else None

    def stop(self) -> None:
        for proc in (self.gateway, *self.procs):
            proc.send_signal(signal.SIGCONT)  # a frozen worker handles SIGTERM
            proc.terminate()
        for proc in (self.gateway, *self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def compared_bodies(seed: int, model: str, count: int) -> list[tuple[str, dict]]:
    """(path, body) of `count` streams whose output is fixed: the soak's bodies, greedy or
    seeded (top_p 1, no top_k: see `difference`), n=1, each token's logprob, 16-256 tokens
    (long enough for faults to strike them mid-stream)."""
    rng, out = random.Random(seed), []
    for i in range(count):
        chat = i % 4 < 2
        body = soak.valid_body(rng, model, chat) | {"n": 1, "stream": True, "top_p": 1.0}
        body |= {"max_tokens": rng.randint(16, 256), "ignore_eos": rng.random() < 0.5}
        body |= {"logprobs": True} if chat else {"logprobs": body.get("logprobs", 0)}
        body |= {"seed": body.get("seed", rng.randint(0, 2**31))} if i % 2 else {"temperature": 0}
        body.pop("top_k", None)
        out.append(("/v1/chat/completions" if chat else "/v1/completions", body))
    return out


async def run_stream(client: httpx.AsyncClient, base: str, path: str, body: dict) -> dict:
    """One stream to [DONE]: its id, token ids and their logprobs, text, finish reason,
    latency and longest pause between events. Unexpected on a status, an error event or no
    [DONE]."""
    run = {"id": None, "tokens": [], "logprobs": [], "text": "", "finish": None, "max_gap_s": 0}
    t0 = last = time.monotonic()
    body = body | {"return_token_ids": True}
    async with client.stream("POST", base + path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise Unexpected(f"http_{response.status_code}", response.text[:300])
        async for line in response.aiter_lines():
            if (event := soak.parse_event(line)) is None:
                continue
            now = time.monotonic()
            run["max_gap_s"], last = max(run["max_gap_s"], now - last), now
            if event == "[DONE]":
                if run["finish"] is None:
                    raise Unexpected("unfinished_choice", "n=1")
                return run | {"latency_s": now - t0}
            run["id"] = event.get("id")
            for c in event["choices"]:
                delta = c.get("delta", c)
                run["tokens"] += delta.get("token_ids") or c.get("token_ids") or []
                run["text"] += delta.get("content") or c.get("text") or ""
                lp = c.get("logprobs") or {}
                run["logprobs"] += [x["logprob"] for x in lp.get("content") or []]
                run["logprobs"] += lp.get("token_logprobs") or []
                run["finish"] = c.get("finish_reason") or run["finish"]
    raise Unexpected("missing_done", f"{len(run['tokens'])} tokens")


def difference(run: dict, ref: dict, greedy: bool) -> str:
    """The run against its reference: "identical"; "near_tie" when the first token that
    differs is one float rounding away from the reference's: greedy, its logprob within
    NEAR_TIE of the reference's; sampled (top_p 1, no top_k), the next token id (the draw
    lies on the two's boundary in the cumulative distribution); else "differs". Without
    batch-invariant workers the logits' last bits depend on the batch's shapes (and a resumed
    stream's tokens so far are prefilled, not decoded): body 5 of `--seed 1` draws token 1146
    or 1147 at output 30 by the batch it runs in, with no fault anywhere."""
    if all(run[k] == ref[k] for k in ("tokens", "text", "finish")):
        return "identical"
    want, got = ref["tokens"], run["tokens"]
    j = next((j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if j is None or min(len(ref["logprobs"]), len(run["logprobs"])) <= j:
        return "differs"
    if greedy:
        return "near_tie" if abs(ref["logprobs"][j] - run["logprobs"][j]) < NEAR_TIE else "differs"
    return "near_tie" if abs(want[j] - got[j]) == 1 else "differs"


class Chaos:
    """A run's state: the load (`soak.Soak`: client, deadline, tally), the compared bodies
    and their references, the compared runs, the faults."""

    def __init__(self, load: soak.Soak, bodies: list, references: list[dict]):
        self.load, self.bodies, self.references = load, bodies, references
        self.runs, self.mismatches, self.faults = [], [], []

    async def compare(self, i: int) -> None:
        path, body = self.bodies[i]
        run = await run_stream(self.load.client, self.load.base, path, body)
        ref = self.references[i]
        run |= {"body": i, "diff": difference(run, ref, body["temperature"] == 0)}
        self.runs.append(run)
        if run["diff"] != "identical" and len(self.mismatches) < 10:
            got = {k: run[k] for k in ("id", "diff", "tokens", "text", "finish")}
            want = {k: ref[k] for k in ("tokens", "text", "finish")}
            self.mismatches.append(got | {"body": body, "reference": want})


async def client_loop(chaos: Chaos, seed: int) -> None:
    rng, load = random.Random(seed), chaos.load
    while load.more():
        try:
            if rng.random() < COMPARED_SHARE:
                await chaos.compare(rng.randrange(len(chaos.bodies)))
                load.tally.add("ok", "compared_stream")
            else:
                load.tally.add(*await soak.one(load, rng))
        except Unexpected as e:
            load.tally.add("unexpected", e.kind, "request", e.detail)
        except httpx.TimeoutException as e:
            load.tally.add("unexpected", "timeout", "request", repr(e))
        except httpx.HTTPError as e:
            load.tally.add("unexpected", f"connection_{type(e).__name__}", "request", repr(e))


async def fault_loop(chaos: Chaos, cluster: Cluster, args, ending: asyncio.Event) -> None:
    """A fault every `fault_every` s at a worker that is up, while fewer than N-1 are down."""
    rng, down, t0 = random.Random(args.seed), {}, time.monotonic()

    async def strike(i: int, kind: str, pause_s: float) -> None:
        record = {"t_s": round(time.monotonic() - t0, 2), "worker": i, "kind": kind}
        record["pause_s"] = round(pause_s, 2) if kind == "stop" else None
        times = await cluster.fault(chaos.load.client, i, kind, pause_s, ending)
        chaos.faults.append(record | dict(zip(("ejected_s", "recovered_s"), times, strict=True)))

    while not ending.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ending.wait(), args.fault_every)
        down = {i: t for i, t in down.items() if not t.done()}
        if ending.is_set() or len(down) >= args.workers - 1:
            continue
        i = rng.choice([i for i in range(args.workers) if i not in down])
        kind, pause = rng.choice(("kill", "stop")), rng.uniform(2, 10)
        down[i] = asyncio.create_task(strike(i, kind, pause))
    await asyncio.gather(*down.values())


def _stats(xs: list[float]) -> dict | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    p90 = xs[round(0.9 * (len(xs) - 1))]
    return {"n": len(xs), "median": round(statistics.median(xs), 3), "p90": round(p90, 3)}


def time_lost(runs: list[dict], resumed_ids: set[str]) -> dict:
    """Resumed compared streams against the same body's undisturbed runs: latency over that
    body's median, and the longest pause between events of both."""
    calm, resumed = {}, [r for r in runs if r["id"] in resumed_ids]
    for r in runs:
        if r["id"] not in resumed_ids:
            calm.setdefault(r["body"], []).append(r)
    extra = [
        r["latency_s"] - statistics.median(c["latency_s"] for c in calm[r["body"]])
        for r in resumed
        if r["body"] in calm
    ]
    return {
        "resumed_compared": len(resumed),
        "extra_latency_s": _stats(extra),
        "max_gap_s_resumed": _stats([r["max_gap_s"] for r in resumed]),
        "max_gap_s_undisturbed": _stats([r["max_gap_s"] for c in calm.values() for r in c]),
    }


async def chaos_run(args, cluster: Cluster) -> dict:
    """References, then the traffic with faults; returns the report (without settings)."""
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)
    limits = httpx.Limits(max_connections=args.concurrency * 2 + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if not await cluster.wait(client, lambda s: set(s) == {"up"}, RECOVER_S):
            raise RuntimeError(f"the workers were not all healthy within {RECOVER_S:.0f} s")
        base, c = cluster.base, args.concurrency
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        bodies, refs = compared_bodies(args.seed, model, args.bodies), []
        for k in range(0, len(bodies), c):  # before any fault; one failing ends the run
            refs += await asyncio.gather(*(run_stream(client, base, *b) for b in bodies[k : k + c]))
        t0 = time.monotonic()
        load = soak.Soak(client, base, model, t0 + args.minutes * 60, None, LONG_PROMPT)
        chaos, ending, series = Chaos(load, bodies, refs), asyncio.Event(), []
        pid = cluster.gateway.pid
        sampler = asyncio.create_task(soak.sample_rss(pid, 2.0, t0, series))
        faults = asyncio.create_task(fault_loop(chaos, cluster, args, ending))
        await asyncio.gather(*(client_loop(chaos, args.seed * 1000 + i) for i in range(c)))
        wall = time.monotonic() - t0
        ending.set()
        await faults
        sampler.cancel()
        if (mb := soak.rss_mb(pid)) is not None:
            series.append((round(wall, 2), round(mb, 1)))
        health = (await client.get(f"{base}/health")).status_code
        metrics = (await client.get(f"{base}/metrics")).text
    if health != 200:
        load.tally.add("unexpected", "unhealthy_after", "GET /health", str(health))
    resumed_ids = set(RESUMED.findall(cluster.gateway_log.read_text()))
    return summary(chaos, wall, health, metrics, resumed_ids) | {
        "rss": soak.rss_summary(series, 0.2 * wall)
    }


def summary(chaos: Chaos, wall: float, health: int, metrics: str, resumed_ids: set) -> dict:
    """The report: outcomes (as the soak's), compared streams, faults, resumes, time lost."""
    runs, tally, faults = chaos.runs, chaos.load.tally, sorted(chaos.faults, key=lambda f: f["t_s"])
    return tally.report(chaos.load.model, wall, health) | {
        "compared": {"bodies": len(chaos.bodies), "streams": len(runs)}
        | {k: sum(r["diff"] == k for r in runs) for k in ("identical", "near_tie", "differs")}
        | {
            f"{k}_resumed": sum(r["diff"] == k and r["id"] in resumed_ids for r in runs)
            for k in ("near_tie", "differs")
        }
        | {"mismatches": [m | {"resumed": m["id"] in resumed_ids} for m in chaos.mismatches]},
        "faults": {
            "by_kind": {k: sum(f["kind"] == k for f in faults) for k in ("kill", "stop")},
            "unrecovered": sum(f["recovered_s"] is None for f in faults),
            "ejected_s": _stats([f["ejected_s"] for f in faults]),
            "recovered_s": _stats([f["recovered_s"] for f in faults]),
            "log": faults,
        },
        "gateway_resumed_total": _total(metrics, "resumed"),
        "gateway_retries_total": _total(metrics, "retries"),
        "resumed_in_log": len(resumed_ids),
        "time_lost": time_lost(runs, resumed_ids),
    }


def _total(metrics: str, name: str) -> float:
    """A per-worker counter of the gateway's, summed over the workers."""
    found = re.findall(rf"^sparrow_gateway_worker_{name}_total{{.*}} (\S+)$", metrics, re.M)
    return sum(map(float, found))


def print_chaos(report: dict) -> None:
    soak.print_table(report)
    cmp, faults, lost = report["compared"], report["faults"], report["time_lost"]
    print(
        f"compared streams: {cmp['streams']}: identical {cmp['identical']}, near ties "
        f"{cmp['near_tie']} ({cmp['near_tie_resumed']} resumed), differ {cmp['differs']} "
        f"({cmp['differs_resumed']} resumed)"
    )
    print(f"faults: {faults['by_kind']}, unrecovered {faults['unrecovered']}")
    for key in ("ejected_s", "recovered_s"):
        print(f"  {key}: {faults[key]}")
    print(
        f"resumed: gateway {report['gateway_resumed_total']:.0f} (retries "
        f"{report['gateway_retries_total']:.0f}), compared {lost['resumed_compared']}"
    )
    for key in ("extra_latency_s", "max_gap_s_resumed", "max_gap_s_undisturbed"):
        print(f"  {key}: {lost[key]}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--fault-every", type=float, default=5.0, help="seconds between faults")
    p.add_argument("--bodies", type=int, default=64, help="distinct compared bodies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="near ties fail the run too")
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers with --batch-invariant: every compared stream identical (near ties fail)",
    )
    p.add_argument("--out", default="bench-out/chaos.json")
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error("--workers: at least 2 (one stays up)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the chaos, print the table, write the report. Returns 1 on any failure."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sparrow-chaos-") as logs:
        cluster = Cluster(args.workers, Path(logs), args.batch_invariant)
        try:
            report = asyncio.run(chaos_run(args, cluster))
        finally:
            cluster.stop()
        cmp = report["compared"]
        failed = report["unexpected_total"] or report["faults"]["unrecovered"] or cmp["differs"]
        strict = args.strict or args.batch_invariant
        if failed := bool(failed or (strict and cmp["near_tie"])):
            report["gateway_log_tail"] = cluster.gateway_log.read_text()[-4000:]
    settings = ("workers", "minutes", "concurrency", "fault_every", "bodies", "seed", "strict")
    settings += ("batch_invariant",)
    report = {k: getattr(args, k) for k in settings} | report
    print_chaos(report)
    write_report(args.out, report)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
