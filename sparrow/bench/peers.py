"""Sparrow beside real engines on one GPU: llama.cpp (CUDA, Q4_0) and mlx-lm (MLX's CUDA
backend), batch 1 at ten prompt lengths and batched decode (GPU).

One random checkpoint at the real layer shapes (`--layers` of the preset's, the same for all
three engines) is written in its family's float release layout, then converted, as part of the
command, into what each engine loads:
- MLX 4-bit (group 64, bf16 scales and biases) by Sparrow's writer: Sparrow and mlx-lm read
  these same bytes;
- GGUF by llama.cpp's own converter (`convert_hf_to_gguf.py`, bf16) and `llama-quantize` to
  Q4_0 (4.5 bits a weight, as group-64 affine 4-bit with bf16 scale and bias).
Conversions are kept in `--workdir` and reused by later runs.

Each round runs every engine over every length in turn (engines alternate), and the report
takes medians over rounds. Each engine runs its fastest path for one request: Sparrow's
engine (CUDA-graph decode) in this process; `llama-bench -fa 1 -ngl 99` (prompt throughput
at each length; decode at each depth with `-d`); mlx-lm's `generate_step` in a process of its
own per round (prefill in its default chunks of 2,048 tokens, then decode), after one warm-up
prompt. Prefill tok/s is the prompt length over the time to the first token (llama-bench:
over the prompt's forward); decode tok/s counts `--decode` tokens after the first. Batched:
C prompts of 512 tokens decode 64 tokens together (Sparrow's engine, `llama-batched-bench`,
mlx-lm's `batch_generate`), output tok/s of the decode phase.

Floors at 4.3 TB/s and 790 TFLOP/s: decode, the bytes a token reads in Sparrow's 4-bit model
at that context; prefill, the larger of the prompt's FLOPs (active weights, causal attention;
Gated DeltaNet's recurrence, a few % of them, left out) and one read of every weight.

    python -m sparrow.bench.peers --llama-cpp ~/llama.cpp --layers 8 --out bench-out/peers.json
    python -m sparrow.bench.peers --engines sparrow,mlx-lm --lengths 256,4096 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparrow.bench.e2e import LENGTHS, decode_bytes_per_token, engine_settings, run_engine
from sparrow.bench.timing import BF16_FLOP_PER_S, HBM_BYTES_PER_S
from sparrow.eval.report import write_report
from sparrow.models import PRESETS
from sparrow.models.interface import ModelArgs

ENGINES = ("sparrow", "llama.cpp", "mlx-lm")
CONCURRENT_PROMPT = 512  # tokens of each prompt of the batched rows
CONCURRENT_DECODE = 64
PREFILL_CHUNK = 8192  # Sparrow's prefill tokens per step

# llama.cpp's converter, run with the pre-tokenizer check falling back to GPT-2's regex: what
# the built-in tokenizer (written beside random checkpoints) uses, and a hash llama.cpp's
# table does not list
_CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass
class Checkpoints:
    float_dir: Path  # the family's release layout, bf16
    mlx_dir: Path  # MLX 4-bit: Sparrow and mlx-lm
    gguf: Path | None  # Q4_0: llama.cpp


def bench_config(preset: str, layers: int | None) -> ModelArgs:
    cfg = PRESETS[preset]
    return cfg if layers is None else cfg.replace(num_layers=layers)


def prepare(
    cfg: ModelArgs,
    workdir: Path,
    llama_src: Path | None,
    llama_bin: Path | None,
    model_dir: Path | None = None,
) -> Checkpoints:
    """The float checkpoint (`model_dir`, else a random one of `cfg` written under
    `workdir`) and its conversions under `workdir`, each step skipped when its output is
    there from an earlier run. The bf16 GGUF is removed once quantised."""
    from sparrow.eval.mlx_reference import write_mlx_checkpoint
    from sparrow.loader.random_checkpoint import write_random_checkpoint

    workdir.mkdir(parents=True, exist_ok=True)
    float_dir, mlx_dir = model_dir or workdir / "float", workdir / "mlx-4bit"
    if not (float_dir / "config.json").is_file():
        _step(f"random checkpoint, {cfg.num_layers} layers", float_dir)
        write_random_checkpoint(float_dir, cfg, seed=0, progress=False)
    if not (mlx_dir / "config.json").is_file():
        _step("MLX 4-bit (Sparrow's writer)", mlx_dir)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        write_mlx_checkpoint(float_dir, mlx_dir, "sparrow", "4bit", device, torch.bfloat16)
    gguf = None
    if llama_src is not None and llama_bin is not None:
        gguf = workdir / "model-q4_0.gguf"
        if not gguf.is_file():
            f16 = workdir / "model-bf16.gguf"
            _step("GGUF bf16 (llama.cpp's converter)", f16)
            convert_gguf(float_dir, f16, llama_src, "bf16")
            _step("GGUF Q4_0 (llama-quantize)", gguf)
            _run([str(llama_bin / "llama-quantize"), str(f16), str(gguf), "Q4_0"])
            f16.unlink()
    return Checkpoints(float_dir, mlx_dir, gguf)


def convert_gguf(model_dir: Path, out: Path, llama_src: Path, outtype: str) -> Path:
    """`model_dir` (a float checkpoint in its release layout) to GGUF by llama.cpp's
    converter in `llama_src`. Qwen3.5/3.6 checkpoints without MTP tensors convert with
    `--no-mtp`."""
    argv = [str(model_dir), "--outfile", str(out), "--outtype", outtype]
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    if text.get("model_type", "").startswith("qwen3_5") and not text.get("mtp_num_hidden_layers"):
        argv.append("--no-mtp")
    _run([sys.executable, "-c", _CONVERT, str(llama_src), *argv])
    return out


def _step(what: str, path: Path) -> None:
    print(f"[peers] {what} -> {path}", flush=True)


def _run(cmd: list[str], **kw: Any) -> str:
    """stdout of `cmd`; on failure a RuntimeError with the tail of its output."""
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {done.returncode}:\n{tail}")
    return done.stdout


def prompts_for(lengths: list[int], vocab: int, seed: int = 0) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths}


# --- Sparrow -------------------------------------------------------------------------------


class SparrowRunner:
    """Sparrow's engine on the MLX 4-bit checkpoint, kept warm across rounds."""

    def __init__(self, mlx_dir: Path, max_len: int, most: int):
        from sparrow.engine.llm import LLM

        settings = engine_settings(max_len, most, PREFILL_CHUNK)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.llm = LLM(mlx_dir, device=device, dtype="bfloat16", **settings)
        self.warm: set[int] = set()

    def batch1(self, prompts: dict[int, list[int]], decode: int) -> dict[int, tuple[float, float]]:
        out = {}
        for n, prompt in prompts.items():
            if n <= 2 * PREFILL_CHUNK and n not in self.warm:  # compiles this length's shapes
                run_engine(self.llm, [prompt], 2)
                self.warm.add(n)
            t_pre, t_dec, got = run_engine(self.llm, [prompt], decode + 1)
            out[n] = (n / t_pre, got / t_dec)
        return out

    def batched(self, prompts: list[list[int]]) -> float:
        run_engine(self.llm, prompts, 4)  # warm-up at this batch size
        _, t_dec, got = run_engine(self.llm, prompts, CONCURRENT_DECODE)
        return got / t_dec


