"""A generation admitted and answered with exactly one outcome, in whichever dialect asked for it.

The response waits for the first token (or the end) before it picks its status, so a request the runner refuses is
a 400 and a runner that dies before answering is a 500 with the cause; once streaming, a runner failure ends the
stream with an error event carrying the cause (never with the dialect's success marker: a truncated answer never
looks like a success). A client that disconnects cancels its generation: each response watches the connection for
``http.disconnect`` while it waits for tokens. A ``Shaper`` (one per dialect: OpenAI's chat and completion objects
and SSE chunks, the Responses API's events, Ollama's NDJSON) owns only the bytes; the outcome rules are
``GenerationResponse``'s alone, and the statuses ``tether.serve.statuses``'.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import anyio
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from tether.errors import InvalidField
from tether.fleet.fleet import Fleet, Hosted, Unavailable
from tether.fleet.resume import Resumable
from tether.fleet.scheduler import Scheduler
from tether.node.fit import DoesNotFit
from tether.protocol import Chunk, EmbedParams, ErrorChunk, TaskState, TaskStatus, TokenizerWork
from tether.serve.dialects.plan import Plan
from tether.serve.metrics import Metrics
from tether.serve.statuses import Answer, GenerationFailed, failure_of

log = logging.getLogger("tether.api")
T = TypeVar("T")


@dataclass(frozen=True)
class Speculation:
    """What speculative decoding did for one generation, as its final chunk says (all 0 where the engine drafted
    nothing): tokens drafted and verified, those kept, the kept and the thrown-away ones drawn from the request's
    ``prediction``, and the engine steps its completion took (fewer than its tokens when drafts were kept)."""

    draft_tokens: int = 0
    draft_accepted: int = 0
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    decode_steps: int = 0

    @classmethod
    def of(cls, chunk: Chunk) -> Speculation:
        return cls(
            chunk.draft_tokens,
            chunk.draft_accepted,
            chunk.prediction_accepted,
            chunk.prediction_rejected,
            chunk.decode_steps,
        )

    def details(self, reasoning_tokens: int) -> dict[str, int]:
        """OpenAI's details of the completion's tokens (chat's ``completion_tokens_details``, Responses'
        ``output_tokens_details``): the reasoning ones, and what the prediction gave."""
        return {
            "reasoning_tokens": reasoning_tokens,
            "accepted_prediction_tokens": self.prediction_accepted,
            "rejected_prediction_tokens": self.prediction_rejected,
        }

    def usage(self) -> dict[str, int]:
        """tether's extension of a response's ``usage`` (``speculation``), in every OpenAI dialect alike."""
        return {
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.draft_accepted,
            "decode_steps": self.decode_steps,
        }


class Shaper(Protocol):
    """One request's response in one dialect. ``feed`` sees every chunk in order (streamed or not: the shaper keeps
    what its whole answer needs) and returns the bytes to stream now; ``opening`` is sent once the status is
    decided (the first chunk, or the end); ``closing`` ends a complete stream, ``whole`` is a complete non-streamed
    body; ``stream_error`` ends a failed stream and ``error_body`` is a failed request's body."""

    media_type: str  # of a stream
    load_seconds: float  # how long the request waited for its model to load (the API sets it)

    def opening(self) -> bytes: ...

    def feed(self, chunk: Chunk) -> bytes: ...

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes: ...

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes: ...

    def stream_error(self, failure: Answer) -> bytes: ...

    def error_body(self, failure: Answer) -> bytes: ...


async def next_event(handle: Resumable) -> Chunk | TaskStatus | ErrorChunk:
    """A task's next event that matters to a client: a chunk, a request error, or the terminal status."""
    while True:
        event = await handle.__anext__()
        if isinstance(event, Chunk) and event.is_progress:
            continue  # a prefill's progress: for the hang deadlines, not the client
        if isinstance(event, Chunk | ErrorChunk):
            return event
        if isinstance(event, TaskStatus) and event.state.terminal:
            return event


