"""MSA decode block selection at 1M context: time `DecodeSelectTiles` variants on the H200.

Builds the inputs once per batch (B = 1 and 8): index keys [B * W, 128, 128] bf16 in shuffled
pages (as bench/msa.py's `_paged`, without K/V), their fp8 codes + scales (`_fp8`), bf16
index queries [B, 4, 128], every sequence at its last position (W = 8192 blocks at 1M).
For each variant (compile failures print and the sweep goes on):
- selection check at B = 1 and 8 against the engine's current path (`decode_select_blocks`:
  `agree`, the fraction of its blocks the variant selects too, and `rows`, the fraction of
  (query, head) rows with the same set); quantised-query variants also against the same
  math in fp32 (`same`: the legacy kernel on the dequantised query), fp8 variants against
  bf16 selection on the full-precision keys (`vs_bf16`, bench/msa.py's `agreement`);
- time: median over rounds of CUDA-graph replays (`timing.graph_time_us`), every variant
  and the baseline taking turns each round: `sel` (scores + top-k, what decode runs) and
  `scr` (the scoring launch alone); `floor` = bytes / 4.3 TB/s over `scr`.
The top-k alone is timed on a [B, 4, W] score tensor: torch (`top_blocks`) and the Triton
kernel (`top_blocks_triton`) at chunks of 256-8,192 scores per program and 4 / 8 warps.

    python -m sparrow.bench.msa_select            # ~2-3 min on the H200
    python -m sparrow.bench.msa_select --only fp8 --rounds 3

Writes bench-out/msa_select.json (commit and command). Without a CUDA GPU it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import statistics
import sys
import time
import traceback

import torch

from sparrow.eval.report import write_report

HI, DI, BS, TOPK, LOCAL = 4, 128, 128, 16, 1
HBM = 4.3e12  # bytes/s, bench/timing.py's HBM_BYTES_PER_S


def variants():
    """name -> (keys: "bf16" | "fp8", DecodeSelectTiles); the baselines first."""
    from sparrow.kernels.msa.select import DecodeSelectTiles as T

    def km(kv=8, **kw):
        kw = {"block_n": 128, "preload_pages": True} | kw
        return T(kv_blocks=kv, keys_major=True, **kw)

    bf16 = {
        "base": T(),  # the engine's path today: rows-major, 16 blocks, 64 keys per dot
        "rows-bn128": T(block_n=128),
        "km-kv4": km(4),
        "km-kv8": km(8),
        "km-kv16": km(16),
        "km-kv32": km(32),
        "km-kv8-nopre": km(8, preload_pages=False),
        "km-kv8-bn64": km(8, block_n=64),
        "km-kv8-w8": km(8, num_warps=8),
        "km-kv8-s2": km(8, num_stages=2),
        "km-kv8-s4": km(8, num_stages=4),
        "km-kv16-s4": km(16, num_stages=4),
        "km-kv8-tk": km(8, triton_topk=True),
        "km-kv16-tk": km(16, triton_topk=True),
        "km-kv8-tk-c512": km(8, triton_topk=True, topk_chunk=512),
        "km-kv16-tk-c512": km(16, triton_topk=True, topk_chunk=512),
        "km-kv16-tk-c1024": km(16, triton_topk=True, topk_chunk=1024),
    }
    fp8 = {
        "base": T(),
        "km-kv8-q": km(8, dot="query"),
        "km-kv8-f16": km(8, dot="fp16"),
        "km-kv4-f8": km(4, dot="fp8"),
        "km-kv8-f8": km(8, dot="fp8"),
        "km-kv16-f8": km(16, dot="fp8"),
        "km-kv32-f8": km(32, dot="fp8"),
        "km-kv8-f8-nopre": km(8, dot="fp8", preload_pages=False),
        "km-kv8-f8-s4": km(8, dot="fp8", num_stages=4),
        "km-kv8-f8-s5": km(8, dot="fp8", num_stages=5),
        "km-kv16-f8-s4": km(16, dot="fp8", num_stages=4),
        "km-kv8-f8-w8": km(8, dot="fp8", num_warps=8),
        "km-kv8-f8-bn64": km(8, dot="fp8", block_n=64),
        "km-kv8-f8-tk": km(8, dot="fp8", triton_topk=True),
        "km-kv16-f8-tk": km(16, dot="fp8", triton_topk=True),
        "km-kv32-f8-tk": km(32, dot="fp8", triton_topk=True),
        "km-kv8-f8-tk-c512": km(8, dot="fp8", triton_topk=True, topk_chunk=512),
        "km-kv16-f8-tk-c512": km(16, dot="fp8", triton_topk=True, topk_chunk=512),
        "km-kv32-f8-tk-c512": km(32, dot="fp8", triton_topk=True, topk_chunk=512),
        "km-kv32-f8-tk-c1024": km(32, dot="fp8", triton_topk=True, topk_chunk=1024),
        "km-kv32-f8-s4-tk-c512": km(32, dot="fp8", num_stages=4, triton_topk=True, topk_chunk=512),
    }
    return {**{("bf16", n): t for n, t in bf16.items()}, **{("fp8", n): t for n, t in fp8.items()}}


def build(batch: int, ctx: int, gen: torch.Generator, dtype=torch.bfloat16) -> dict:
    """Index keys (bf16) + their fp8 codes, shuffled tables, queries and positions."""
    from sparrow.bench.msa import _fp8

    dev = gen.device
    w = -(-ctx // BS)
    tables = torch.randperm(batch * w, generator=gen, device=dev).view(batch, w)
    ik = torch.randn(batch * w, BS, DI, generator=gen, device=dev, dtype=dtype)
    codes, scale = _fp8(ik)
    iq = torch.randn(batch, HI, DI, generator=gen, device=dev, dtype=dtype)
    pos = torch.full((batch,), ctx - 1, device=dev)
    return {
        "tables": tables.to(torch.int32),
        "keys": {"bf16": (ik, None), "fp8": (codes, scale)},
        "iq": iq,
        "pos": pos,
        "width": max(w, TOPK),
        "bytes": {"bf16": ik.numel() * 2, "fp8": codes.numel() + scale.numel() * 4},
    }


def quantised_query(iq: torch.Tensor, dot: str) -> torch.Tensor:
    """The query a quantised dot multiplies, dequantised to fp32 (the kernel's formula)."""
    from sparrow.kernels.msa import naive

    if dot == "query":
        return iq
    codes, scale = naive.quantize_index_keys(iq)
    if dot == "fp16":
        codes = (iq.float() / scale[..., None]).clamp(-448, 448).half()
    return naive.dequantize_index_keys(codes, scale)


def rows_equal(ours: torch.Tensor, ref: torch.Tensor) -> float:
    big = 1 << 30
    a = ours.masked_fill(ours < 0, big).sort(-1).values
    b = ref.masked_fill(ref < 0, big).sort(-1).values
    return (a == b).all(-1).float().mean().item()


def check(data: dict, keys: str, tiles, reference: dict) -> dict:
    """Compile + run once; the selection against the references."""
    from sparrow.bench.msa import selection_agreement
    from sparrow.kernels.msa.select import DecodeSelectTiles, decode_select_with

    ik, scale = data["keys"][keys]
    args = (data["tables"], data["pos"], TOPK, LOCAL, scale)
    ours = decode_select_with(tiles, data["iq"], ik, *args)
    if ours.is_cuda:
        torch.cuda.synchronize()
    base = reference[keys]
    row = {"agree": selection_agreement(ours, base), "rows": rows_equal(ours, base)}
    if keys == "fp8":
        row["vs_bf16"] = selection_agreement(ours, reference["bf16"])
        if tiles.dot != "query":  # the same math in fp32: the rows-major kernel, fp32 query
            q = quantised_query(data["iq"], tiles.dot)
            same = decode_select_with(DecodeSelectTiles(), q, ik, *args)
            row["same"] = selection_agreement(ours, same)
    return row


def timers(data: dict, keys: str, tiles) -> dict:
    from sparrow.kernels.msa.select import decode_block_scores, decode_select_with

    ik, scale = data["keys"][keys]
    iq, tables, pos, width = data["iq"], data["tables"], data["pos"], data["width"]
    return {
        "sel": lambda: decode_select_with(tiles, iq, ik, tables, pos, TOPK, LOCAL, scale),
        "scr": lambda: decode_block_scores(iq, ik, tables, pos, width, LOCAL, scale, tiles),
    }


def time_topk(data: dict, rounds: int, timer) -> dict:
    from sparrow.kernels.msa.select import top_blocks, top_blocks_triton

    scores = torch.randn(data["iq"].shape[0], HI, data["width"], device=data["iq"].device)
    scores[..., -1] = torch.inf  # a local block
    fns = {"torch": lambda: top_blocks(scores, TOPK)}
    ref = top_blocks(scores, TOPK)
    for w, chunk in ((4, 256), (4, 512), (8, 512), (4, 1024), (8, 1024), (8, 8192)):
        fn = functools.partial(top_blocks_triton, scores, TOPK, chunk=chunk, num_warps=w)
        try:
            same = rows_equal(fn(), ref)
            print(f"  triton top-k w{w} c{chunk}: rows equal to torch.topk {same:.4f}", flush=True)
            fns[f"triton_w{w}_c{chunk}"] = fn
        except Exception:  # noqa: BLE001 - a sweep reports and goes on
            print(
                f"  triton top-k w{w} c{chunk} FAILED:\n{traceback.format_exc()[-1500:]}",
                flush=True,
            )
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            times[n].append(timer([fn]))
    return {n: statistics.median(t) for n, t in times.items()}


def wall_us(calls) -> float:
    """--dry-run's timer (CPU, interpreter): one call's wall time."""
    t0 = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - t0) * 1e6 / len(calls)


