"""Checkpoints written by HF's own `save_pretrained` load in Sparrow, and greedy decoding
gives HF's tokens (and, fp32, HF's logits), for awkward sizes and both HF layouts.

The models are random and tiny: HF builds them (`Qwen3_5MoeForCausalLM`: text layout,
`model.layers.*`; `Qwen3_5MoeForConditionalGeneration`: `model.language_model.*` plus a
vision tower Sparrow ignores), seeded, and writes config.json and the safetensors itself, so
the files are exactly what HF writes. Each checkpoint carries a word-level tokenizer.json
(prompts go in as token ids; it only keeps the packaged Qwen vocabulary from loading).

Greedy tokens are compared only where HF's top-2 logit gap is well above fp32 noise: the
prompts are chosen (deterministically) so that every greedy step has such a gap. On a GPU the
same checkpoints decode from CUDA graphs and eagerly, in fp32 (against HF too) and bf16.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
)

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.layers.rotary import RotaryEmbedding
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err

pytestmark = pytest.mark.usefixtures("hf_gdn_in_pytorch")

TOL = 1e-4  # fp32 logits, relative to the largest
STEPS = 8  # greedy tokens per prompt
MARGIN = 1e-3  # least top-2 logit gap, relative to the row's largest |logit|
PROMPT_LENGTHS = (9, 70, 23)  # 70: more than one 64-token GDN chunk in HF

LIN, FULL = "linear_attention", "full_attention"


def _rope(
    partial: float, section: list[int] | None = None, theta: float = 10_000.0, **yarn
) -> dict:
    rope = {
        "rope_type": "yarn" if yarn else "default",
        "rope_theta": theta,
        "partial_rotary_factor": partial,
    } | yarn
    return rope | ({"mrope_section": section, "mrope_interleaved": True} if section else {})


@dataclass(frozen=True)
class Case:
    layout: str  # "text": Qwen3_5MoeForCausalLM; "vlm": Qwen3_5MoeForConditionalGeneration
    text: dict = field(default_factory=dict)  # Qwen3_5MoeTextConfig keywords
    tie: bool = False  # tie_word_embeddings (top level of the config, as HF reads it)
    seed: int = 0
    lengths: tuple[int, ...] = PROMPT_LENGTHS  # of the prompts compared


# Head dims / hidden sizes not powers of two, head counts not multiples of 4, expert counts
# not powers of two, top-k 1 and 3, vocabularies not multiples of 64, mixed layer types.
CASES = {
    # HF's own rope_parameters (no mrope_section: HF falls back to [11, 11, 10]); rotary
    # dim 48 * 0.25 = 12. MQA (3 q heads, 1 kv head), top-1 of 10 experts.
    "text-mqa-default-rope": Case(
        "text",
        dict(
            vocab_size=250,
            hidden_size=96,
            num_hidden_layers=4,
            layer_types=[FULL, LIN, LIN, FULL],
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=48,
            linear_num_key_heads=3,
            linear_num_value_heads=6,
            linear_key_head_dim=24,
            linear_value_head_dim=40,
            num_experts=10,
            num_experts_per_tok=1,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=56,
        ),
    ),
    # mrope_section given and consistent with the rotary dim (12 / 2 = 2 + 2 + 2).
    "text-gqa": Case(
        "text",
        dict(
            vocab_size=250,
            hidden_size=96,
            num_hidden_layers=3,
            layer_types=[LIN, FULL, LIN],
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=48,
            rope_parameters=_rope(0.25, [2, 2, 2]),
            linear_num_key_heads=3,
            linear_num_value_heads=6,
            linear_key_head_dim=40,
            linear_value_head_dim=24,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=56,
        ),
        seed=1,
    ),
    # ConditionalGeneration layout; rotary dim 24 * 0.5 = 12, sections [3, 2, 1].
    "vlm-gqa": Case(
        "vlm",
        dict(
            vocab_size=333,
            hidden_size=120,
            num_hidden_layers=3,
            layer_types=[FULL, LIN, FULL],
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=24,
            rope_parameters=_rope(0.5, [3, 2, 1]),
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=40,
            linear_value_head_dim=24,
            num_experts=10,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        ),
        seed=2,
    ),
    # ConditionalGeneration with HF's default rope block; rotary dim 40 * 0.25 = 10. MHA.
    "vlm-default-rope": Case(
        "vlm",
        dict(
            vocab_size=1000,
            hidden_size=96,
            num_hidden_layers=2,
            layer_types=[LIN, FULL],
            num_attention_heads=3,
            num_key_value_heads=3,
            head_dim=40,
            linear_num_key_heads=3,
            linear_num_value_heads=3,
            linear_key_head_dim=24,
            linear_value_head_dim=24,
            num_experts=6,
            num_experts_per_tok=1,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=24,
        ),
        seed=3,
    ),
    # The real checkpoints' rope block (head_dim 256, 0.25, [11, 11, 10], theta 1e7).
    "vlm-qwen-rope": Case(
        "vlm",
        dict(
            vocab_size=515,
            hidden_size=72,
            num_hidden_layers=3,
            layer_types=[LIN, LIN, FULL],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            rope_parameters=_rope(0.25, [11, 11, 10], theta=10_000_000.0),
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            num_experts=12,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
        seed=4,
    ),
    # YaRN over 64 original positions (factor 4: a context of 256), prompts longer than 64.
    # The real rope block; most frequencies interpolated, cos and sin scaled by 1.139.
    "vlm-yarn": Case(
        "vlm",
        dict(
            vocab_size=515,
            hidden_size=72,
            num_hidden_layers=3,
            layer_types=[FULL, LIN, FULL],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=256,
            rope_parameters=_rope(
                0.25,
                [11, 11, 10],
                theta=10_000_000.0,
                factor=4.0,
                original_max_position_embeddings=64,
            ),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            num_experts=12,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
        seed=7,
        lengths=(100, 9, 70),
    ),
    # YaRN with every optional key, in the text layout (a context of 144); rotary dim 12.
    "text-yarn": Case(
        "text",
        dict(
            vocab_size=250,
            hidden_size=96,
            num_hidden_layers=2,
            layer_types=[FULL, LIN],
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=48,
            rope_parameters=_rope(
                0.25,
                [2, 2, 2],
                factor=3.0,
                original_max_position_embeddings=48,
                beta_fast=16,
                beta_slow=2,
                mscale=1.0,
                mscale_all_dim=0.5,
                truncate=False,
            ),
            linear_num_key_heads=3,
            linear_num_value_heads=6,
            linear_key_head_dim=24,
            linear_value_head_dim=24,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=56,
        ),
        seed=8,
        lengths=(90, 41, 9),
    ),
}
# Tied embeddings: HF writes no lm_head tensor. In the VLM layout HF sets the flag at the top
# level and writes text_config.tie_word_embeddings false; HF ties by the top-level flag.
TIED = {
    "text-tied": Case("text", CASES["text-gqa"].text, tie=True, seed=5),
    "vlm-tied": Case("vlm", CASES["vlm-gqa"].text, tie=True, seed=6),
}
SMALL_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=8,
    num_position_embeddings=16,
)


def save_hf_checkpoint(path: Path, case: Case, eos_token_id: int | None = -1) -> torch.nn.Module:
    """Build the case's model with HF (fp32, seeded; weights std 0.1 so every layer moves the
    logits), `save_pretrained` it to `path` with a word-level tokenizer. eos -1: the last id."""
    vocab = case.text["vocab_size"]
    text = dict(
        case.text,
        initializer_range=0.1,
        eos_token_id=vocab - 1 if eos_token_id == -1 else eos_token_id,
    )
    torch.manual_seed(case.seed)
    if case.layout == "text":
        hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text, tie_word_embeddings=case.tie))
    else:
        vision = SMALL_VISION | {"out_hidden_size": text["hidden_size"]}
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=case.tie)
        hf = Qwen3_5MoeForConditionalGeneration(cfg)
    hf.eval().save_pretrained(path)
    words = {f"t{i}": i for i in range(vocab)}
    Tokenizer(models.WordLevel(words, unk_token="t0")).save(str(path / "tokenizer.json"))
    return hf


@dataclass
class Reference:
    prompt: list[int]
    tokens: list[int]  # HF's greedy continuation [STEPS]
    logits: torch.Tensor  # fp32 [len(prompt) + STEPS - 1, V]: prompt rows, then each step's


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int = STEPS) -> Reference:
    """HF's greedy decode with its cache (HF's own argmax loop, no eos handling)."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    rows, cache = [out.logits[0]], out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0])
        cache = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return Reference(prompt, tokens, torch.cat(rows).float())


