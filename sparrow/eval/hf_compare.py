"""Our reference path against HF transformers on one set of weights (GPU).

HF's `Qwen3_5MoeForCausalLM` is built with its own init and its state dict handed to our
loader (no copy). Both engines prefill the same prompt and decode the same teacher-forced
tokens; logits are compared at the last prompt position and at every decode step.

`python -m sparrow.eval.hf_compare` measures the numerical agreement at full width: fp32 vs
fp32 (exactness) and, as the yardstick for bf16, how far HF's own bf16 run is from fp32.
Speed of the same comparison is `python -m sparrow.bench.reference`.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from sparrow.eval.measure import rel_err, timed
from sparrow.eval.report import write_report
from sparrow.loader.weights import load_tensors
from sparrow.models import PRESETS
from sparrow.models.interface import ModelArgs
from sparrow.worker.sequences import SequenceBatch


def build_hf(cfg: ModelArgs, dtype: torch.dtype) -> torch.nn.Module:
    """HF's model with HF's own init, created directly on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg.to_hf_config()).get_text_config()
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return hf.eval()


def ours_from_hf(cfg: ModelArgs, hf: torch.nn.Module) -> torch.nn.Module:
    return load_tensors(cfg, hf.state_dict(), "cuda", hf.dtype, where="HF state dict")


@torch.inference_mode()
def run_hf(hf, prompt: torch.Tensor, steps: int, decode: list[int] | None = None):
    """Prefill, then `steps` decode steps (greedy unless `decode` gives the tokens).
    Returns (prefill s, decode s, fp32 logits [1 + steps, V], decode tokens)."""
    t_pre, out = timed(lambda: hf(prompt[None], use_cache=True, logits_to_keep=1))
    logits, cache, tokens = [out.logits[0, -1].float()], out.past_key_values, []

    def loop():
        nonlocal cache
        for i in range(steps):
            tokens.append(decode[i] if decode else int(logits[-1].argmax()))
            ids = torch.tensor([[tokens[-1]]], device=prompt.device)
            step = hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = step.past_key_values
            logits.append(step.logits[0, -1].float())

    t_dec, _ = timed(loop)
    return t_pre, t_dec, torch.stack(logits), tokens


@torch.inference_mode()
def run_ours(model, prompt: torch.Tensor, decode: list[int]):
    """Same as `run_hf` for our model, with the decode tokens given."""
    batch = SequenceBatch(model, 1, len(prompt) + len(decode))
    t_pre, hidden = timed(lambda: batch.forward([prompt]))
    logits = [model.logits(hidden[-1:])[0]]

    def loop():
        for tok in decode:
            ids = torch.tensor([tok], device=prompt.device)
            logits.append(model.logits(batch.forward([ids]))[0])

    t_dec, _ = timed(loop)
    return t_pre, t_dec, torch.stack(logits), decode


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Logits [N, V] of two runs: relative error and top-1 agreement over the N positions."""
    return {
        "rel_err": rel_err(a, b),
        "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="layers (full width; fp32 needs memory)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--out", default="bench-out/hf_compare.json")
    args = p.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    torch.backends.cuda.matmul.allow_tf32 = False

    cfg = PRESETS["qwen3.6-35b-a3b"].replace(num_layers=args.layers)
    torch.manual_seed(0)
    hf32 = build_hf(cfg, torch.float32)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    ours32, ours16 = ours_from_hf(cfg, hf32), ours_from_hf(cfg, hf16)
    prompt = torch.randint(0, 248000, (args.prompt_len,), device="cuda")
    *_, ref, tokens = run_hf(hf32, prompt, args.decode)
    logits = {
        "ours_fp32": run_ours(ours32, prompt, tokens)[2],
        "hf_bf16": run_hf(hf16, prompt, args.decode, tokens)[2],
        "ours_bf16": run_ours(ours16, prompt, tokens)[2],
    }
    report = {
        "config": f"{args.layers} layers at full width, prompt {args.prompt_len}, "
        f"{args.decode} teacher-forced decode steps",
        "vs_hf_fp32": {name: agreement(x, ref) for name, x in logits.items()},
        "ours_bf16_vs_hf_bf16": agreement(logits["ours_bf16"], logits["hf_bf16"]),
    }
    print(json.dumps(report, indent=2))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