def run(args) -> dict:
    import triton

    from sparrow.bench.timing import graph_time_us
    from sparrow.kernels.msa.select import decode_select_blocks

    dry = args.dry_run
    timer = wall_us if dry else graph_time_us

    todo = {k: t for k, t in variants().items() if re.search(args.only, f"{k[0]}/{k[1]}")}
    todo.setdefault(("bf16", "base"), variants()[("bf16", "base")])
    if any(k[0] == "fp8" for k in todo):
        todo.setdefault(("fp8", "base"), variants()[("fp8", "base")])
    gen = torch.Generator(device="cpu" if dry else "cuda").manual_seed(0)
    report = {
        "gpu": "none (dry run)" if dry else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "context": args.ctx,
        "batches": args.batches,
        "rounds": args.rounds,
        "variants": {f"{k}/{n}": dataclasses.asdict(t) for (k, n), t in todo.items()},
        "results": {},
        "topk_us": {},
    }
    failed = set()
    for batch in args.batches:
        t0 = time.time()
        data = build(batch, args.ctx, gen, torch.float32 if dry else torch.bfloat16)
        reference = {
            k: decode_select_blocks(
                data["iq"], ik, data["tables"], data["pos"], TOPK, LOCAL, ik_scale=s
            )
            for k, (ik, s) in data["keys"].items()
        }
        print(f"B={batch}: inputs in {time.time() - t0:.1f} s; checking", flush=True)
        fns = {}
        for key, tiles in todo.items():
            if key in failed:
                continue
            name = f"{key[0]}/{key[1]}"
            t0 = time.time()
            try:
                row = check(data, key[0], tiles, reference)
            except Exception:  # noqa: BLE001 - a sweep reports and goes on
                print(f"  {name} FAILED:\n{traceback.format_exc()[-2000:]}", flush=True)
                failed.add(key)
                report["results"].setdefault(name, {})["error"] = traceback.format_exc()[-2000:]
                continue
            report["results"].setdefault(name, {})[f"b{batch}"] = row
            print(f"  {name:<22} {time.time() - t0:5.1f} s  {row}", flush=True)
            fns |= {(key, kind): fn for kind, fn in timers(data, key[0], tiles).items()}
        times = {k: [] for k in fns}
        t0 = time.time()
        for r in range(args.rounds):  # every variant and the baselines take turns
            if r > 0 and time.time() - args.t0 > args.budget:
                print(f"B={batch}: {r} rounds only (--budget {args.budget} s)", flush=True)
                break
            for k, fn in fns.items():
                times[k].append(timer([fn]))
        print(f"B={batch}: timed in {time.time() - t0:.1f} s", flush=True)
        for (key, kind), t in times.items():
            row = report["results"][f"{key[0]}/{key[1]}"][f"b{batch}"]
            row[f"{kind}_us"] = statistics.median(t)
            row["floor_us"] = data["bytes"][key[0]] / HBM * 1e6
        report["topk_us"][f"b{batch}"] = time_topk(data, args.rounds, timer)
        del data, reference, fns
        if not dry:
            torch.cuda.empty_cache()
    return report


