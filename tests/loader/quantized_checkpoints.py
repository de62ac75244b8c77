"""Helpers of the tests of quantised checkpoint formats (`test_fp8_checkpoints.py`,
`test_compressed_tensors.py`): tiny float releases of both families, rewritten as a tool
writes them, and the oracle, HF transformers 5.17 running the tool's own dequantisation of
those files as a plain float checkpoint (fp32), against Sparrow loading the quantised files:
logits at every position and greedy tokens through `LLM` and through the app `sparrow serve`
runs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from fastapi.testclient import TestClient
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.async_engine import AsyncEngine
from sparrow.engine.llm import LLM
from sparrow.loader.weights import load_checkpoint
from sparrow.loader.writer import save_checkpoint
from sparrow.server.app import build_app
from tests.conftest import rel_err
from tests.loader.layouts import TINY, logits, randomised
from tests.loader.test_release_layouts import _hf_model
from tests.models.test_hf_checkpoints import STEPS, tie_free_references

TOL = 1e-4  # fp32 logits, relative to the largest
LENGTHS = (9, 40)  # prompts for greedy tokens
FAMILIES = ("qwen3_5_moe", "minimax_m3")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    return out


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def write(dst: Path, config: dict, tensors: dict[str, torch.Tensor], src: Path) -> Path:
    """config.json, one safetensors file and the tokenizer files of `src` (a word-level
    tokenizer where it has none)."""
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    extras = [p for p in src.iterdir() if p.suffix != ".safetensors" and p.name != "config.json"]
    for p in extras if src != dst else ():
        shutil.copy(p, dst / p.name)
    if not (dst / "tokenizer.json").exists():
        vocab = config.get("text_config", config)["vocab_size"]
        words = {f"t{i}": i for i in range(vocab)}
        Tokenizer(models.WordLevel(words, unk_token="t0")).save(str(dst / "tokenizer.json"))
    return dst


def float_release(family: str, root: Path) -> Path:
    """The family's tiny model (`layouts.TINY`: every dim a multiple of 32) written by Sparrow
    as its float release (fp32): Qwen's experts fused, M3's per expert (w1 / w3 / w2)."""
    return save_checkpoint(randomised(TINY[family]), root / f"{family}-float")


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused experts (`experts.gate_up_proj`, `experts.down_proj`) as HF's `save_pretrained`
    writes them: `experts.E.{gate,up,down}_proj.weight`."""
    out = {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = t
            continue
        base = name.rsplit(".", 1)[0]
        for e, w in enumerate(t):
            if name.endswith("gate_up_proj"):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate, up
            else:
                out[f"{base}.{e}.down_proj.weight"] = w
    return out


_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(w1|w3|w2)\.weight$")
_SPLIT = re.compile(r"^(.+)\.(gate_proj|up_proj)\.weight$")


def fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MiniMax's per-expert (w1 / w3 / w2) and split gate / up tensors in the fused form of
    HF 5.17's MiniMax M3 classes, which its loader reads as they are: `experts.gate_up_proj`
    [E, 2I, H] (w1 rows, then w3), `experts.down_proj` [E, H, I], a dense MLP's or shared
    expert's `gate_up_proj.weight` [2I, H]."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, list[torch.Tensor]]] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if m := _EXPERT.match(name):
            experts.setdefault(m[1], {"w1": [], "w3": [], "w2": []})[m[3]].append(t)
        elif m := _SPLIT.match(name):
            halves.setdefault(m[1], {})[m[2]] = t
        else:
            out[name] = t
    for base, w in experts.items():
        gate_up = [torch.cat([g, u]) for g, u in zip(w["w1"], w["w3"], strict=True)]
        out[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{base}.down_proj"] = torch.stack(w["w2"])
    for base, h in halves.items():
        out[f"{base}.gate_up_proj.weight"] = torch.cat([h["gate_proj"], h["up_proj"]])
    return out


def family_of(path: Path) -> str:
    return "minimax_m3" if config_of(path)["model_type"].startswith("minimax") else "qwen3_5_moe"


class Reference:
    """HF 5.17 on a float checkpoint (the tool's dequantisation of the quantised one)."""

    def __init__(self, float_dir: Path):
        self.hf = _hf_model(family_of(float_dir), float_dir)
        config = config_of(float_dir)
        self.vocab = config.get("text_config", config)["vocab_size"]

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0]


def assert_matches_hf(quantized: Path, reference: Reference) -> None:
    """Sparrow loading `quantized` (fp32) gives HF's logits at every position of a prompt,
    and HF's greedy tokens through `LLM`, batched, and through the app `sparrow serve` runs
    (/v1/completions), for prompts without near-ties."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, reference.vocab, (70,), generator=gen).tolist()
    model = load_checkpoint(quantized, progress=False)
    err = rel_err(logits(model, ids), reference.logits(ids))
    assert err < TOL, f"rel err {err:.2e}"
    refs = tie_free_references(reference.hf, reference.vocab, LENGTHS)
    llm = LLM(model=str(quantized), device="cpu", dtype=torch.float32)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    got = [c.token_ids for c in llm.generate([r.prompt for r in refs], params)]
    assert got == [r.tokens for r in refs]
    request = {"model": "m", "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(AsyncEngine(llm), llm.tokenizer, "m")) as http:
        for ref in refs:
            body = request | {"prompt": ref.prompt, "return_token_ids": True}
            answer = http.post("/v1/completions", json=body).json()
            assert answer["choices"][0]["token_ids"] == ref.tokens, answer
