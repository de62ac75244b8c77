"""Attention over the paged cache, ours against torch SDPA in the same run (GPU).

Prefill: one sequence's chunk of `--chunk` queries over a context of C tokens (the chunk's
own keys last, causal), the cache's blocks in random physical order. Variants:
- `paged`: the Triton paged kernel (`kernels/attention/paged.py`);
- `split-cudnn` (the model's path for long chunks) and `split-flash`:
  `kernels/attention/chunked.py`, prefix and chunk through cuDNN's or FlashAttention-2's
  SDPA kernel, merged by log-sum-exp (the gather from the pages included);
- `sdpa-lower-right`: the prefix gathered, K/V repeated to Hq, one SDPA call with a
  lower-right causal mask (the gather and repeat included).
Decode: batch 1 at context C, `paged` (split-K kernel) against SDPA over contiguous K/V
(no gather: SDPA's best case), both replayed in CUDA graphs.
Rates count causal pairs: 4 * D * Hq FLOPs per (query, key) pair; decode bytes are the K/V
read. Variants alternate within each round; medians over rounds.

    python -m sparrow.bench.attention --out bench-out/attention.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from sparrow.bench.timing import BF16_FLOP_PER_S, HBM_BYTES_PER_S, event_ms, graph_time_us
from sparrow.eval.report import write_report
from sparrow.kernels.attention.chunked import chunk_attention, gather_prefix
from sparrow.kernels.attention.paged import paged_attention, paged_decode_attention

SHAPES = {"qwen3.6": (16, 2, 256), "minimax-m3": (64, 4, 128)}  # Hq, Hkv, D
BLOCK = 128


def _cache(ctx: int, hkv: int, d: int, gen: torch.Generator):
    blocks = -(-ctx // BLOCK)
    k = torch.randn(blocks, BLOCK, hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(blocks, BLOCK, hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
    table = torch.randperm(blocks, generator=gen, device="cuda").to(torch.int32)
    return k, v, table


def prefill_variants(q, k_cache, v_cache, table, ctx, scale, variants) -> dict:
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    prefix = ctx - t
    rows = torch.arange(prefix, ctx, device="cuda")
    k_chunk = k_cache[table[rows // BLOCK].long(), rows % BLOCK]
    v_chunk = v_cache[table[rows // BLOCK].long(), rows % BLOCK]
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor([ctx], dtype=torch.int32, device="cuda")

    def lower_right():
        k = gather_prefix(k_cache, table, ctx).repeat_interleave(hq // hkv, 0)[None]
        v = gather_prefix(v_cache, table, ctx).repeat_interleave(hq // hkv, 0)[None]
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k, v, scale=scale, attn_mask=causal_lower_right(t, ctx)
        )

    calls = {
        "paged": lambda: paged_attention(q, k_cache, v_cache, table[None], cu, ctx_t, scale),
        "sdpa-lower-right": lower_right,
    } | {
        f"split-{b}": (
            lambda b=b: chunk_attention(
                q, k_chunk, v_chunk, k_cache, v_cache, table, prefix, scale, b
            )
        )
        for b in ("cudnn", "flash")
    }
    return {name: calls[name] for name in variants}


def bench_prefill(shape: str, ctx: int, chunk: int, rounds: int, variants: list[str]) -> dict:
    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache, table = _cache(ctx, hkv, d, gen)
    q = torch.randn(chunk, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    scale = d**-0.5
    calls = prefill_variants(q, k_cache, v_cache, table, ctx, scale, variants)
    ref = calls["paged"]().float()
    row = {"shape": shape, "context": ctx, "chunk": chunk}
    for name, fn in calls.items():
        try:
            out = fn()
            out = out[0].transpose(0, 1) if out.dim() == 4 else out
            row[f"{name}_err"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        except Exception as e:  # a backend that refuses the shape is reported, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    live = [n for n in calls if f"{n}_error" not in row]
    times: dict[str, list[float]] = {n: [] for n in live}
    for _ in range(rounds):
        for name in live:
            times[name].append(event_ms(calls[name]))
    pairs = chunk * (ctx - chunk) + chunk * (chunk + 1) / 2
    flops = 4 * d * hq * pairs
    for name in live:
        ms = statistics.median(times[name])
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9
    row["floor_ms"] = flops / BF16_FLOP_PER_S * 1e3
    return row


def bench_decode(shape: str, ctx: int) -> dict:
    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache, table = _cache(ctx, hkv, d, gen)
    q = torch.randn(1, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    ctx_t = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    k_flat = gather_prefix(k_cache, table, ctx)[None]
    v_flat = gather_prefix(v_cache, table, ctx)[None]
    scale = d**-0.5
    ours_us = graph_time_us(
        [lambda: paged_decode_attention(q, k_cache, v_cache, table[None], ctx_t, scale)]
    )
    sdpa_us = graph_time_us(
        [
            lambda: F.scaled_dot_product_attention(
                q[:, :, None], k_flat, v_flat, scale=scale, enable_gqa=True
            )
        ]
    )
    kv_bytes = 2 * ctx * hkv * d * 2
    return {
        "shape": shape,
        "context": ctx,
        "paged_us": ours_us,
        "sdpa_us": sdpa_us,
        "paged_of_floor": kv_bytes / HBM_BYTES_PER_S * 1e6 / ours_us,
        "sdpa_of_floor": kv_bytes / HBM_BYTES_PER_S * 1e6 / sdpa_us,
    }


def _table(rows: list[dict], keys: list[str]) -> None:
    print(" | ".join(keys))
    for r in rows:
        print(
            " | ".join(
                f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys
            )
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="qwen3.6,minimax-m3")
    p.add_argument("--contexts", default="16384,32768,65536,131072")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--decode-contexts", default="4096,32768,131072,1048576")
    p.add_argument("--variants", default="paged,split-flash,split-cudnn,sdpa-lower-right")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench-out/attention.json")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    prefill, decode = [], []
    for shape in args.shapes.split(","):
        for ctx in map(int, args.contexts.split(",")):
            prefill.append(bench_prefill(shape, ctx, args.chunk, args.rounds, variants))
            torch.cuda.empty_cache()
        for ctx in map(int, filter(None, args.decode_contexts.split(","))):
            decode.append(bench_decode(shape, ctx))
            torch.cuda.empty_cache()
    _table(prefill, ["shape", "context", *[f"{v}_tflops" for v in variants]])
    _table(decode, ["shape", "context", "paged_us", "sdpa_us", "paged_of_floor"])
    write_report(
        args.out, {"prefill": prefill, "decode": decode, "gpu": torch.cuda.get_device_name()}
    )


if __name__ == "__main__":
    main()