def min_gap(ref: Reference) -> float:
    """Smallest top-2 gap over the rows that choose a token, relative to each row's scale."""
    rows = ref.logits[len(ref.prompt) - 1 :]
    top2 = rows.topk(2, dim=-1).values
    return ((top2[:, 0] - top2[:, 1]) / rows.abs().amax(-1)).min().item()


def tie_free_references(hf, vocab: int, lengths=PROMPT_LENGTHS, tries: int = 20) -> list:
    """For each length, the first seeded random prompt whose greedy path has no near-tie."""
    refs = []
    for n in lengths:
        for seed in range(tries):
            gen = torch.Generator().manual_seed(1000 * n + seed)
            ref = hf_greedy(hf, torch.randint(0, vocab, (n,), generator=gen).tolist())
            if min_gap(ref) > MARGIN:
                refs.append(ref)
                break
        else:
            raise AssertionError(f"no prompt of {n} tokens without a near-tie in {tries} tries")
    return refs


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(checkpoint dir, HF references for PROMPT_LENGTHS, case name) of one case."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_checkpoint(path, CASES[request.param])
    case = CASES[request.param]
    return path, tie_free_references(hf, case.text["vocab_size"], case.lengths), request.param


def _llm(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32, **kw) -> LLM:
    return LLM(model=str(path), device=device, dtype=dtype, **kw)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    return [c.token_ids for c in llm.generate(prompts, params)]


