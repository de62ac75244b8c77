"""Batched decode (GPU): where a step's time goes at 8, 32 and 64 sequences, and the
few-rows kernels that set it.

`--kernels moe`: one full-size MoE layer of Qwen3.6-35B-A3B (4-bit) at 2-64 tokens on each
expert path (the expert GEMVs with several tile sets, the grouped GEMM); `--kernels dense`:
the dense 4-bit projections at 8-64 rows (the tensor-core GEMV's tile sets against
dequantise + cuBLAS); each in a CUDA graph over copies that do not fit in L2 (as the 40
layers of a step read their own weights from HBM).

`--engine`: the full-size 4-bit model through the engine, C requests of 512 tokens decoding
together (output tok/s, median of rounds); then one eager decode step at each size profiled
by kernel group. `--recurrent-state-dtype bfloat16` keeps the engine's Gated DeltaNet state in
bf16 (half the state bytes a step reads and writes).

    python -m sparrow.bench.batch --kernels moe,dense --engine --out bench-out/batch.json
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
import torch.nn.functional as F

from sparrow.bench.e2e import VOCAB, engine_settings, run_engine
from sparrow.bench.gemv import weight_copies
from sparrow.bench.timing import HBM_BYTES_PER_S, graph_time_us, kernel_profile
from sparrow.config import RECURRENT_STATE_DTYPES, QuantConfig
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.eval.report import write_report
from sparrow.kernels.dequant.dequant import dequantize
from sparrow.kernels.moe.expert_gemv import ExpertGemvTiles
from sparrow.kernels.moe.experts import moe_experts
from sparrow.kernels.moe.grouped_gemm import GemmTiles
from sparrow.kernels.quant_gemv.gemv import GemvTiles
from sparrow.kernels.quant_gemv.mma import MmaTiles, quant_mma
from sparrow.loader.random_checkpoint import random_model
from sparrow.models import PRESETS
from sparrow.models.interface import ModelArgs
from sparrow.quant.affine import QuantSpec, quantize
from sparrow.worker.cache import build_metadata

QWEN = PRESETS["qwen3.6-35b-a3b"]

SIZES = (8, 32, 64)
MOE_TOKENS = (2, 4, 8, 16, 32, 48, 64)
COPIES = 8  # MoE layers cycled in one graph: their experts' weights exceed L2
DENSE = {  # name: (N, K)
    "gdn in_proj 2048->12352": (12352, 2048),
    "attention qkv 2048->9216": (9216, 2048),
    "out_proj 4096->2048": (2048, 4096),
    "lm_head 2048->248320": (248320, 2048),
}
GEMV_TILES = {  # name: expert GEMV tiles (gate_up, down)
    "g16x1024w4 d32x512w2": ExpertGemvTiles(),
    "g8x2048w4 d32x512w2": ExpertGemvTiles(GemvTiles(8, 2048, 4, f16_dot=True)),
    "g16x2048w4 d32x512w2": ExpertGemvTiles(GemvTiles(16, 2048, 4, f16_dot=True)),
    "g32x1024w4 d32x512w2": ExpertGemvTiles(GemvTiles(32, 1024, 4, f16_dot=True)),
    "g8x1024w2 d32x512w2": ExpertGemvTiles(GemvTiles(8, 1024, 2, f16_dot=True)),
    "g16x1024w4 d16x512w2": ExpertGemvTiles(down=GemvTiles(16, 512, 2, f16_dot=True)),
    "g16x1024w4 d64x512w4": ExpertGemvTiles(down=GemvTiles(64, 512, 4, f16_dot=True)),
    "g16x1024w4 d32x512w4": ExpertGemvTiles(down=GemvTiles(32, 512, 4, f16_dot=True)),
}
MMA_CONFIGS = {
    "default": None,
    "bn32 bk256 s1 w4": MmaTiles(32, 256, 1, 4),
    "bn64 bk128 s1 w4": MmaTiles(64, 128, 1, 4),
    "bn16 bk256 s4 w4": MmaTiles(16, 256, 4, 4),
    "bn32 bk128 s2 w4": MmaTiles(32, 128, 2, 4),
}


def _moe_layers(cfg: ModelArgs) -> list[tuple]:
    """COPIES distinct random 4-bit expert stacks (gate_up, down), with a shared expert."""
    spec = QuantSpec(4, 64)
    d, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    layers = []
    for _ in range(COPIES):
        gate_up = quantize(torch.randn(e, 2 * inter, d, device="cuda") * 0.02, spec, torch.bfloat16)
        down = quantize(torch.randn(e, d, inter, device="cuda") * 0.02, spec, torch.bfloat16)
        shared = tuple(tuple(t[0].clone() for t in w) for w in (gate_up, down))
        layers.append((gate_up, down, shared))
    return layers


def bench_moe(cfg: ModelArgs, tokens: list[int]) -> dict:
    """Each path's time per layer (us, graph over COPIES layers) and error against the
    GEMV path, per token count."""
    from sparrow.kernels.moe.shared import Shared

    spec, k = QuantSpec(4, 64), cfg.num_experts_per_tok
    layers = _moe_layers(cfg)
    table = {}
    for t in tokens:
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, cfg.num_experts, device="cuda", dtype=torch.bfloat16)
        gate = torch.randn(t, 1, device="cuda", dtype=torch.bfloat16)
        paths = {
            "gemv": ExpertGemvTiles.for_shape(t, True),
            "grouped": GemmTiles.for_shape(t * k, cfg.num_experts),
            **{f"gemv {n}": tiles for n, tiles in GEMV_TILES.items()},
        }
        row, ref = {}, None
        for name, tiles in paths.items():

            def call(layer, tiles=tiles, x=x, logits=logits, gate=gate):
                gate_up, down, shared = layer
                return moe_experts(
                    x,
                    logits,
                    k,
                    gate_up,
                    down,
                    spec,
                    tiles=tiles,
                    shared=Shared(gate, weights=shared),
                )

            try:
                with torch.inference_mode():
                    out = call(layers[0])
                    us = graph_time_us(
                        [lambda layer=layer: call(layer) for layer in layers], replays=10, rounds=3
                    )
            except Exception as err:  # noqa: BLE001 - a tile set that does not compile
                row[name] = {"error": str(err)[:160]}
                continue
            ref = out if ref is None else ref
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            row[name] = {"us": us, "rel_err_vs_gemv": err}
        touched = min(cfg.num_experts, t * k) + 1  # an upper bound on the experts read
        nbytes = touched * 3 * cfg.hidden_size * cfg.moe_intermediate_size * (0.5 + 4 / 64)
        ok = {n: r["us"] for n, r in row.items() if "us" in r}
        best = min(ok, key=ok.get)
        table[t] = {"paths": row, "best": best, "floor_us": nbytes / HBM_BYTES_PER_S * 1e6}
        print(
            f"[moe] {t:>3} tokens: "
            + "  ".join(f"{n} {v:.1f}" for n, v in ok.items())
            + f"  | best {best}",
            flush=True,
        )
    return table


def bench_dense(rows_list: list[int]) -> dict:
    """The dense projections at each row count: the tensor-core GEMV (tile sets) against
    dequantise + cuBLAS, us per call in a graph over copies beyond L2."""
    spec = QuantSpec(4, 64)
    table: dict[str, dict] = {}
    for name, (n, k) in DENSE.items():
        copies, nbytes, _ = weight_copies(n, k, spec)
        table[name] = {}
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {}
            for cname, tiles in MMA_CONFIGS.items():
                try:
                    row[cname] = graph_time_us(
                        [lambda c=c, t=tiles, x=x: quant_mma(x, *c, spec, t) for c in copies],
                        replays=10,
                        rounds=3,
                    )
                except Exception as err:  # noqa: BLE001 - a tile set that does not compile
                    row[cname] = str(err)[:120]
            row["dequant+cublas"] = graph_time_us(
                [lambda c=c, x=x: F.linear(x, dequantize(*c, spec, x.dtype)) for c in copies],
                replays=5,
                rounds=3,
            )
            row["floor_us"] = nbytes / HBM_BYTES_PER_S * 1e6
            table[name][m] = row
            print(
                f"[dense] {name} x {m} rows: "
                + "  ".join(
                    f"{c} {v:.1f}" if isinstance(v, float) else f"{c} err" for c, v in row.items()
                ),
                flush=True,
            )
    return table


GROUPS = (  # kernel-name substrings -> group, first match wins
    ("expert", "moe experts"),
    ("moe_gemm", "moe experts"),
    ("topk", "moe routing"),
    ("count_kernel", "moe routing"),
    ("scan_kernel", "moe routing"),
    ("scatter", "moe routing"),
    ("combine", "moe combine"),
    ("mma", "dense 4-bit (tensor cores)"),
    ("gemv", "dense 4-bit (row GEMV)"),
    ("dequant", "dequantise"),
    ("gemm", "cuBLAS"),
    ("nvjet", "cuBLAS"),
    ("xmma", "cuBLAS"),
    ("paged", "attention"),
    ("attention", "attention"),
    ("fmha", "attention"),
    ("recurrent", "gdn"),
    ("delta", "gdn"),
    ("conv", "gdn"),
    ("norm", "norms"),
)


def _group_of(kernel: str) -> str:
    low = kernel.lower()
    return next((g for key, g in GROUPS if key in low), "other")


def profile_batch(llm: LLM, batch: int, context: int = 512) -> dict:
    """One eager decode step of `batch` sequences at `context` tokens each: kernel time by
    group (the busiest kernels too)."""
    runner = llm.runner
    bs = runner.cache.block_size
    per = -(-(context + 1) // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    meta = build_metadata(
        [[1]] * batch, [context] * batch, tables, list(range(batch)), bs, runner.model.device
    )

    @torch.inference_mode()
    def step():
        return runner.model.logits(runner.model(meta, runner.cache)).argmax(-1)

    prof = kernel_profile(step, top=40)
    groups: dict[str, float] = defaultdict(float)
    for row in prof["top"]:
        groups[_group_of(row["kernel"])] += row["us"]
    prof["groups_us"] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
    return prof


def bench_engine(sizes: list[int], rounds: int, state_dtype: str = "float32") -> dict:
    """Output tok/s of C requests of 512 tokens decoding 64 tokens together (median of
    rounds), and one eager decode step at each size profiled; Gated DeltaNet state in
    `state_dtype`."""
    model = random_model(QWEN, 0, "cuda", quantize=QuantConfig.from_name("4bit"))
    llm = LLM(model, **engine_settings(1024, max(sizes), 16384, state_dtype))
    gen = torch.Generator().manual_seed(0)
    tok_s, profiles = {}, {}
    for c in sizes:
        prompts = [torch.randint(100, VOCAB, (512,), generator=gen).tolist() for _ in range(c)]
        run_engine(llm, prompts, 4)  # warm-up at this batch size
        runs = []
        for _ in range(rounds):
            _, t_dec, n = run_engine(
                llm, prompts, 64, SamplingParams(max_tokens=64, ignore_eos=True)
            )
            runs.append(n / t_dec)
        tok_s[c] = statistics.median(runs)
        profiles[c] = profile_batch(llm, c)
        g = profiles[c]["groups_us"]
        print(
            f"[engine] concurrency {c}: {tok_s[c]:.0f} tok/s; eager step kernel time "
            f"{profiles[c]['kernel_time_us']:.0f} us, by group: "
            + ", ".join(f"{k} {us:.0f}" for k, us in g.items()),
            flush=True,
        )
    return {"recurrent_state_dtype": state_dtype, "decode_tok_s": tok_s, "profiles": profiles}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernels", default="", help="moe, dense or both (comma-separated)")
    p.add_argument("--engine", action="store_true")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--moe-tokens", default=",".join(map(str, MOE_TOKENS)))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--recurrent-state-dtype",
        choices=RECURRENT_STATE_DTYPES,
        default="float32",
        help="how the --engine run keeps Gated DeltaNet state between steps",
    )
    p.add_argument("--out", default="bench-out/batch.json")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    kernels = set(args.kernels.split(",")) - {""}
    report: dict = {"gpu": torch.cuda.get_device_name()}
    if "moe" in kernels:
        report["moe"] = bench_moe(QWEN, [int(s) for s in args.moe_tokens.split(",")])
    if "dense" in kernels:
        report["dense"] = bench_dense(sorted({8, 16, *sizes}))
    if args.engine:
        report["engine"] = bench_engine(sizes, args.rounds, args.recurrent_state_dtype)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
