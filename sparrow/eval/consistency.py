"""Teacher-forced consistency with a reference engine on identical weights: HF transformers
(`--reference hf`, the default) or mlx-lm (`--reference mlx-lm`).

Both sides read the same checkpoint and predict the next token from the same reference
prefix at `--positions` positions of held-out text (default: the Python standard library
files `sparrow.train` holds out, which every machine has): Sparrow prefills `--context`
tokens and then decodes the reference tokens one step at a time (its prefill and decode
paths), the reference runs one forward over the same tokens. Reported per pair of sides:
top-1 agreement, each side's perplexity on the reference tokens and their ratio, and the KL
divergence from the reference side's next-token distribution (mean and p99).

With `--quantize 4bit` two more pairs: Sparrow on the 4-bit weights against HF on the same
weights dequantised (every quantised tensor replaced by what its codes, scales and biases
represent, so both sides compute with identical values), and the 4-bit model against HF on
the original weights (what quantising costs).

    python -m sparrow.eval.consistency [--model DIR] [--quantize 4bit] [--device cuda]

On a CPU both sides run in fp32 and Sparrow takes its reference path; on a GPU, bf16 and the
Triton kernels (`--dtype` and `--hf-dtype` choose otherwise). Where HF runs in another dtype
than Sparrow, one more pair: HF itself in Sparrow's dtype against HF in its own, how far that
dtype's rounding alone moves the predictions.

`--reference mlx-lm`: Sparrow and mlx-lm load the same bytes, an MLX-quantised checkpoint:
`--model` itself when its config.json has MLX's `quantization` block, else `--model`
quantised (`--quantize`, 4bit by default) into a temporary directory by `--writer`: Sparrow's
MLX writer (`sparrow checkpoint quantize`) or `mlx_lm.convert`. Both sides run in `--dtype`;
mlx-lm on mlx's default device (the report names it), Sparrow on `--device`. One pair,
sparrow_vs_mlx_lm. mlx's CPU backend is meaningful in float32 only; bf16 belongs on a GPU.

    python -m sparrow.eval.consistency --reference mlx-lm [--writer mlx-lm] [--model DIR]

`--recurrent-state-dtype bfloat16` keeps Sparrow's Gated DeltaNet state in bf16 between steps
(every Sparrow side above then does) and adds one more pair: Sparrow with bf16 state against
itself with fp32 state, what the state's rounding alone costs.
"""

from __future__ import annotations

import argparse
import copy
import json
from argparse import Namespace
from pathlib import Path

import torch

from sparrow.config import RECURRENT_STATE_DTYPES, QuantConfig
from sparrow.eval import mlx_reference as mlx
from sparrow.eval.quant_error import logits_run
from sparrow.eval.report import write_report
from sparrow.kernels import set_backend
from sparrow.loader.hub import ModelNotFoundError, resolve_model
from sparrow.loader.weights import (
    WeightAssembler,
    build_empty_model,
    load_checkpoint,
    load_tensors,
)
from sparrow.models import load_model_args
from sparrow.quant.affine import dequantize, quantize
from sparrow.tokenizer import load_tokenizer

REFERENCES = ("hf", "mlx-lm")
Pairs = dict[str, dict[str, float]]


def held_out_text() -> str:
    """The standard library files `sparrow.train` never trains on."""
    from sparrow.train import corpus

    return "\n".join(corpus()[1])