def test_files_are_as_hf_writes_them(case):
    """Guards the cases against HF changing what it writes: the config layout, rope block
    and tensor names each case is meant to cover."""
    path, _, name = case
    raw = json.loads((path / "config.json").read_text())
    layout = CASES[name].layout
    text = raw["text_config"] if layout == "vlm" else raw
    assert raw["model_type"] == {"vlm": "qwen3_5_moe", "text": "qwen3_5_moe_text"}[layout]
    rope = text["rope_parameters"]
    assert rope["rope_type"] == CASES[name].text.get("rope_parameters", _rope(0))["rope_type"]
    assert ("mrope_section" in rope) == ("rope_parameters" in CASES[name].text)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    prefix = "model.language_model." if layout == "vlm" else "model.layers."
    assert any(n.startswith(prefix) for n in names)
    assert any(n.startswith("model.visual.") for n in names) == (layout == "vlm")


def test_greedy_tokens_match_hf(case):
    """One prompt alone, then all prompts (different lengths) batched."""
    path, refs, _ = case
    llm = _llm(path)
    assert _greedy(llm, [refs[0].prompt]) == [refs[0].tokens]
    assert _greedy(llm, [r.prompt for r in refs]) == [r.tokens for r in refs]


def test_logits_match_hf(case):
    """fp32 logits at every prompt position and each decode step (fed HF's greedy tokens)."""
    path, refs, _ = case
    model = _llm(path).model
    for ref in refs[:2]:
        batch = SequenceBatch(model, 1, len(ref.prompt) + STEPS)
        with torch.inference_mode():
            rows = [model.logits(batch.forward([ref.prompt]))]
            rows += [model.logits(batch.forward([[t]])) for t in ref.tokens[:-1]]
        err = rel_err(torch.cat(rows), ref.logits)
        assert err < TOL, f"prompt of {len(ref.prompt)} tokens: rel err {err:.2e}"


@pytest.mark.parametrize("name", ["vlm-yarn", "text-yarn"])
def test_yarn_changes_the_logits(name, tmp_path):
    """The same checkpoint with the YaRN rotation swapped for plain RoPE is far from HF's
    logits: the parity above is parity of the scaling, not of a rotation it leaves alone."""
    hf = save_hf_checkpoint(tmp_path, CASES[name])
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, CASES[name].text["vocab_size"], (100,), generator=gen).tolist()
    want = hf_greedy(hf, prompt, steps=1).logits
    model = _llm(tmp_path).model
    args = model.config
    assert len(prompt) > args.rope_scaling.original_max_position_embeddings
    errs = []
    for scaling in (args.rope_scaling, None):
        model.rotary = RotaryEmbedding(
            args.rotary_dim, args.rope_theta, args.mrope_section, scaling
        )
        with torch.inference_mode():
            errs.append(rel_err(model.logits(SequenceBatch(model, 1, 100).forward([prompt])), want))
    assert errs[0] < TOL, f"YaRN: rel err {errs[0]:.2e}"
    assert errs[1] > 100 * TOL, f"plain RoPE is as close to HF as YaRN: {errs[1]:.2e}"


