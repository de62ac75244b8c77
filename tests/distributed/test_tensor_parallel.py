"""Tensor parallelism on the CPU: two processes over gloo give the greedy tokens of one, on
tiny Qwen3.5/3.6 and MiniMax M3 checkpoints (float, and quantised to 4 bits on load), with
the experts split by columns or shared out whole and the vocabulary rows of the embedding
and lm_head split; a rank that dies fails the engine's next step with an error naming it."""

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError, QuantConfig
from sparrow.distributed.shard import Shard, pieces
from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint
from sparrow.loader.weights import rank_args
from sparrow.models import get_architecture

# the tiny preset's heads (4 q, 2 kv, 2 key, 4 value) split in 2; the input dims each rank
# keeps of the split projections (attention and value heads, the experts' intermediate) are
# whole 4-bit groups of 64
CFG = PRESETS["qwen3.6-tiny"].replace(
    linear_value_head_dim=32, moe_intermediate_size=128, shared_expert_intermediate_size=128
)
PROMPTS = [[11, 42, 7, 99, 5, 1024, 3, 17, 250, 8], [5000, 6, 77]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    write_random_checkpoint(out, CFG, seed=3, dtype=torch.float32, progress=False)
    return out


def tokens(llm: LLM) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("quantize", [None, "4bit"])
@pytest.mark.parametrize("experts", [False, True], ids=["tp", "tp+ep"])
def test_two_ranks_give_the_tokens_of_one(checkpoint, quantize, experts):
    """Heads and expert columns split (tp), or heads split and experts shared out whole
    (tp+ep): the greedy tokens of one process."""
    settings = {
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 64,
        "block_size": 16,
        "quantize": quantize,
    }
    one = tokens(LLM(str(checkpoint), **settings))
    llm = LLM(str(checkpoint), tensor_parallel_size=2, enable_expert_parallel=experts, **settings)
    try:
        cfg = llm.model.config
        assert cfg.num_attention_heads == CFG.num_attention_heads // 2
        assert cfg.expert_range == ((0, CFG.num_experts // 2) if experts else None)
        assert llm.model.layers[0].mlp.experts.gate_up_proj.shape[0] == (
            CFG.num_experts // 2 if experts else CFG.num_experts
        )
        assert cfg.vocab_range == (0, CFG.vocab_size // 2)
        assert llm.model.lm_head.weight.shape[0] == CFG.vocab_size // 2
        assert tokens(llm) == one
    finally:
        llm.close()


# the tiny M3 preset's heads (4 q, 2 kv, 2 index) split in 2, its MLPs widened so that
# each rank's input dims are whole 4-bit groups
M3 = PRESETS["minimax-m3-tiny"].replace(
    moe_intermediate_size=128, shared_intermediate_size=128, dense_intermediate_size=256
)


@pytest.fixture(scope="module")
def m3_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-m3")
    write_random_checkpoint(out, M3, seed=5, dtype=torch.float32, progress=False)
    return out


@pytest.mark.parametrize("quantize", [None, "4bit"])
def test_minimax_m3_on_two_ranks(m3_checkpoint, quantize):
    """MSA layers split by KV group (each rank's index heads choose its groups' blocks),
    dense MLPs and experts by columns, or experts whole."""
    settings = {
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 64,
        "block_size": 16,
        "quantize": quantize,
    }
    one = tokens(LLM(str(m3_checkpoint), **settings))
    for experts in (False, True):
        llm = LLM(
            str(m3_checkpoint), tensor_parallel_size=2, enable_expert_parallel=experts, **settings
        )
        try:
            assert llm.model.config.index_n_heads == M3.index_n_heads // 2
            assert tokens(llm) == one
        finally:
            llm.close()


def test_per_expert_tensors_are_read_by_the_rank_that_holds_them(tmp_path):
    """A checkpoint with one tensor per expert and projection: each rank reads its experts'
    (tp+ep) or its columns of every expert's (tp)."""
    write_random_checkpoint(
        tmp_path, CFG, seed=4, dtype=torch.float32, per_expert=True, progress=False
    )
    settings = {"device": "cpu", "dtype": "float32", "max_model_len": 64, "block_size": 16}
    one = tokens(LLM(str(tmp_path), **settings))
    for experts in (True, False):
        llm = LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=experts, **settings)
        try:
            assert tokens(llm) == one
        finally:
            llm.close()


def test_a_rank_that_dies_fails_the_engine_with_its_name(checkpoint):
    llm = LLM(
        str(checkpoint),
        tensor_parallel_size=2,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        block_size=16,
    )
    try:
        llm._ranks.procs[0].kill()
        llm._ranks.procs[0].join(10)
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            tokens(llm)
    finally:
        llm.close()


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(
        ConfigError, match="num_kv_heads 2 is not divisible by tensor_parallel_size 4"
    ):
        rank_args(CFG, Shard(0, 4))
    quantized = CFG.replace(quantization=QuantConfig.from_name("4bit"), moe_intermediate_size=64)
    with pytest.raises(
        ConfigError, match="moe_intermediate_size 64 over tensor_parallel_size 2 is not a multiple"
    ):
        rank_args(quantized, Shard(0, 2))
    with pytest.raises(
        ConfigError, match="num_experts 8 is not divisible by tensor_parallel_size 3"
    ):
        rank_args(
            CFG.replace(
                num_attention_heads=6,
                num_kv_heads=3,
                linear_num_key_heads=3,
                linear_num_value_heads=6,
                moe_intermediate_size=192,
                shared_expert_intermediate_size=192,
            ),
            Shard(0, 3, True),
        )


def test_the_gated_deltanet_projection_is_cut_per_part():
    """[q | k | v] rows: rank 1 of 2 reads the second half of each part."""
    kd = CFG.linear_num_key_heads * CFG.linear_key_head_dim
    vd = CFG.linear_num_value_heads * CFG.linear_value_head_dim
    dim, ranges = pieces(
        "layers.0.linear_attn.in_proj_qkv.weight",
        get_architecture(CFG.architecture).shard_plan(CFG, False),
        Shard(1, 2),
    )
    assert dim == 0 and ranges == [
        (kd // 2, kd),
        (kd + kd // 2, 2 * kd),
        (2 * kd + vd // 2, 2 * kd + vd),
    ]


def test_dummy_weights_are_drawn_per_rank(checkpoint):
    """`load_format="dummy"`: each rank draws its own share (no file is read): the engine
    runs, with each rank's heads."""
    llm = LLM(
        str(checkpoint),
        tensor_parallel_size=2,
        load_format="dummy",
        device="cpu",
        dtype="float32",
        max_model_len=64,
        block_size=16,
    )
    try:
        assert llm.model.config.linear_num_value_heads == CFG.linear_num_value_heads // 2
        assert all(len(t) == 8 for t in tokens(llm))
    finally:
        llm.close()


def test_a_request_crosses_whole_once_then_as_its_changes():
    """Rank 0 sends a request whole the first time it runs, then only what changed: the
    prompt does not cross again."""
    from types import SimpleNamespace

    from sparrow.core.request import Request
    from sparrow.engine.executor import RankedRunner, RequestUpdate

    sent = []
    ranks = SimpleNamespace(send=lambda *message: sent.append(message))
    runner = RankedRunner(
        SimpleNamespace(media=None, execute=lambda plan, reqs: None, free=lambda rid: None), ranks
    )
    request = Request("r", list(range(1000)))
    plan = SimpleNamespace(num_scheduled_tokens={"r": 1000})
    runner.execute(plan, {"r": request})
    request.output_token_ids += [7, 8]
    request.num_computed_tokens = 1001
    runner.execute(plan, {"r": request})
    first, second = sent[0][2]["r"], sent[1][2]["r"]
    assert first is request and isinstance(second, RequestUpdate)
    assert (second.new_output_ids, second.num_computed_tokens) == ([7, 8], 1001)
    runner.free("r")
    runner.execute(plan, {"r": request})  # a freed request crosses whole again
    assert sent[-1][2]["r"] is request


def test_serve_with_two_ranks_answers_and_stops_on_ctrl_c(checkpoint, tmp_path):
    """`sparrow serve --tensor-parallel-size 2`: a completion over HTTP with the tokens of
    one process, then Ctrl-C drains and stops the server and its rank (status 0)."""
    import signal
    import subprocess
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from sparrow.bench.serve import wait_healthy
    from sparrow.net import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparrow",
            "serve",
            "--model",
            str(checkpoint),
            "--tensor-parallel-size",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--max-model-len",
            "64",
            "--block-size",
            "16",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, 240)
        body = {
            "model": checkpoint.name,
            "prompt": PROMPTS[0],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        one = (
            LLM(str(checkpoint), device="cpu", dtype="float32", max_model_len=64, block_size=16)
            .generate([PROMPTS[0]], GREEDY)[0]
            .token_ids
        )
        assert reply.json()["choices"][0]["token_ids"] == one
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.returncode == 0, proc.stderr.read()
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_process_group_of_the_program_leaves_one_engine_alone(checkpoint, tmp_path, monkeypatch):
    """A program that made a process group of its own (here one that says it has 4 ranks,
    as one engine per process under torchrun would see): the engine does not take it for
    its tensor-parallel group, and gives the tokens it gives alone."""
    import torch.distributed as dist

    from sparrow.distributed import group

    settings = {"device": "cpu", "dtype": "float32", "max_model_len": 64, "block_size": 16}
    alone = tokens(LLM(str(checkpoint), **settings))
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda *args: 4)
        assert group.size() == 1
        assert tokens(LLM(str(checkpoint), **settings)) == alone
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
