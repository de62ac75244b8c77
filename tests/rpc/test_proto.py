"""The checked-in modules are what `python -m sparrow.proto.generate` writes from
`worker.proto` (where grpcio-tools is installed), and carry no runtime version check;
sampling params cross whole."""

import dataclasses
from pathlib import Path

import pytest

from sparrow.core.sampling_params import SamplingParams
from sparrow.core.structured import GrammarSpec
from sparrow.proto import generate
from sparrow.proto import worker_pb2 as pb
from sparrow.rpc import convert


def test_generated_modules_carry_no_runtime_check():
    text = (generate.HERE / "worker_pb2.py").read_text()
    assert "runtime_version" not in text and "Protobuf Python Version: 4.25" in text
    assert "GRPC_GENERATED_VERSION" not in (generate.HERE / "worker_pb2_grpc.py").read_text()


def test_generated_modules_match_the_proto(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    assert generate.main(tmp_path) == 0
    for name in ("worker_pb2.py", "worker_pb2_grpc.py"):
        fresh = (tmp_path / "sparrow" / "proto" / name).read_text()
        assert fresh == (generate.HERE / name).read_text(), f"{name} is stale: regenerate it"


def test_sampling_params_cross_whole():
    """Every field set away from its default crosses unchanged (a field the converters
    leave out fails here); an unset output_offset is 0 (a request not resumed)."""
    params = SamplingParams(
        max_tokens=7,
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        seed=2**64 - 3,
        stop_token_ids=(5, 9),
        stop=("\n\n",),
        logprobs=3,
        ignore_eos=True,
        min_p=0.05,
        min_tokens=9,  # counts the 4 earlier tokens: above max_tokens
        logit_bias=((3, -2.5), (11, 1.0)),
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        grammar=GrammarSpec("regex", "[a-z]+", after=17),
        prompt_logprobs=2,
        skip_special_tokens=False,
        output_offset=4,
    )
    defaults = SamplingParams()
    unset = [
        f.name
        for f in dataclasses.fields(SamplingParams)
        if getattr(params, f.name) == getattr(defaults, f.name)
    ]
    assert not unset, f"set these fields here too: {unset}"
    assert convert.params_from_pb(convert.params_to_pb(params)) == params
    assert convert.params_from_pb(pb.SamplingParams(max_tokens=1, top_p=1.0)).output_offset == 0
