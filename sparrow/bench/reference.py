"""Reference path vs HF transformers, speed at full size on one set of weights (GPU).

Per round, engines alternating: prefill a random prompt, then decode teacher-forced tokens
(HF's greedy tokens from the warm-up round, so both engines see identical inputs). Reports
median prefill and decode tok/s per engine, and how far our bf16 logits are from HF's.

    python -m sparrow.bench.reference --prompt-len 4096 --decode 32 --out bench-out/ref.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sparrow.eval.hf_compare import agreement, build_hf, ours_from_hf, run_hf, run_ours
from sparrow.eval.report import write_report
from sparrow.models import PRESETS


def _hf_gdn_backend() -> str:
    try:
        import fla  # noqa: F401

        return "flash-linear-attention"
    except ImportError:
        return "torch fallback"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the full 40")
    p.add_argument("--out", default="bench-out/reference.json")
    args = p.parse_args(argv)

    cfg = PRESETS["qwen3.6-35b-a3b"]
    cfg = cfg if args.layers is None else cfg.replace(num_layers=args.layers)
    torch.manual_seed(0)
    hf = build_hf(cfg, torch.bfloat16)
    ours = ours_from_hf(cfg, hf)
    shared = ours.lm_head.weight.data_ptr() == hf.lm_head.weight.data_ptr()
    prompt = torch.randint(0, 248000, (args.prompt_len,), device="cuda")

    *_, hf_logits, tokens = run_hf(hf, prompt, args.decode)  # warm-up; fixes the tokens
    sp_logits = run_ours(ours, prompt, tokens)[2]
    timings: dict[str, list[tuple[float, float]]] = {"hf": [], "sparrow": []}
    for _ in range(args.rounds):
        timings["hf"].append(run_hf(hf, prompt, args.decode, tokens)[:2])
        timings["sparrow"].append(run_ours(ours, prompt, tokens)[:2])

    report = {
        "model": f"Qwen3.6-35B-A3B full width, {cfg.num_layers} layers, bf16, random weights",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "hf_gdn_kernels": _hf_gdn_backend(),
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode,
        "rounds": args.rounds,
        "weights_shared": shared,
        "bf16_logits_vs_hf": agreement(sp_logits, hf_logits),
    }
    print(f"{'engine':<10}{'prefill tok/s':>16}{'decode tok/s':>16}")
    for engine, rows in timings.items():
        pre = statistics.median(args.prompt_len / r[0] for r in rows)
        dec = statistics.median(args.decode / r[1] for r in rows)
        report[engine] = {"prefill_tok_s": pre, "decode_tok_s": dec, "rounds_s": rows}
        print(f"{engine:<10}{pre:>16.1f}{dec:>16.2f}")
    print(json.dumps(report["bf16_logits_vs_hf"]))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
