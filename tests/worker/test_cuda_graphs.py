"""Decode and prefill steps from CUDA graphs: which sizes are captured, how a step pads to
one, and that a padded step gives the eager step's logits while its padding rows write only
the cache's scratch block and slot.

On the CPU nothing is captured: each "graph" replays the model eagerly on the static input
buffers (what the captured kernels read), so the host side of `DecodeGraphs.run` (filling
and padding the buffers, pending tokens) is tested there too; on a GPU the graphs are real.
"""

import copy
import dataclasses

import pytest
import torch

from sparrow.kernels import get_backend, set_backend
from sparrow.loader.random_checkpoint import PRESETS, random_model
from sparrow.loader.weights import load_checkpoint
from sparrow.worker.cache import ModelCache, build_metadata
from sparrow.worker.cuda_graphs import (
    BATCH_SIZES,
    PAD_TOKENS,
    PREFILL_TOKENS,
    DecodeGraphs,
    PrefillGraphs,
)
from tests.conftest import rel_err

BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS = 16, 40, 6  # scratch: block 40, slot 6
# Three decoding sequences (blocks out of order, slots not 0) and a bystander holding
# block 0, block 1 and slot 0, which padding rows must leave alone.
PROMPT_LENS = [20, 5, 33]
TABLES = [[7, 3], [12], [20, 9, 30]]
SLOTS = [4, 2, 5]
BYSTANDER = (9, [0, 1], 0)  # prompt length, table, slot


class EagerReplay:
    """A captured graph's stand-in on the CPU: `replay` runs the model on the static buffers
    of batch size `size` into a fixed output tensor, as a replayed graph does."""

    def __init__(self, graphs: DecodeGraphs, size: int):
        self.graphs, self.size = graphs, size
        self.out = torch.empty(size, graphs.model.config.vocab_size)

    def replay(self) -> None:
        g = self.graphs
        self.out.copy_(g.model.logits(g.model(g._meta(self.size), g.cache)))


def ready(graphs, stand_in):
    """`graphs` captured on a GPU; on the CPU each size gets `stand_in(graphs, size)`."""
    if graphs.model.device.type == "cuda":
        graphs.capture()
    else:
        for size in graphs.sizes:
            replay = stand_in(graphs, size)
            graphs.graphs[size] = (replay, replay.out)
    return graphs


def decode_graphs(model, cache, max_batch: int, max_blocks: int) -> DecodeGraphs:
    return ready(DecodeGraphs(model, cache, max_batch, max_blocks), EagerReplay)


@pytest.fixture
def kernel_backend():
    previous = get_backend()
    yield set_backend
    set_backend(previous)


@pytest.fixture(scope="module")
def cpu_model(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint, "cpu", torch.float32, progress=False)


@pytest.mark.parametrize(
    "max_batch, sizes",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (4, [1, 2, 4]),
        (5, [1, 2, 4, 5]),
        (64, list(BATCH_SIZES[:9])),
        (200, [*BATCH_SIZES, 200]),
    ],
)
def test_captured_sizes_end_at_the_max_batch(cpu_model, max_batch, sizes):
    cache = ModelCache(cpu_model.cache_specs(), 4, BLOCK_SIZE, 2, "cpu", torch.float32)
    graphs = DecodeGraphs(cpu_model, cache, max_batch, 3)
    assert graphs.sizes == sizes
    assert not graphs.graphs  # nothing captured before capture()


def test_batch_sizes_are_increasing_from_one():
    assert BATCH_SIZES[0] == 1
    assert list(BATCH_SIZES) == sorted(set(BATCH_SIZES))


def test_padded_size_is_the_smallest_captured_size_that_fits(cpu_model):
    cache = ModelCache(cpu_model.cache_specs(), 4, BLOCK_SIZE, 2, "cpu", torch.float32)
    graphs = DecodeGraphs(cpu_model, cache, 20, 3)
    assert [graphs.padded_size(b) for b in range(1, 22)] == (
        [1, 2, 4, 4] + [8] * 4 + [16] * 8 + [20] * 4 + [None]
    )


def test_static_buffers_start_on_the_scratch_block_and_slot(cpu_model):
    cache = ModelCache(cpu_model.cache_specs(), 4, BLOCK_SIZE, 2, "cpu", torch.float32)
    graphs = DecodeGraphs(cpu_model, cache, 5, 3)
    assert (graphs.block_tables == cache.pad_block).all()
    assert (graphs.slot_mapping == cache.pad_block * BLOCK_SIZE).all()
    assert (graphs.state_slots == cache.pad_slot).all()


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor a cache holds, in a fixed order, whatever its layout of attributes."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for x in obj for t in _tensors(x)]
    if hasattr(obj, "__dict__"):
        return [t for _, v in sorted(vars(obj).items()) for t in _tensors(v)]
    return []


