"""The engine's executor over the ranks of a tensor-parallel engine. Rank 0 is the engine's own
process: it schedules, samples and speaks to clients. Ranks 1..S-1 are processes it spawns
(`start`); each loads its share of the checkpoint, builds the same cache and runner, and
then does what rank 0's `RankedRunner` forwards, step by step: every rank runs each step's
forward (its heads and expert columns; the layers all-reduce), and takes rank 0's sampled
tokens (`group.broadcast` in the runner), so no rank's sampling can drift from rank 0's.

A step's message carries the plan and, for each request it names, the request whole the
first time and then only what changed (`RequestUpdate`: the tokens sampled since, the
computed and pending counts), so a long context crosses once. A rank that dies fails rank
0's next step with an error naming it (rank 0 checks the processes before each message; a
collective that waits longer than `group.TIMEOUT_S` raises too).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from dataclasses import dataclass

import torch

from sparrow.core.request import Request, RequestStatus
from sparrow.distributed import group
from sparrow.distributed.shard import Shard
from sparrow.net import free_port

logger = logging.getLogger(__name__)


class RankFailed(RuntimeError):
    """A rank of the engine stopped: the engine cannot run another step."""


def rank_device(device: torch.device | str, rank: int) -> torch.device:
    """Rank r's device: cuda:r on GPUs, the CPU otherwise."""
    device = torch.device(device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


class Ranks:
    """The spawned ranks 1..S-1 of rank 0's engine."""

    def __init__(self, procs: list[multiprocessing.Process]):
        self.procs = procs
        self.stopped = False

    @classmethod
    def start(cls, config, device: torch.device) -> Ranks:
        """Spawn ranks 1..S-1 for `config` (an EngineConfig), then join the group as rank 0."""
        size = config.parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, size, init_method, config),
                name=f"sparrow-rank-{r}",
                daemon=True,
            )
            for r in range(1, size)
        ]
        for p in procs:
            p.start()
        group.init(0, size, init_method, rank_device(device, 0))
        return cls(procs)

    def check(self) -> None:
        """RankFailed if a rank has exited."""
        for p in self.procs:
            if not p.is_alive():
                raise RankFailed(
                    f"tensor-parallel rank {p.name.rsplit('-', 1)[-1]} exited "
                    f"with code {p.exitcode}"
                )

    def send(self, *message) -> None:
        self.check()
        group.broadcast_object(message)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask every rank to stop, wait for them (killing those that do not), leave the group.
        Once: later calls do nothing."""
        if self.stopped:
            return
        self.stopped = True
        if all(p.is_alive() for p in self.procs):
            try:
                group.broadcast_object(("stop",))
            except RuntimeError:
                pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        group.close()


@dataclass(frozen=True)
class RequestUpdate:
    """What changed in a request the other ranks hold since rank 0 last sent it."""

    new_output_ids: list[int]
    num_computed_tokens: int
    num_pending: int
    status: RequestStatus

    def apply(self, request: Request) -> None:
        request.output_token_ids.extend(self.new_output_ids)
        request.num_computed_tokens, request.num_pending = (
            self.num_computed_tokens,
            self.num_pending,
        )
        request.status = self.status


class RankedRunner:
    """Rank 0's runner: each call that changes what the runner holds or computes is sent to
    the other ranks first, then run here."""

    def __init__(self, runner, ranks: Ranks):
        self.runner, self.ranks = runner, ranks
        self.media = _RankedMedia(runner.media, ranks)
        self.sent: dict[str, int] = {}  # request -> output tokens the other ranks hold

    def execute(self, plan, requests):
        self.ranks.send(
            "execute", plan, {rid: self._update(requests[rid]) for rid in plan.num_scheduled_tokens}
        )
        return self.runner.execute(plan, requests)

    def _update(self, request: Request) -> Request | RequestUpdate:
        """The request whole the first time (or if its output shrank), else what changed."""
        out, sent = request.output_token_ids, self.sent.get(request.request_id)
        self.sent[request.request_id] = len(out)
        if sent is None or sent > len(out):
            return request
        return RequestUpdate(
            out[sent:], request.num_computed_tokens, request.num_pending, request.status
        )

    def free(self, request_id: str) -> None:
        self.ranks.send("free", request_id)
        self.sent.pop(request_id, None)
        self.runner.free(request_id)

    def add_grammar(self, *args, **kwargs) -> None:
        """Grammars mask rank 0's sampling only: the other ranks take its tokens."""
        self.runner.add_grammar(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


class _RankedMedia:
    def __init__(self, media, ranks: Ranks):
        self.media, self.ranks = media, ranks

    def add(self, *args) -> None:
        self.ranks.send("media", *args)
        self.media.add(*args)

    def __getattr__(self, name: str):
        return getattr(self.media, name)


def _rank_main(rank: int, size: int, init_method: str, config) -> None:
    """A spawned rank: load its share, build the runner rank 0 resolved, follow its steps."""
    from sparrow.engine.resolve import resolve_device
    from sparrow.loader.model import load_model
    from sparrow.worker.model_runner import ModelRunner

    # Ctrl-C reaches every process of the terminal: rank 0 stops the others itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name, dtype = resolve_device(config.device)
    device = rank_device(name, rank)
    group.init(rank, size, init_method, device)
    try:
        shard = Shard(rank, size, config.parallel.enable_expert_parallel)
        model = load_model(config, device, dtype, shard=shard)
        scheduler_config, cache_config = group.broadcast_object()
        runner = ModelRunner(
            model,
            scheduler_config,
            cache_config,
            cuda_graphs=not config.device.enforce_eager,
            batch_invariant=config.device.batch_invariant,
        )
        requests: dict[str, Request] = {}  # as rank 0 sent them
        while True:
            op, *args = group.broadcast_object()
            if op == "stop":
                break
            if op == "execute":
                plan, updates = args
                for rid, update in updates.items():
                    if isinstance(update, Request):
                        requests[rid] = update
                    else:
                        update.apply(requests[rid])
                runner.execute(plan, requests)
            elif op == "free":
                requests.pop(args[0], None)
                runner.free(*args)
            elif op == "media":
                runner.media.add(*args)
    except Exception as e:  # the other ranks see the group fail; say why here
        logger.error("tensor-parallel rank %d: %s: %s", rank, type(e).__name__, e)
        raise
    finally:
        group.close()