# --- llama.cpp -----------------------------------------------------------------------------


def llama_bench_cmd(bin_dir: Path, gguf: Path, **flags: str) -> list[str]:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-fa", "1"]
    for k, v in flags.items():
        cmd += [f"-{k}", v]
    return cmd + ["-r", "1", "-o", "json"]


def llama_batch1(
    bin_dir: Path, gguf: Path, lengths: list[int], decode: int
) -> tuple[dict[int, tuple[float, float]], dict]:
    """One round of llama-bench: prompt throughput at each length, decode at each depth.
    Returns ({length: (prefill tok/s, decode tok/s)}, build info)."""
    joined = ",".join(map(str, lengths))
    pre = json.loads(_run(llama_bench_cmd(bin_dir, gguf, p=joined, n="0")))
    dec = json.loads(_run(llama_bench_cmd(bin_dir, gguf, p="0", n=str(decode), d=joined)))
    prefill = {r["n_prompt"]: r["avg_ts"] for r in pre if r["n_prompt"]}
    decoded = {r["n_depth"]: r["avg_ts"] for r in dec if r["n_gen"]}
    info = {k: pre[0].get(k) for k in ("build_commit", "build_number", "backends", "gpu_info")}
    return {n: (prefill[n], decoded[n]) for n in lengths}, info


