"""bench.e2e's long-context rows on the CPU (a smoke test: the numbers come from the H200):
the lengths `--long` adds, the YaRN model past the native context, and engines sized for a
1,010,000-token request that then run a prompt."""

import pytest

from sparrow.bench import e2e
from sparrow.core.request import Request
from sparrow.core.sampling_params import SamplingParams
from sparrow.layers.rotary import YarnScaling
from sparrow.models.qwen3_5_moe import ModelArgs

# One attention layer with one 16-wide KV head: the KV cache of 1M tokens is 64 MB in bf16.
SMALL = ModelArgs(
    vocab_size=512,
    hidden_size=32,
    num_layers=4,
    num_attention_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mrope_section=(1, 1, 0),
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)


def test_long_rows_are_opt_in():
    assert e2e.plan_lengths(e2e._parse([])) == list(e2e.LENGTHS)
    args = e2e._parse(["--lengths", "4096,262144", "--long"])
    assert e2e.plan_lengths(args) == [4096, 262144, 524288, 1_010_000]


def test_yarn_past_the_native_context():
    native = ModelArgs()
    assert e2e.model_for(native, 131072 + 33) is native
    for n in (262144 + 33, 1_010_000 + 33):
        cfg = e2e.model_for(native, n)
        assert cfg.rope_scaling == YarnScaling(4.0, 262144) and cfg.max_context >= n
    with pytest.raises(ValueError, match="1048609 tokens .* exceed the 1048576 positions"):
        e2e.model_for(native, 1_048_576 + 33)


def test_engine_for_the_1m_row_runs_on_cpu():
    args = e2e._parse(
        [
            "--long",
            "--lengths",
            "",
            "--variants",
            "bf16",
            "--hf-max-len",
            "0",
            "--decode",
            "2",
            "--rounds",
            "1",
        ]
    )
    max_len = max(e2e.plan_lengths(args)) + args.decode + 1
    cfg = e2e.model_for(SMALL, max_len)
    engines = e2e.build_engines(cfg, args, max_len, most=2, device="cpu")
    llm = engines["sparrow-bf16"]
    assert llm.scheduler_config.max_model_len == max_len == 1_010_003
    assert llm.cache_config.num_blocks * llm.cache_config.block_size >= max_len
    # the 1M request is admissible: it fits the context limit and the KV cache
    llm.scheduler.validate(Request("1m", [1] * 1_010_000, SamplingParams(max_tokens=3)))
    row = e2e.batch1(engines, list(range(1, 300)), args)["sparrow-bf16"]
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
