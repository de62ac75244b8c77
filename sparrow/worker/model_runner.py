"""Runs the model for one scheduler step.

The runner owns the cache tensors (paged K/V, recurrent-state pools) sized by the scheduler's
config; the scheduler owns which blocks and slots each request holds. For each planned
request it feeds the next `num_tokens` of its uncomputed tokens, batched back to back, and
samples a token for every request whose input is now complete. On a GPU, steps where every
request brings exactly its one next token (decode) replay a captured CUDA graph
(`cuda_graphs.DecodeGraphs`), and so does a step that is one prompt of up to a few thousand
tokens from its start (`cuda_graphs.PrefillGraphs`); other steps run eagerly.

Sampled tokens stay on the device: each is written to `next_tokens[state slot]`, where the
next step reads it if the host does not have it yet (a pending token, see the scheduler),
and is copied to the host without waiting (`LaunchedStep.tokens` waits when asked). So the
engine plans and launches step k + 1 while step k is still running.

A request that asks for prompt logprobs gets the logits of every prompt position: its steps
run eagerly until its prompt is computed (the prefill graph gives the last row's logits
only), each chunk's rows go through the LM head `PROMPT_ROWS` at a time, and what they give
is kept until its first token is sampled, whose `LaunchedStep` carries them.

A request with a grammar (structured output) needs its token of step k before its logits of
step k + 1 can be masked, not before its forward (which reads the token on the device): a
step that samples one starts copying the pending tokens of such requests back, launches its
forward, then waits for the copy (step k's end, not this forward's), advances the grammars
and fills the masks on the CPU while the forward runs (`_catch_up`).

Every sampled request has a seed (its own, or a random one kept from its first draw), and
its draws are a function of that seed and the token's output position (`sampler.uniforms`).
A resumed request (`SamplingParams.output_offset` > 0) counts the last `output_offset`
prompt tokens as output: for its positions, its min_tokens, its presence and frequency
penalties and its grammar (which `add_grammar` replays through them), so it continues
exactly as the stream it resumes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparrow.config import CacheConfig, ConfigError, SchedulerConfig
from sparrow.core.cache_spec import with_index_dtype, with_state_dtype
from sparrow.core.request import Request
from sparrow.core.sampling_params import SamplingParams, TokenLogprob
from sparrow.core.scheduler import SAVES_INSIDE, SchedulerOutput
from sparrow.distributed import group
from sparrow.kernels import get_backend
from sparrow.kernels.batch_invariant import BatchInvariantOps
from sparrow.worker.cache import ModelCache, build_metadata, to_device
from sparrow.worker.cuda_graphs import DecodeGraphs, PrefillGraphs
from sparrow.worker.grammar import Grammar, allocate_bitmask, apply_masks
from sparrow.worker.multimodal import MediaInputs
from sparrow.worker.sampler import (
    penalize,
    prompt_logprobs,
    random_seed,
    sample_rows,
    token_logprob,
)

PENDING = -1  # input token still on the device
# prompt rows per LM-head pass for prompt logprobs: [256, 248,320] fp32 logits are ~250 MB
PROMPT_ROWS = 256


@dataclass
class LaunchedStep:
    """The tokens one step sampled, on their way to the host."""

    request_ids: list[str]
    host: torch.Tensor  # [len(request_ids)] long; pinned, filled by an async copy on a GPU
    ready: torch.cuda.Event | None
    logprobs: dict[str, TokenLogprob]
    # requests sampling their first token that asked for prompt logprobs: one per prompt
    # token after the first
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        request_ids: list[str],
        picked: torch.Tensor,
        logprobs: dict[str, TokenLogprob],
        prompt: dict[str, list[TokenLogprob]] | None = None,
    ) -> LaunchedStep:
        """Start copying the sampled tokens `picked` to the host; do not wait."""
        prompt = prompt or {}
        if picked.device.type != "cuda":
            return cls(request_ids, picked, None, logprobs, prompt)
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(request_ids, host, ready, logprobs, prompt)

    def tokens(self) -> dict[str, list[int]]:
        """{request_id: [sampled token]}, waiting for the copy if it is not done."""
        if self.ready is not None:
            self.ready.synchronize()
        return {rid: [t] for rid, t in zip(self.request_ids, self.host.tolist(), strict=True)}


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        sched: SchedulerConfig,
        cache: CacheConfig,
        cuda_graphs: bool = True,
        batch_invariant: bool = False,
    ):
        """sched, cache: resolved settings. cuda_graphs: capture decode steps (GPU only, and
        only for models whose `cuda_graphs` attribute, if any, is true) and one-prompt
        prefills (where `prefill_graphs`, if any, is true too); False runs every step
        eagerly. batch_invariant: every step under `BatchInvariantOps`, its layers in their
        batch-invariant form (the reference path on a CPU only)."""
        if batch_invariant and (model.device.type != "cpu" or get_backend() == "triton"):
            raise ConfigError("batch_invariant takes the CPU reference path (SPARROW_KERNELS)")
        if batch_invariant and not getattr(model, "batch_invariant", False):
            raise ConfigError(f"{type(model).__name__} has no batch-invariant form")
        self.model = model
        self.batch_invariant = batch_invariant
        specs = with_index_dtype(model.cache_specs(), cache.index_cache_dtype)
        specs = with_state_dtype(specs, cache.recurrent_state_dtype)
        self.cache = ModelCache(
            specs,
            cache.num_blocks,
            cache.block_size,
            cache.num_state_slots,
            model.device,
            model.dtype,
            cache.num_state_snapshots or 0,
        )
        self.seeds: dict[str, int] = {}  # of the sampled requests without one of their own
        self.grammars: dict[str, Grammar] = {}
        # prompt logprobs so far of the requests computing their prompt: entry p - 1 is
        # prompt token p's (None until computed)
        self.prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self.media = MediaInputs(model)
        # the last token sampled for each state slot (and the padding slot)
        self.next_tokens = torch.zeros(
            self.cache.pad_slot + 1, dtype=torch.long, device=model.device
        )
        self.graphs = self.prefill_graphs = None
        if cuda_graphs and model.device.type == "cuda" and model.cuda_graphs:
            max_blocks = -(-sched.max_model_len // cache.block_size)
            self.graphs = DecodeGraphs(model, self.cache, sched.max_num_seqs, max_blocks)
            self.graphs.capture()
            if model.prefill_graphs:
                most = min(sched.max_num_batched_tokens, sched.max_model_len)
                self.prefill_graphs = PrefillGraphs(model, self.cache, most, max_blocks)
                self.prefill_graphs.capture()

    def _start_states(self, plan: SchedulerOutput) -> None:
        """(Re)started requests begin from zero recurrent state, or from the snapshot their
        cached prefix ends at."""
        device = self.model.device
        fresh = [plan.state_slots[r] for r in plan.new_request_ids if r not in plan.restore]
        if fresh:
            self.cache.reset_slots(to_device(fresh, torch.long, device))
        if plan.restore:
            slots = to_device([plan.state_slots[r] for r in plan.restore], torch.long, device)
            self.cache.restore(slots, to_device(list(plan.restore.values()), torch.long, device))

    def _saves_inside(self, plan: SchedulerOutput, rids: list[str]) -> list | None:
        """[2, B, SAVES_INSIDE]: per request of the step, the slot-pool rows of the snapshots
        its states inside the step go to (-1: none), and the tokens of the step before each;
        None if no request saves one."""
        if not plan.save_inside:
            return None
        rows, ats = [], []
        for rid in rids:
            saves = plan.save_inside.get(rid, [])
            pad = SAVES_INSIDE - len(saves)
            rows.append([self.cache.snapshot_row(s) for _, s in saves] + [-1] * pad)
            ats.append([n for n, _ in saves] + [0] * pad)
        return [rows, ats]

    def _save_states(self, plan: SchedulerOutput) -> None:
        """After the forward: the recurrent states the plan saves for prefix caching."""
        if plan.save:
            device = self.model.device
            slots = to_device([plan.state_slots[r] for r in plan.save], torch.long, device)
            self.cache.save(slots, to_device(list(plan.save.values()), torch.long, device))

    def add_grammar(
        self,
        request_id: str,
        compiled,
        stop_token_ids: tuple[int, ...],
        after: int | None = None,
        replay: list[int] | tuple[int, ...] = (),
    ) -> None:
        """Constrain a request's output to a compiled grammar (`GrammarCompiler.compile`),
        from the token after `after` if given (`GrammarSpec.after`), advanced through
        `replay` (a resumed request's earlier output) as if it had sampled those."""
        self.grammars[request_id] = Grammar(compiled, stop_token_ids, after, replay)

    def free(self, request_id: str) -> None:
        self.seeds.pop(request_id, None)
        self.grammars.pop(request_id, None)
        self.prompt_logprobs.pop(request_id, None)
        self.media.free(request_id)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, requests: dict[str, Request]) -> LaunchedStep | None:
        """Launch one step. Returns the sampled tokens of the requests that completed their
        input (None if none did); logprobs where a request asked (read back at once)."""
        if self.batch_invariant:
            with BatchInvariantOps():
                return self._execute(plan, requests)
        return self._execute(plan, requests)

    def _execute(self, plan: SchedulerOutput, requests: dict[str, Request]) -> LaunchedStep | None:
        if not plan.num_scheduled_tokens:
            return None
        device = self.model.device
        self._start_states(plan)
        rids = list(plan.num_scheduled_tokens)
        computed = [requests[rid].num_computed_tokens for rid in rids]
        tokens = []
        for rid, c in zip(rids, computed, strict=True):
            n = plan.num_scheduled_tokens[rid]
            known = requests[rid].token_ids(c, c + n)
            tokens.append(known + [PENDING] * (n - len(known)))
        done = [
            rid
            for rid, c, t in zip(rids, computed, tokens, strict=True)
            if c + len(t) == requests[rid].num_tokens
        ]
        caught_up = self._catch_up(done, requests, plan) if self.grammars else None
        tables, slots = [plan.block_tables[r] for r in rids], [plan.state_slots[r] for r in rids]
        is_decode = len(done) == len(rids) and all(len(t) == 1 for t in tokens)
        if is_decode and self.graphs is not None and self.graphs.padded_size(len(rids)):
            offsets = [self.media.rope_offset(r) for r in rids] if self.media.requests else None
            logits = self.graphs.run(
                [t[0] for t in tokens], computed, tables, slots, self.next_tokens, offsets
            )
            self._save_states(plan)
        elif self._prefill_graph_fits(rids, computed, tokens, requests):
            logits = self.prefill_graphs.run(
                tokens[0], tables[0], slots[0], self._saves_inside(plan, rids)
            )
            self._save_states(plan)
            if not done:  # the first chunk of a longer prompt
                return None
        else:
            meta = build_metadata(tokens, computed, tables, slots, self.cache.block_size, device)
            meta.batch_invariant = self.batch_invariant
            saves = self._saves_inside(plan, rids)
            if saves is not None:
                meta.save_rows, meta.save_at = to_device(saves, torch.int32, device)
            if self.media.requests:
                self.media.apply(meta, rids, computed)
            ends = list(itertools.accumulate(meta.seq_lens))  # host side: no device sync
            pending = [i for i, t in enumerate(tokens) if t[-1] == PENDING]
            if pending:  # only a request's last token can be pending
                rows = to_device([ends[i] - 1 for i in pending], torch.long, device)
                meta.input_ids[rows] = self.next_tokens[
                    to_device([slots[i] for i in pending], torch.long, device)
                ]
            hidden = self.model(meta, self.cache)
            self._save_states(plan)
            self._prompt_logprobs(hidden, ends, rids, computed, tokens, requests)
            finished = set(done)
            last = [ends[i] - 1 for i, rid in enumerate(rids) if rid in finished]
            if not last:
                return None
            logits = self.model.logits(hidden[to_device(last, torch.long, device)])
        params = [requests[rid].params for rid in done]
        seeds = [self._seed(rid, p) for rid, p in zip(done, params, strict=True)]
        positions = [_output_position(requests[rid]) for rid in done]
        logits = self._penalized(logits, done, params, requests, plan)
        # logprobs stay the model's (penalised) ones, as without a grammar
        if caught_up is not None:
            caught_up()
        # under tensor parallelism every rank takes rank 0's tokens (no-op in one process)
        picked = group.broadcast(sample_rows(self._masked(logits, done), params, seeds, positions))
        done_slots = to_device([plan.state_slots[r] for r in done], torch.long, device)
        self.next_tokens[done_slots] = picked
        logprobs = {}
        if any(p.logprobs is not None for p in params):
            chosen = picked.tolist()
            logprobs = {
                rid: token_logprob(logits[row], chosen[row], p.logprobs)
                for row, (rid, p) in enumerate(zip(done, params, strict=True))
                if p.logprobs is not None
            }
        prompt = {
            rid: self.prompt_logprobs.pop(rid, [])
            for rid in done
            if _wants_prompt_logprobs(requests[rid])
        }
        return LaunchedStep.start(done, picked, logprobs, prompt)

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        ends: list[int],
        rids: list[str],
        computed: list[int],
        tokens: list[list[int]],
        requests: dict[str, Request],
    ) -> None:
        """Keep the logprobs of the prompt tokens that this step's rows predict, for the
        requests that ask. hidden: [sum of len(tokens), hidden], request i's rows ending at
        ends[i]; row of position p predicts prompt token p + 1."""
        for i, rid in enumerate(rids):
            req = requests[rid]
            prompt = req.prompt_token_ids
            stop = min(computed[i] + len(tokens[i]), len(prompt) - 1)
            if not _wants_prompt_logprobs(req) or computed[i] >= stop:
                continue
            kept = self.prompt_logprobs.setdefault(rid, [None] * (len(prompt) - 1))
            first = ends[i] - len(tokens[i])  # row of position computed[i]
            for start in range(computed[i], stop, PROMPT_ROWS):
                end = min(start + PROMPT_ROWS, stop)
                rows = hidden[first + start - computed[i] : first + end - computed[i]]
                kept[start:end] = prompt_logprobs(
                    self.model.logits(rows), prompt[start + 1 : end + 1], req.params.prompt_logprobs
                )

    def _prefill_graph_fits(
        self,
        rids: list[str],
        computed: list[int],
        tokens: list[list[int]],
        requests: dict[str, Request],
    ) -> bool:
        """Whether the step is one prompt from its first token, without media or prompt
        logprobs, that a captured prefill graph holds."""
        return (
            self.prefill_graphs is not None
            and len(rids) == 1
            and computed[0] == 0
            and tokens[0][-1] != PENDING
            and rids[0] not in self.media.requests
            and not _wants_prompt_logprobs(requests[rids[0]])
            and self.prefill_graphs.size_for(len(tokens[0])) is not None
        )

    def _penalized(
        self,
        logits: torch.Tensor,
        done: list[str],
        params: list,
        requests: dict[str, Request],
        plan: SchedulerOutput,
    ) -> torch.Tensor:
        """Presence / frequency / repetition penalties over each request's tokens so far,
        its token still on the device (sampled by the step before) included, and a resumed
        request's earlier output (its last `output_offset` prompt tokens) counted as output."""
        if not any(p.penalized for p in params):
            return logits
        reqs = [requests[rid] for rid in done]
        pending = {
            b: self.next_tokens[plan.state_slots[r.request_id]]
            for b, r in enumerate(reqs)
            if r.num_pending
        }
        split = [len(r.prompt_token_ids) - r.params.output_offset for r in reqs]
        return penalize(
            logits,
            params,
            [r.prompt_token_ids[n:] + r.output_token_ids for r, n in zip(reqs, split, strict=True)],
            [r.prompt_token_ids[:n] for r, n in zip(reqs, split, strict=True)],
            pending,
        )

    def _catch_up(
        self, done: list[str], requests: dict[str, Request], plan: SchedulerOutput
    ) -> Callable[[], None] | None:
        """Advance the grammar of each sampling request past the tokens the host knows. The
        one still on the device is copied back without waiting: the function returned (None
        if there is none) waits for it and advances the grammars past it."""
        late = {}
        for rid in done:
            grammar = self.grammars.get(rid)
            if grammar is None:
                continue
            req = requests[rid]
            for token in req.output_token_ids[grammar.num_accepted :]:
                grammar.accept(token)
            if grammar.num_accepted < len(req.output_token_ids) + req.num_pending:
                late[rid] = (grammar, plan.state_slots[rid])
        if not late:
            return None
        slots = to_device([slot for _, slot in late.values()], torch.long, self.model.device)
        read = LaunchedStep.start(list(late), self.next_tokens[slots], {})

        def accept() -> None:
            for rid, (token,) in read.tokens().items():
                late[rid][0].accept(token)

        return accept

    def _masked(self, logits: torch.Tensor, done: list[str]) -> torch.Tensor:
        """logits [len(done), V] with the tokens each request's grammar bars at -inf."""
        rows = [(b, self.grammars[rid]) for b, rid in enumerate(done) if rid in self.grammars]
        if not rows:
            return logits
        bitmask = allocate_bitmask(len(done), logits.shape[1])
        for b, grammar in rows:
            grammar.fill(bitmask, b)
        return apply_masks(logits, bitmask, [b for b, _ in rows])

    def _seed(self, rid: str, params: SamplingParams) -> int | None:
        """The request's seed: its own, or for a sampled one without, a random 63-bit seed
        drawn at its first draw and kept until it is freed (None for greedy ones)."""
        if params.seed is not None or params.temperature == 0:
            return params.seed
        if rid not in self.seeds:
            self.seeds[rid] = random_seed()
        return self.seeds[rid]


def _output_position(request: Request) -> int:
    """The output position of the request's next token: its output tokens so far (the
    pending ones and a resumed request's earlier ones included)."""
    return request.num_tokens - len(request.prompt_token_ids) + request.params.output_offset


def _wants_prompt_logprobs(request: Request) -> bool:
    """Asks for prompt logprobs and has not sampled its first token yet (a request preempted
    later recomputes its prompt without them)."""
    return (
        request.params.prompt_logprobs is not None
        and not request.output_token_ids
        and not request.num_pending
    )
