"""`python -m sparrow.bench.peers` at tiny sizes on the CPU: the conversions give checkpoints
each peer loads, the engines' greedy tokens agree on the built-in model in float32, and the
report's arithmetic holds on recorded timings.

llama.cpp's parts need its source tree with a CPU build of its tools in `build/bin`
(`SPARROW_LLAMA_CPP=<tree>`); without it they are skipped."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from sparrow.assets import default_checkpoint
from sparrow.bench.peers import (
    active_weights,
    convert_gguf,
    main,
    prefill_flops_per_token,
    summarize,
)
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.eval.mlx_reference import write_mlx_checkpoint

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def _llama_cpp() -> Path:
    tree = os.environ.get("SPARROW_LLAMA_CPP")
    if not tree or not (Path(tree) / "build" / "bin" / "llama-completion").is_file():
        pytest.skip("SPARROW_LLAMA_CPP: a llama.cpp tree with its tools built in build/bin")
    return Path(tree)


def test_the_report_takes_medians_ratios_and_fractions_of_the_floor():
    runs = {
        "sparrow": {256: [(1000.0, 100.0), (3000.0, 300.0), (2000.0, 200.0)]},
        "llama.cpp": {256: [(500.0, 50.0), (1500.0, 400.0), (1000.0, 100.0)]},
        "mlx-lm": {256: [(4000.0, 80.0)]},
    }
    report = summarize(runs, decode_floor={256: 1000.0}, prefill_floor={256: 10000.0})
    ours = report["batch1"]["sparrow"][256]
    assert (ours["prefill_tok_s"], ours["decode_tok_s"], ours["rounds"]) == (2000, 200, 3)
    assert (ours["prefill_of_floor"], ours["decode_of_floor"]) == (0.2, 0.2)
    assert report["ratios"]["llama.cpp"][256] == {"prefill": 2.0, "decode": 2.0}
    assert report["ratios"]["mlx-lm"][256] == {"prefill": 0.5, "decode": 2.5}
    assert "sparrow" not in report["ratios"]


def test_the_flop_count_takes_the_active_weights_by_their_logical_shapes():
    model = LLM(default_checkpoint(), device="cpu", dtype="float32", quantize="4bit").model
    cfg = model.config
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    dense = sum(
        p.numel()
        for n, p in LLM(
            default_checkpoint(), device="cpu", dtype="float32"
        ).model.named_parameters()
        if not any(k in n for k in ("embed_tokens", "lm_head", ".experts."))
    )
    want = dense + cfg.num_layers * expert * cfg.num_experts_per_tok
    assert active_weights(model) == pytest.approx(want, rel=1e-9)
    attention = sum(1 for t in cfg.layer_types if t == "full_attention")
    per_token = 4 * cfg.head_dim * cfg.num_attention_heads * attention
    grow = prefill_flops_per_token(model, 2048) - prefill_flops_per_token(model, 1024)
    assert grow == pytest.approx(per_token * 512)


def test_sparrow_and_mlx_lm_run_rounds_on_the_same_4bit_bytes(tmp_path):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    out = tmp_path / "peers.json"
    flags = ["--model", str(default_checkpoint()), "--engines", "sparrow,mlx-lm"]
    flags += ["--lengths", "24,48", "--rounds", "2", "--decode", "3", "--concurrency", "2"]
    main([*flags, "--workdir", str(tmp_path / "ckpt"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["checkpoints"]["mlx-lm"] == report["checkpoints"]["sparrow"] == "MLX 4-bit"
    config = json.loads((tmp_path / "ckpt" / "mlx-4bit" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    for engine in ("sparrow", "mlx-lm"):
        rows = report["batch1"][engine]
        assert set(rows) == {"24", "48"}
        assert all(
            r["rounds"] == 2 and r["prefill_tok_s"] > 0 < r["decode_tok_s"] for r in rows.values()
        )
        assert report["batched_decode_tok_s"][engine]["2"] > 0
    assert set(report["ratios"]) == {"mlx-lm"}
    assert report["versions"]["mlx-lm"]["mlx-lm"]
    assert report["command"] and report["commit"]  # this process's (pytest's) command line


def test_unknown_engines_and_a_missing_llama_cpp_are_usage_errors(tmp_path):
    with pytest.raises(SystemExit, match="--engines"):
        main(["--engines", "mlx-lm,vllm"])
    with pytest.raises(SystemExit, match="llama.cpp needs --llama-cpp"):
        main(["--engines", "sparrow,llama.cpp", "--llama-cpp", str(tmp_path)])
    with pytest.raises(SystemExit, match="no config.json"):
        main(["--engines", "sparrow", "--model", str(tmp_path)])


def _sparrow_greedy(model_dir: Path, n: int) -> str:
    llm = LLM(model_dir, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].text


def test_mlx_lm_greedy_tokens_match_sparrow_on_the_same_4bit_bytes_in_float32(tmp_path):
    """The seed's protocol reads identical 4-bit bytes in both engines. (mlx-lm's unquantised
    path on mlx-cpu is not a reference: on the built-in model its float32 logits differ from
    HF's by up to ~1.4, where Sparrow's agree to 1e-4.)"""
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    q4 = write_mlx_checkpoint(
        default_checkpoint(), tmp_path / "q4", "sparrow", "4bit", "cpu", torch.float32
    )
    model, tokenizer = load(str(q4))
    model.set_dtype(mx.float32)
    steps = generate_step(mx.array(tokenizer.encode(PROMPT)), model, max_tokens=16)
    theirs = tokenizer.decode([int(tok) for tok, _ in steps])
    assert theirs == _sparrow_greedy(q4, 16)


def test_llama_cpp_reads_the_gguf_and_its_greedy_tokens_match_sparrow(tmp_path):
    """float32 GGUF from llama.cpp's converter; llama-completion, greedy, on the CPU."""
    tree = _llama_cpp()
    gguf = convert_gguf(default_checkpoint(), tmp_path / "f32.gguf", tree, "f32")
    cmd = [str(tree / "build" / "bin" / "llama-completion"), "-m", str(gguf), "-p", PROMPT]
    cmd += ["-n", "16", "--temp", "0", "--ignore-eos", "-no-cnv", "--no-warmup", "-t", "2"]
    cmd += ["--no-display-prompt", "-fa", "off"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == _sparrow_greedy(default_checkpoint(), 16).strip()
