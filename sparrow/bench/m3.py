"""MiniMax M3 on one GPU: engine speed at real layer width, and its MSA path against HF (GPU).

Speed: hidden 6144, 64/4 heads, MSA (4 index heads, 128-token blocks, top-16), 128 experts
top-4, random weights quantised to 4 bits on the GPU, `--layers` of the 60 (the real
layout: 3 full-attention dense layers, then sparse MoE ones; the whole model does not fit
one GPU). Per prompt length: prefill tok/s (time to the first token) and decode tok/s at
batch 1 through `sparrow.LLM` (chunked prefill, eager decode), medians over rounds; the
full 60-layer figures are extrapolated per layer and marked so.

Parity: a 4-layer bf16 model (one full dense layer, three sparse MoE ones) with HF's own
init, HF's `MiniMaxM3VLForCausalLM` against ours on the same weights for one prompt of
`--parity-len` tokens: logits of the last 512 positions, relative error and top-1
agreement, with our reference path (plain PyTorch MSA) and with the kernels.

    python -m sparrow.bench.m3 --out bench-out/m3.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sparrow import kernels
from sparrow.bench.e2e import engine_settings, run_engine
from sparrow.bench.report import write_report
from sparrow.config import QuantConfig
from sparrow.engine.llm import LLM
from sparrow.eval.hf_compare import agreement, timed
from sparrow.loader.random_checkpoint import random_model
from sparrow.loader.weights import load_tensors
from sparrow.models.minimax_m3 import ModelArgs
from sparrow.worker.sequences import SequenceBatch

FULL_LAYERS = 60
KEEP = 512  # logits compared per prompt


def speed(args: argparse.Namespace, lengths: list[int]) -> dict:
    cfg = ModelArgs().replace(num_layers=args.layers)
    model = random_model(cfg, 0, "cuda", quantize=QuantConfig.from_name("4bit"))
    gib = torch.cuda.memory_allocated() / 2**30
    max_len = max(lengths) + args.decode + 1
    llm = LLM(model, **engine_settings(max_len, 1, args.chunk))
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for length in lengths:
        prompt = torch.randint(0, cfg.vocab_size - 64, (length,), generator=gen).tolist()
        runs = []
        for _ in range(args.rounds + 1):  # the first compiles
            t_pre, t_dec, n = run_engine(llm, [prompt], args.decode + 1)
            runs.append((length / t_pre, n / t_dec))
        pre = statistics.median(r[0] for r in runs[1:])
        dec = statistics.median(r[1] for r in runs[1:])
        scale = args.layers / FULL_LAYERS  # layer time dominates; embedding/head not scaled
        rows[length] = {"prefill_tok_s": pre, "decode_tok_s": dec,
                        "prefill_tok_s_60_layers_extrapolated": pre * scale,
                        "decode_tok_s_60_layers_extrapolated": dec * scale}  # fmt: skip
        print(f"[m3] {args.layers} layers, {length:>6} tokens: prefill {pre:8.0f} tok/s, "
              f"decode {dec:6.1f} tok/s (60 layers, extrapolated: {pre * scale:7.0f} / "
              f"{dec * scale:5.1f})", flush=True)  # fmt: skip
    del llm, model
    torch.cuda.empty_cache()
    return {"layers": args.layers, "weights_gib": gib, "rows": rows}


@torch.inference_mode()
def parity(length: int) -> dict:
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    cfg = ModelArgs().replace(num_layers=4, layer_types=("full_attention",)
                              + ("minimax_m3_sparse",) * 3,
                              mlp_layer_types=("dense",) + ("sparse",) * 3)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = MiniMaxM3VLForCausalLM._from_config(MiniMaxM3VLTextConfig(**cfg.to_hf_text_config()),
                                                 dtype=torch.bfloat16).eval()  # fmt: skip
    ours = load_tensors(cfg, hf.state_dict(), "cuda", torch.bfloat16, where="HF state dict")
    prompt = torch.randint(0, cfg.vocab_size, (length,), device="cuda")
    t_hf, out = timed(lambda: hf(prompt[None], logits_to_keep=KEEP))
    ref = out.logits[0].float()
    del out
    result = {"tokens": length, "hf_prefill_s": t_hf}
    for backend in ("reference", "auto"):
        kernels.set_backend(backend)
        try:
            t, hidden = timed(lambda: SequenceBatch(ours, 1, length).forward([prompt]))
            logits = ours.logits(hidden[-KEEP:]).float()
        finally:
            kernels.set_backend("auto")
        name = "reference" if backend == "reference" else "kernels"
        result[name] = agreement(logits, ref) | {"prefill_s": t}
        print(f"[m3] parity at {length} tokens, ours ({name}) vs HF bf16: "
              f"rel err {result[name]['rel_err']:.4f}, top-1 {result[name]['top1_agree']:.2%}",
              flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--layers", type=int, default=16, help="of the 60 (4-bit, one GPU)")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    p.add_argument("--parity-len", type=int, default=4096, help="0: skip the HF comparison")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "decode_tokens": args.decode, "rounds": args.rounds}  # fmt: skip
    if args.parity_len:
        report["parity"] = parity(args.parity_len)
        torch.cuda.empty_cache()
    if lengths:
        report["speed"] = speed(args, lengths)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
