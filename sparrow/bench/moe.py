"""One full-size MoE layer of Qwen3.6-35B-A3B (hidden 2048, 256 experts, top-8, 512 wide,
shared expert): our 4-bit kernels vs HF's bf16 `Qwen3_5MoeSparseMoeBlock` (grouped_mm) and a
dequantise-then-matmul baseline, in one run. Decode sizes (<= 8 tokens) are timed inside a
CUDA graph, larger ones eagerly; medians of several rounds. Our layer is also timed inside a
graph at every size ("graph us": GPU time without the host's launch cost, which sets the
eager time up to ~2K tokens on the H200's host), and with the shared expert run as its own
layers instead of as one more assignment in the experts' kernels ("apart"). HF's block is
timed inside a graph too above the decode sizes ("hf graph us"; its grouped_mm captures),
for a comparison of GPU time with GPU time.
A graph replaying one layer keeps the few experts a decode step reads (~15 MB at 1 token)
in L2; in the model each of 40 layers reads its own from HBM. So at decode sizes our layer
is also timed as COPIES distinct copies replayed in turn in one graph ("HBM us").

    python -m sparrow.bench.moe --out bench-out/moe.json
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch

from sparrow.bench.timing import BF16_FLOP_PER_S, HBM_BYTES_PER_S, event_ms, graph_time_us
from sparrow.config import QuantConfig
from sparrow.eval.report import write_report
from sparrow.kernels import set_backend
from sparrow.kernels.moe.experts import moe_experts
from sparrow.kernels.moe.grouped_gemm import GemmTiles
from sparrow.kernels.moe.shared import Shared
from sparrow.layers.moe import SparseMoE
from sparrow.layers.quantized import quantized_copy
from sparrow.models import PRESETS
from sparrow.models.interface import ModelArgs

TOKENS = (1, 8, 64, 512, 2048, 8192)
COPIES = 8  # layers cycled for the HBM case: 8 x ~15 MB per step at 1 token, beyond L2


def _time(fn, tokens: int) -> float:
    return graph_time_us([fn], replays=50) if tokens <= 8 else event_ms(fn, rounds=7) * 1e3


def build_layers(cfg: ModelArgs):
    """(HF bf16 block with grouped_mm, our 4-bit layer built from the same weights)."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    hf_cfg = Qwen3_5MoeTextConfig(**cfg.to_hf_text_config())
    hf_cfg._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        hf = Qwen3_5MoeSparseMoeBlock(hf_cfg).to(torch.bfloat16)
    for p in hf.parameters():
        p.requires_grad_(False).normal_(0, 0.02)
    with torch.device("meta"):
        float_layer = SparseMoE(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        )
    float_layer.load_state_dict(hf.state_dict(), strict=True, assign=True)
    ours = quantized_copy(float_layer, QuantConfig.mlx_default(), torch.bfloat16, "layers.0.mlp.")
    return hf, ours


