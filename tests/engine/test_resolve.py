"""The context limit: max_model_len up to what the model's positions reach (YaRN's original
length x factor), longer an error, as in vLLM; and the CLI's `--max-model-len 1010000`.
An fp8 index cache on a model without MSA layers is refused, as is bf16 recurrent state on a
model without recurrent layers."""

import json

import pytest
import torch

from sparrow.cli import main
from sparrow.cli.args import build_parser, engine_config
from sparrow.config import ConfigError, DeviceConfig, EngineConfig
from sparrow.engine.resolve import resolve, resolve_device
from sparrow.layers.rotary import YarnScaling
from sparrow.loader.random_checkpoint import PRESETS
from sparrow.models import minimax_m3
from sparrow.models.qwen3_5_moe import Model

TINY = PRESETS["qwen3.6-tiny"].replace(num_layers=2)  # max_position_embeddings 262144
QWEN_1M = YarnScaling(4.0, 262144)  # Qwen3.6's recipe for 1M tokens


def _resolve(args, **settings):
    with torch.device("meta"):
        model = Model(args)
    config = EngineConfig.from_kwargs(num_blocks=8000, **settings)
    return resolve(config, model)[0]


def test_yarn_extends_the_context():
    args = TINY.replace(rope_scaling=QWEN_1M)
    assert _resolve(args).max_model_len == 1_048_576
    assert _resolve(args, max_model_len=1_010_000).max_model_len == 1_010_000
    scaled = r"1048577 exceeds .* 1048576 tokens \(max_position_embeddings 262144 x 4 by rope"
    with pytest.raises(ConfigError, match=scaled):
        _resolve(args, max_model_len=1_048_577)


def test_without_rope_scaling_the_native_context_is_the_limit():
    assert _resolve(TINY).max_model_len == 262144
    native = r"of 262144 tokens \(max_position_embeddings; rope scaling"
    with pytest.raises(ConfigError, match=native):
        _resolve(TINY, max_model_len=1_010_000)


def test_yarn_over_a_short_original_caps_the_context():
    """vLLM's rule: the derived length is original x factor, even below
    max_position_embeddings."""
    args = TINY.replace(max_position_embeddings=32768, rope_scaling=YarnScaling(4.0, 64))
    assert _resolve(args).max_model_len == 256


@pytest.mark.parametrize("yarn", [True, False], ids=["yarn", "native"])
def test_cli_max_model_len_1m(yarn, tmp_path, capsys):
    """`sparrow generate --max-model-len 1010000` runs when config.json carries Qwen3.6's
    YaRN block and stops with the reason (exit status 2) when it does not."""
    cfg = TINY.replace(rope_scaling=QWEN_1M if yarn else None).to_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    status = main(
        [
            "generate",
            "--model",
            str(tmp_path),
            "--load-format",
            "dummy",
            "--max-model-len",
            "1010000",
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            "--raw",
        ]
    )
    captured = capsys.readouterr()
    if yarn:
        assert status == 0, captured.err
        assert "decode: 2 tokens" in captured.out
    else:
        assert status == 2
        assert "max_model_len 1010000 exceeds the model's context of 262144" in captured.err


def test_fp8_index_cache_needs_msa_layers(tmp_path, capsys):
    with pytest.raises(ConfigError, match="fp8_e4m3.*no MSA layers"):
        _resolve(TINY, index_cache_dtype="fp8_e4m3")
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    status = main(
        [
            "generate",
            "--model",
            str(tmp_path),
            "--load-format",
            "dummy",
            "--index-cache-dtype",
            "fp8_e4m3",
            "--prompt",
            "hi",
            "--raw",
        ]
    )
    assert status == 2 and "no MSA layers" in capsys.readouterr().err


def test_bf16_recurrent_state_needs_recurrent_layers(tmp_path, capsys):
    """`--recurrent-state-dtype` reaches the cache settings from every engine command; bf16
    state resolves on a model with Gated DeltaNet layers, its snapshots at half the state's
    bytes, and is refused on one without (MiniMax M3)."""
    for command in (["generate", "--prompt", "hi"], ["serve"], ["worker"]):
        args = build_parser().parse_args([*command, "--recurrent-state-dtype", "bfloat16"])
        assert engine_config(args).cache.recurrent_state_dtype == "bfloat16"
    default = engine_config(build_parser().parse_args(["serve"]))
    assert default.cache.recurrent_state_dtype == "float32"
    with torch.device("meta"):
        model = Model(TINY)
    config = EngineConfig.from_kwargs(num_blocks=8, recurrent_state_dtype="bfloat16")
    assert resolve(config, model)[1].recurrent_state_dtype == "bfloat16"
    m3 = minimax_m3.PRESETS["minimax-m3-tiny"]
    with torch.device("meta"):
        model = minimax_m3.Model(m3)
    with pytest.raises(ConfigError, match="'bfloat16'.*no recurrent layers"):
        resolve(config, model)
    (tmp_path / "config.json").write_text(json.dumps(m3.to_hf_config()))
    status = main(
        [
            "generate",
            "--model",
            str(tmp_path),
            "--load-format",
            "dummy",
            "--recurrent-state-dtype",
            "bfloat16",
            "--prompt",
            "hi",
            "--raw",
        ]
    )
    assert status == 2 and "no recurrent layers" in capsys.readouterr().err


def test_batch_invariant_flag_and_device():
    """`--batch-invariant` on each engine command lands in the device settings; the mode runs
    on the CPU, so a device that resolves to CUDA is refused."""
    for command in (["generate", "--prompt", "hi"], ["serve"], ["worker"]):
        args = build_parser().parse_args([*command, "--batch-invariant"])
        assert engine_config(args).device.batch_invariant
    assert not engine_config(build_parser().parse_args(["serve"])).device.batch_invariant
    assert resolve_device(DeviceConfig(batch_invariant=True, device="cpu"))[0] == "cpu"
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="batch_invariant runs on the CPU"):
            resolve_device(DeviceConfig(batch_invariant=True))
