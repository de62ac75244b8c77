"""Per-step metadata from hand-made plans (positions, slot mapping, cu_seqlens, padded block
tables) and the cache tensors: scratch block and slot, slot resets, fp8 index keys, fp32 and
bf16 recurrent state (pools and prefix-cache snapshots)."""

import random

import pytest
import torch

from sparrow.core.cache_spec import (
    PagedKVSpec,
    RecurrentStateSpec,
    SparseKVSpec,
    paged_bytes_per_block,
    slot_bytes,
    with_index_dtype,
    with_state_dtype,
)
from sparrow.loader.weights import load_checkpoint
from sparrow.worker.cache import STATE_DTYPES, ModelCache, build_metadata


def test_metadata_of_a_prompt_and_a_decode():
    meta = build_metadata(
        tokens=[[11, 12, 13], [14]],
        computed=[0, 20],
        block_tables=[[4, 2], [7, 1, 3]],
        state_slots=[1, 0],
        block_size=16,
        device="cpu",
    )
    assert meta.input_ids.tolist() == [11, 12, 13, 14]
    assert meta.positions.tolist() == [0, 1, 2, 20]
    # token 20 of sequence 1 sits in its table's block 1 (block id 1), offset 4
    assert meta.slot_mapping.tolist() == [4 * 16, 4 * 16 + 1, 4 * 16 + 2, 1 * 16 + 4]
    assert meta.seq_lens == [3, 1]
    assert meta.cu_seqlens.tolist() == [0, 3, 4]
    assert meta.context_lens.tolist() == [3, 21]
    assert meta.block_tables.tolist() == [[4, 2, 0], [7, 1, 3]]  # padded to the widest
    assert meta.state_slots.tolist() == [1, 0]
    assert meta.max_q_len == 3
    assert not meta.prefix_free
    dtypes = {
        "input_ids": torch.long,
        "positions": torch.long,
        "slot_mapping": torch.long,
        "cu_seqlens": torch.int32,
        "context_lens": torch.int32,
        "block_tables": torch.int32,
        "state_slots": torch.int32,
    }
    assert {k: getattr(meta, k).dtype for k in dtypes} == dtypes


def test_metadata_of_a_chunk_across_a_block_boundary():
    meta = build_metadata([[5, 6, 7, 8, 9]], [14], [[9, 5]], [3], 16, "cpu")
    assert meta.positions.tolist() == [14, 15, 16, 17, 18]
    assert meta.slot_mapping.tolist() == [9 * 16 + 14, 9 * 16 + 15, 80, 81, 82]
    assert meta.context_lens.tolist() == [19]
    assert meta.cu_seqlens.tolist() == [0, 5]


def test_prefix_free_only_when_no_sequence_has_cached_tokens():
    assert build_metadata([[1, 2], [3]], [0, 0], [[0], [1]], [0, 1], 16, "cpu").prefix_free
    assert not build_metadata([[1, 2], [3]], [0, 1], [[0], [1]], [0, 1], 16, "cpu").prefix_free