class GenerationResponse(Response):
    """Streams or collects one generation while watching the client; ends the fleet's request bookkeeping.

    The bytes are the ``shaper``'s (one per API dialect); the outcome rules are this class's alone.
    """

    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics,
        hosted: Hosted,
        handle: Resumable,
        release: contextlib.AsyncExitStack,
        shaper: Shaper,
        *,
        stream: bool,
        endpoint: str,
        started: float,
    ) -> None:
        super().__init__()
        self.fleet = fleet
        self.metrics = metrics
        self.hosted = hosted
        self.handle = handle
        self.release = release
        self.shaper = shaper
        self.stream = stream
        self.endpoint = endpoint
        self.started = started
        self.outcome = "failed"
        self.disconnected = False
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.speculation = Speculation()
        self.first_token_at: float | None = None
        self.response_started = False
        self.response_complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch_client() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    self.disconnected = True
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_client)
                await self._respond(send)
                tg.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside (the client's leaving cancels only the group above): the server is stopping and
            # its graceful shutdown ran out while this request waited or streamed. It ends with an error in its
            # API's shape, not the web server's bare "500 Internal Server Error" or a stream that just stops.
            if self.disconnected or self.response_complete:
                raise
            with anyio.CancelScope(shield=True):
                await self._stopping(send)
        finally:
            with anyio.CancelScope(shield=True):
                if self.handle.final is None:  # the client left (or we failed to send): stop generating for it
                    reply = await self.fleet.cancel(self.handle.task_id)
                    self.outcome = "cancelled" if self.disconnected else self.outcome
                    log.info("request %s: client gone, %s", self.handle.task_id, reply.detail)
                await self.release.aclose()
                self._record()

    async def _respond(self, send: Send) -> None:
        shaper = self.shaper
        finish: str | None = None
        request_error: str | None = None
        while True:
            try:
                event = await next_event(self.handle)
            except StopAsyncIteration:  # cannot happen: every task ends with a terminal status
                event = TaskStatus(self.handle.task_id, TaskState.FAILED, error="the task stream ended unexpectedly")
            if isinstance(event, ErrorChunk):
                request_error = event.message
                continue
            if isinstance(event, Chunk):
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.completion_tokens += event.tokens
                if event.finish_reason is not None:
                    finish = event.finish_reason
                    self.prompt_tokens = event.prompt_tokens
                    self.cached_tokens = event.cached_tokens
                    self.speculation = Speculation.of(event)
                    self.completion_tokens = event.completion_tokens or self.completion_tokens
                piece = shaper.feed(event)
                if not self.stream:
                    continue
                if not self.response_started:  # the status is decided: the first token is out
                    await self._start(send, 200, shaper.media_type)
                    await self._body(send, shaper.opening())
                if piece:
                    await self._body(send, piece)
                continue
            # The terminal status.
            self.outcome = event.state.value
            if event.state is TaskState.COMPLETE:
                reason = "length" if finish == "length" else "stop"
                if self.stream:
                    if not self.response_started:
                        await self._start(send, 200, shaper.media_type)
                        await self._body(send, shaper.opening())
                    await self._body(send, shaper.closing(reason, self.prompt_tokens, self.completion_tokens), False)
                else:
                    body = shaper.whole(reason, self.prompt_tokens, self.completion_tokens)
                    await self._whole(send, 200, body)
                return
            failure = failure_of(event, request_error, self.completion_tokens)
            self.outcome = failure.outcome
            if self.response_started:
                await self._body(send, shaper.stream_error(failure), more=False)
            else:
                await self._whole(send, failure.status, shaper.error_body(failure))
            return

    async def _stopping(self, send: Send) -> None:
        """End the request with "the server is stopping": a 503 with Retry-After before its response started, the
        stream's error event after. The runner's task is cancelled after this (``__call__``'s ``finally``)."""
        answer = Answer(
            503,
            "server_error",
            "shutting_down",
            "the server is shutting down (SIGTERM or SIGINT) and its graceful shutdown ended before this request: "
            "retry it against a running server",
            retry_after=1.0,
            extra={"completion_tokens": self.completion_tokens},
            outcome="cancelled",
        )
        self.outcome = answer.outcome
        try:
            if self.response_started:
                await self._body(send, self.shaper.stream_error(answer), more=False)
            else:
                await self._whole(send, 503, self.shaper.error_body(answer), answer.headers())
        except OSError:  # the connection went with the server: nothing left to tell
            pass

    async def _start(self, send: Send, status: int, media_type: str, extra: dict[str, str] | None = None) -> None:
        headers = [(b"content-type", media_type.encode()), (b"x-request-id", self.handle.task_id.encode())]
        if media_type != "application/json":  # a stream (SSE, NDJSON): no cache, and no proxy buffering it
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
        self.response_started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, send: Send, data: bytes, more: bool = True) -> None:
        self.response_complete = not more
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def _whole(self, send: Send, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        await self._start(send, status, "application/json", headers)
        await self._body(send, body, more=False)

    def _record(self) -> None:
        m, instance = self.metrics, self.hosted.id
        m.requests.labels(instance, self.endpoint, self.outcome).inc()
        m.tokens.labels(instance, "prompt").inc(self.prompt_tokens)
        m.tokens.labels(instance, "completion").inc(self.completion_tokens)
        m.tokens.labels(instance, "prompt_cached").inc(self.cached_tokens)
        drafted = self.speculation
        m.tokens.labels(instance, "drafted").inc(drafted.draft_tokens)
        m.tokens.labels(instance, "draft_accepted").inc(drafted.draft_accepted)
        m.tokens.labels(instance, "prediction_accepted").inc(drafted.prediction_accepted)
        m.tokens.labels(instance, "prediction_rejected").inc(drafted.prediction_rejected)
        m.decode_steps.labels(instance).inc(drafted.decode_steps)
        self.hosted.drafts.add(
            drafted.draft_tokens, drafted.draft_accepted, drafted.decode_steps, self.completion_tokens
        )
        if self.first_token_at is not None:
            m.ttft.labels(instance).observe(self.first_token_at - self.started)
        m.duration.labels(instance).observe(time.monotonic() - self.started)


@dataclass
class Api:
    """What a route module (``openai``'s routes here, ``responses``, ``ollama``) needs to serve generations: the
    scheduler (and its fleet), the metrics, and the one way a generation is admitted and answered."""

    scheduler: Scheduler
    metrics: Metrics

    @property
    def fleet(self) -> Fleet:
        return self.scheduler.fleet

    async def respond(
        self, model_id: str, plan: Plan, shaper: Shaper, request_id: str, endpoint: str, started: float
    ) -> Response:
        """Admit the plan's generation to model ``model_id`` (loading it if it is not: the lease lasts as long as
        the response), answered with ``shaper`` (every generating route ends here)."""
        release = contextlib.AsyncExitStack()
        try:
            leased = time.monotonic()
            loaded = self.scheduler.loaded(model_id)
            hosted = await release.enter_async_context(self.scheduler.lease(model_id, plan.keep_alive))
            shaper.load_seconds = 0.0 if loaded else time.monotonic() - leased
            if not loaded:
                self.metrics.load_wait.labels(model_id).observe(shaper.load_seconds)
            handle = await release.enter_async_context(self.fleet.generation(hosted, plan.params, request_id))
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await release.aclose()
            if isinstance(exc, Unavailable | DoesNotFit):
                self.metrics.requests.labels(model_id, endpoint, "rejected").inc()
            raise
        return GenerationResponse(
            self.fleet,
            self.metrics,
            hosted,
            handle,
            release,
            shaper,
            stream=plan.stream,
            endpoint=endpoint,
            started=started,
        )

    def planned(self, hosted_id: str, endpoint: str, make: Callable[[], T]) -> T:
        """``make()``, with a refused request counted as the route's bad request."""
        try:
            return make()
        except InvalidField:
            self.metrics.requests.labels(hosted_id, endpoint, "bad_request").inc()
            raise

    async def embed(
        self,
        model_id: str,
        inputs: Sequence[EmbedParams | TokenizerWork],
        request_id: str,
        endpoint: str,
        keep_alive: float | None = None,
    ) -> list[Chunk]:
        """Each input's final chunk (an embedding's vector, a tokenizer question's answer), in order;
        ``GenerationFailed`` when one fails.

        Inputs go to the runner at most ``parallel`` at a time, so a long list waits its turn instead of overflowing
        the queue; each is a task like any generation (deadlines, cancel, a runner's death reported with its cause).
        """
        async with self.scheduler.lease(model_id, keep_alive) as hosted:
            return await self._embed(hosted, inputs, request_id, endpoint)

    async def _embed(
        self, hosted: Hosted, inputs: Sequence[EmbedParams | TokenizerWork], request_id: str, endpoint: str
    ) -> list[Chunk]:
        started = time.monotonic()
        results: list[Chunk | None] = [None] * len(inputs)
        outcome = "failed"
        limiter = anyio.Semaphore(max(hosted.parallel, 1))
        prompt_tokens = 0

        async def one(i: int, params: EmbedParams | TokenizerWork) -> None:
            nonlocal prompt_tokens
            async with limiter, self.fleet.generation(hosted, params, f"{request_id}-{i}") as handle:
                request_error: str | None = None
                while True:
                    event = await next_event(handle)
                    if isinstance(event, ErrorChunk):
                        request_error = event.message
                    elif isinstance(event, Chunk):
                        if event.finish_reason is not None:
                            results[i] = event
                            prompt_tokens += event.prompt_tokens
                    elif event.state is TaskState.COMPLETE and results[i] is not None:
                        return
                    else:
                        raise GenerationFailed(failure_of(event, request_error, 0))

        try:
            try:
                async with anyio.create_task_group() as tg:
                    for i, params in enumerate(inputs):
                        tg.start_soon(one, i, params)
            except BaseExceptionGroup as group:  # the first failure speaks for the request
                first = group.exceptions[0]
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                if isinstance(first, GenerationFailed):
                    outcome = first.answer.outcome
                elif isinstance(first, Unavailable):
                    outcome = "rejected"
                raise first from None
            outcome = "complete"
        finally:
            m = self.metrics
            m.requests.labels(hosted.id, endpoint, outcome).inc()
            m.tokens.labels(hosted.id, "prompt").inc(prompt_tokens)
            m.duration.labels(hosted.id).observe(time.monotonic() - started)
        return [chunk for chunk in results if chunk is not None]
