"""The MSA steps in Triton under the names and signatures of `naive.py`, so a layer picks
either module with one switch:

    ops = kernels if use_triton(q) and fits_tiles(head_dim, index_head_dim) else naive

- `select_blocks`: `select.py` (index scores in Triton per query chunk, torch.topk);
- `decode_select_blocks`: `select.py`'s (one scoring launch for the batch, then torch.topk):
  on the H200 it beats `decode_select.py`'s fused form (scores and top-k in one launch) in
  every row of bench/msa.py, 115.8 against 186.3 us at 1M and batch 1, 525.7 against 554.0
  at batch 8 (bf16 keys; docs/PERF.md);
- `sparse_attention`: `decode.py` (the paged decode kernel, one (query, KV group) per
  sequence) for up to DECODE_ROWS queries, else `prefill.py` (KV-block major with an LSE
  merge). The choice depends on the query count only (known on the host, the same for every
  decode step of a batch size, so a captured graph keeps it);
- `token_tables`: the reference's (torch ops).
"""

from __future__ import annotations

import torch

from sparrow.kernels.msa.decode import sparse_decode_attention
from sparrow.kernels.msa.naive import token_tables
from sparrow.kernels.msa.prefill import Q_CHUNK, sparse_prefill_attention
from sparrow.kernels.msa.select import decode_select_blocks, select_blocks

__all__ = ["decode_select_blocks", "select_blocks", "sparse_attention", "token_tables"]

# Queries up to which attention runs per (query, KV group) through the decode kernel: each
# reads its K blocks itself, which beats sorting the pairs by block while the blocks are
# few readers apiece. A first guess, to be set from bench/msa.py on the H200.
DECODE_ROWS = 64


def sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
    q_chunk: int = Q_CHUNK,
) -> torch.Tensor:
    """`naive.sparse_attention` (same contract). q: [T, Hq, D]; k_cache, v_cache: [pages,
    bs, Hkv, D]; tables: [T, W]; positions: [T]; blocks: [T, Hkv, K] as selection gives
    them (ids at or before the query's block, -1 unused). No host reads."""
    if q.shape[0] <= DECODE_ROWS:
        return sparse_decode_attention(q, k_cache, v_cache, tables, positions, blocks, scale)
    return sparse_prefill_attention(
        q, k_cache, v_cache, tables, positions, blocks, scale, q_chunk=q_chunk
    )