def recommend(report: dict, batches: list[int]) -> dict:
    """Per keys kind: the fastest select at the smallest batch among variants that select
    as the baseline (bf16: agree >= 0.999; fp8: same-math or baseline agree >= 0.99) and
    are no slower than it at the largest batch (+2%)."""
    lo, hi = f"b{min(batches)}", f"b{max(batches)}"
    out = {}
    for keys in ("bf16", "fp8"):
        base = report["results"].get(f"{keys}/base", {})
        best = None
        for name, r in report["results"].items():
            if not name.startswith(keys + "/") or lo not in r or "sel_us" not in r[lo]:
                continue
            ok = r[lo].get("same", r[lo]["agree"]) >= (0.999 if keys == "bf16" else 0.99)
            if hi in r and hi in base and "sel_us" in r[hi]:
                ok &= r[hi]["sel_us"] <= 1.02 * base[hi]["sel_us"]
            if ok and (best is None or r[lo]["sel_us"] < report["results"][best][lo]["sel_us"]):
                best = name
        if best:
            out[keys] = {"variant": best, "tiles": report["variants"][best]}
    return out


def show(report: dict, batches: list[int]) -> None:
    cols = "".join(f"{f'B={b} sel':>10}{'scr':>7}{'floor':>7}" for b in batches)
    print(f"\n{'variant':<24}{cols}{'agree':>8}{'rows':>7}{'same':>7}{'vs_bf16':>8}")
    for name, r in report["results"].items():
        if "error" in r and not any(f"b{b}" in r for b in batches):
            print(f"{name:<24}  FAILED (compile or launch; see the log)")
            continue
        line = f"{name:<24}"
        for b in batches:
            x = r.get(f"b{b}", {})
            if "sel_us" in x:
                line += (
                    f"{x['sel_us']:>10.1f}{x['scr_us']:>7.1f}{x['floor_us'] / x['scr_us']:>7.0%}"
                )
            else:
                line += f"{'-':>10}{'-':>7}{'-':>7}"
        x = r.get(f"b{batches[0]}", {})
        for k, width in (("agree", 8), ("rows", 7), ("same", 7), ("vs_bf16", 8)):
            line += f"{x[k]:>{width}.4f}" if k in x else f"{'':>{width}}"
        print(line)
    print("\ntop-k alone (us):")
    for b, t in report["topk_us"].items():
        print(f"  {b}: " + "  ".join(f"{n} {us:.1f}" for n, us in t.items()))
    for keys, rec in report.get("recommended", {}).items():
        kw = ", ".join(f"{k}={v!r}" for k, v in rec["tiles"].items())
        const = "DECODE_TILES" if keys == "bf16" else "DECODE_TILES_FP8"
        print(f"recommended {keys}: {rec['variant']}  ->  {const} = DecodeSelectTiles({kw})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ctx", type=int, default=1 << 20)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=200, help="seconds; then fewer rounds")
    p.add_argument("--only", default="", help="regex over 'keys/variant' (baselines stay)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU: the whole flow on the CPU under TRITON_INTERPRET=1 (use a small --ctx)",
    )
    p.add_argument("--out", default="bench-out/msa_select.json")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if not torch.cuda.is_available() and not args.dry_run:
        print("msa_select: no CUDA GPU here; nothing to time (--dry-run: on the CPU)")
        return 0
    t0 = args.t0 = time.time()
    with torch.inference_mode():
        report = run(args)
    report["recommended"] = recommend(report, args.batches)
    report["seconds"] = time.time() - t0
    show(report, args.batches)
    write_report(args.out, report)
    print(f"\n{args.out} written; {report['seconds']:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
