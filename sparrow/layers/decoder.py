"""The decoder stack the architectures share: embedding, layers each returning (MLP output,
residual stream), the final norm with the last residual add fused into it, the lm_head."""

from __future__ import annotations

import torch
from torch import nn

from sparrow.distributed import group
from sparrow.layers.metadata import StepMetadata


class DecoderStack(nn.Module):
    """A model's forward over `embed_tokens`, `rotary`, `layers`, `norm` and `lm_head`, which
    the architecture's `__init__` sets; its layers take (x, residual, cos, sin, meta, their
    cache) and return (MLP output, residual). The class flags are `models.interface.Model`'s,
    at the values most architectures take; `visual`: the vision tower, when the checkpoint
    has one (`loader.vision.attach_vision`), else None."""

    uses_mrope = False  # rotary positions are (t, h, w) around media, else one per token
    joint_media = False  # the tower attends across all of a prompt's media (HF 5.17's M3)
    media_merge = 2  # the tower's spatial merge: 2 x 2 patches per placeholder token
    cuda_graphs = True  # decode steps may replay CUDA graphs
    prefill_graphs = True  # one-prompt prefills may too
    batch_invariant = True  # its layers take their batch-invariant form in that mode

    def __init__(self) -> None:
        super().__init__()
        self.visual: nn.Module | None = None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (weights may be packed integers)."""
        return self.norm.weight.dtype

    def forward(self, meta: StepMetadata, cache) -> torch.Tensor:
        """Run the step's new tokens (meta.input_ids [T], media placeholders' rows replaced by
        meta.media_embeds); reads and extends the cache (`cache.layers[i]`: layer i's
        tensors). Returns final-norm hidden states [T, hidden]."""
        x = self.embed(meta.input_ids)
        if meta.media_rows is not None:  # image and video placeholders
            x[meta.media_rows] = meta.media_embeds.to(x.dtype)
        rope = meta.rope_positions if meta.rope_positions is not None else meta.positions
        cos, sin = self.rotary.cos_sin(rope, x.dtype)
        residual = None
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            x, residual = layer(x, residual, cos, sin, meta, layer_cache)
        return self.norm.add(x, residual)[1]

    def embed_media(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """The patches [N, patch_dim] of images and videos with these grids, back to back ->
        their placeholder embeddings [N / merge^2, hidden] in the model's dtype (one tower
        call: with `joint_media`, the tower attends across them)."""
        visual = self.visual
        if visual is None:
            raise ValueError("this model has no vision tower: it takes text only")
        dtype = next(visual.parameters()).dtype
        grid = torch.tensor(grids, device=pixel_values.device)
        return visual(pixel_values.to(dtype), grid).to(self.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> embeddings [T, hidden]. Under tensor parallelism each rank holds
        a block of the vocabulary (`config.vocab_range`): its rows for the ids in it, zeros
        for the rest, summed over the ranks."""
        if self.config.vocab_range is None:
            return self.embed_tokens(ids)
        local, mine = group.local_ids(ids, self.config.vocab_range)
        x = self.embed_tokens(local)
        return group.all_reduce(x * mine[:, None].to(x.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> fp32 logits [N, vocab] (under tensor parallelism each
        rank's block of the vocabulary, gathered)."""
        logits = self.lm_head(hidden).float()
        return logits if self.config.vocab_range is None else group.all_gather(logits)