@pytest.mark.parametrize("name", list(TIED))
def test_tied_embeddings_match_hf(name, tmp_path):
    hf = save_hf_checkpoint(tmp_path, TIED[name])
    ref = tie_free_references(hf, TIED[name].text["vocab_size"], lengths=(17,))[0]
    assert _greedy(_llm(tmp_path), [ref.prompt]) == [ref.tokens]


def test_checkpoint_without_eos_token_loads(tmp_path):
    """HF's defaults write `"eos_token_id": null`: the checkpoint still loads and runs."""
    case = CASES["text-gqa"]
    hf = save_hf_checkpoint(tmp_path, case, eos_token_id=None)
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] is None
    ref = tie_free_references(hf, case.text["vocab_size"], lengths=(17,))[0]
    assert _greedy(_llm(tmp_path), [ref.prompt]) == [ref.tokens]


@pytest.mark.parametrize("eos", [0, 249, [249, 0]], ids=["id0", "last-id", "list"])
def test_eos_token_ids_of_the_config_stop_generation(eos, tmp_path):
    """Whatever HF writes as eos_token_id (0 included) is among the default stop ids."""
    case = dataclasses.replace(
        CASES["text-gqa"],
        text=CASES["text-gqa"].text | {"num_hidden_layers": 1, "layer_types": [FULL]},
    )
    save_hf_checkpoint(tmp_path, case, eos_token_id=eos)
    expected = set(eos) if isinstance(eos, list) else {eos}
    assert expected <= set(_llm(tmp_path).default_stop_ids)


# On the GPU: a context of one 128-token block, so the graphs' block tables are as wide as
# eager steps' (for head dims the kernels do not take, decode attention runs over the whole
# table: wider tables round differently, and bf16 rounding flips this random model's router
# and logit near-ties); 4 sequences at most (captured sizes 1, 2, 4; the default 64 at the
# model's full context took 9 GiB of graph memory, past what the KV sizing leaves).
GPU_LIMITS = {"max_model_len": 128, "block_size": 128, "max_num_seqs": 4}
LOGPROB_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _gpu_logprobs(
    path: Path, prompts: list[list[int]], dtype: torch.dtype, cuda_graphs: bool
) -> list[list]:
    """Each prompt's greedy steps [STEPS] as TokenLogprobs (token, log-prob, top 2), from a
    fresh engine that is freed afterwards (its KV cache is sized from the free memory)."""
    llm = _llm(path, "cuda", dtype, enforce_eager=not cuda_graphs, **GPU_LIMITS)
    assert (llm.runner.graphs is not None) == cuda_graphs
    try:
        params = SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=2)
        rids = [llm.add_request(p, params).request_id for p in prompts]
        steps = {rid: [] for rid in rids}
        while llm.scheduler.has_unfinished():
            for out in llm.step():
                steps[out.request_id] += out.logprobs or []
        return [steps[rid] for rid in rids]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_match_eager_and_hf_gpu(case, dtype):
    """Decode from CUDA graphs (3 prompts: padded to the captured size 4) gives the eager
    tokens and log-probs; in fp32 also HF's tokens and log-probs."""
    torch.backends.cudnn.allow_tf32 = False  # cuDNN convs default to TF32
    path, refs, _ = case
    prompts = [r.prompt for r in refs]
    graphs = _gpu_logprobs(path, prompts, dtype, cuda_graphs=True)
    eager = _gpu_logprobs(path, prompts, dtype, cuda_graphs=False)
    tokens = [[s.token_id for s in steps] for steps in graphs]
    assert tokens == [[s.token_id for s in steps] for steps in eager]
    for g, e in zip(graphs, eager, strict=True):
        err = max(abs(a.logprob - b.logprob) for a, b in zip(g, e, strict=True))
        assert err < LOGPROB_TOL[dtype], f"graphs vs eager log-probs: max abs err {err:.2e}"
    if dtype == torch.float32:
        assert tokens == [r.tokens for r in refs]
        for g, ref in zip(graphs, refs, strict=True):
            hf = torch.log_softmax(ref.logits[len(ref.prompt) - 1 :].double(), -1)
            got = torch.tensor([s.logprob for s in g], dtype=torch.float64)
            err = (got - hf[torch.arange(STEPS), ref.tokens]).abs().max().item()
            assert err < 1e-3, f"log-probs of HF's tokens: max abs err {err:.2e}"
