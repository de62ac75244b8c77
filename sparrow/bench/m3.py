"""MiniMax M3 on one GPU: engine speed at real layer width, and its MSA path against HF (GPU).

Speed: hidden 6144, 64/4 heads, MSA (4 index heads, 128-token blocks, top-16), 128 experts
top-4, random weights quantised to 4 bits on the GPU, `--layers` of the 60 (the real
layout: 3 full-attention dense layers, then sparse MoE ones; the whole model does not fit
one GPU). Per prompt length: prefill tok/s (time to the first token) and decode tok/s at
batch 1 through `sparrow.LLM` (chunked prefill, CUDA-graph decode), medians over rounds; the
full 60-layer figures are extrapolated per layer and marked so.

Parity: a 4-layer model (one full-attention layer, three MSA ones; dense MLPs, then one
MoE) with HF's own init. HF's `MiniMaxM3VLForCausalLM` in bf16 and ours on the same weights
in bf16 (the reference path: plain PyTorch MSA; and the kernels) for one prompt of
`--parity-len` tokens, each against ours in fp32 (the reference path) and against HF bf16:
logits of the last 512 positions, relative error and top-1 agreement.

    python -m sparrow.bench.m3 --out bench-out/m3.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sparrow import kernels
from sparrow.bench.e2e import engine_settings, run_engine
from sparrow.config import INDEX_CACHE_DTYPES, QuantConfig
from sparrow.engine.llm import LLM
from sparrow.eval.hf_compare import agreement
from sparrow.eval.measure import timed
from sparrow.eval.report import write_report
from sparrow.loader.random_checkpoint import PRESETS, random_model
from sparrow.loader.weights import load_tensors
from sparrow.models.interface import ModelArgs
from sparrow.worker.sequences import SequenceBatch

FULL_LAYERS = 60
KEEP = 512  # logits compared per prompt


def speed(args: argparse.Namespace, lengths: list[int], base: ModelArgs, device: str) -> dict:
    cfg = base.replace(num_layers=args.layers)
    model = random_model(cfg, 0, device, quantize=QuantConfig.from_name("4bit"))
    gib = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    max_len = max(lengths) + args.decode + 1
    bs = cfg.index_block_size  # a cache page is one MSA block
    llm = LLM(
        model,
        **engine_settings(max_len, 1, args.chunk)
        | {
            "block_size": bs,
            "num_blocks": -(-max_len // bs) + 8,
            "index_cache_dtype": args.index_cache_dtype,
        },
    )
    gen = torch.Generator().manual_seed(0)
    # one warm-up prompt of two chunks and a bit compiles every kernel the timed runs take
    # (first chunk, chunks after a prefix, decode graphs)
    warm = min(max(lengths), 2 * args.chunk + 7)
    run_engine(
        llm,
        [torch.randint(0, cfg.vocab_size - 64, (warm,), generator=gen).tolist()],
        args.decode + 1,
    )
    rows = {}
    for length in lengths:
        prompt = torch.randint(0, cfg.vocab_size - 64, (length,), generator=gen).tolist()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        runs = []
        for _ in range(args.rounds):
            t_pre, t_dec, n = run_engine(llm, [prompt], args.decode + 1)
            runs.append((length / t_pre, n / t_dec, t_pre))
        pre = statistics.median(r[0] for r in runs)
        dec = statistics.median(r[1] for r in runs)
        scale = args.layers / FULL_LAYERS  # layer time dominates; embedding/head not scaled
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        rows[length] = {
            "prefill_tok_s": pre,
            "decode_tok_s": dec,
            "prefill_s": statistics.median(r[2] for r in runs),
            "peak_gib": peak,
            "prefill_tok_s_60_layers_extrapolated": pre * scale,
            "decode_tok_s_60_layers_extrapolated": dec * scale,
        }
        print(
            f"[m3] {args.layers} layers, {length:>6} tokens: prefill {pre:8.0f} tok/s "
            f"({rows[length]['prefill_s']:.1f} s), decode {dec:6.1f} tok/s, peak "
            f"{peak or 0:.1f} GiB (60 layers, extrapolated: {pre * scale:7.0f} / "
            f"{dec * scale:5.1f})",
            flush=True,
        )
    cache_gib = (
        sum(
            t.numel() * t.element_size()
            for layer in llm.runner.cache.layers
            if layer is not None
            for t in layer
        )
        / 2**30
    )
    del llm, model
    _empty_cache()
    return {"layers": args.layers, "weights_gib": gib, "kv_cache_gib": cache_gib, "rows": rows}


def _ours_logits(model, prompt: torch.Tensor, backend: str) -> tuple[float, torch.Tensor]:
    """(prefill seconds, fp32 logits of the last KEEP positions) with the kernel `backend`."""
    kernels.set_backend(backend)
    try:
        t, hidden = timed(lambda: SequenceBatch(model, 1, len(prompt)).forward([prompt]))
        return t, model.logits(hidden[-KEEP:]).float()
    finally:
        kernels.set_backend("auto")


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.inference_mode()
def parity(length: int, base: ModelArgs, device: str) -> dict:
    """HF bf16 and ours bf16 (reference path and kernels) against ours in fp32 on HF's
    weights (the reference path: the truth both bf16 runs round away from), and against
    each other. With random weights the logits are nearly flat, so bf16 rounding alone
    moves top-1 at some positions: the distances to fp32 say who rounds more."""
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    # three MSA layers after one full one; one MoE layer (the MSA path is under test)
    cfg = base.replace(
        num_layers=4,
        layer_types=("full_attention",) + ("minimax_m3_sparse",) * 3,
        mlp_layer_types=("dense",) * 3 + ("sparse",),
    )
    torch.manual_seed(0)
    with torch.device(device):
        hf = MiniMaxM3VLForCausalLM._from_config(
            MiniMaxM3VLTextConfig(**cfg.to_hf_text_config()), dtype=torch.bfloat16
        ).eval()
    prompt = torch.randint(0, cfg.vocab_size, (length,), device=device)
    t_hf, out = timed(lambda: hf(prompt[None], logits_to_keep=KEEP))
    logits = {"hf_bf16": out.logits[0].float()}
    del out
    result = {"tokens": length, "positions": KEEP, "hf_prefill_s": t_hf}
    runs = ((torch.bfloat16, ("reference", "auto")), (torch.float32, ("reference",)))
    for dtype, backends in runs:
        ours = load_tensors(cfg, hf.state_dict(), device, dtype, where="HF state dict")
        for backend in backends:
            name = f"ours_{'kernels' if backend == 'auto' else 'reference'}_{str(dtype)[6:]}"
            result[f"{name}_prefill_s"], logits[name] = _ours_logits(ours, prompt, backend)
        del ours
        _empty_cache()
    truth = logits.pop("ours_reference_float32")
    for name, value in logits.items():
        result[f"{name}_vs_fp32"] = agreement(value, truth)
        result[f"{name}_vs_hf_bf16"] = agreement(value, logits["hf_bf16"])
        print(
            f"[m3] parity at {length} tokens, {name}: vs fp32 rel err "
            f"{result[f'{name}_vs_fp32']['rel_err']:.4f}, top-1 "
            f"{result[f'{name}_vs_fp32']['top1_agree']:.2%}; vs HF bf16 top-1 "
            f"{result[f'{name}_vs_hf_bf16']['top1_agree']:.2%}",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--layers", type=int, default=16, help="of the 60 (4-bit, one GPU)")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    p.add_argument(
        "--index-cache-dtype",
        choices=INDEX_CACHE_DTYPES,
        default="auto",
        help="MSA index keys in the activation dtype or as fp8 codes",
    )
    p.add_argument("--parity-len", type=int, default=4096, help="0: skip the HF comparison")
    p.add_argument(
        "--preset",
        choices=("minimax-m3", "minimax-m3-tiny"),
        default="minimax-m3",
        help="minimax-m3-tiny: a smoke test (also on CPU)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    base = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [int(x) for x in args.lengths.split(",") if x]
    room = base.max_context - args.decode - 1  # the prompt, then the decoded tokens
    if any(n > room for n in lengths):
        p.error(
            f"prompts of up to {room} tokens leave room for --decode {args.decode} in the "
            f"model's context of {base.max_context}"
        )
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "preset": args.preset,
        "torch": torch.__version__,
        "decode_tokens": args.decode,
        "rounds": args.rounds,
    }
    if args.parity_len:
        report["parity"] = parity(args.parity_len, base, device)
    if lengths:
        report["speed"] = speed(args, lengths, base, device)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
