"""The CLI end to end, in subprocesses, as a newcomer runs it."""

import os
import subprocess
import sys


def _run(args, tmp_path, timeout=300):
    env = os.environ | {"SPARROW_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "sparrow", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_generate_on_builtin_default(tmp_path):
    """The packaged model, trained on the standard library's source, writes Python."""
    first = _run(["generate", "--raw", "--prompt", "import os", "--max-tokens", "24"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "decode: 24 tokens" in first.stdout and "prompt: " in first.stdout
    text = first.stdout.rsplit("prompt: ", 1)[0]
    assert text.isascii() and any(w in text.split() for w in ("import", "def", "return", "="))
    again = _run(
        [
            "generate",
            "--prompt",
            "Hi",
            "--max-tokens",
            "3",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
            "--seed",
            "1",
        ],
        tmp_path,
    )
    assert again.returncode == 0, again.stderr


def test_random_checkpoint_command_then_generate(tmp_path):
    out = tmp_path / "ckpt"
    made = _run(
        [
            "checkpoint",
            "random",
            str(out),
            "--preset",
            "qwen3.6-tiny",
            "--layers",
            "2",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--per-expert",
        ],
        tmp_path,
    )
    assert made.returncode == 0, made.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    gen = _run(["generate", "--model", str(out), "--prompt", "x", "--max-tokens", "2"], tmp_path)
    assert gen.returncode == 0, gen.stderr


def test_help_documents_every_command(tmp_path):
    top = _run(["--help"], tmp_path)
    assert top.returncode == 0 and "generate" in top.stdout and "checkpoint" in top.stdout
    assert "--preset" in _run(["checkpoint", "random", "--help"], tmp_path).stdout
    for command in ("serve", "gateway"):
        text = _run([command, "--help"], tmp_path).stdout
        assert "--drain-timeout" in text and "--body-timeout" in text


def test_clear_errors(tmp_path):
    missing = _run(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"], tmp_path)
    assert missing.returncode == 2
    assert "no such directory" in missing.stderr and "Traceback" not in missing.stderr
    bad = _run(["generate", "--prompt", "x", "--max-tokens", "0"], tmp_path)
    assert bad.returncode == 2 and "max_tokens must be >= 1" in bad.stderr


def test_quantize_command_and_4bit_generation(tmp_path):
    src, out = tmp_path / "float", tmp_path / "q4"
    assert (
        _run(["checkpoint", "random", str(src), "--preset", "qwen3.6-tiny"], tmp_path).returncode
        == 0
    )
    made = _run(["checkpoint", "quantize", str(src), str(out)], tmp_path)
    assert made.returncode == 0, made.stderr
    assert '"bits": 4' in (out / "config.json").read_text() and (out / "tokenizer.json").is_file()
    for args in (["--model", str(out)], ["--model", str(src), "--quantize", "4bit"]):
        gen = _run(["generate", *args, "--prompt", "hi", "--max-tokens", "3"], tmp_path)
        assert gen.returncode == 0, gen.stderr
        assert "decode: 3 tokens" in gen.stdout
