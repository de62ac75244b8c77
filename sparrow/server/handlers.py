"""From a validated body to engine requests and back: tokenise (chat template for chat),
add the n choices to the engine, then collect their outputs into one response or stream
them as server-sent events. Talks to the engine through `EngineClient` alone.

Prompt text is held to PROMPT_BYTES_PER_TOKEN bytes per token of the model's context before
it is tokenised, then tokenised (and templated) on the text executor, never on the event
loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sparrow.core import structured
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.client import EngineClient, EngineError, EngineFull, InvalidRequest
from sparrow.engine.output_processor import OutputDelta
from sparrow.multimodal.pipeline import MediaPipeline
from sparrow.server import protocol
from sparrow.server.drain import DRAINED, RETRY_AFTER_S, Drain, ShuttingDown
from sparrow.server.jobs import Choice, Job
from sparrow.server.metrics import Metrics
from sparrow.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from sparrow.server.reasoning import ReasoningFormat, ReasoningSplitter, prompt_opens
from sparrow.server.sse import sse_events
from sparrow.server.tool_parsers import ToolCallSplitter, ToolFormat
from sparrow.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 256
DISCONNECT_POLL_S = 0.25  # a whole-response request checks its client this often


MEDIA_PARTS = ("image_url", "video_url")  # as vLLM accepts them
# A prompt's text may be this many UTF-8 bytes per token of max_model_len: English runs ~4
# bytes a token, CJK ~2-3, the built-in vocabulary's longest token is 128 (a run of spaces);
# 32 passes any prompt that could fit, and bounds the tokeniser's work (0.1-0.4 s per MB).
PROMPT_BYTES_PER_TOKEN = 32
TOKENS_PER_SLICE = 4096  # /tokenize writes its ids in slices (0.4 ms each)


class Handlers:
    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        model_name: str,
        metrics: Metrics,
        drain: Drain,
        max_waiting: int | None = None,
        media: MediaPipeline | None = None,
        reasoning: ReasoningFormat | None = None,
        media_executor: Executor | None = None,
        tool_parser: ToolFormat | None = None,
        text_executor: Executor | None = None,
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.metrics, self.drain, self.max_waiting = metrics, drain, max_waiting
        self.media, self.reasoning, self.media_executor = media, reasoning, media_executor
        self.tool_parser, self.text_executor = tool_parser, text_executor
        self.video_token_id = tokenizer.token_id(media.video.video_token) if media else None

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await self._respond(await self.start_chat(body), request)

    async def start_chat(
        self, body: ChatCompletionRequest, prompt: tuple[list[int], list, bool] | None = None
    ) -> Job:
        """The request's choices added to the engine, each with its reasoning and tool-call
        splitters: what `chat` answers with, and what other APIs built on chat (Responses,
        Messages) read as it runs. `prompt`: its (ids, media, inside a think block) when the
        caller built them (`chat_prompt`'s by default)."""
        self._check(body)
        ids, media, inside = prompt or await self.chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        job = await self._start(body, ids, max_tokens, chat=True, media=media, thinking=inside)
        schemas = body.tool_schemas()
        for c in job.choices:
            if self.reasoning is not None:
                c.splitter, c.reasoning = ReasoningSplitter(self.reasoning, inside), ""
            if self.tool_parser is not None and schemas is not None:
                c.calls = ToolCallSplitter(self.tool_parser, schemas)
        self.metrics.media_items.inc(len(media))
        return job

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], list, bool]:
        """The prompt's ids (template applied, media placeholders expanded), its media items,
        and whether it leaves the model inside a think block; 400 for bad messages or media."""
        messages = _template_messages(body.messages)
        sources = self._media_sources(messages)
        kwargs = _template_kwargs(body.chat_template_kwargs, body.tools)
        self._check_text(_text_bytes([messages, kwargs]), "messages")
        try:
            ids, inside = await self._off_loop(self._encode_chat, messages, kwargs)
            media = []
            if sources:  # fetch, decode and preprocess off the event loop
                ids, media = self.media.expand(
                    ids, await self._prepare(sources), self.video_token_id
                )
        except ValueError as e:  # MediaError is one
            raise ApiError(400, str(e), "invalid_request_error", param="messages") from e
        return ids, media, inside

    def _media_sources(self, messages: list[dict]) -> list[tuple[bool, str]]:
        """(is video, URL) of each image_url / video_url part, in order; 400 for other
        non-text parts, and for media when the model takes text only."""
        sources = []
        for m in messages:
            for part in m.get("content") if isinstance(m.get("content"), list) else ():
                kind = part["type"]
                if kind == "text":
                    continue
                if kind not in MEDIA_PARTS:
                    raise ApiError(
                        400,
                        f"content part type {kind!r} is not supported",
                        "invalid_request_error",
                        param="messages",
                    )
                if self.media is None:
                    raise ApiError(
                        400,
                        f"content part type {kind!r} is not supported: this model takes text only",
                        "invalid_request_error",
                        param="messages",
                    )
                url = part.get(kind)
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ApiError(
                        400,
                        f"a {kind} part needs {{'{kind}': {{'url': ...}}}}",
                        "invalid_request_error",
                        param="messages",
                    )
                sources.append((kind == "video_url", url))
        return sources

    async def _prepare(self, sources: list[tuple[bool, str]]) -> list:
        """Each item loaded on the media executor (all at once), then its placeholder ids."""
        loop, start = asyncio.get_running_loop(), time.perf_counter()
        loaded = await asyncio.gather(
            *(
                loop.run_in_executor(self.media_executor, self.media.load, video, url)
                for video, url in sources
            )
        )
        self.metrics.media_seconds.observe(time.perf_counter() - start)
        self.metrics.media_bytes.inc(sum(item.nbytes for item in loaded))
        return [self.media.finish(item, self.tokenizer.encode) for item in loaded]

    async def completions(self, body: CompletionRequest, request: Request):
        self._check(body)
        prompt = body.prompt
        if isinstance(prompt, str):
            self._check_text(_text_bytes(prompt), "prompt")
            ids = await self._encode(prompt)
        else:
            ids = list(prompt)
        job = await self._start(body, ids, body.max_tokens, chat=False)
        return await self._respond(job, request)

    async def tokenize(self, body: TokenizeRequest) -> Response:
        """vLLM's /tokenize: {count, max_model_len, tokens}."""
        self._check_model(body.model)
        if body.messages is None:
            self._check_text(_text_bytes(body.prompt), "prompt")
            ids = await self._encode(body.prompt)
        else:
            messages = _template_messages(body.messages)
            kwargs = _template_kwargs(body.chat_template_kwargs, body.tools)
            self._check_text(_text_bytes([messages, kwargs]), "messages")
            try:
                ids = await self._off_loop(lambda: self.tokenizer.encode_chat(messages, **kwargs))
            except ValueError as e:
                raise ApiError(400, str(e), "invalid_request_error") from e
        info = self.engine.info
        return Response(
            await self._off_loop(_tokens_json, ids, info.max_model_len),
            media_type="application/json",
        )

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: {prompt}."""
        self._check_model(body.model)
        vocab = self.engine.info.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ApiError(
                400, f"token ids must be in [0, {vocab})", "invalid_request_error", param="tokens"
            )
        return {"prompt": await self._off_loop(self.tokenizer.decode, body.tokens)}

    async def _off_loop(self, fn, *args):
        """`fn(*args)` on the text executor (tokenising a 1 MB prompt takes 0.1-0.4 s)."""
        return await asyncio.get_running_loop().run_in_executor(self.text_executor, fn, *args)

    async def _encode(self, text: str) -> list[int]:
        try:
            return await self._off_loop(self.tokenizer.encode, text)
        except ValueError as e:  # tiktoken's regex gives up on some long runs
            raise ApiError(400, str(e), "invalid_request_error", param="prompt") from e

    async def history_ids(self, body: ChatCompletionRequest, count: int) -> list[int]:
        """The ids of the template's rendering of the first `count` messages as history
        (no generation prompt)."""
        messages = _template_messages(body.messages[:count])
        kwargs = _template_kwargs(body.chat_template_kwargs, body.tools)
        kwargs = kwargs | {"add_generation_prompt": False}
        return await self._off_loop(lambda: self.tokenizer.encode_chat(messages, **kwargs))

    def _encode_chat(self, messages: list[dict], kwargs: dict) -> tuple[list[int], bool]:
        """The prompt's ids, and whether it leaves the model inside a think block."""
        ids = self.tokenizer.encode_chat(messages, **kwargs)
        inside = self.reasoning is not None and prompt_opens(
            self.reasoning, self.tokenizer.apply_chat_template(messages, **kwargs)
        )
        return ids, inside

    def _check_text(self, size: int, param: str) -> None:
        """400 for prompt text over PROMPT_BYTES_PER_TOKEN bytes per context token."""
        context = self.engine.info.max_model_len
        limit = PROMPT_BYTES_PER_TOKEN * context
        if size > limit:
            raise ApiError(
                400,
                f"the prompt text is {size} bytes; the limit is {limit} bytes "
                f"({PROMPT_BYTES_PER_TOKEN} per token of the {context}-token context)",
                "invalid_request_error",
                param=param,
            )

    def _stop_ids(self, body: SamplingFields) -> tuple[int, ...]:
        """The request's stop token ids and, unless it ignores EOS, the model's end tokens
        (vLLM's meaning); () leaves the engine's default."""
        if not body.stop_token_ids:
            return ()
        ends = () if body.ignore_eos else self.engine.info.default_stop_token_ids
        return tuple(dict.fromkeys([*body.stop_token_ids, *ends]))

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                "not_found_error",
                param="model",
            )

    def _check(self, body: SamplingFields) -> None:
        if self.drain.draining:
            retry = {"Retry-After": str(RETRY_AFTER_S)}
            raise ApiError(503, "the server is shutting down", "server_overloaded", retry)
        self._check_model(body.model)
        if self.max_waiting is not None and body.n > self.max_waiting:
            raise ApiError(
                400,
                f"n = {body.n} exceeds the server's queue limit of {self.max_waiting} requests",
                "invalid_request_error",
                param="n",
            )

    def _params(
        self, body: SamplingFields, prompt_len: int, max_tokens: int | None, thinking: bool = False
    ):
        """The request's SamplingParams; `thinking`: the prompt leaves the model inside a
        think block, so a grammar applies after its end marker."""
        limit = self.engine.info.request_limit
        if prompt_len >= limit:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens; the limit of {limit} "
                "tokens per request leaves no room to generate",
                "invalid_request_error",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        try:
            grammar = structured.from_request(body.structured_outputs, body.response_format)
            if grammar is not None and thinking:
                end = self.tokenizer.token_id(self.reasoning.end)
                grammar = dataclasses.replace(grammar, after=end)
            return SamplingParams(
                max_tokens=max_tokens or min(DEFAULT_MAX_TOKENS, limit - prompt_len),
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop_strings(),
                logprobs=body.logprobs_count(),
                ignore_eos=body.ignore_eos,
                min_p=body.min_p,
                min_tokens=body.min_tokens,
                logit_bias=_logit_bias(body.logit_bias),
                presence_penalty=body.presence_penalty,
                repetition_penalty=body.repetition_penalty,
                frequency_penalty=body.frequency_penalty,
                stop_token_ids=self._stop_ids(body),
                grammar=grammar,
                prompt_logprobs=body.prompt_logprobs,
                skip_special_tokens=body.skip_special_tokens,
            )
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_request_error") from e

    async def _start(
        self,
        body: SamplingFields,
        ids: list[int],
        max_tokens: int | None,
        chat: bool,
        media: list | None = None,
        thinking: bool = False,
    ) -> Job:
        """Add the n choices (seeds seed, seed + 1, ... so they differ reproducibly; the first
        alone computes the prompt logprobs, when asked for); on any refusal the ones added are
        aborted and the error becomes the response."""
        params = self._params(body, len(ids), max_tokens, thinking)
        job = Job(body, chat, ids, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}")
        try:
            for i in range(body.n):
                rid = f"{job.response_id}-{i}"
                seed = None if body.seed is None else body.seed + i
                prompt = params.prompt_logprobs if i == 0 else None
                choice = dataclasses.replace(params, seed=seed, prompt_logprobs=prompt)
                stream = await self.engine.add(rid, ids, choice, media or ())
                job.choices.append(Choice(i, rid, stream))
        except (InvalidRequest, EngineFull, EngineError) as e:
            for c in job.choices:
                self.engine.abort(c.request_id)
            raise _refusal(e) from e
        self.metrics.prompt_tokens.inc(len(ids) * body.n)
        return job

    async def _respond(self, job: Job, request: Request):
        if job.body.stream:
            return StreamingResponse(
                sse_events(job, self.events(job), self.model_name), media_type="text/event-stream"
            )
        await self.finish(job, request)
        chat = job.chat
        ids = job.body.return_token_ids
        prompt = job.prompt_logprobs()
        choices = [
            protocol.choice_body(
                c.index,
                c.text,
                protocol.finish_reason(c.finish_reason, bool(c.tool_calls)),
                protocol.logprobs_body(c.logprobs, chat),
                chat,
                token_ids=c.token_ids if ids else None,
                reasoning=c.reasoning,
                tool_calls=c.tool_calls,
            )
            for c in job.choices
        ]
        if prompt is not None and not chat:  # vLLM's places: in each choice of a completion
            for choice in choices:
                choice["prompt_logprobs"] = prompt
        extra = {"prompt_logprobs": prompt} if prompt is not None and chat else {}
        return protocol.response_body(
            job.response_id, job.created, self.model_name, choices, chat, usage=job.usage(), **extra
        )

    async def finish(
        self,
        job: Job,
        request: Request,
        on_delta: Callable[[Choice, OutputDelta], None] | None = None,
    ) -> None:
        """Runs `job` to its end, its choices taking their deltas (each also given to
        `on_delta`); 499 when the client leaves first (its choices aborted), 500 when the
        engine fails, 503 when the shutdown drain window ends first."""
        collect = asyncio.create_task(self._collect(job, on_delta))
        try:
            while not (await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    raise ApiError(499, "the client disconnected", "invalid_request_error")
            collect.result()
        except EngineError as e:
            raise ApiError(500, str(e), "server_error") from e
        except ShuttingDown as e:
            raise ApiError(503, str(e), "server_overloaded") from e
        finally:
            if not collect.done():
                collect.cancel()  # closes the events: unfinished choices are aborted
                await asyncio.gather(collect, return_exceptions=True)

    async def _collect(self, job: Job, on_delta: Callable | None = None) -> None:
        async with contextlib.aclosing(self.events(job)) as events:
            async for choice, delta in events:
                if on_delta is not None:
                    on_delta(choice, delta)

    async def events(self, job: Job) -> AsyncIterator[tuple[Choice, OutputDelta]]:
        """(choice, delta) as outputs arrive, all choices interleaved; aborts every
        unfinished choice if the consumer stops early (client gone). Raises EngineError, and
        ShuttingDown when the shutdown drain window ends first."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for delta in choice.stream:
                    await merged.put((choice, delta))
            except EngineError as e:
                await merged.put((choice, e))

        tasks = [asyncio.create_task(pump(c)) for c in job.choices]
        start = last = time.perf_counter()
        open_choices = len(job.choices)
        self.drain.open(merged)
        try:
            while open_choices:
                choice, delta = await merged.get()
                if isinstance(delta, EngineError):
                    raise delta
                if delta is DRAINED:
                    raise ShuttingDown(
                        "the server is shutting down; the request did not "
                        f"finish within the {self.drain.drain_s:g} s drain"
                    )
                if delta.token_ids:
                    now = time.perf_counter()
                    first = choice.num_tokens == 0
                    (self.metrics.ttft if first else self.metrics.itl).observe(
                        now - (start if first else last)
                    )
                    last = now
                    self.metrics.generation_tokens.inc(len(delta.token_ids))
                choice.take(delta)
                if choice.finish_reason is not None:
                    open_choices -= 1
                yield choice, delta
        finally:
            self.drain.close(merged)
            for task in tasks:
                task.cancel()
            for c in job.choices:
                if c.finish_reason is None:
                    self.metrics.aborted.inc()
                    self.engine.abort(c.request_id)


def _template_kwargs(kwargs: dict | None, tools: list[protocol.Tool] | None) -> dict:
    """A request's chat_template_kwargs and its tools (HF's `tools=`: the template renders
    them); 400 for keys the template call sets itself."""
    kwargs = kwargs or {}
    if kwargs.keys() & {"messages", "add_generation_prompt", "tools"}:
        raise ApiError(
            400,
            "chat_template_kwargs may not set messages, add_generation_prompt or tools",
            "invalid_request_error",
            param="chat_template_kwargs",
        )
    if tools:
        kwargs = kwargs | {"tools": [t.model_dump(exclude_none=True) for t in tools]}
    return kwargs


def _template_messages(messages: list[protocol.ChatMessage]) -> list[dict]:
    """Messages as chat templates take them: an assistant turn's tool call arguments as an
    object (HF's convention; OpenAI sends them as JSON text); 400 when they are not one."""
    out = []
    for m in messages:
        message = m.model_dump(exclude_none=True)
        for call in message.get("tool_calls", ()):
            args = call["function"]["arguments"]
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise ApiError(
                    400,
                    f"the arguments of tool call {call['function']['name']!r} "
                    "are not a JSON object",
                    "invalid_request_error",
                    param="messages",
                )
            call["function"]["arguments"] = args
        out.append(message)
    return out


def _text_bytes(value: object) -> int:
    """The UTF-8 bytes of the strings in `value` (nested lists and dicts), media parts' URLs
    left out: what a chat template renders."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        if value.get("type") in MEDIA_PARTS:
            return 0
        return sum(_text_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_text_bytes(v) for v in value)
    return 0


def _tokens_json(ids: list[int], max_model_len: int) -> bytes:
    """/tokenize's body. json.dumps of 650K ids holds the GIL for 60 ms, and the engine
    thread, which takes the GIL back after every torch op, waits up to a switch interval
    each time: a stream's chunk gap grew to 100 ms. Written in slices, the GIL given up
    between them, it stays at 25 ms."""
    pieces = []
    for i in range(0, len(ids), TOKENS_PER_SLICE):
        pieces.append(json.dumps(ids[i : i + TOKENS_PER_SLICE], separators=(",", ":"))[1:-1])
        time.sleep(0)  # releases the GIL: waiting threads run now, not after 5 ms
    head = f'{{"count":{len(ids)},"max_model_len":{max_model_len},"tokens":['
    return f"{head}{','.join(pieces)}]}}".encode()


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> SamplingParams' pairs; ValueError for a key that is not
    a token id (the caller's 400)."""
    try:
        return tuple((int(k), v) for k, v in (bias or {}).items())
    except ValueError:
        raise ValueError("logit_bias keys must be token ids") from None


def _refusal(e: Exception) -> ApiError:
    if isinstance(e, InvalidRequest):
        return ApiError(400, str(e), "invalid_request_error")
    if isinstance(e, EngineFull):
        return ApiError(503, str(e), "server_overloaded", {"Retry-After": "1"})
    return ApiError(503, str(e), "server_error")
