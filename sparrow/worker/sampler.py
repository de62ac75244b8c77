"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from sparrow.core.sampling_params import SamplingParams, TokenLogprob
from sparrow.worker.cache import to_device


def sample(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None
) -> torch.Tensor:
    """logits: [B, V] fp32 -> token ids [B]."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p, and always the most likely
        # token: a top_p below fp32's smallest subnormal (5e-324) compares as 0.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[..., 0] = False
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> torch.Tensor:
    """logits: [B, V] fp32, row b sampled with params[b] -> token ids [B] (long, on the
    logits' device: nothing waits for them). Greedy rows share one argmax."""
    greedy = [b for b, p in enumerate(params) if p.temperature == 0]
    if len(greedy) == len(params):
        return logits.argmax(dim=-1)
    picked = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if greedy:
        rows = to_device(greedy, torch.long, logits.device)
        picked[rows] = logits[rows].argmax(dim=-1)
    for b, (p, gen) in enumerate(zip(params, gens, strict=True)):
        if p.temperature != 0:
            picked[b] = sample(logits[b : b + 1], p, gen)[0]
    return picked


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits: [V] fp32. The token's log-probability under the model (before temperature and
    filtering) and the `top` most likely tokens with theirs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logp, top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best else ()
    return TokenLogprob(token, float(logp[token]), pairs)