def _changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Indices along dim 0 (block or slot) where the tensor changed."""
    diff = (before != after).reshape(before.shape[0], -1).any(-1)
    return set(diff.nonzero()[:, 0].tolist())


def _prefill(model, cache, gen: torch.Generator) -> list[int]:
    """Prompts of the three sequences and the bystander into `cache`; returns the first
    token each decoding sequence feeds next."""
    vocab = model.config.vocab_size
    lens, tables, slots = [*PROMPT_LENS, BYSTANDER[0]], [*TABLES, BYSTANDER[1]], [*SLOTS, 0]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    meta = build_metadata(prompts, [0] * 4, tables, slots, BLOCK_SIZE, model.device)
    cache.reset_slots(torch.tensor(slots, device=model.device))
    with torch.inference_mode():
        model(meta, cache)
    return torch.randint(0, vocab, (3,), generator=gen).tolist()


def _eager_decode(model, cache, tokens: list[int], positions: list[int]) -> torch.Tensor:
    meta = build_metadata([[t] for t in tokens], positions, TABLES, SLOTS, BLOCK_SIZE, model.device)
    with torch.inference_mode():
        return model.logits(model(meta, cache))


def check_padded_decode(model, tol: float) -> None:
    """Three sequences decode two steps through graphs of size 4 (one padding row), the second
    with two tokens still on the device; an identical cache decodes eagerly. Same logits;
    the graphs' cache differs from the eager one only in the scratch block and slot."""
    device = model.device
    graph_cache = ModelCache(
        model.cache_specs(), NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, device, model.dtype
    )
    tokens = _prefill(model, graph_cache, torch.Generator().manual_seed(0))
    eager_cache = copy.deepcopy(graph_cache)
    before = [t.clone() for t in _tensors(graph_cache)]
    graphs = decode_graphs(model, graph_cache, max_batch=4, max_blocks=3)
    assert graphs.padded_size(3) == 4

    positions = list(PROMPT_LENS)
    device_tokens = torch.zeros(NUM_SLOTS + 1, dtype=torch.long, device=device)
    for step in range(2):
        fed = tokens if step == 0 else [-1, tokens[1], -1]  # -1: read device_tokens[slot]
        got = graphs.run(fed, positions, TABLES, SLOTS, device_tokens).clone()
        expected = _eager_decode(model, eager_cache, tokens, positions)
        assert got.shape == expected.shape == (3, model.config.vocab_size)
        err = rel_err(got, expected)
        assert err < tol, f"step {step}: rel err {err:.2e}"
        tokens = expected.argmax(-1).tolist()
        device_tokens[torch.tensor(SLOTS, device=device)] = expected.argmax(-1)
        positions = [p + 1 for p in positions]

    pad_block, pad_slot = graph_cache.pad_block, graph_cache.pad_slot
    written_blocks = {
        table[p // BLOCK_SIZE]
        for table, p0 in zip(TABLES, PROMPT_LENS, strict=True)
        for p in (p0, p0 + 1)
    }
    allowed = written_blocks | set(SLOTS) | {pad_block, pad_slot}
    scratch_written = False
    for old, new, eager in zip(before, _tensors(graph_cache), _tensors(eager_cache), strict=True):
        changed = _changed(old, new)
        assert changed <= allowed, f"rows {sorted(changed - allowed)} of a {list(old.shape)} pool"
        assert 0 not in changed and 1 not in changed  # the bystander's block 0/1 and slot 0
        scratch_written |= bool(changed & {pad_block, pad_slot})
        rows = [i for i in range(old.shape[0]) if i not in (pad_block, pad_slot)]
        scale = max(eager[rows].abs().max().item(), 1e-30)
        assert (new[rows] - eager[rows]).abs().max().item() <= tol * scale
    assert scratch_written  # the padding row did run, in the scratch block and slot


def test_padded_decode_matches_eager_on_cpu(cpu_model):
    check_padded_decode(cpu_model, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
def test_padded_decode_matches_eager_gpu(tiny_checkpoint, dtype, tol):
    model = load_checkpoint(tiny_checkpoint, "cuda", dtype, progress=False)
    check_padded_decode(model, tol)


class EagerPrefillReplay:
    """A captured prefill graph's stand-in on the CPU. The reference path splits sequences by
    their host lengths, which a graph fixes at capture, so it gets the step's real ones; the
    kernel path reads only the device buffers, as the captured kernels do."""

    def __init__(self, graphs: PrefillGraphs, size: int):
        self.graphs, self.size = graphs, size
        self.out = torch.empty(1, graphs.model.config.vocab_size)

    def replay(self) -> None:
        g, rows = self.graphs, self.size + PAD_TOKENS
        t = int(g.cu_seqlens[1])
        meta = dataclasses.replace(g._meta(self.size), seq_lens=[t, rows - t])
        self.out.copy_(g.forward(meta))


def prefill_graphs(model, cache, max_tokens: int, max_blocks: int) -> PrefillGraphs:
    return ready(PrefillGraphs(model, cache, max_tokens, max_blocks), EagerPrefillReplay)


def test_prefill_sizes_end_at_the_step_budget(cpu_model):
    cache = ModelCache(cpu_model.cache_specs(), 4, BLOCK_SIZE, 2, "cpu", torch.float32)
    graphs = PrefillGraphs(cpu_model, cache, 1000, 3)
    assert graphs.sizes == [64, 128, 256, 512]
    assert [graphs.size_for(n) for n in (1, 64, 65, 512, 513)] == [64, 64, 128, 512, None]
    assert list(PREFILL_TOKENS) == sorted(set(PREFILL_TOKENS))


def check_padded_prefill(
    model, prompt_len: int, tol: float, cache_tol: float | None = None
) -> None:
    """A prompt prefills through the graph of size 64 (rows past it: padding) beside a
    bystander, then decodes one token eagerly; the same on a copy of the cache, eagerly
    throughout. Same logits (within tol); the caches differ only in the scratch block and
    slot, elsewhere within cache_tol (default tol) of each tensor's largest entry."""
    device = model.device
    graph_cache = ModelCache(
        model.cache_specs(), NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, device, model.dtype
    )
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    bystander = torch.randint(0, vocab, (BYSTANDER[0],), generator=gen).tolist()
    meta = build_metadata([bystander], [0], [BYSTANDER[1]], [0], BLOCK_SIZE, device)
    with torch.inference_mode():
        model(meta, graph_cache)
    table, slot = [7, 3, 12, 20, 25][: -(-(prompt_len + 1) // BLOCK_SIZE)], 4
    eager_cache = copy.deepcopy(graph_cache)
    before = [t.clone() for t in _tensors(graph_cache)]
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
    graphs = prefill_graphs(model, graph_cache, 128, 5)  # 128 captured first
    got = [graphs.run(prompt, table, slot).clone()]
    meta = build_metadata([prompt], [0], [table], [slot], BLOCK_SIZE, device)
    with torch.inference_mode():
        expected = [model.logits(model(meta, eager_cache)[-1:])]
    token = [expected[0].argmax(-1).item()]
    for cache, out in ((graph_cache, got), (eager_cache, expected)):
        meta = build_metadata([token], [prompt_len], [table], [slot], BLOCK_SIZE, device)
        with torch.inference_mode():
            out.append(model.logits(model(meta, cache)))
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.shape == e.shape == (1, vocab)
        assert rel_err(g, e) < tol, f"step {step}: rel err {rel_err(g, e):.2e}"

    pad_block, pad_slot = graph_cache.pad_block, graph_cache.pad_slot
    allowed = set(table) | {slot, pad_block, pad_slot}
    for old, new, eager in zip(before, _tensors(graph_cache), _tensors(eager_cache), strict=True):
        assert _changed(old, new) <= allowed
        rows = [i for i in range(old.shape[0]) if i not in (pad_block, pad_slot)]
        scale = max(eager[rows].abs().max().item(), 1e-30)
        assert (new[rows] - eager[rows]).abs().max().item() <= (cache_tol or tol) * scale


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("prompt_len", [1, 37, 64])
def test_padded_prefill_matches_eager_on_cpu(cpu_model, kernel_backend, backend, prompt_len):
    kernel_backend(backend)
    check_padded_prefill(cpu_model, prompt_len, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len", [1, 37, 64])
# bf16 caches: the two paths' roundings compound through the random tiny model's layers
# (measured on the H200: the third GDN layer's state 2.2-4.1% of its largest entry apart)
@pytest.mark.parametrize(
    "dtype, tol, cache_tol",
    [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 3e-2, 6e-2)],
    ids=["fp32", "bf16"],
)
def test_padded_prefill_matches_eager_gpu(tiny_checkpoint, dtype, tol, cache_tol, prompt_len):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_checkpoint(tiny_checkpoint, "cuda", dtype, progress=False)
    check_padded_prefill(model, prompt_len, tol, cache_tol)


def test_prefill_graphs_only_where_gdn_takes_the_kernels(cpu_model, kernel_backend):
    """The reference GDN path splits a step by lengths read on the host: no prefill graph."""
    kernel_backend("triton")
    assert cpu_model.prefill_graphs
    odd = random_model(
        PRESETS["qwen3.6-tiny"].replace(linear_key_head_dim=24),
        seed=0,
        device="cpu",
        dtype=torch.float32,
    )
    assert not odd.prefill_graphs
    kernel_backend("reference")
    assert not cpu_model.prefill_graphs
