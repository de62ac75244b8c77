"""Every registered architecture, on a tiny random model in float and quantised to 4 bits on
load: a prompt in one step, the same prompt with a cached decode, two sequences in one step,
the prompt in chunks, and on a GPU decode replayed from CUDA graphs against eager steps.
Each must agree with the one-step prefill (fp32 activations). The module and its model
satisfy `models.interface`. A new architecture registers a tiny config in TINY."""

import pytest
import torch

from sparrow.config import QuantConfig
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.loader.random_checkpoint import PRESETS, random_model
from sparrow.models import ARCHITECTURES
from sparrow.models.interface import Architecture, Model, ModelArgs
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err

TINY = {
    "qwen3_5_moe": PRESETS["qwen3.6-tiny"].replace(vocab_size=320, initializer_range=0.1),
    # MSA blocks of 4 tokens, top-2: PROMPT spans 8 blocks, so selection drops most of them.
    "minimax_m3": PRESETS["minimax-m3-tiny"].replace(
        vocab_size=320, initializer_range=0.1, index_block_size=4
    ),
    "qwen3_moe": PRESETS["qwen3-moe-tiny"].replace(vocab_size=320, initializer_range=0.1),
    "qwen3_next": PRESETS["qwen3-next-tiny"].replace(vocab_size=320, initializer_range=0.1),
}
TOL = 1e-4
PROMPT = [(7 * i + 3) % 320 for i in range(29)]
OTHER = [(5 * i + 11) % 320 for i in range(13)]


def test_every_architecture_has_a_tiny_config():
    assert set(TINY) == set(ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_architecture_satisfies_the_interface(name):
    arch = ARCHITECTURES[name]
    assert isinstance(arch, Architecture) and arch.NAME == name
    assert all(isinstance(p, ModelArgs) and p.architecture == name for p in arch.PRESETS.values())
    model = random_model(TINY[name], seed=3, device="cpu", dtype=torch.float32)
    assert isinstance(model, Model) and model.visual is None
    assert len(model.cache_specs()) == TINY[name].num_layers
    assert arch.ModelArgs.from_hf(TINY[name].to_hf_config()) == TINY[name]


@pytest.fixture(scope="module", params=[(n, q) for n in sorted(TINY) for q in ("float", "4bit")])
def model(request):
    name, quant = request.param
    quantize = QuantConfig.from_name("4bit") if quant == "4bit" else None
    model = random_model(TINY[name], seed=3, device="cpu", dtype=torch.float32, quantize=quantize)
    if quantize is not None:  # the experts at least take the quantised layer
        assert any(hasattr(m, "spec") for m in model.modules())
    return model


def _logits(model, batch: SequenceBatch, tokens, seqs=None) -> torch.Tensor:
    return model.logits(batch.forward(tokens, seqs))


@pytest.fixture(scope="module")
def whole(model):
    """Logits of every position of PROMPT in one step."""
    return _logits(model, SequenceBatch(model, 1, 64), [PROMPT])


def test_cached_decode_matches_prefill(model, whole):
    batch = SequenceBatch(model, 1, 64)
    steps = [_logits(model, batch, [PROMPT[:20]])[-1:]]
    steps += [_logits(model, batch, [[t]]) for t in PROMPT[20:]]
    assert rel_err(torch.cat(steps), whole[19:]) < TOL


def test_two_sequences_in_one_step_match_each_alone(model, whole):
    other = _logits(model, SequenceBatch(model, 1, 64), [OTHER])
    both = _logits(model, SequenceBatch(model, 2, 64), [PROMPT, OTHER])
    assert rel_err(both[: len(PROMPT)], whole) < TOL
    assert rel_err(both[len(PROMPT) :], other) < TOL


def test_chunked_prefill_matches_one_step(model, whole):
    batch = SequenceBatch(model, 1, 64)
    chunks = [_logits(model, batch, [PROMPT[i : i + 8]]) for i in range(0, len(PROMPT), 8)]
    assert rel_err(torch.cat(chunks), whole) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(TINY))
def test_graph_decode_matches_eager_gpu(name):
    """Decode steps replayed from captured graphs (batches padded to captured sizes) give
    the eager engine's greedy tokens."""
    prompts = [PROMPT, OTHER, PROMPT[:5]]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        model = random_model(TINY[name], seed=3, device="cuda", dtype=torch.float32)
        llm = LLM(model, enforce_eager=eager, max_num_seqs=4, max_model_len=128, num_blocks=64)
        assert (llm.runner.graphs is None) == (eager or not getattr(model, "cuda_graphs", True))
        tokens[eager] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens[False] == tokens[True]