def load_hf(model_dir: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """HF's model for the checkpoint, as its Auto classes choose it: the image-text-to-text
    model where the config has a vision tower or the family has no causal LM (MiniMax M3),
    else the causal LM."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = json.loads((model_dir / "config.json").read_text())
    seeing = (
        "vision_config" in config or config["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    cls = transformers.AutoModelForImageTextToText if seeing else transformers.AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def dequantised(state: dict[str, torch.Tensor], model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """`state` (HF names) with each tensor the quantised `model` quantises replaced by the
    weight its codes represent (in `dtype`): the same `quantize` call as the loader's,
    undone."""
    assembler = WeightAssembler(build_empty_model(model.config, model.dtype), "meta", model.dtype)
    out = {}
    for name, t in state.items():
        target = assembler.target(name, tuple(t.shape), t.dtype, "HF state dict")
        if target is not None and target.quantize is not None:
            spec = target.quantize
            t = dequantize(*quantize(t, spec, model.dtype), spec, dtype)
        out[name] = t
    return out


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, ids: torch.Tensor, context: int) -> torch.Tensor:
    """fp32 logits [len(ids) - context, V] predicting ids[context:], one forward."""
    return hf(ids[None, :-1]).logits[0, context - 1 :].float()


def sparrow_logits(
    model: torch.nn.Module, ids: torch.Tensor, context: int, state_dtype: str
) -> torch.Tensor:
    """fp32 logits [len(ids) - context, V] predicting ids[context:]: prefill ids[:context],
    then decode the rest teacher-forced."""
    return logits_run(model, ids[:context], ids[context:-1].tolist(), state_dtype).float()


def compare(ours: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Logits [N, V] of a side and of its reference, the reference tokens [N]."""
    lp, lq = ours.float().log_softmax(-1), ref.float().log_softmax(-1)
    nll_ours = -lp.gather(-1, targets[:, None]).mean()
    nll_ref = -lq.gather(-1, targets[:, None]).mean()
    kl = (lq.exp() * (lq - lp)).sum(-1)
    return {
        "top1_agreement": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "perplexity": nll_ours.exp().item(),
        "reference_perplexity": nll_ref.exp().item(),
        "perplexity_ratio": (nll_ours - nll_ref).exp().item(),
        "kl_mean": kl.mean().item(),
        "kl_p99": kl.quantile(0.99).item(),
    }


def sparrow_pairs(
    name: str, model: torch.nn.Module, ref: torch.Tensor, ids: torch.Tensor, args: Namespace
) -> Pairs:
    """Sparrow's `model` against the reference logits `ref`, and with bf16 recurrent state
    against itself with fp32 state."""
    state_dtype = args.recurrent_state_dtype
    logits = sparrow_logits(model, ids, args.context, state_dtype)
    targets = ids[args.context :]
    pairs = {name: compare(logits, ref, targets)}
    if state_dtype != "float32":  # the state's rounding alone
        pairs[f"sparrow_{state_dtype}_state_vs_float32_state"] = compare(
            logits, sparrow_logits(model, ids, args.context, "float32"), targets
        )
    return pairs


def against_hf(
    args: Namespace, model_dir: Path, dtype: torch.dtype, ids: torch.Tensor
) -> tuple[dict, Pairs]:
    """(report fields, pairs) with HF transformers as the reference."""
    targets = ids[args.context :]
    hf = load_hf(model_dir, getattr(torch, args.hf_dtype) if args.hf_dtype else dtype, args.device)
    cfg = load_model_args(model_dir)
    state = hf.state_dict()
    ref = hf_logits(hf, ids, args.context)
    state = {name: t.to(dtype) for name, t in state.items()}  # Sparrow's dtype
    model = load_tensors(cfg, state, args.device, dtype)
    pairs = sparrow_pairs("sparrow_vs_hf", model, ref, ids, args)
    del model
    if hf.dtype != dtype:  # HF's own rounding in Sparrow's dtype, against the same truth
        pairs[f"hf_{str(dtype).removeprefix('torch.')}_vs_hf"] = compare(
            hf_logits(load_hf(model_dir, dtype, args.device), ids, args.context).float(),
            ref,
            targets,
        )
    if args.quantize:
        q = load_tensors(
            cfg, state, args.device, dtype, quantize=QuantConfig.from_name(args.quantize)
        )
        q_logits = sparrow_logits(q, ids, args.context, args.recurrent_state_dtype)
        hf_q = copy.deepcopy(hf)
        hf_q.load_state_dict(dequantised(state, q, hf.dtype))
        pairs[f"sparrow_{args.quantize}_vs_hf_dequantised"] = compare(
            q_logits, hf_logits(hf_q, ids, args.context), targets
        )
        pairs[f"sparrow_{args.quantize}_vs_hf_original"] = compare(q_logits, ref, targets)
    return {"hf_dtype": str(hf.dtype)}, pairs


def against_mlx_lm(
    args: Namespace, model_dir: Path, dtype: torch.dtype, ids: torch.Tensor
) -> tuple[dict, Pairs]:
    """(report fields, pairs) with mlx-lm as the reference, both on the same MLX bytes."""
    name = str(dtype).removeprefix("torch.")
    fields = mlx.environment(name)
    if "note" in fields:
        print(f"note: {fields['note']}")
    bits = args.quantize or "4bit"
    writer = args.writer or "sparrow"
    with mlx.mlx_checkpoint(model_dir, writer, bits, args.device, dtype) as (ckpt, by):
        ref = mlx.mlx_lm_logits(ckpt, ids.tolist(), args.context, name).to(ids.device)
        model = load_checkpoint(ckpt, args.device, dtype, progress=False)
        quant = json.loads((ckpt / "config.json").read_text())["quantization"]
        pairs = sparrow_pairs("sparrow_vs_mlx_lm", model, ref, ids, args)
    fields |= {
        "quantized_by": by,
        "quantization": {k: v for k, v in quant.items() if not isinstance(v, dict)},
    }
    return fields, pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", default=None, help="checkpoint directory or Hub id (default: built-in)"
    )
    p.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit")
    p.add_argument("--reference", choices=REFERENCES, default="hf", help="the engine to match")
    p.add_argument(
        "--quantize",
        choices=["4bit", "8bit"],
        default=None,
        help="hf: add the quantised pairs; mlx-lm: how a float checkpoint is quantised "
        "(default 4bit)",
    )
    p.add_argument(
        "--writer",
        choices=mlx.WRITERS,
        default=None,
        help="mlx-lm: who quantises a float checkpoint: Sparrow's MLX writer (default) or "
        "mlx_lm.convert",
    )
    p.add_argument("--positions", type=int, default=192, help="next-token predictions")
    p.add_argument("--context", type=int, default=64, help="prompt tokens before the first")
    p.add_argument("--text", default=None, help="a text file (default: held-out stdlib files)")
    p.add_argument("--device", default="cpu", help="Sparrow's: cpu (fp32, reference path) or cuda")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="Sparrow's dtype, and mlx-lm's (default: float32 on a CPU, bfloat16 on a GPU)",
    )
    p.add_argument(
        "--hf-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="HF's dtype (default: Sparrow's); float32 against a bf16 Sparrow "
        "measures both bf16 sides against the same fp32 truth",
    )
    p.add_argument(
        "--recurrent-state-dtype",
        choices=RECURRENT_STATE_DTYPES,
        default="float32",
        help="how Sparrow keeps Gated DeltaNet state between steps; bfloat16 adds the pair "
        "Sparrow with bf16 state against Sparrow with fp32 state",
    )
    p.add_argument("--out", default="bench-out/consistency.json")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.positions < 2 or args.context < 1:
        raise SystemExit("--positions must be >= 2 and --context >= 1")
    if args.reference != "hf" and args.hf_dtype:
        raise SystemExit("--hf-dtype applies to --reference hf only")
    if args.reference != "mlx-lm" and args.writer:
        raise SystemExit("--writer applies to --reference mlx-lm only")
    try:
        model_dir = resolve_model(args.model, args.revision)
    except ModelNotFoundError as e:
        raise SystemExit(str(e)) from e
    cpu = args.device == "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if cpu else torch.bfloat16
    set_backend("reference" if cpu else "triton")
    text = Path(args.text).read_text() if args.text else held_out_text()
    ids = load_tokenizer(model_dir).encode(text)[: args.context + args.positions]
    if len(ids) < args.context + args.positions:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --context + --positions")
    ids = torch.tensor(ids, device=args.device)
    against = against_hf if args.reference == "hf" else against_mlx_lm
    fields, pairs = against(args, model_dir, dtype, ids)
    report = {
        "model": str(model_dir),
        "reference": args.reference,
        "device": args.device,
        "dtype": str(dtype),
        **fields,
        "recurrent_state_dtype": args.recurrent_state_dtype,
        "positions": args.positions,
        "context": args.context,
        "text": args.text or "held-out standard library files",
        **pairs,
    }
    write_report(args.out, report)
    for name, row in pairs.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.6g}" for k, v in row.items()))
    return report


if __name__ == "__main__":
    main()
