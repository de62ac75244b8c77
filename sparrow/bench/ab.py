"""The engine at two checkouts of the tree, alternating in one run (GPU): is a change a
regression end to end?

Each checkout (a directory holding a `sparrow/` package, e.g. `git worktree add /tmp/old
REV`) runs in its own process with the full-size 4-bit model materialised on the GPU; the
parent sends both the same work in turns (old, new, old, new, ...) and takes medians:
batch-1 prefill and decode at each `--lengths`, and decode output tok/s at each
`--concurrency` (prompts of 512 tokens). A checkout's own `sparrow.bench.e2e.run_engine`
does the timing, so both sides measure the same way.

    python -m sparrow.bench.ab --old /tmp/old --new . --lengths 4096,131072 --concurrency 8

`--recurrent-state-dtype` sets how both sides keep Gated DeltaNet state between steps, or
each side's as OLD,NEW: one tree with two state dtypes is

    python -m sparrow.bench.ab --old . --new . --recurrent-state-dtype float32,bfloat16

`--profile` adds one profiled eager prefill step per side and shape: per-kernel CUDA time
and count, host launch time against wall time (where two checkouts differ, and why).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from sparrow.config import RECURRENT_STATE_DTYPES
from sparrow.eval.report import write_report

# Runs inside each checkout's process (its own `sparrow` on sys.path): builds the engine,
# then answers one JSON request per stdin line with one JSON line on stdout.
_WORKER = r"""
import json, sys, torch
from sparrow.bench.e2e import VOCAB, run_engine
from sparrow.loader.random_checkpoint import PRESETS, random_model
from sparrow.config import QuantConfig
most, max_len, preset, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
state_dtype = sys.argv[5]
try:
    from sparrow.engine.llm import LLM
    from dataclasses import fields
    from sparrow.config import CacheConfig
    cache_fields = {f.name for f in fields(CacheConfig)}
    # rounds repeat their prompts: no prefix caching where the checkout has it
    off = {"enable_prefix_caching": False} if "enable_prefix_caching" in cache_fields else {}
    if "recurrent_state_dtype" in cache_fields:
        off["recurrent_state_dtype"] = state_dtype
    elif state_dtype != "float32":
        raise SystemExit(f"this checkout keeps recurrent state in fp32 only, not {state_dtype}")
    settings = lambda n, l, b: {"max_num_seqs": n, "max_model_len": l, "num_blocks": b} | off
except ImportError:
    if state_dtype != "float32":
        raise SystemExit(f"this checkout keeps recurrent state in fp32 only, not {state_dtype}")
    from sparrow.llm import LLM
    from sparrow.core.scheduler import SchedulerConfig
    settings = lambda n, l, b: {"scheduler": SchedulerConfig(max_num_seqs=n, max_model_len=l,
                                                             num_blocks=b)}
if device == "cpu":  # the smoke test: run_engine syncs the GPU between phases
    torch.cuda.synchronize = lambda *a: None
torch.manual_seed(0)
args = PRESETS[preset]
quant = QuantConfig.from_name("4bit") if device == "cuda" else None
model = random_model(args, 0, device, torch.bfloat16 if device == "cuda" else torch.float32,
                     quantize=quant)
