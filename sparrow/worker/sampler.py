"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

All sampled rows of a step are filtered together (one top-k, one sort for the rows with a
top-p, one softmax), then drawn by an exponential race: argmax(p / E) with E ~ Exp(1) per
token picks token i with probability p_i. The noise comes from each request's own generator
(one draw per generator for all its rows), so a seeded request's tokens do not depend on the
other requests of the step.
"""

from __future__ import annotations

import torch

from sparrow.core.sampling_params import SamplingParams, TokenLogprob
from sparrow.worker.cache import to_device


def sample(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None
) -> torch.Tensor:
    """logits: [B, V] fp32 -> token ids [B], every row with the same params and generator."""
    return sample_rows(logits, [params] * logits.shape[0], [gen] * logits.shape[0])


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> torch.Tensor:
    """logits: [B, V] fp32, row b sampled with params[b] and gens[b] -> token ids [B] (long,
    on the logits' device: nothing waits for them). Greedy rows take the argmax."""
    picked = logits.argmax(dim=-1)
    hot = [b for b, p in enumerate(params) if p.temperature != 0]
    if not hot:
        return picked
    every = len(hot) == len(params)
    rows = None if every else to_device(hot, torch.long, logits.device)
    chosen = [params[b] for b in hot]
    x = logits if every else logits[rows]
    x = x / _column([p.temperature for p in chosen], x)
    x = _top_k(x, [p.top_k for p in chosen])
    probs = _top_p(torch.softmax(x, dim=-1), [p.top_p for p in chosen])
    noise = _exponential(probs, [gens[b] for b in hot])
    drawn = (probs / noise).argmax(dim=-1)
    if every:
        return drawn
    picked[rows] = drawn
    return picked


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.dtype, like.device)[:, None]


def _top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Logits below each row's k-th largest set to -inf (k 0 or >= V: no filter)."""
    vocab = x.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in ks]
    if min(ks) == vocab:
        return x
    best = torch.topk(x, max(ks), dim=-1).values
    kth = best.gather(1, to_device([k - 1 for k in ks], torch.long, x.device)[:, None])
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(probs: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Each row with p < 1 keeps the smallest prefix of its sorted probabilities whose mass
    reaches p, and always the most likely token (a p below fp32's smallest subnormal compares
    as 0). Rows with p = 1 are left as they are."""
    need = [i for i, p in enumerate(ps) if p < 1]
    if not need:
        return probs
    every = len(need) == len(ps)
    rows = None if every else to_device(need, torch.long, probs.device)
    sub = probs if every else probs[rows]
    ordered, order = sub.sort(dim=-1, descending=True)
    drop = ordered.cumsum(-1) - ordered >= _column([ps[i] for i in need], ordered)
    drop[:, 0] = False
    kept = torch.zeros_like(sub).scatter_(-1, order, ordered.masked_fill(drop, 0.0))
    if every:
        return kept
    probs = probs.clone()
    probs[rows] = kept
    return probs


def _exponential(probs: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise like probs, the rows of each generator drawn from it in one call (rows
    sharing none from the default generator). Kept above 0: p / 0 would be inf or NaN."""
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, gen in enumerate(gens):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    if len(groups) == 1:
        noise = torch.empty_like(probs).exponential_(generator=gens[0])
    else:
        noise = torch.empty_like(probs)
        for gen, rows in groups.values():
            draw = torch.empty(len(rows), probs.shape[1], device=probs.device,
                               dtype=probs.dtype).exponential_(generator=gen)  # fmt: skip
            noise[to_device(rows, torch.long, probs.device)] = draw
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits: [V] fp32. The token's log-probability under the model (before temperature and
    filtering) and the `top` most likely tokens with theirs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logp, top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best else ()
    return TokenLogprob(token, float(logp[token]), pairs)
