"""EngineConfig: per-concern settings, validated when built, and the flat keyword form."""

import pytest

from sparrow.config import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)


def test_keywords_land_in_their_sections():
    cfg = EngineConfig.from_kwargs(
        model="dir",
        max_model_len=4096,
        max_num_seqs=8,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        dtype="float16",
        quantize="4bit",
        block_size=16,
    )
    assert cfg.scheduler == SchedulerConfig(max_model_len=4096, max_num_seqs=8)
    assert cfg.cache == CacheConfig(block_size=16, gpu_memory_utilization=0.5)
    assert cfg.device == DeviceConfig(dtype="float16", enforce_eager=True)
    assert cfg.quantization.bits == 4 and cfg.model == "dir"
    assert EngineConfig.from_kwargs() == EngineConfig()
    assert EngineConfig.from_kwargs(batch_invariant=True).device == DeviceConfig(
        batch_invariant=True
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_model_len": 0}, "max_model_len must be >= 1"),
        ({"block_size": 24}, "block_size must be a power of two"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"dtype": "int8"}, "dtype 'int8'"),
        ({"index_cache_dtype": "fp8"}, "index_cache_dtype 'fp8'"),
        (
            {"recurrent_state_dtype": "float16"},
            r"recurrent_state_dtype 'float16': expected one of \['float32', 'bfloat16'\]",
        ),
        ({"device": "tpu"}, "device 'tpu'"),
        ({"device": "cuda", "batch_invariant": True}, "batch_invariant runs on the CPU"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"load_format": "gguf"}, "load_format 'gguf'"),
        ({"quantize": "3bit"}, "unknown quantisation"),
        ({"max_num_tokens": 5}, "unknown engine setting 'max_num_tokens'"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        ParallelConfig().tensor_parallel_size = 2
