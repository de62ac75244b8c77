"""MiniMax M3 sparse attention (MSA) per layer vs dense attention at long context (GPU).

Real shapes, bf16: 64 query heads over 4 KV heads of 128, 4 index heads x 128 with one index
key per token, 128-token blocks (one cache page each), top-16 blocks, the local block forced
in. Random inputs: the selection is spread over the context (a real model's sink blocks
make some blocks far more popular, which the block-major kernel's tiles absorb).

Prefill: one prompt of C tokens. Sparse = `select.select_blocks` (index scores + top-k) and
`prefill.sparse_prefill_attention` over the paged caches, each timed; dense = torch SDPA,
causal, over contiguous [1, Hq, C, D] tensors (K/V heads repeated: the flash backend).
Dense above --dense-max tokens (default 128K) is not run but extrapolated as the
--dense-max time x (C / dense_max)^2 (causal attention is quadratic: 512K = 128K x 16, 1M =
128K x 64), and marked so in the table and the JSON.
Decode: one step of a batch of sequences of C tokens. Sparse = what the engine runs:
`select.decode_select_blocks` (the scores, then torch.topk; also timed:
`decode_select.fused_decode_select_blocks`, the top-k in the scoring launch) and
`decode.sparse_decode_attention` (the paged decode kernel on per-head page views); dense =
SDPA over contiguous caches (a KV group's 16 query heads as 16 query rows of one head, no
mask) and the engine's paged split-K decode over the same pages.
Decode times are CUDA-graph replays (`timing.graph_time_us`); batches whose caches exceed
--max-gib are skipped.
fp8 index keys (default; --no-fp8-index skips them): the same index keys as e4m3 codes with
a per-token scale (`naive.quantize_index_keys`, half the bytes selection reads). Decode
times both selections on them (`select_fp8`, `select_fp8_fused`, and `sparse_fp8` with the
attention) in the same rounds; prefill and decode report `agreement`: the fraction of the
blocks bf16 selection picks per (query, index head) that fp8 selection picks too.

Sparse and dense run in the same process, alternating round by round; times are medians.

    python -m sparrow.bench.msa --out bench-out/msa.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from sparrow.bench.timing import event_ms, graph_time_us
from sparrow.eval.report import write_report
from sparrow.kernels.attention.paged import paged_decode_attention
from sparrow.kernels.msa.decode import sparse_decode_attention
from sparrow.kernels.msa.decode_select import fused_decode_select_blocks
from sparrow.kernels.msa.naive import quantize_index_keys
from sparrow.kernels.msa.prefill import sparse_prefill_attention
from sparrow.kernels.msa.select import decode_select_blocks, select_blocks

HQ, HKV, D, HI, DI, BS, TOPK, LOCAL = 64, 4, 128, 4, 128, 128, 16, 1
SCALE = D**-0.5


def _alternate(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median ms per call of each function, the functions taking turns each round."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(event_ms(fn, rounds=1, reps=reps))
    return {name: statistics.median(t) for name, t in times.items()}


def _paged(batch: int, ctx: int, gen: torch.Generator):
    """K, V [pages, BS, HKV, D], index keys [pages, BS, DI] and shuffled block tables [B, W]."""
    w = -(-ctx // BS)
    pages = batch * w
    tables = torch.randperm(pages, generator=gen, device="cuda").view(batch, w).to(torch.int32)
    k, v = (
        torch.randn(pages, BS, HKV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    ik = torch.randn(pages, BS, DI, generator=gen, device="cuda", dtype=torch.bfloat16)
    return k, v, ik, tables


def _fp8(ik: torch.Tensor, pages: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes [pages, BS, DI] and scales [pages, BS] of the index keys, a few thousand
    pages at a time (the quantiser's fp32 temporaries stay small)."""
    codes = torch.empty(ik.shape, device=ik.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(ik.shape[:2], device=ik.device, dtype=torch.float32)
    for p0 in range(0, ik.shape[0], pages):
        codes[p0 : p0 + pages], scale[p0 : p0 + pages] = quantize_index_keys(ik[p0 : p0 + pages])
    return codes, scale


def selection_agreement(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The fraction of ref's selected blocks [..., topk] (ids >= 0) that ours selects in the
    same row."""
    picked = ref >= 0
    shared = (ref[..., :, None] == ours[..., None, :]).any(-1) & picked
    return shared.sum().item() / max(1, picked.sum().item())


def _contiguous(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[pages, BS, HKV, D] -> [B, HKV, ctx, D] in table order (the dense side's layout)."""
    return cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()


def bench_prefill(ctx: int, dense_max: int, rounds: int, gen, fp8: bool) -> dict:
    k, v, ik, tables = _paged(1, ctx, gen)
    q = torch.randn(ctx, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(ctx, HI, DI, generator=gen, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(ctx, device="cuda")
    token_tables = tables[0][None].expand(ctx, -1)  # one row for every query, no copy
    blocks = select_blocks(iq, ik, tables[0], range(ctx), TOPK, LOCAL)

    fns = {
        "select": lambda: select_blocks(iq, ik, tables[0], range(ctx), TOPK, LOCAL),
        "attend": lambda: sparse_prefill_attention(q, k, v, token_tables, pos, blocks, SCALE),
    }
    n_dense = min(ctx, dense_max)
    qd = q[:n_dense].transpose(0, 1)[None]
    # K/V heads repeated for the query heads: the flash backend, no GQA fallback to math
    kd, vd = (
        _contiguous(c, tables, ctx)[:, :, :n_dense].repeat_interleave(HQ // HKV, dim=1)
        for c in (k, v)
    )
    fns["dense"] = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    reps = 1 if ctx >= 131072 else 3
    t = _alternate(fns, rounds, reps)
    dense = t["dense"] * (ctx / n_dense) ** 2
    sparse = t["select"] + t["attend"]
    row = {
        "context": ctx,
        "select_ms": t["select"],
        "attend_ms": t["attend"],
        "sparse_ms": sparse,
        "dense_ms": dense,
        "dense_extrapolated": n_dense < ctx,
        "dense_measured_tokens": n_dense,
        "speedup": dense / sparse,
    }
    if fp8:
        codes, scale = _fp8(ik)
        fp8_blocks = select_blocks(iq, codes, tables[0], range(ctx), TOPK, LOCAL, ik_scale=scale)
        row["agreement"] = selection_agreement(fp8_blocks, blocks)
    return row


def bench_decode(ctx: int, batch: int, rounds: int, gen, fp8: bool) -> dict:
    k, v, ik, tables = _paged(batch, ctx, gen)
    q = torch.randn(batch, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(batch, HI, DI, generator=gen, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((batch,), ctx - 1, device="cuda")
    ctx_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    kd, vd = _contiguous(k, tables, ctx), _contiguous(v, tables, ctx)
    qd = q.view(batch, HKV, HQ // HKV, D)  # a group's query heads as rows: GQA, no mask

    def sparse(select):
        return lambda: sparse_decode_attention(q, k, v, tables, pos, select(), SCALE)

    def select():
        return decode_select_blocks(iq, ik, tables, pos, TOPK, LOCAL)

    blocks = select()

    fns = {
        "select": select,
        "select_fused": lambda: fused_decode_select_blocks(iq, ik, tables, pos, TOPK, LOCAL),
        "attend": lambda: sparse_decode_attention(q, k, v, tables, pos, blocks, SCALE),
        "sparse": sparse(select),
        "dense_sdpa": lambda: F.scaled_dot_product_attention(qd, kd, vd),
        "dense_paged": lambda: paged_decode_attention(q, k, v, tables, ctx_lens, SCALE),
    }
    if fp8:
        codes, scale = _fp8(ik)

        def select_fp8():
            return decode_select_blocks(iq, codes, tables, pos, TOPK, LOCAL, ik_scale=scale)

        fns["select_fp8"] = select_fp8
        fns["select_fp8_fused"] = lambda: fused_decode_select_blocks(
            iq, codes, tables, pos, TOPK, LOCAL, ik_scale=scale
        )
        fns["sparse_fp8"] = sparse(select_fp8)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(graph_time_us([fn]))
    row = {"context": ctx, "batch": batch}
    row |= {f"{name}_us": statistics.median(t) for name, t in times.items()}
    row["speedup_vs_sdpa"] = row["dense_sdpa_us"] / row["sparse_us"]
    row["speedup_vs_paged"] = row["dense_paged_us"] / row["sparse_us"]
    if fp8:
        row["speedup_fp8_vs_paged"] = row["dense_paged_us"] / row["sparse_fp8_us"]
        row["agreement"] = selection_agreement(select_fp8(), blocks)
    return row


def _decode_gib(ctx: int, batch: int, fp8: bool) -> float:
    """Paged caches plus the dense side's contiguous K/V copies (and the fp8 index keys)."""
    return batch * ctx * ((4 * HKV * D + DI) * 2 + (DI + 4) * fp8) / 2**30


def _print(prefill: list[dict], decode: list[dict], fp8: bool) -> None:
    head = f"{'fp8 agree':>11}" if fp8 else ""
    print(
        f"{'prefill ctx':>12}{'select ms':>11}{'attend ms':>11}{'sparse ms':>11}"
        f"{'dense ms':>11}{'speedup':>9}{head}"
    )
    for r in prefill:
        mark = " (extrapolated)" if r["dense_extrapolated"] else ""
        agree = f"{r['agreement']:>11.4f}" if fp8 else ""
        print(
            f"{r['context']:>12}{r['select_ms']:>11.2f}{r['attend_ms']:>11.2f}"
            f"{r['sparse_ms']:>11.2f}{r['dense_ms']:>11.2f}{r['speedup']:>9.2f}"
            f"{agree}{mark}"
        )
    head = (
        (
            f"{'fp8 sel us':>12}{'fp8 fused us':>14}{'fp8 sparse us':>15}{'fp8 vs paged':>14}"
            f"{'fp8 agree':>11}"
        )
        if fp8
        else ""
    )
    print(
        f"{'decode ctx':>12}{'batch':>7}{'select us':>11}{'fused us':>10}{'attend us':>11}"
        f"{'sparse us':>11}{'sdpa us':>10}{'paged us':>10}{'vs sdpa':>9}"
        f"{'vs paged':>10}{head}"
    )
    for r in decode:
        fp8_cols = (
            (
                f"{r['select_fp8_us']:>12.1f}{r['select_fp8_fused_us']:>14.1f}"
                f"{r['sparse_fp8_us']:>15.1f}{r['speedup_fp8_vs_paged']:>14.2f}"
                f"{r['agreement']:>11.4f}"
            )
            if fp8
            else ""
        )
        print(
            f"{r['context']:>12}{r['batch']:>7}{r['select_us']:>11.1f}"
            f"{r['select_fused_us']:>10.1f}{r['attend_us']:>11.1f}"
            f"{r['sparse_us']:>11.1f}{r['dense_sdpa_us']:>10.1f}{r['dense_paged_us']:>10.1f}"
            f"{r['speedup_vs_sdpa']:>9.2f}{r['speedup_vs_paged']:>10.2f}{fp8_cols}"
        )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default="32768,131072,524288,1048576")
    p.add_argument("--batches", default="1,8")
    p.add_argument(
        "--dense-max",
        type=int,
        default=131072,
        help="longest dense prefill run; longer ones are extrapolated",
    )
    p.add_argument("--max-gib", type=float, default=60.0, help="decode cache budget")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--fp8-index",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also select on fp8 index keys: decode times, agreement",
    )
    p.add_argument("--out", default="bench-out/msa.json")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    prefill, decode = [], []
    with torch.inference_mode():
        for ctx in contexts:
            for batch in map(int, args.batches.split(",")):
                if _decode_gib(ctx, batch, args.fp8_index) <= args.max_gib:
                    decode.append(bench_decode(ctx, batch, args.rounds, gen, args.fp8_index))
                torch.cuda.empty_cache()
        for ctx in contexts:
            prefill.append(bench_prefill(ctx, args.dense_max, args.rounds, gen, args.fp8_index))
            torch.cuda.empty_cache()
    _print(prefill, decode, args.fp8_index)
    report = {
        "gpu": torch.cuda.get_device_name(),
        "shapes": f"Hq={HQ} Hkv={HKV} D={D} Hi={HI} Di={DI} block={BS} topk={TOPK}",
        "fp8_index": args.fp8_index,
        "prefill": prefill,
        "decode": decode,
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