def test_slot_mapping_follows_the_block_tables():
    """Random plans: every token's cache row is in the block its table names for its
    position, at the position's offset; cu_seqlens are the running sums."""
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        n = rng.randint(1, 6)
        computed = [rng.randint(0, 40) for _ in range(n)]
        lens = [rng.randint(1, 20) for _ in range(n)]
        tables = [
            rng.sample(range(100), -(-(c + q) // block_size))
            for c, q in zip(computed, lens, strict=True)
        ]
        tokens = [[rng.randint(0, 299) for _ in range(q)] for q in lens]
        meta = build_metadata(tokens, computed, tables, list(range(n)), block_size, "cpu")
        rows, positions = meta.slot_mapping.tolist(), meta.positions.tolist()
        seq = [b for b, q in enumerate(lens) for _ in range(q)]
        for row, pos, b in zip(rows, positions, seq, strict=True):
            assert row // block_size == tables[b][pos // block_size]
            assert row % block_size == pos % block_size
        assert meta.cu_seqlens.tolist() == [sum(lens[:i]) for i in range(n + 1)]
        assert meta.max_q_len == max(lens)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint, "cpu", torch.float32, progress=False)


def _pools(cache: ModelCache):
    """(paged K/V pools, slot pools) of every layer."""
    paged, slots = [], []
    for spec, tensors in zip(cache.specs, cache.layers, strict=True):
        if spec is not None:
            (paged if spec.paged else slots).extend(tensors)
    return paged, slots


def test_cache_has_one_scratch_block_and_slot(model):
    cache = ModelCache(model.cache_specs(), 13, 16, 5, "cpu", torch.float32)
    assert (cache.pad_block, cache.pad_slot, cache.block_size) == (13, 5, 16)
    paged, slots = _pools(cache)
    assert paged and slots
    assert all(t.shape[:2] == (14, 16) for t in paged)
    assert all(t.shape[0] == 6 for t in slots)


def test_reset_slots_zeroes_only_those_slots(model):
    cache = ModelCache(model.cache_specs(), 13, 16, 5, "cpu", torch.float32)
    paged, slots = _pools(cache)
    for t in paged + slots:
        t.fill_(1.5)
    cache.reset_slots(torch.tensor([4, 1]))
    for t in slots:
        assert t[[1, 4]].abs().sum() == 0
        assert (t[[0, 2, 3, 5]] == 1.5).all()
    assert all((t == 1.5).all() for t in paged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_index_keys_layout_and_bytes(dtype):
    """An MSA layer with fp8 index keys holds (k, v, e4m3 codes, fp32 scales); a block's
    bytes as the specs count them are the bytes the tensors take."""
    specs = [SparseKVSpec(2, 8, 20, 16), PagedKVSpec(2, 8), None]
    for index_dtype, itemsize in (("auto", dtype.itemsize), ("fp8_e4m3", 1)):
        fp8 = with_index_dtype(specs, index_dtype)
        cache = ModelCache(fp8, 5, 16, 2, "cpu", dtype)
        sparse = cache.layers[0]
        assert sparse[2].shape == (6, 16, 20) and sparse[2].element_size() == itemsize
        if index_dtype == "fp8_e4m3":
            assert sparse[2].dtype == torch.float8_e4m3fn
            assert sparse[3].shape == (6, 16) and sparse[3].dtype == torch.float32
        paged = [t for layer in cache.layers[:2] for t in layer]
        assert sum(t.nbytes for t in paged) == 6 * paged_bytes_per_block(fp8, 16, dtype.itemsize)
    assert fp8[0].bytes_per_token(2) == 2 * 2 * 8 * 2 + 20 + 4
    with pytest.raises(ValueError, match="no MSA layers"):
        with_index_dtype(specs[1:], "fp8_e4m3")


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_recurrent_state_and_snapshots_take_the_state_dtype(state_dtype):
    """The recurrent pool and its snapshots are kept in the state dtype (the conv windows in
    the activation dtype): the snapshots are the pools' rows after the scratch slot; a slot's
    bytes as the specs count them are the bytes the tensors take; saved states come back bit
    for bit."""
    specs = with_state_dtype(
        [RecurrentStateSpec(12, 4, (2, 8, 16)), PagedKVSpec(2, 8)], state_dtype
    )
    cache = ModelCache(specs, 5, 16, 3, "cpu", torch.float16, num_snapshots=2)
    conv, state = cache.layers[0]
    saved_conv, saved_state = cache.snapshots[0]
    assert state.dtype == saved_state.dtype == STATE_DTYPES[state_dtype]
    assert conv.dtype == saved_conv.dtype == torch.float16
    assert state.shape == (6, 2, 8, 16) and saved_state.shape == (2, 2, 8, 16)
    assert saved_state.data_ptr() == state[cache.snapshot_row(0)].data_ptr()
    assert conv.nbytes + state.nbytes == 6 * slot_bytes(specs, 2)
    gen = torch.Generator().manual_seed(0)
    for t in (conv, state):
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [conv.clone(), state.clone()]
    cache.save(torch.tensor([2, 0]), torch.tensor([1, 0]))  # slot 2 -> snapshot 1, 0 -> 0
    cache.reset_slots(torch.tensor([0, 1, 2]))
    cache.restore(torch.tensor([1, 0]), torch.tensor([1, 0]))
    for now, was in zip((conv, state), before, strict=True):
        assert torch.equal(now[1], was[2]) and torch.equal(now[0], was[0])
        assert not now[2].any()


def test_state_dtype_needs_recurrent_layers():
    """bf16 halves the state's bytes per slot; a model without recurrent layers takes
    "float32" only, and other dtypes are refused."""
    specs = [RecurrentStateSpec(12, 4, (2, 8, 16)), PagedKVSpec(2, 8), None]
    assert with_state_dtype(specs[1:], "float32") == specs[1:]
    assert (
        specs[0].bytes_per_slot(2) - with_state_dtype(specs, "bfloat16")[0].bytes_per_slot(2)
        == 2 * 8 * 16 * 2
    )
    with pytest.raises(ValueError, match="no recurrent layers"):
        with_state_dtype(specs[1:], "bfloat16")
    with pytest.raises(ValueError, match="'float16'"):
        with_state_dtype(specs, "float16")
