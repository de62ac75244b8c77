"""Decode steps replayed as CUDA graphs.

A decode step (one new token per sequence) launches hundreds of small kernels; replaying
them from a captured graph removes the per-launch host cost. One graph is captured per batch
size in `BATCH_SIZES` (up to the engine's max), reading its inputs from static buffers; a
step with B sequences fills the first B rows, pads to the next captured size and replays.
Padding rows point at the cache's scratch block and slot, so they never touch a request's
cache. The graph covers the model and the lm_head; sampling runs after it.
"""

from __future__ import annotations

import torch

from sparrow.worker.cache import ModelCache, StepMetadata, to_device

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache: ModelCache, max_batch: int,
                 max_blocks_per_seq: int):  # fmt: skip
        self.model, self.cache = model, cache
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        n, dev = max_batch, model.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.rope_positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, max_blocks_per_seq), cache.pad_block,
                                       dtype=torch.int32, device=dev)  # fmt: skip
        self.slot_mapping = torch.full((n,), cache.pad_block * cache.block_size,
                                       dtype=torch.long, device=dev)  # fmt: skip
        self.state_slots = torch.full((n,), cache.pad_slot, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, b: int) -> StepMetadata:
        return StepMetadata(
            input_ids=self.input_ids[:b], positions=self.positions[:b], seq_lens=[1] * b,
            rope_positions=self.rope_positions[:b],
            cu_seqlens=self.cu_seqlens[: b + 1], context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
            state_slots=self.state_slots[:b], max_q_len=1,
        )  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, sharing one memory pool."""
        pool = None
        for b in reversed(self.sizes):
            meta = self._meta(b)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: compiles kernels, sizes the pool
                self.model.logits(self.model(meta, self.cache))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.logits(self.model(meta, self.cache))
            pool = graph.pool()
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize()

    def padded_size(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], block_tables: list[list[int]],
            state_slots: list[int], device_tokens: torch.Tensor,
            rope_offsets: list[int] | None = None) -> torch.Tensor:  # fmt: skip
        """One decode step for len(tokens) sequences: token b sits at positions[b] of the
        sequence with that block table and slot, its rotary position that plus
        rope_offsets[b] (mRoPE after media; default 0); a token < 0 is still on the device, in
        device_tokens[slot]. Returns fp32 logits [B, V] (a view of the graph's output: read
        it before the next replay)."""
        b = len(tokens)
        size = self.padded_size(b)
        pad = size - b
        bs = self.cache.block_size
        rows = [table[p // bs] * bs + p % bs
                for table, p in zip(block_tables, positions, strict=True)]  # fmt: skip
        dev = to_device(
            [tokens + [0] * pad,
             positions + [0] * pad,
             [p + 1 for p in positions] + [1] * pad,
             rows + [self.cache.pad_block * bs] * pad,
             state_slots + [self.cache.pad_slot] * pad,
             [p + o for p, o in zip(positions, rope_offsets or [0] * b, strict=True)]
             + [0] * pad],
            torch.long, self.input_ids.device,
        )  # fmt: skip
        self.input_ids[:size].copy_(dev[0])
        self.positions[:size].copy_(dev[1])
        self.context_lens[:size].copy_(dev[2])
        self.slot_mapping[:size].copy_(dev[3])
        self.state_slots[:size].copy_(dev[4])
        self.rope_positions[:size].copy_(dev[5])
        if min(tokens) < 0:
            ids = self.input_ids[:size]
            ids.copy_(torch.where(ids < 0, device_tokens[self.state_slots[:size]], ids))
        width, pad_block = max(len(t) for t in block_tables), self.cache.pad_block
        tables = [t + [pad_block] * (width - len(t)) for t in block_tables]
        tables += [[pad_block] * width] * pad
        dev_tables = to_device(tables, torch.int32, self.input_ids.device)
        self.block_tables[:size, :width].copy_(dev_tables)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:b]