def llama_batched(bin_dir: Path, gguf: Path, concurrency: list[int]) -> dict[int, float]:
    """Output tok/s of C sequences decoding together (`llama-batched-bench`, one slot each)."""
    ctx = max(concurrency) * (CONCURRENT_PROMPT + CONCURRENT_DECODE)
    cmd = [
        str(bin_dir / "llama-batched-bench"),
        *("-m", str(gguf), "-ngl", "99", "-fa", "on", "-c", str(ctx)),
        *("-npp", str(CONCURRENT_PROMPT), "-ntg", str(CONCURRENT_DECODE)),
        *("-npl", ",".join(map(str, concurrency)), "--output-format", "jsonl"),
    ]
    rows = [json.loads(line) for line in _run(cmd).splitlines() if line.startswith("{")]
    return {r["pl"]: r["speed_tg"] for r in rows}


# --- mlx-lm --------------------------------------------------------------------------------


def mlx_round(
    mlx_dir: Path,
    prompts: dict[int, list[int]],
    decode: int,
    batched_prompt: list[int],
    concurrency: list[int],
) -> dict:
    """One round of mlx-lm in a process of its own (MLX and torch keep separate GPU memory):
    {"batch1": {length: [prefill, decode]}, "batched": {C: tok/s}, "versions": {...}}."""
    job = {
        "model": str(mlx_dir),
        "prompts": {str(n): p for n, p in prompts.items()},
        "decode": decode,
        "batched_prompt": batched_prompt,
        "concurrency": concurrency,
    }
    cmd = [sys.executable, "-m", "sparrow.bench.peers", "--mlx-worker"]
    out = _run(cmd, input=json.dumps(job))
    return json.loads(out.strip().splitlines()[-1])


def _mlx_worker() -> None:
    """Reads a job from stdin, prints its result as the last line of stdout."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import batch_generate, generate_step
    from mlx_lm.utils import load

    job = json.loads(sys.stdin.read())
    model, tokenizer = load(job["model"])

    def one(prompt: list[int], decode: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        steps = generate_step(mx.array(prompt), model, max_tokens=decode + 1)
        int(next(steps)[0])  # the first token: prefill done
        t1 = time.perf_counter()
        got = sum(1 for tok, _ in steps if int(tok) >= 0)
        return len(prompt) / (t1 - t0), got / (time.perf_counter() - t1)

    warm = next(iter(job["prompts"].values()))
    n = min(4096, max(len(p) for p in job["prompts"].values()))
    one((warm * (n // len(warm) + 1))[:n], 4)  # compiles the prefill and decode kernels
    batch1 = {n: one(p, job["decode"]) for n, p in job["prompts"].items()}
    batched = {}
    for c in job["concurrency"]:
        prompts = [job["batched_prompt"]] * c
        batch_generate(model, tokenizer, prompts, max_tokens=4)
        stats = batch_generate(model, tokenizer, prompts, max_tokens=CONCURRENT_DECODE).stats
        batched[c] = stats.generation_tps
    versions = {
        "mlx": mx.__version__,
        "mlx-lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
    }
    print(json.dumps({"batch1": batch1, "batched": batched, "versions": versions}))


# --- floors and the report -----------------------------------------------------------------


def active_weights(model: torch.nn.Module) -> float:
    """Weights a prompt token multiplies by: every matrix but the embedding table and the LM
    head (a prefill computes logits for its last token only), the routed experts at top_k /
    num_experts; quantised matrices by their logical shapes."""
    cfg = model.config
    total = routed = 0
    for prefix, module in model.named_modules():
        shapes = getattr(module, "logical_shapes", None)
        for name, p in module.named_parameters(recurse=False):
            if shapes is not None and name not in shapes:  # scales and biases
                continue
            n = math.prod(shapes[name]) if shapes is not None else p.numel()
            full = f"{prefix}.{name}"
            if "embed_tokens" in full or "lm_head" in full:
                continue
            total += n
            routed += n if ".experts." in full else 0
    return total - routed + routed * cfg.num_experts_per_tok / cfg.num_experts


def prefill_flops_per_token(model: torch.nn.Module, length: int) -> float:
    """FLOPs per prompt token at prompt `length`: 2 per active weight, and causal attention's
    QK and PV in the full-attention layers (a mean context of length / 2)."""
    cfg = model.config
    attention = sum(1 for t in cfg.layer_types if t == "full_attention")
    per_pair = 4 * cfg.head_dim * cfg.num_attention_heads
    return 2 * active_weights(model) + attention * per_pair * length / 2


def prefill_floor_tok_s(model: torch.nn.Module, length: int) -> float:
    """A `length`-token prompt's floor: its FLOPs at 790 TFLOP/s or every weight read once
    at 4.3 TB/s (a prompt of a few hundred tokens routes to nearly every expert), the
    larger; in prompt tokens per second."""
    weights = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if "embed_tokens" not in name
    )
    seconds = max(
        length * prefill_flops_per_token(model, length) / BF16_FLOP_PER_S,
        weights / HBM_BYTES_PER_S,
    )
    return length / seconds


def summarize(
    runs: dict[str, dict[int, list[tuple[float, float]]]],
    decode_floor: dict[int, float],
    prefill_floor: dict[int, float],
) -> dict[str, Any]:
    """Medians over rounds per engine and length, each engine's fraction of the floors, and
    Sparrow's ratio to each peer (>1: Sparrow is faster)."""
    batch1 = {
        engine: {
            n: {
                "prefill_tok_s": statistics.median(r[0] for r in rows),
                "decode_tok_s": statistics.median(r[1] for r in rows),
                "rounds": len(rows),
            }
            for n, rows in by_len.items()
        }
        for engine, by_len in runs.items()
    }
    for rows in batch1.values():
        for n, row in rows.items():
            row["prefill_of_floor"] = row["prefill_tok_s"] / prefill_floor[n]
            row["decode_of_floor"] = row["decode_tok_s"] / decode_floor[n]
    ratios = {}
    ours = batch1.get("sparrow", {})
    for peer, rows in batch1.items():
        if peer == "sparrow":
            continue
        ratios[peer] = {
            n: {
                "prefill": ours[n]["prefill_tok_s"] / row["prefill_tok_s"],
                "decode": ours[n]["decode_tok_s"] / row["decode_tok_s"],
            }
            for n, row in rows.items()
            if n in ours
        }
    return {"batch1": batch1, "ratios": ratios}