llm = LLM(model, **settings(most, max_len, -(-max_len // 128) + 8 * most))
print(json.dumps({"ready": True}), flush=True)

def profile(batch, length):  # one eager prefill step of batch x length tokens, profiled
    import time
    from sparrow.bench.timing import kernel_profile
    from sparrow.worker.cache import build_metadata
    runner, tables = llm.runner, []
    for b in range(batch):
        tables.append(list(range(b * -(-length // 128), (b + 1) * -(-length // 128))))
    meta = build_metadata([[1] * length] * batch, [0] * batch, tables, list(range(batch)),
                          runner.cache.block_size, "cuda")
    def step():
        with torch.inference_mode():
            return runner.model.logits(runner.model(meta, runner.cache)[-1:]).argmax(-1)
    report = kernel_profile(step, top=30)
    walls, launches = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        launches.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    return report | {"launch_ms": sorted(launches)[2] * 1e3, "wall_ms": sorted(walls)[2] * 1e3}

for line in sys.stdin:
    job = json.loads(line)
    if "profile" in job:
        print(json.dumps(profile(job["profile"], job["length"])), flush=True)
        continue
    gen = torch.Generator().manual_seed(job["seed"])
    prompts = [torch.randint(0, VOCAB, (job["length"],), generator=gen).tolist()
               for _ in range(job["batch"])]
    t_pre, t_dec, n = run_engine(llm, prompts, job["decode"])
    print(json.dumps({"prefill_s": t_pre, "decode_s": t_dec, "tokens": n}), flush=True)
"""


class Side:
    """One checkout's engine process."""

    def __init__(
        self, tree: Path, most: int, max_len: int, preset: str, device: str, state_dtype: str
    ):
        env = os.environ | {"PYTHONPATH": str(tree.resolve())}
        argv = [str(most), str(max_len), preset, device, state_dtype]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, *argv],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=tree,
        )

    def ready(self) -> None:
        line = self.proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError("an engine process failed to start (its stderr is above)")

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("an engine process died (its stderr is above)")
        return json.loads(line)


def _alternate(sides: dict[str, Side], job: dict, rounds: int, warm: int) -> dict[str, list]:
    runs: dict[str, list] = {name: [] for name in sides}
    for r in range(warm + rounds):
        for name, side in sides.items():
            result = side.run(job)
            if r >= warm:
                runs[name].append(result)
    return runs


def _medians(runs: list[dict], length: int, batch: int) -> dict[str, float]:
    return {
        "prefill_tok_s": statistics.median(length * batch / r["prefill_s"] for r in runs),
        "decode_tok_s": statistics.median(r["tokens"] / r["decode_s"] for r in runs),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="checkout directory of the baseline")
    p.add_argument("--new", default=".", help="checkout directory of the change")
    p.add_argument("--lengths", default="4096,131072")
    p.add_argument("--concurrency", default="8")
    p.add_argument("--decode", type=int, default=32, help="decode tokens per batch-1 run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--preset", default="qwen3.6-35b-a3b", help="qwen3.6-tiny: a smoke test")
    p.add_argument("--device", default="cuda", help="cpu: the float model, a smoke test")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one eager prefill step per length <= 16K and per "
        "concurrency on each side (per-kernel CUDA time, host launch time)",
    )
    p.add_argument(
        "--recurrent-state-dtype",
        default="float32",
        metavar="DTYPE[,DTYPE]",
        help="how both sides keep Gated DeltaNet state between steps, or OLD,NEW: each "
        f"side's (of {', '.join(RECURRENT_STATE_DTYPES)})",
    )
    p.add_argument("--out", default="bench-out/ab.json")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",") if x]
    state_dtypes = _state_dtypes(p, args.recurrent_state_dtype)
    most = max(concurrency + [1])
    max_len = max(max(lengths) + args.decode, 512 + 64) + 2
    sides = {
        name: Side(Path(tree), most, max_len, args.preset, args.device, state_dtypes[name])
        for name, tree in (("old", args.old), ("new", args.new))
    }
    for side in sides.values():
        side.ready()
    report: dict = {
        "old": str(args.old),
        "new": str(args.new),
        "recurrent_state_dtype": state_dtypes,
        "batch1": {},
        "concurrency": {},
    }
    for length in lengths:
        job = {"length": length, "batch": 1, "decode": args.decode + 1, "seed": length}
        runs = _alternate(sides, job, args.rounds, warm=1 if length <= 16384 else 0)
        report["batch1"][length] = {n: _medians(r, length, 1) for n, r in runs.items()}
        _print_row(f"batch 1, {length} tokens", report["batch1"][length])
    for c in concurrency:
        job = {"length": 512, "batch": c, "decode": 64, "seed": c}
        runs = _alternate(sides, job, args.rounds, warm=1)
        report["concurrency"][c] = {n: _medians(r, 512, c) for n, r in runs.items()}
        _print_row(f"concurrency {c}, 512 tokens", report["concurrency"][c])
    if args.profile:
        shapes = [(1, n) for n in lengths if n <= 16384] + [(c, 512) for c in concurrency]
        report["profile"] = {
            f"{b}x{n}": {
                name: side.run({"profile": b, "length": n}) for name, side in sides.items()
            }
            for b, n in shapes
        }
        for shape, row in report["profile"].items():
            _print_profile(shape, row)
    for side in sides.values():
        side.proc.stdin.close()
        side.proc.wait(timeout=60)
    write_report(args.out, report)
    return report


def _state_dtypes(parser: argparse.ArgumentParser, value: str) -> dict[str, str]:
    """{"old": dtype, "new": dtype} from `--recurrent-state-dtype` (one for both, or OLD,NEW)."""
    names = value.split(",")
    if len(names) == 1:
        names = names * 2
    if len(names) != 2 or any(n not in RECURRENT_STATE_DTYPES for n in names):
        parser.error(
            f"--recurrent-state-dtype {value!r}: expected DTYPE or OLD,NEW, each one of "
            f"{', '.join(RECURRENT_STATE_DTYPES)}"
        )
    return dict(zip(("old", "new"), names, strict=True))


def _print_profile(shape: str, row: dict[str, dict]) -> None:
    old, new = row["old"], row["new"]
    print(
        f"[ab] profile {shape}: wall {old['wall_ms']:.1f} -> {new['wall_ms']:.1f} ms, host "
        f"launch {old['launch_ms']:.1f} -> {new['launch_ms']:.1f} ms, kernels "
        f"{old['kernels']} -> {new['kernels']} taking {old['kernel_time_us'] / 1e3:.1f} -> "
        f"{new['kernel_time_us'] / 1e3:.1f} ms"
    )
    times = {side: {k["kernel"]: k for k in row[side]["top"]} for side in row}
    for name in sorted(
        set(times["old"]) | set(times["new"]),
        key=lambda k: -max(times[s].get(k, {}).get("us", 0) for s in times),
    ):
        o, n = times["old"].get(name, {}), times["new"].get(name, {})
        print(
            f"    {o.get('count', '-'):>5} {o.get('us', 0):9.1f} -> {n.get('count', '-'):>5} "
            f"{n.get('us', 0):9.1f} us  {name[:70]}"
        )


def _print_row(what: str, row: dict[str, dict[str, float]]) -> None:
    old, new = row["old"], row["new"]
    print(
        f"[ab] {what:>26}: prefill {old['prefill_tok_s']:9.0f} -> {new['prefill_tok_s']:9.0f}"
        f" tok/s ({new['prefill_tok_s'] / old['prefill_tok_s']:.3f}x) | decode "
        f"{old['decode_tok_s']:7.1f} -> {new['decode_tok_s']:7.1f} tok/s "
        f"({new['decode_tok_s'] / old['decode_tok_s']:.3f}x)",
        flush=True,
    )


if __name__ == "__main__":
    main()
