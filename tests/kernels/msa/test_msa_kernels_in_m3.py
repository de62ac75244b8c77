"""MiniMax M3 against HF with the MSA Triton kernels in place of the reference, picked by the
layer's kernel switch (`M3Attention._sparse`) under the Triton backend.
Dims the kernels take (head and index dims 16, 16-token blocks); top-2 of 3 blocks, so
selection drops keys. Prefill (block major), then a cached decode step (the paged decode kernel)."""

from __future__ import annotations

import pytest
import torch

from sparrow.kernels.msa import kernels
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err
from tests.models.test_minimax_m3_parity import TEXT, build, hf_logits, prompt

POW2 = TEXT | {"head_dim": 16, "index_head_dim": 16, "index_block_size": 16, "index_topk_blocks": 2}


@pytest.fixture
def triton_msa(monkeypatch):
    """The Triton backend (the interpreter on a CPU) for the whole model: the layer's switch
    picks the MSA kernels."""
    from sparrow.kernels import get_backend, set_backend

    monkeypatch.setattr(kernels, "DECODE_ROWS", 1)  # the prompt: block major; decode: paged
    before = get_backend()
    set_backend("triton")
    yield
    set_backend(before)


@torch.no_grad()
def test_m3_with_msa_kernels_matches_hf(triton_msa):
    hf, ours = build(POW2)
    ids = prompt(40, POW2["vocab_size"], 3)
    batch = SequenceBatch(ours, 1, 48)
    first = ours.logits(batch.forward([ids]))
    token = int(first[-1].argmax())
    second = ours.logits(batch.forward([[token]]))
    assert rel_err(torch.cat([first, second]), hf_logits(hf, ids + [token])) < 1e-4
