"""Gated DeltaNet kernels vs flash-linear-attention 0.6.0 at the model's shapes (GPU).

Prefill: our chunked kernel vs fla's `chunk_gated_delta_rule` (both with the L2-norm of q/k
in the kernel, an initial state and the final state out), one sequence of 512..32K tokens,
eager, median of `do_bench`; also the sum of each side's kernel times (below the eager
time, the rest is host time: launches and allocations). fla's eager time is host-bound up
to ~8K tokens and moves with the host's speed (8K: 1.41 ms in one run on the H200, 0.66 in
another), so the kernel-time ratio is the GPU-to-GPU comparison.
Decode: one layer step for a batch of sequences whose states sit in a pool; ours is conv
update + fused recurrent step with the gated RMSNorm (two kernels), fla's is its fused
recurrent kernel alone; both timed inside a CUDA graph of 30 consecutive layers (distinct
states, as in the model) and fla also eagerly. State traffic = state bytes read + written.
Batch-1 decode in the model fuses the conv and the norm into the 4-bit projections' GEMVs
(`GatedDeltaNet._decode_one_token`), so at batch 1 the whole mixer (in-projection 2048 ->
12352, step, out-projection 4096 -> 2048) is also timed that way and as projections + conv
kernel + step with norm, against the two bare GEMVs: the layer step's own time is the
mixer's minus theirs. Graphs of 30 layers, variants alternating over rounds.

    python -m sparrow.bench.gdn --out bench-out/gdn.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sparrow.bench.timing import HBM_BYTES_PER_S, graph_time_us, kernel_profile
from sparrow.eval.measure import rel_err
from sparrow.eval.report import write_report
from sparrow.kernels.causal_conv1d.conv import causal_conv1d_varlen, state_pool
from sparrow.kernels.gated_delta_rule.chunk import ChunkTiles, chunk_gated_delta_rule_varlen
from sparrow.kernels.gated_delta_rule.fused_recurrent import fused_recurrent_step
from sparrow.kernels.quant_gemv.gdn import quant_gemv_conv, quant_gemv_rms_scaled
from sparrow.kernels.quant_gemv.gemv import quant_gemv
from sparrow.layers.norms import GatedRMSNorm
from sparrow.quant.affine import QuantSpec, quantize

HK, HV, D, CONV_K = 16, 32, 128, 4  # Qwen3.6-35B-A3B
CONV_DIM = 2 * HK * D + HV * D
LAYERS = 30


def _inputs(batch: int, length: int, gen: torch.Generator):
    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    q, k, v = randn(batch, length, HK, D), randn(batch, length, HK, D), randn(batch, length, HV, D)
    g = F.logsigmoid(randn(batch, length, HV, dtype=torch.float32)) * 0.1
    beta = randn(batch, length, HV, dtype=torch.float32).sigmoid()
    h0 = randn(batch, HV, D, D, dtype=torch.float32) * 0.1
    return q, k, v, g, beta, h0


def bench_prefill(length: int, fla_chunk, gen) -> dict:
    q, k, v, g, beta, h0 = _inputs(1, length, gen)
    cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    slots = torch.zeros(1, dtype=torch.int32, device="cuda")
    pool = h0.clone()

    def ours(block_v=None):  # the default tiles, or another state width
        pool.copy_(h0)
        tiles = ChunkTiles() if block_v is None else ChunkTiles(state_bv=block_v)
        return chunk_gated_delta_rule_varlen(
            q[0], k[0], v[0], g[0], beta[0], cu, pool, slots, tiles=tiles
        )

    def fla():
        return fla_chunk(
            q,
            k,
            v,
            g,
            beta,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    o_ours, (o_fla, h_fla) = ours(), fla()
    row = {
        "tokens": length,
        "o_rel_err_vs_fla": rel_err(o_ours, o_fla[0]),
        "state_rel_err_vs_fla": rel_err(pool, h_fla),
    }
    copy_ms = do_bench(lambda: pool.copy_(h0), return_mode="median")
    row["ours_ms"] = do_bench(ours, return_mode="median") - copy_ms
    for bv in (16, 32, 64):  # state columns per program of the sequential kernel
        row[f"ours_bv{bv}_ms"] = do_bench(lambda bv=bv: ours(bv), return_mode="median") - copy_ms
    row["fla_ms"] = do_bench(fla, return_mode="median")
    row["speedup"] = row["fla_ms"] / row["ours_ms"]
    profile = kernel_profile(ours, top=6)
    row["ours_kernels"] = profile["top"]
    row["ours_kernel_ms"] = profile["kernel_time_us"] / 1e3
    row["fla_kernel_ms"] = kernel_profile(fla)["kernel_time_us"] / 1e3
    row["kernel_speedup"] = row["fla_kernel_ms"] / row["ours_kernel_ms"]
    return row


def bench_decode(batch: int, fla_recurrent, gen) -> dict:
    norm = GatedRMSNorm(D, 1e-6).to("cuda", torch.bfloat16)  # as the model holds it
    norm.weight.data.fill_(1.0)
    a_log = torch.rand(HV, generator=gen, device="cuda").mul(15).add(0.01).log()
    dt_bias = torch.ones(HV, device="cuda")
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    conv_w = torch.randn(CONV_DIM, CONV_K, generator=gen, device="cuda").bfloat16() * 0.3
    layers = []
    for _ in range(LAYERS):  # distinct inputs and states per layer: nothing stays in L2
        mixed = torch.randn(batch, CONV_DIM, generator=gen, device="cuda").bfloat16()
        ab = torch.randn(2, batch, HV, generator=gen, device="cuda").bfloat16()
        z = torch.randn(batch, HV, D, generator=gen, device="cuda").bfloat16()
        conv = state_pool(batch, CONV_DIM, CONV_K, "cuda", torch.bfloat16)  # as the engine's
        state = torch.randn(batch, HV, D, D, generator=gen, device="cuda") * 0.1
        layers.append((mixed, ab, z, conv, state))

    def step_only(mixed, ab, z, conv, state):
        return fused_recurrent_step(
            mixed, ab[0], ab[1], z, a_log, dt_bias, norm.weight, norm.eps, state, slots, HK
        )

    def ours(mixed, ab, z, conv, state):  # the layer's decode path: two kernels
        return step_only(
            causal_conv1d_varlen(mixed, cu, conv, slots, conv_w, max_len=1), ab, z, conv, state
        )

    fla_calls = []
    for mixed, ab, _, _, state in layers:
        q, k, v = mixed.view(batch, 1, -1).split((HK * D, HK * D, HV * D), dim=-1)
        args = (
            q.reshape(batch, 1, HK, D),
            k.reshape(batch, 1, HK, D),
            v.reshape(batch, 1, HV, D),
            F.logsigmoid(ab[0].float())[:, None],
            ab[1].float().sigmoid()[:, None],
        )
        fla_calls.append(
            lambda args=args, state=state: fla_recurrent(
                *args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
        )
    state_bytes = batch * HV * D * D * 4 * 2
    row = {"batch": batch}
    row["ours_graph_us"] = graph_time_us([lambda x=x: ours(*x) for x in layers])
    row["ours_step_only_graph_us"] = graph_time_us([lambda x=x: step_only(*x) for x in layers])
    row["conv_only_graph_us"] = graph_time_us(
        [lambda x=x: causal_conv1d_varlen(x[0], cu, x[3], slots, conv_w, max_len=1) for x in layers]
    )
    row["fla_graph_us"] = graph_time_us(fla_calls)
    row["fla_eager_us"] = do_bench(fla_calls[0], return_mode="median") * 1e3
    for name in ("ours_graph_us", "fla_graph_us", "fla_eager_us"):
        row[name.replace("_us", "_state_tb_s")] = state_bytes / (row[name] * 1e-6) / 1e12
    row["ours_state_bw_fraction"] = row["ours_graph_state_tb_s"] * 1e12 / HBM_BYTES_PER_S
    return row


def bench_mixer(gen, rounds: int = 3) -> dict:
    """Batch-1 decode of the whole GDN mixer (see the module docstring), us per layer."""
    spec = QuantSpec(4, 64)
    hidden, n_in = 2048, CONV_DIM + HV * D + 2 * HV
    norm_w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    a_log = torch.rand(HV, generator=gen, device="cuda").mul(15).add(0.01).log()
    dt_bias = torch.ones(HV, device="cuda")
    slots = torch.zeros(1, dtype=torch.int32, device="cuda")
    cu = torch.arange(2, dtype=torch.int32, device="cuda")
    layers = []
    for _ in range(LAYERS):
        x = torch.randn(1, hidden, generator=gen, device="cuda").bfloat16()
        w_in, w_out = (
            quantize(torch.randn(n, k, generator=gen, device="cuda"), spec)
            for n, k in ((n_in, hidden), (hidden, HV * D))
        )
        conv_w = torch.randn(CONV_DIM, CONV_K, generator=gen, device="cuda").bfloat16() * 0.3
        conv = state_pool(1, CONV_DIM, CONV_K, "cuda", torch.bfloat16)
        state = torch.randn(1, HV, D, D, generator=gen, device="cuda") * 0.1
        layers.append((x, w_in, w_out, conv_w, conv, state))

    def split(y):
        qkv, z, b, a = y.split((CONV_DIM, HV * D, HV, HV), dim=-1)
        return qkv, z.unflatten(-1, (HV, D)), b, a

    def fused(x, w_in, w_out, conv_w, conv, state):  # the model's batch-1 path
        qkv, z, b, a = split(quant_gemv_conv(x, *w_in, spec, conv_w, conv, slots))
        gated, sq_sums = fused_recurrent_step(
            qkv, a, b, z, a_log, dt_bias, norm_w, 1e-6, state, slots, HK, normed=False
        )
        return quant_gemv_rms_scaled(gated, sq_sums, 1e-6, *w_out, spec, torch.bfloat16)

    def separate(x, w_in, w_out, conv_w, conv, state):  # the path at batch > 1
        mixed, z, b, a = split(quant_gemv(x, *w_in, spec))
        qkv = causal_conv1d_varlen(mixed, cu, conv, slots, conv_w, max_len=1)
        y = fused_recurrent_step(qkv, a, b, z, a_log, dt_bias, norm_w, 1e-6, state, slots, HK)
        return quant_gemv(y.flatten(1), *w_out, spec)

    def gemvs(x, w_in, w_out, conv_w, conv, state):  # the projections alone
        return quant_gemv(quant_gemv(x, *w_in, spec)[:, : HV * D], *w_out, spec)

    variants = {"fused": fused, "separate": separate, "gemvs_only": gemvs}
    conv_before = [layer[4].clone() for layer in layers]
    state_before = [layer[5].clone() for layer in layers]
    outs = {}
    for name, fn in variants.items():  # the same output both ways (from the same states)
        for layer, c, s in zip(layers, conv_before, state_before, strict=True):
            layer[4].copy_(c)
            layer[5].copy_(s)
        outs[name] = fn(*layers[0])
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(graph_time_us([lambda x=x, fn=fn: fn(*x) for x in layers]))
    row = {f"{name}_us": statistics.median(t) for name, t in times.items()}
    row["rounds_us"] = times
    row["fused_step_us"] = row["fused_us"] - row["gemvs_only_us"]
    row["separate_step_us"] = row["separate_us"] - row["gemvs_only_us"]
    row["fused_vs_separate_rel_err"] = rel_err(outs["fused"], outs["separate"])
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="512,2048,8192,32768")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--out", default="bench-out/gdn.json")
    args = p.parse_args(argv)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():  # decode first: after its 32K prefill, fla 0.6.0's
        # recurrent kernel faulted (illegal address) in a run on the H200
        decode = [
            bench_decode(int(b), fused_recurrent_gated_delta_rule, gen)
            for b in args.batches.split(",")
        ]
        mixer = bench_mixer(gen)
        prefill = [
            bench_prefill(int(n), chunk_gated_delta_rule, gen) for n in args.lengths.split(",")
        ]
    print(
        f"{'prefill tokens':>14}{'ours ms':>10}{'fla ms':>10}{'speedup':>9}{'o err':>10}"
        f"{'our kernels ms':>16}{'fla kernels ms':>16}{'ratio':>7}"
    )
    for r in prefill:
        print(
            f"{r['tokens']:>14}{r['ours_ms']:>10.3f}{r['fla_ms']:>10.3f}{r['speedup']:>9.2f}"
            f"{r['o_rel_err_vs_fla']:>10.1e}{r['ours_kernel_ms']:>16.3f}"
            f"{r['fla_kernel_ms']:>16.3f}{r['kernel_speedup']:>7.2f}  "
            + ", ".join(f"{k['kernel'][:14]} {k['us']:.0f}us" for k in r["ours_kernels"])
        )
    print(
        f"{'decode batch':>14}{'ours graph us':>15}{'TB/s':>7}"
        f"{'step + norm us':>16}{'conv us':>9}{'fla graph us':>14}"
        f"{'fla eager us':>14}"
    )
    for r in decode:
        print(
            f"{r['batch']:>14}{r['ours_graph_us']:>15.2f}{r['ours_graph_state_tb_s']:>7.2f}"
            f"{r['ours_step_only_graph_us']:>16.2f}{r['conv_only_graph_us']:>9.2f}"
            f"{r['fla_graph_us']:>14.2f}{r['fla_eager_us']:>14.2f}"
        )
    print(
        f"batch-1 mixer, us per layer: in-proj GEMV with conv + step + out-proj GEMV "
        f"finishing the norm {mixer['fused_us']:.2f}; GEMVs + conv + step with norm "
        f"{mixer['separate_us']:.2f}; the two GEMVs alone {mixer['gemvs_only_us']:.2f}: "
        f"layer step {mixer['fused_step_us']:.2f} (fused) vs "
        f"{mixer['separate_step_us']:.2f} (separate); outputs differ by "
        f"{mixer['fused_vs_separate_rel_err']:.1e}"
    )
    report = {
        "gpu": torch.cuda.get_device_name(),
        "shapes": f"Hk={HK} Hv={HV} D={D}",
        "prefill": prefill,
        "decode": decode,
        "mixer_batch1": mixer,
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
