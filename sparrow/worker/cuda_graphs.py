"""Decode steps and short prefills replayed as CUDA graphs.

A step launches about a thousand kernels (prefill) or hundreds of small ones (decode);
replaying them from a captured graph removes the per-launch host cost, which sets the pace
of decode and of prefills up to a few thousand tokens. Graphs read their inputs from static
buffers and are captured at fixed sizes: batch sizes in `BATCH_SIZES` for decode (a step
with B sequences fills the first B rows and pads to the next captured size), token counts in
`PREFILL_TOKENS` for a step that is one prompt from its start (`PrefillGraphs`). Padding
rows point at the cache's scratch block and slot, so they never touch a request's cache.
The graphs cover the model and the lm_head; sampling runs after them.
"""

from __future__ import annotations

import torch

from sparrow.core.scheduler import SAVES_INSIDE
from sparrow.worker.cache import ModelCache, StepMetadata, to_device

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, cache: ModelCache, max_batch: int, max_blocks_per_seq: int
    ):
        self.model, self.cache = model, cache
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        n, dev = max_batch, model.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.rope_positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full(
            (n, max_blocks_per_seq), cache.pad_block, dtype=torch.int32, device=dev
        )
        self.slot_mapping = torch.full(
            (n,), cache.pad_block * cache.block_size, dtype=torch.long, device=dev
        )
        self.state_slots = torch.full((n,), cache.pad_slot, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, b: int) -> StepMetadata:
        return StepMetadata(
            input_ids=self.input_ids[:b],
            positions=self.positions[:b],
            seq_lens=[1] * b,
            rope_positions=self.rope_positions[:b],
            cu_seqlens=self.cu_seqlens[: b + 1],
            context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            state_slots=self.state_slots[:b],
            max_q_len=1,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, sharing one memory pool."""
        pool = None
        for b in reversed(self.sizes):
            meta = self._meta(b)
            self.graphs[b], pool = capture_graph(
                lambda meta=meta: self.model.logits(self.model(meta, self.cache)), pool
            )
        torch.cuda.synchronize()

    def padded_size(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        state_slots: list[int],
        device_tokens: torch.Tensor,
        rope_offsets: list[int] | None = None,
    ) -> torch.Tensor:
        """One decode step for len(tokens) sequences: token b sits at positions[b] of the
        sequence with that block table and slot, its rotary position that plus
        rope_offsets[b] (mRoPE after media; default 0); a token < 0 is still on the device, in
        device_tokens[slot]. Returns fp32 logits [B, V] (a view of the graph's output: read
        it before the next replay)."""
        b = len(tokens)
        size = self.padded_size(b)
        pad = size - b
        bs = self.cache.block_size
        rows = [
            table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions, strict=True)
        ]
        dev = to_device(
            [
                tokens + [0] * pad,
                positions + [0] * pad,
                [p + 1 for p in positions] + [1] * pad,
                rows + [self.cache.pad_block * bs] * pad,
                state_slots + [self.cache.pad_slot] * pad,
                [p + o for p, o in zip(positions, rope_offsets or [0] * b, strict=True)]
                + [0] * pad,
            ],
            torch.long,
            self.input_ids.device,
        )
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


# Token counts of the captured prefill graphs: a step that is one whole prompt (or a first
# chunk) of at most the largest runs as the smallest that holds it. Beyond 4K tokens the GPU
# work of a step outlasts launching it eagerly.
PREFILL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
# A prefill graph of size n runs n + PAD_TOKENS rows: the prompt, then a padding sequence of
# at least PAD_TOKENS rows on the scratch block and slot (never empty: kernels then see two
# sequences of fixed total length, whatever the prompt's).
PAD_TOKENS = 16


class PrefillGraphs:
    """Captured prefill steps of one prompt starting at position 0 (no cached prefix, no
    media): its T tokens fill rows [0, T) of the graph of the smallest size n >= T, rows
    [T, n + PAD_TOKENS) are a second sequence on the cache's scratch block and slot, so the
    recurrent layers' varlen kernels keep the prompt's state apart from it, and causal
    attention over all rows at once (`StepMetadata.padded`) gives the prompt's rows exactly
    their own. With state snapshots the graphs take the prompt's saves inside it
    (`StepMetadata.save_rows`; -1 rows when it saves none). The graph ends with the lm_head
    on the prompt's last row."""

    def __init__(
        self, model: torch.nn.Module, cache: ModelCache, max_tokens: int, max_blocks_per_seq: int
    ):
        self.model, self.cache = model, cache
        self.sizes = [n for n in PREFILL_TOKENS if n <= max_tokens]
        rows, dev = (self.sizes[-1] if self.sizes else 0) + PAD_TOKENS, model.device
        scratch = cache.pad_block * cache.block_size
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((rows,), scratch, dtype=torch.long, device=dev)
        self.cu_seqlens = torch.tensor([0, 1, rows], dtype=torch.int32, device=dev)
        self.context_lens = torch.tensor([1, rows - 1], dtype=torch.int32, device=dev)
        self.block_tables = torch.full(
            (2, max_blocks_per_seq), cache.pad_block, dtype=torch.int32, device=dev
        )
        self.state_slots = torch.full((2,), cache.pad_slot, dtype=torch.int32, device=dev)
        self.last_row = torch.zeros(1, dtype=torch.long, device=dev)
        # [rows | tokens before each state] of the prompt's saves inside it, and the padding's
        self.saves = torch.full((2, 2, SAVES_INSIDE), -1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, n: int) -> StepMetadata:
        rows = n + PAD_TOKENS
        return StepMetadata(
            input_ids=self.input_ids[:rows],
            positions=self.positions[:rows],
            seq_lens=[n, PAD_TOKENS],
            cu_seqlens=self.cu_seqlens,
            context_lens=self.context_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:rows],
            state_slots=self.state_slots,
            max_q_len=rows,
            prefix_free=True,
            prefix_lens=[0, 0],
            padded=True,
            save_rows=self.saves[0] if self.cache.num_snapshots else None,
            save_at=self.saves[1] if self.cache.num_snapshots else None,
        )

    def forward(self, meta: StepMetadata) -> torch.Tensor:
        """What a graph runs on its metadata: fp32 logits [1, V] of the prompt's last row."""
        hidden = self.model(meta, self.cache)
        return self.model.logits(hidden.index_select(0, self.last_row))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool."""
        pool = None
        for n in reversed(self.sizes):
            rows = n + PAD_TOKENS  # lengths that fit size n for the warm-up run; replays set theirs
            self.cu_seqlens.copy_(torch.tensor([0, 1, rows], dtype=torch.int32))
            self.context_lens.copy_(torch.tensor([1, rows - 1], dtype=torch.int32))
            meta = self._meta(n)
            self.graphs[n], pool = capture_graph(lambda meta=meta: self.forward(meta), pool)
        torch.cuda.synchronize()

    def size_for(self, num_tokens: int) -> int | None:
        return next((n for n in self.sizes if n >= num_tokens), None)

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int],
        block_table: list[int],
        state_slot: int,
        saves: list | None = None,
    ) -> torch.Tensor:
        """Prefill `tokens` (positions 0..T-1, all known on the host) into the sequence with
        this block table and state slot; saves: [2, 1, SAVES_INSIDE], the slot-pool rows its
        states inside the prompt go to (-1: none) and the tokens before each, or None.
        Returns fp32 logits [1, V] of its last token (a view of the graph's output: read it
        before the next replay)."""
        t, bs = len(tokens), self.cache.block_size
        n = self.size_for(t)
        rows = n + PAD_TOKENS
        scratch = self.cache.pad_block * bs
        cache_rows = [block_table[p // bs] * bs + p % bs for p in range(t)]
        dev = to_device(
            [
                tokens + [0] * (rows - t),
                list(range(t)) + [0] * (rows - t),
                cache_rows + [scratch] * (rows - t),
            ],
            torch.long,
            self.input_ids.device,
        )
        self.input_ids[:rows].copy_(dev[0])
        self.positions[:rows].copy_(dev[1])
        self.slot_mapping[:rows].copy_(dev[2])
        width = self.block_tables.shape[1]
        saves = saves or [[[-1] * SAVES_INSIDE], [[0] * SAVES_INSIDE]]
        small = to_device(
            [0, t, rows, t, rows - t, state_slot, t - 1]
            + [x for part in saves for x in part[0]]
            + block_table
            + [self.cache.pad_block] * (width - len(block_table)),
            torch.int32,
            self.input_ids.device,
        )
        self.cu_seqlens.copy_(small[:3])
        self.context_lens.copy_(small[3:5])
        self.state_slots[:1].copy_(small[5:6])
        self.last_row.copy_(small[6:7])
        n_saves = 2 * SAVES_INSIDE
        self.saves[:, 0].copy_(small[7 : 7 + n_saves].view(2, SAVES_INSIDE))
        self.block_tables[0].copy_(small[7 + n_saves :])
        graph, logits = self.graphs[n]
        graph.replay()
        return logits


def capture_graph(fn, pool):
    """Capture `fn()` (after one warm-up call on a side stream, which compiles its kernels and
    sizes the pool) into a CUDA graph in memory pool `pool` (None: a new one). Returns
    ((graph, fn's output), the graph's pool)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return (graph, out), graph.pool()