def print_table(report: dict) -> None:
    batch1, engines = report["batch1"], list(report["batch1"])
    lengths = sorted({n for rows in batch1.values() for n in rows})
    head = "".join(f"{e + ' pre':>17}{e + ' dec':>15}" for e in engines)
    print(f"{'tokens':>8}{head}")
    for n in lengths:
        cells = "".join(
            f"{batch1[e][n]['prefill_tok_s']:>17.0f}{batch1[e][n]['decode_tok_s']:>15.1f}"
            if n in batch1[e]
            else f"{'-':>17}{'-':>15}"
            for e in engines
        )
        print(f"{n:>8}{cells}")
    for peer, rows in report["ratios"].items():
        print(
            f"sparrow / {peer} (prefill, decode): "
            + ", ".join(f"{n}: {r['prefill']:.2f}x {r['decode']:.2f}x" for n, r in rows.items())
        )
    for e in engines:
        print(
            f"{e} of the floors (prefill, decode): "
            + ", ".join(
                f"{n}: {r['prefill_of_floor']:.0%} {r['decode_of_floor']:.0%}"
                for n, r in batch1[e].items()
            )
        )
    for e, rows in report["batched_decode_tok_s"].items():
        print(f"{e} batched decode tok/s: " + ", ".join(f"{c}: {v:.0f}" for c, v in rows.items()))


