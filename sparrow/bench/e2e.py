"""End-to-end engine speed at batch 1 and under concurrency: the headline benchmark (GPU).

Full-size Qwen3.6-35B-A3B with random weights through the engine (`sparrow.LLM`: scheduler,
chunked prefill, CUDA-graph decode), 4-bit and bf16, against HF transformers (bf16, its
fastest kernels installed) in the same run. Per prompt length and round, engines alternate:
prefill the prompt (time to the first token), then decode `--decode` tokens. Medians over
rounds. HF runs up to `--hf-max-len` (beyond, it is skipped and the report says so).
Then concurrency: C requests of 512 tokens decoding together (output tok/s of all of them).
Finally one decode step of the 4-bit engine is profiled eagerly: time and count per kernel.

`--long` adds the rows past the native 262,144-token context: 256K, 512K and 1M (1,010,000
tokens, the longest context Qwen3.6's model card serves), `--long-rounds` rounds each. Past
the native context the model takes the card's YaRN scaling (factor 4 over 262,144
positions). Each engine's KV cache then holds the longest row: ~20 KB a token in bf16, 21 GB
at 1M, so run one variant at a time there (`--variants 4bit --hf-max-len 0`).

`--recurrent-state-dtype bfloat16` runs Sparrow's engines with their Gated DeltaNet state in
bf16 between steps (HF keeps it in fp32).

    python -m sparrow.bench.e2e --out bench-out/e2e.json
    python -m sparrow.bench.e2e --long --lengths 4096 --variants 4bit --hf-max-len 0
    python -m sparrow.bench.plot bench-out/e2e.json   # the PNG (needs matplotlib)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from sparrow.bench.timing import HBM_BYTES_PER_S, kernel_profile
from sparrow.config import RECURRENT_STATE_DTYPES, QuantConfig, SchedulerConfig
from sparrow.core.cache_spec import paged_bytes_per_block
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.eval.measure import sync_time
from sparrow.eval.report import write_report
from sparrow.layers.rotary import YarnScaling
from sparrow.loader.random_checkpoint import random_model
from sparrow.models import PRESETS
from sparrow.models.interface import ModelArgs
from sparrow.worker.cache import build_metadata

LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
LONG_LENGTHS = (262144, 524288, 1_010_000)  # opt-in (--long)
YARN_FACTOR = 4.0  # Qwen3.6's model card: 1M tokens over the native 262,144
VOCAB = 248000  # prompt token ids are drawn below this
BLOCK_SIZE = 128


def model_for(cfg: ModelArgs, max_len: int) -> ModelArgs:
    """`cfg`, with the model card's YaRN scaling when `max_len` tokens pass its native
    context. ValueError past what that scaling reaches."""
    if max_len <= cfg.max_context:
        return cfg
    yarn = YarnScaling(YARN_FACTOR, cfg.max_position_embeddings)
    if max_len > yarn.max_positions:
        raise ValueError(
            f"{max_len} tokens (longest prompt + decode) exceed the "
            f"{yarn.max_positions} positions of YaRN factor {YARN_FACTOR} over "
            f"{cfg.max_position_embeddings}"
        )
    return cfg.replace(rope_scaling=yarn)


def engine_settings(max_len: int, most: int, budget: int, state_dtype: str = "float32") -> dict:
    """LLM settings that hold one request of `max_len` tokens (or `most` short ones)
    without preemption; prompts are prefilled in chunks of `budget` tokens; Gated DeltaNet
    state kept in `state_dtype`. No prefix caching: rounds repeat their prompts."""
    return {
        "max_num_seqs": most,
        "max_model_len": max_len,
        "max_num_batched_tokens": budget,
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": False,
        "num_blocks": -(-max_len // BLOCK_SIZE) + 8 * most,
        "recurrent_state_dtype": state_dtype,
    }


def run_engine(
    llm: LLM, prompts: list[list[int]], decode: int, params: SamplingParams | None = None
) -> tuple[float, float, int]:
    """Run prompts together to `decode` tokens each (greedy, EOS ignored, unless `params`
    say otherwise). Returns (seconds until every request has its first token, seconds after
    that until all finish, tokens generated in that time)."""
    params = params or SamplingParams(max_tokens=decode, ignore_eos=True)
    for p in prompts:
        llm.add_request(p, params)
    t0 = sync_time()
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {o.request_id for o in llm.step() if o.new_token_ids}
    # no sync: a token on the host means its prefill finished, and the engine has launched
    # the next step already (it counts as decode time)
    t1 = time.perf_counter()
    generated = 0
    while llm.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in llm.step())
    return t1 - t0, sync_time() - t1, generated


def decode_bytes_per_token(model: torch.nn.Module, context: int) -> float:
    """Bytes one decode token must read at batch 1: every weight except the routed experts,
    top_k / num_experts of those, and the KV cache of `context` tokens."""
    cfg = model.config
    total = routed = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        routed += nbytes if ".experts." in name else 0
    if not cfg.tie_word_embeddings:  # the embedding reads one row, not the table
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = paged_bytes_per_block(model.cache_specs(), 1, model.dtype.itemsize) * context
    return total - routed + routed * cfg.num_experts_per_tok / cfg.num_experts + kv


@torch.inference_mode()
def profile_step(llm: LLM, context: int, new_tokens: int) -> dict:
    """Profile one eager step of one sequence: `new_tokens` after `context` cached ones (a
    decode step, or a prefill chunk from context 0): per-kernel CUDA time and count, and the
    host's time to launch it (until the forward returns, no sync) against the step's wall
    time: when the two are close, the host, not the GPU, sets the pace."""
    runner = llm.runner
    bs = runner.cache.block_size
    table = list(range(-(-(context + new_tokens) // bs)))
    meta = build_metadata([[1] * new_tokens], [context], [table], [0], bs, runner.model.device)

    def step():
        return runner.model.logits(runner.model(meta, runner.cache)[-1:]).argmax(-1)

    report = kernel_profile(step)
    launch, wall = [], []
    for _ in range(3):
        t0 = sync_time()
        step()
        launch.append(time.perf_counter() - t0)
        wall.append(sync_time() - t0)
    report["host_launch_ms"] = statistics.median(launch) * 1e3
    report["wall_ms"] = statistics.median(wall) * 1e3
    return report


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument(
        "--long",
        action="store_true",
        help=f"add {', '.join(map(str, LONG_LENGTHS))} (YaRN past 262,144)",
    )
    p.add_argument("--long-rounds", type=int, default=1, help="rounds of rows past 131,072")
    p.add_argument(
        "--chunk",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="prefill tokens per step",
    )
    p.add_argument("--decode", type=int, default=32, help="decode tokens per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="4bit,bf16")
    p.add_argument("--hf-max-len", type=int, default=16384, help="0: no HF baseline")
    p.add_argument("--hf-decode", type=int, default=8, help="HF decode tokens per round")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the full 40")
    p.add_argument(
        "--recurrent-state-dtype",
        choices=RECURRENT_STATE_DTYPES,
        default="float32",
        help="how the engines keep Gated DeltaNet state between steps",
    )
    p.add_argument("--out", default="bench-out/e2e.json")
    return p.parse_args(argv)


def plan_lengths(args: argparse.Namespace) -> list[int]:
    """The prompt lengths of the batch-1 rows: --lengths, then the --long ones."""
    lengths = [int(x) for x in args.lengths.split(",") if x]
    return lengths + [n for n in LONG_LENGTHS if args.long and n not in lengths]


def build_engines(
    cfg: ModelArgs, args: argparse.Namespace, max_len: int, most: int, device: str = "cuda"
) -> dict:
    """{"hf": HF model (when the baseline runs), "sparrow-<variant>": LLM} on `device`."""
    engines: dict[str, object] = {}
    hf = None
    if args.hf_max_len:
        from sparrow.eval.hf_compare import build_hf

        hf = build_hf(cfg, torch.bfloat16)
        engines["hf"] = hf
    settings = engine_settings(max_len, most, args.chunk, args.recurrent_state_dtype)
    for variant in args.variants.split(","):
        if variant == "bf16":
            from sparrow.eval.hf_compare import ours_from_hf

            model = ours_from_hf(cfg, hf) if hf is not None else random_model(cfg, 0, device)
        else:
            model = random_model(cfg, 0, device, quantize=QuantConfig.from_name(variant))
        engines[f"sparrow-{variant}"] = LLM(model, **settings)
    return engines


def batch1(engines: dict, prompt: list[int], args: argparse.Namespace) -> dict[str, dict]:
    """Median prefill and decode tok/s of each engine on one prompt, engines alternating."""
    length = len(prompt)
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    # a prompt of one or two chunks compiles the kernels of its shapes (a chunk after a cached
    # prefix among them) in a round of its own; longer prompts reuse them
    warm = 1 if length <= 2 * args.chunk else 0
    rounds = args.rounds if length <= 131072 else args.long_rounds
    for _ in range(rounds + warm):
        for name, engine in engines.items():
            if name != "hf":
                t_pre, t_dec, n = run_engine(engine, [prompt], args.decode + 1)
                runs[name].append((length / t_pre, n / t_dec))
            elif length <= args.hf_max_len:
                from sparrow.eval.hf_compare import run_hf

                t_pre, t_dec = run_hf(engine, torch.tensor(prompt, device="cuda"), args.hf_decode)[
                    :2
                ]
                runs[name].append((length / t_pre, args.hf_decode / t_dec))
    return {
        name: {
            "prefill_tok_s": statistics.median(r[0] for r in rows[warm:]),
            "decode_tok_s": statistics.median(r[1] for r in rows[warm:]),
        }
        for name, rows in runs.items()
    }


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    lengths = plan_lengths(args)
    concurrency = [int(x) for x in args.concurrency.split(",") if x]
    max_len = max(lengths) + args.decode + 1
    cfg = PRESETS["qwen3.6-35b-a3b"]
    cfg = cfg if args.layers is None else cfg.replace(num_layers=args.layers)
    cfg = model_for(cfg, max_len)
    torch.manual_seed(0)
    engines = build_engines(cfg, args, max_len, max(concurrency + [1]))
    print(f"[e2e] engines ready; GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[int, dict]] = {name: {} for name in engines}
    for length in lengths:
        prompt = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        for name, row in batch1(engines, prompt, args).items():
            results[name][length] = row
        line = "  ".join(
            f"{n}: {r[length]['prefill_tok_s']:9.0f} / {r[length]['decode_tok_s']:6.1f}"
            for n, r in results.items()
            if length in r
        )
        print(f"[e2e] {length:>7} tokens  prefill / decode tok/s  {line}", flush=True)
    conc: dict[str, dict[int, float]] = defaultdict(dict)
    for c in concurrency:
        prompts = [torch.randint(0, VOCAB, (512,), generator=gen).tolist() for _ in range(c)]
        for name, engine in engines.items():
            if name != "hf":
                run_engine(engine, prompts, 4)  # warm-up at this batch size
                _, t_dec, n = run_engine(engine, prompts, 64)
                conc[name][c] = n / t_dec
    report = {
        "model": f"Qwen3.6-35B-A3B full width, {cfg.num_layers} layers, random weights",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "decode_tokens": args.decode,
        "hf_decode_tokens": args.hf_decode,
        "rounds": args.rounds,
        "hf_skipped_above": args.hf_max_len or None,
        "long_rounds": args.long_rounds,
        "prefill_chunk": args.chunk,
        "recurrent_state_dtype": args.recurrent_state_dtype,
        "rope_scaling": cfg.rope_scaling.to_hf() if cfg.rope_scaling else None,
        "batch1": results,
        "concurrency_decode_tok_s": conc,
    }
    for name, engine in engines.items():
        if name != "hf":
            floor = {n: HBM_BYTES_PER_S / decode_bytes_per_token(engine.model, n) for n in lengths}
            report.setdefault("decode_roofline_tok_s", {})[name] = floor
            report.setdefault("decode_profile_4k", {})[name] = profile_step(engine, 4096, 1)
            report.setdefault("prefill_profile_4k", {})[name] = profile_step(engine, 0, 4096)
    _print_table(report, lengths)
    write_report(args.out, report)
    return report


def _print_table(report: dict, lengths: list[int]) -> None:
    batch1 = report["batch1"]
    names = list(batch1)
    print(f"{'tokens':>8}" + "".join(f"{n + ' pre':>20}{n + ' dec':>18}" for n in names))
    for length in lengths:
        cells = "".join(
            f"{batch1[n][length]['prefill_tok_s']:>20.0f}{batch1[n][length]['decode_tok_s']:>18.1f}"
            if length in batch1[n]
            else f"{'-':>20}{'-':>18}"
            for n in names
        )
        print(f"{length:>8}{cells}")
    for name, floor in report.get("decode_roofline_tok_s", {}).items():
        frac = {n: batch1[name][n]["decode_tok_s"] / floor[n] for n in lengths}
        print(
            f"{name} decode as a fraction of the bandwidth floor: "
            + ", ".join(f"{n}: {f:.0%}" for n, f in frac.items())
        )
    for name, c in report["concurrency_decode_tok_s"].items():
        print(
            f"{name} decode tok/s by concurrency: "
            + ", ".join(f"{k}: {v:.0f}" for k, v in c.items())
        )
    for key, what in (
        ("decode_profile_4k", "decode step at 4K"),
        ("prefill_profile_4k", "prefill of 4K tokens"),
    ):
        for name, prof in report.get(key, {}).items():
            print(
                f"{name}: one eager {what}: {prof['kernels']} kernels, "
                f"{prof['kernel_time_us']:.0f} us of kernel time, launched in "
                f"{prof['host_launch_ms']:.1f} ms, {prof['wall_ms']:.1f} ms wall; top:"
            )
            for row in prof["top"][:12]:
                print(f"    {row['us']:>9.1f} us  x{row['count']:<4} {row['kernel']}")


if __name__ == "__main__":
    main()
