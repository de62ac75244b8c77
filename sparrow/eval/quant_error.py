"""How far the 4-bit model's logits are from the bf16 model's (same random weights, GPU),
and whether the 4-bit decode through the fused GEMV kernels matches the 4-bit reference.

    python -m sparrow.eval.quant_error --layers 8 --prompt-len 512 --decode 8
"""

from __future__ import annotations

import argparse
import json

import torch

from sparrow.config import QuantConfig
from sparrow.eval.hf_compare import agreement
from sparrow.eval.report import write_report
from sparrow.kernels import set_backend
from sparrow.loader.random_checkpoint import random_tensors
from sparrow.loader.weights import load_tensors
from sparrow.models import PRESETS
from sparrow.worker.sequences import SequenceBatch


@torch.inference_mode()
def logits_run(
    model, prompt: torch.Tensor, decode: list[int], state_dtype: str = "float32"
) -> torch.Tensor:
    """Last-position prefill logits and teacher-forced decode logits [1 + len(decode), V];
    recurrent states kept in `state_dtype` (`CacheConfig.recurrent_state_dtype`)."""
    batch = SequenceBatch(model, 1, len(prompt) + len(decode), state_dtype=state_dtype)
    out = [model.logits(batch.forward([prompt])[-1:])[0]]
    for tok in decode:
        ids = torch.tensor([tok], device=prompt.device)
        out.append(model.logits(batch.forward([ids]))[0])
    return torch.stack(out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", default="bench-out/quant_error.json")
    args = p.parse_args(argv)

    cfg = PRESETS["qwen3.6-35b-a3b"].replace(num_layers=args.layers)
    qcfg = cfg.replace(quantization=QuantConfig.mlx_default())
    dtype = getattr(torch, args.dtype)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    bf16 = load_tensors(cfg, random_tensors(cfg, 0, "cuda", dtype), "cuda", dtype)
    q4 = load_tensors(qcfg, bf16.state_dict().items(), "cuda", dtype, where="bf16 model")
    prompt = torch.randint(0, 248000, (args.prompt_len,), device="cuda")
    decode = torch.randint(0, 248000, (args.decode,)).tolist()
    set_backend("reference")
    ref16, ref4 = logits_run(bf16, prompt, decode), logits_run(q4, prompt, decode)
    set_backend("triton")
    kern4 = logits_run(q4, prompt, decode)
    report = {
        "config": f"{args.layers} layers at full width, {args.dtype}, prompt {args.prompt_len}, "
        f"{args.decode} teacher-forced decode steps, random weights (HF init)",
        "4bit_vs_unquantised": agreement(ref4, ref16),
        "4bit_gemv_kernels_vs_4bit_reference": agreement(kern4, ref4),
    }
    print(json.dumps(report, indent=2))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