def plot(report: dict, out: Path) -> Path | None:
    """Prefill and decode tok/s against prompt length, one line per engine (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[peers] matplotlib is not installed: no PNG")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key in zip(axes, ("prefill", "decode"), strict=True):
        for engine, rows in report["batch1"].items():
            lengths = sorted(rows)
            ax.plot(lengths, [rows[n][f"{key}_tok_s"] for n in lengths], marker="o", label=engine)
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="tok/s")
        ax.set_title(f"{key}, batch 1")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['model']} on {report['gpu']} ({report.get('commit', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen3.6-35b-a3b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=8, help="layers of the preset's (all engines)")
    p.add_argument("--model", type=Path, help="a float checkpoint instead of random weights")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--decode", type=int, default=64, help="decode tokens per row")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="8,32", help="batched rows ('' for none)")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp's source tree (its converter)")
    p.add_argument("--llama-bin", type=Path, help="its built tools (default: <src>/build/bin)")
    p.add_argument("--workdir", type=Path, default=Path("bench-out/peers-checkpoints"))
    p.add_argument("--out", default="bench-out/peers.json")
    p.add_argument("--mlx-worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = _parse(argv)
    if args.mlx_worker:
        _mlx_worker()
        return None
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown or "sparrow" not in engines:
        raise SystemExit(f"--engines: sparrow and any of {ENGINES[1:]}, not {sorted(unknown)}")
    llama_bin = args.llama_bin or (args.llama_cpp / "build" / "bin" if args.llama_cpp else None)
    if "llama.cpp" in engines and (llama_bin is None or not (llama_bin / "llama-bench").is_file()):
        raise SystemExit("llama.cpp needs --llama-cpp (its source) with llama-bench built")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    concurrency = [int(x) for x in args.concurrency.split(",") if x]
    if args.model and not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there")
    cfg = bench_config(args.preset, args.layers)
    with_llama = "llama.cpp" in engines
    ckpt = prepare(
        cfg,
        args.workdir,
        args.llama_cpp if with_llama else None,
        llama_bin if with_llama else None,
        args.model,
    )
    max_len = max(max(lengths) + args.decode, CONCURRENT_PROMPT + CONCURRENT_DECODE) + 2
    ours = SparrowRunner(ckpt.mlx_dir, max_len, max(concurrency + [1]))
    model = ours.llm.model
    vocab = min(model.config.vocab_size, 248000)
    prompts = prompts_for(lengths, vocab)
    batched_prompt = prompts_for([CONCURRENT_PROMPT], vocab, seed=1)[CONCURRENT_PROMPT]
    runs: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    batched: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    versions: dict[str, Any] = {"torch": torch.__version__}
    for r in range(args.rounds):
        for engine in engines:
            t0 = time.perf_counter()
            if engine == "sparrow":
                rows = ours.batch1(prompts, args.decode)
                for c in concurrency:
                    batched[engine][c].append(ours.batched([batched_prompt] * c))
            elif engine == "llama.cpp":
                rows, versions["llama.cpp"] = llama_batch1(
                    llama_bin, ckpt.gguf, lengths, args.decode
                )
                for c, v in llama_batched(llama_bin, ckpt.gguf, concurrency).items():
                    batched[engine][c].append(v)
            else:
                got = mlx_round(ckpt.mlx_dir, prompts, args.decode, batched_prompt, concurrency)
                rows = {int(n): tuple(v) for n, v in got["batch1"].items()}
                for c, v in got["batched"].items():
                    batched[engine][int(c)].append(v)
                versions["mlx-lm"] = got["versions"]
            for n, row in rows.items():
                runs[engine][n].append(row)
            print(
                f"[peers] round {r + 1}: {engine} in {time.perf_counter() - t0:.0f} s", flush=True
            )
    decode_floor = {n: HBM_BYTES_PER_S / decode_bytes_per_token(model, n) for n in lengths}
    prefill_floor = {n: prefill_floor_tok_s(model, n) for n in lengths}
    what = (
        str(args.model)
        if args.model
        else f"{args.preset} full width, {cfg.num_layers} layers, random weights"
    )
    report = {
        "model": f"{what}, 4-bit",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": versions,
        "rounds": args.rounds,
        "decode_tokens": args.decode,
        "checkpoints": {"sparrow": "MLX 4-bit", "mlx-lm": "MLX 4-bit", "llama.cpp": "GGUF Q4_0"},
        **summarize(runs, decode_floor, prefill_floor),
        "batched_decode_tok_s": {
            e: {c: statistics.median(v) for c, v in rows.items()} for e, rows in batched.items()
        },
        "decode_floor_tok_s": decode_floor,
        "prefill_floor_tok_s": prefill_floor,
    }
    print_table(report)
    write_report(args.out, report)
    png = plot(
        report | {"commit": os.environ.get("SPARROW_COMMIT", "")},
        Path(args.out).with_suffix(".png"),
    )
    if png:
        print(f"[peers] wrote {args.out} and {png}")
    return report


if __name__ == "__main__":
    main()
