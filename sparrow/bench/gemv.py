"""Dense 4-bit GEMV for decode: our fused-dequant kernels vs bf16 cuBLAS and dequantise-
then-matmul, each timed inside a CUDA graph over weights that do not fit in L2. One row
(batch 1): the row GEMV over a sweep of block sizes and warps; `--rows 8`: the tensor-core
kernel for 2-16 rows (its default configuration).

    python -m sparrow.bench.gemv --out bench-out/gemv.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
from dataclasses import replace

import torch
import torch.nn.functional as F

from sparrow.bench.timing import HBM_BYTES_PER_S, graph_time_us
from sparrow.eval.report import write_report
from sparrow.kernels.quant_gemv.gemv import GemvTiles, quant_gemv
from sparrow.kernels.quant_gemv.naive import quant_matmul
from sparrow.quant.affine import QuantSpec, quantize

SHAPES = {  # name: (N, K): the model's fused projections
    "gdn in_proj 2048->12352": (12352, 2048),
    "attention qkv 2048->9216": (9216, 2048),
    "2048->8192 (issue 3's bar)": (8192, 2048),
    "out_proj 4096->2048": (2048, 4096),
    "shared expert up 2048->1024": (1024, 2048),
    "lm_head 2048->248320": (248320, 2048),
}
L2_BYTES = 60 << 20


def weight_copies(n: int, k: int, spec: QuantSpec):
    """Enough independent quantised weights that one pass over them exceeds 2x L2."""
    w = torch.randn(n, k, device="cuda")
    q = quantize(w, spec, torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in q)
    count = max(1, -(-2 * L2_BYTES // nbytes))
    return [tuple(t.clone() for t in q) for _ in range(count)], nbytes, w.bfloat16()


def _named(tiles: GemvTiles, f16_named: bool) -> tuple[str, GemvTiles]:
    """(name in the report, tiles): the f16_dot suffix where it was chosen, not defaulted."""
    name = f"bn{tiles.block_n}_bk{tiles.block_k}_w{tiles.num_warps}_s{tiles.num_stages}"
    name += {None: "", True: "_pf", False: "_nopf"}[tiles.prefetch]
    if f16_named:
        name += "_f16dot" if tiles.f16_dot else "_f32dot"
    return name, tiles


def bench_shape(n: int, k: int, configs, rows: int) -> dict:
    spec = QuantSpec(4, 64)
    copies, nbytes, w_bf16 = weight_copies(n, k, spec)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = quant_matmul(x, *copies[0], spec)
    w_copies = [w_bf16] + [w_bf16.clone() for _ in range(max(0, len(copies) // 4 - 1))]
    result = {
        "bytes": nbytes,
        "floor_us": nbytes / HBM_BYTES_PER_S * 1e6,
        "bf16_cublas_us": graph_time_us([lambda w=w: F.linear(x, w) for w in w_copies]),
        "dequant_matmul_us": graph_time_us(
            [lambda q=q: quant_matmul(x, *q, spec) for q in copies[:2]], replays=5
        ),
        "configs": {},
    }
    for name, tiles in configs if rows == 1 else [("default", None)]:
        kw = {"tiles": tiles}
        try:
            y = quant_gemv(x, *copies[0], spec, **kw)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = graph_time_us([functools.partial(quant_gemv, x, *q, spec, **kw) for q in copies])
            result["configs"][name] = {"us": t, "rel_err": err}
        except Exception as e:  # a config the compiler rejects (registers, shared memory)
            result["configs"][name] = {"error": str(e)[:200]}
    ok = {c: r for c, r in result["configs"].items() if "us" in r}
    best = min(ok, key=lambda c: ok[c]["us"])
    result["best"] = best
    result["best_us"] = ok[best]["us"]
    result["best_fraction_of_bandwidth"] = result["floor_us"] / ok[best]["us"]
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench-out/gemv.json")
    p.add_argument(
        "--quick",
        action="store_true",
        help="`GemvTiles.for_shape` blocks only, with and without the weight "
        "prefetch, products in fp16 pairs or fp32",
    )
    p.add_argument("--rows", type=int, default=1, help="activation rows (1-16)")
    p.add_argument(
        "--f16-dot",
        action="store_true",
        help="sweep with the products in packed fp16 pairs (`GemvTiles.f16_dot`)",
    )
    args = p.parse_args(argv)
    sweep = [
        (bn, bk, nw)  # 3 stages never beat 2 in the sweeps of 2026-11-30
        for bn, bk, nw in itertools.product(
            [4, 8, 16, 32, 64], [512, 1024, 2048, 4096], [1, 2, 4, 8]
        )
        if bn * bk <= 64 * 2048
    ]
    report = {"gpu": torch.cuda.get_device_name(), "rows": args.rows, "shapes": {}}
    print(
        f"{'shape':<28}{'floor us':>10}{'ours us':>10}{'frac bw':>9}{'bf16 us':>10}"
        f"{'deq+mm us':>11}  best config"
    )
    for name, (n, k) in SHAPES.items():
        default = GemvTiles.for_shape(n, k)
        # --quick: the default blocks, with and without the weight prefetch, fp16 or fp32 products
        configs = (
            [
                _named(replace(default, prefetch=pf, f16_dot=f16), True)
                for pf in (True, False)
                for f16 in (True, False)
            ]
            if args.quick
            else [
                _named(GemvTiles(bn, bk, nw, f16_dot=args.f16_dot or default.f16_dot), args.f16_dot)
                for bn, bk, nw in sweep
                if bk <= k
            ]
        )
        r = bench_shape(n, k, configs, args.rows)
        report["shapes"][name] = r
        print(
            f"{name:<28}{r['floor_us']:>10.2f}{r['best_us']:>10.2f}"
            f"{r['best_fraction_of_bandwidth']:>9.0%}{r['bf16_cublas_us']:>10.2f}"
            f"{r['dequant_matmul_us']:>11.1f}  {r['best']}"
        )
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