def shared_apart(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The 4-bit layer with its shared expert run as its own layers (dequantise + cuBLAS per
    projection), its output added in the combine kernel, instead of as one more assignment
    per token in the experts' kernels."""
    router_logits, shared_gate = layer.project("gates", x)
    e = layer.experts
    return moe_experts(
        x,
        router_logits,
        layer.top_k,
        (e.gate_up_proj, e.gate_up_proj_scales, e.gate_up_proj_biases),
        (e.down_proj, e.down_proj_scales, e.down_proj_biases),
        e.spec,
        shared=Shared(shared_gate, output=layer.shared_expert(x)),
    )


def bench_tokens(hf, ours, cfg: ModelArgs, t: int, copies: list | None = None) -> dict:
    """copies: more layers like `ours` (distinct weights) for the HBM case at decode sizes."""
    d, inter, k, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, 256
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        hf_us = _time(lambda: hf(x[None]), t)
        hf_graph_us = hf_us if t <= 8 else graph_time_us([lambda: hf(x[None])], replays=10)
        set_backend("triton")
        ours_us = _time(lambda: ours(x), t)
        graph_us = graph_time_us([lambda: ours(x)], replays=20)
        hbm_us = float("nan")
        if copies and t <= 8:
            hbm_us = graph_time_us(
                [lambda layer=layer: layer(x) for layer in [ours, *copies]], replays=20
            )
        out = ours(x)
        # the alternative: the shared expert as its own layers (dequantise + cuBLAS)
        apart_us = _time(lambda: shared_apart(ours, x), t)
        apart_graph_us = graph_time_us([lambda: shared_apart(ours, x)], replays=20)
        set_backend("reference")  # dequantise each expert, then matmul
        ref = ours(x)
        deq_us = event_ms(lambda: ours(x)) * 1e3 if t <= 512 else float("nan")
        set_backend("auto")
    # FLOPs: k routed experts + the shared one, gate_up + down. Bytes: 4-bit weights (+ bf16
    # scale and bias per 64) of the experts touched, the shared expert and the 8-bit router.
    flops = 2 * t * (k + 1) * 3 * d * inter
    nbytes = (min(e, t * k) + 1) * 3 * d * inter * (0.5 + 4 / 64) + e * d * (1 + 4 / 64)
    floor_us = max(flops / BF16_FLOP_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
    return {
        "tokens": t,
        "hf_bf16_us": hf_us,
        "hf_bf16_graph_us": hf_graph_us,
        "dequant_matmul_us": deq_us,
        "ours_us": ours_us,
        "ours_graph_us": graph_us,
        "ours_hbm_graph_us": hbm_us,
        "speedup_vs_hf_graph": hf_graph_us / graph_us,
        "shared_apart_us": apart_us,
        "shared_apart_graph_us": apart_graph_us,
        "speedup_vs_hf": hf_us / ours_us,
        "tflops": flops / ours_us / 1e6,
        "gbps": nbytes / ours_us / 1e3,
        "fraction_of_roofline": floor_us / ours_us,
        "rel_err_vs_reference": (
            (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        ).item(),
    }


def sweep_tiles(ours, cfg: ModelArgs, tokens: list[int]) -> dict:
    """Time the routed experts (routing, both GEMMs, combine) for each tile config inside a
    CUDA graph (GPU time: eagerly the host's launches hide the differences up to ~2K
    tokens): the table behind `GemmTiles.for_shape`."""
    e = ours.experts
    gate_up = (e.gate_up_proj, e.gate_up_proj_scales, e.gate_up_proj_biases)
    down = (e.down_proj, e.down_proj_scales, e.down_proj_biases)
    configs = [
        GemmTiles(bm, bn, nw, ns)
        for bm, bn, nw, ns in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (2, 3, 4))
    ]
    # and each 128-row set with an expert's last <= 64 rows in one 64-row block
    small = GemmTiles(block_m=64, down_block_n=128)
    configs += [replace(c, small=small) for c in configs if c.block_m == 128]
    table = {}
    for t in tokens:
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, cfg.num_experts, device="cuda")
        times = {}
        for tiles in configs:

            def run(tiles=tiles, x=x, logits=logits):
                return moe_experts(
                    x, logits, cfg.num_experts_per_tok, gate_up, down, e.spec, tiles=tiles
                )

            try:
                with torch.inference_mode():
                    times[str(tiles)] = graph_time_us([run], replays=10, rounds=3)
            except Exception as err:  # a tile set the compiler rejects (shared memory)
                times[str(tiles)] = f"error: {str(err)[:120]}"
        ok = {c: v for c, v in times.items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        default = str(GemmTiles.for_shape(t * cfg.num_experts_per_tok, cfg.num_experts))
        table[t] = {
            "best": best,
            "best_us": ok[best],
            "default": default,
            "default_us": times.get(default),
            "all": times,
        }
        print(f"{t:>6} tokens: best {ok[best]:9.1f} us {best}; default {times.get(default)}")
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--out", default="bench-out/moe.json")
    p.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=None,
        help="also sweep GEMM tiles at these token counts",
    )
    args = p.parse_args(argv)

    cfg = PRESETS["qwen3.6-35b-a3b"]
    hf, ours = build_layers(cfg)
    copies = None
    if any(t <= 8 for t in args.tokens):
        copies = [build_layers(cfg)[1] for _ in range(COPIES - 1)]
    sweep = sweep_tiles(ours, cfg, args.sweep) if args.sweep else None
    rows = []
    print(
        f"{'tokens':>7}{'hf bf16 us':>12}{'hf graph us':>12}{'deq+mm us':>11}{'ours us':>10}"
        f"{'graph us':>10}{'HBM us':>8}{'vs hf':>8}{'graphs':>8}{'apart us':>10}"
        f"{'apart graph':>12}{'TF/s':>8}{'GB/s':>8}{'roofline':>10}{'rel err':>10}"
    )
    for t in args.tokens:
        r = bench_tokens(hf, ours, cfg, t, copies)
        rows.append(r)
        print(
            f"{t:>7}{r['hf_bf16_us']:>12.1f}{r['hf_bf16_graph_us']:>12.1f}"
            f"{r['dequant_matmul_us']:>11.1f}{r['ours_us']:>10.1f}{r['ours_graph_us']:>10.1f}"
            f"{r['ours_hbm_graph_us']:>8.1f}{r['speedup_vs_hf']:>7.2f}x"
            f"{r['speedup_vs_hf_graph']:>7.2f}x"
            f"{r['shared_apart_us']:>10.1f}{r['shared_apart_graph_us']:>12.1f}"
            f"{r['tflops']:>8.1f}"
            f"{r['gbps']:>8.0f}{r['fraction_of_roofline']:>10.1%}"
            f"{r['rel_err_vs_reference']:>10.1e}"
        )
    report = {
        "gpu": torch.cuda.get_device_name(),
        "layer": "qwen3.6-35b-a3b MoE, 4-bit",
        "rows": rows,
        "tile_sweep": sweep,
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
