"""The HTTP API of a serving worker: OpenAI-compatible generation, instance admin, probes, metrics, its schema.

Every generation is answered with exactly one outcome. The response waits for the first token (or the end) before
it picks its status, so a request the runner refuses is a 400 and a runner that dies before answering is a 500 with
the cause; once streaming, a runner failure ends the stream with an error event carrying the cause (never with
``[DONE]``: a truncated answer never looks like a success). A client that disconnects cancels its generation: each
response watches the connection for ``http.disconnect`` while it waits for tokens.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

import tether
from tether.errors import (
    DoesNotFit,
    EngineImportRefused,
    InstanceExists,
    InvalidField,
    NotFound,
    TetherError,
    Unavailable,
)
from tether.fleet.fleet import Fleet, Hosted, InstanceConfig, new_request_id
from tether.fleet.scheduler import Scheduler, scheduler_json
from tether.node.instance import Instance, InstanceReady, InstanceRestarting
from tether.node.memory import NodeMemory
from tether.node.output import default_log_dir
from tether.node.ranks import RankGroup
from tether.node.tasks import TaskHandle
from tether.protocol import Chunk, ErrorChunk, GenerateParams, TaskState, TaskStatus, tag_of
from tether.serve import dashboard, schema
from tether.serve.dialects import embeddings, ollama, openai, responses
from tether.serve.guard import BodyTooLarge, Guard, Policy, too_large
from tether.serve.metrics import CONTENT_TYPE, Metrics
from tether.serve.shaping import Failure, Shaper, cause_json, failure_of

log = logging.getLogger("tether.api")


class ClusterView(Protocol):
    """The Ray cluster's nodes, agents and events (``tether.cluster.coordinator.Cluster``), for GET /v1/instances."""

    def view(self) -> dict[str, Any]: ...


LOG_LINES = 2000  # the most lines one read of a runner's log returns
LOG_TAIL_BYTES = 1 << 20  # and the most bytes it reads, from the end
_encode = msgspec.json.Encoder().encode
_instance_decoder = msgspec.json.Decoder(InstanceConfig)
_CODES = {404: "not_found", 405: "method_not_allowed"}
T = TypeVar("T")


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json", headers=headers)


def _error(status: int, message: str, type_: str, *, code: str | None = None, **extra: Any) -> Response:
    headers = None
    retry_after = extra.pop("retry_after", None)
    if retry_after is not None:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))}
    body = openai.error_body(message, type_, code=code, **extra)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


# --------------------------------------------------------------------------------------------------------------
# A generation's response
# --------------------------------------------------------------------------------------------------------------


async def next_event(handle: TaskHandle) -> Chunk | TaskStatus | ErrorChunk:
    """A task's next event that matters to a client: a chunk, a request error, or the terminal status."""
    while True:
        event = await handle.__anext__()
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
        handle: TaskHandle,
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
        self.first_token_at: float | None = None

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
        started_stream = False
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
                    self.completion_tokens = event.completion_tokens or self.completion_tokens
                piece = shaper.feed(event)
                if not self.stream:
                    continue
                if not started_stream:  # the status is decided: the first token is out
                    await self._start(send, 200, shaper.media_type)
                    started_stream = True
                    await self._body(send, shaper.opening())
                if piece:
                    await self._body(send, piece)
                continue
            # The terminal status.
            self.outcome = event.state.value
            if event.state is TaskState.COMPLETE:
                reason = "length" if finish == "length" else "stop"
                if self.stream:
                    if not started_stream:
                        await self._start(send, 200, shaper.media_type)
                        await self._body(send, shaper.opening())
                    await self._body(send, shaper.closing(reason, self.prompt_tokens, self.completion_tokens), False)
                else:
                    body = shaper.whole(reason, self.prompt_tokens, self.completion_tokens)
                    await self._whole(send, 200, body)
                return
            failure = failure_of(event, request_error, self.completion_tokens)
            self.outcome = failure.outcome
            if started_stream:
                await self._body(send, shaper.stream_error(failure), more=False)
            else:
                await self._whole(send, failure.status, shaper.error_body(failure))
            return

    async def _start(self, send: Send, status: int, media_type: str) -> None:
        headers = [(b"content-type", media_type.encode()), (b"x-request-id", self.handle.task_id.encode())]
        if media_type != "application/json":  # a stream (SSE, NDJSON): no cache, and no proxy buffering it
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, send: Send, data: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def _whole(self, send: Send, status: int, body: bytes) -> None:
        await self._start(send, status, "application/json")
        await self._body(send, body, more=False)

    def _record(self) -> None:
        m, instance = self.metrics, self.hosted.id
        m.requests.labels(instance, self.endpoint, self.outcome).inc()
        m.tokens.labels(instance, "prompt").inc(self.prompt_tokens)
        m.tokens.labels(instance, "completion").inc(self.completion_tokens)
        if self.first_token_at is not None:
            m.ttft.labels(instance).observe(self.first_token_at - self.started)
        m.duration.labels(instance).observe(time.monotonic() - self.started)


class GenerationFailed(TetherError):
    """A request that did not complete (an embedding's runner failed, say): its ``Failure``, for any dialect."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


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
        self, model_id: str, plan: openai.Plan, shaper: Shaper, request_id: str, endpoint: str, started: float
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
        inputs: list[GenerateParams],
        request_id: str,
        endpoint: str,
        keep_alive: float | None = None,
    ) -> list[Chunk]:
        """Each input's final chunk (its ``embedding`` set), in order; ``GenerationFailed`` when one fails.

        Inputs go to the runner at most ``parallel`` at a time, so a long list waits its turn instead of overflowing
        the queue; each is a task like any generation (deadlines, cancel, a runner's death reported with its cause).
        """
        async with self.scheduler.lease(model_id, keep_alive) as hosted:
            return await self._embed(hosted, inputs, request_id, endpoint)

    async def _embed(self, hosted: Hosted, inputs: list[GenerateParams], request_id: str, endpoint: str) -> list[Chunk]:
        started = time.monotonic()
        results: list[Chunk | None] = [None] * len(inputs)
        outcome = "failed"
        limiter = anyio.Semaphore(max(hosted.parallel, 1))
        prompt_tokens = 0

        async def one(i: int, params: GenerateParams) -> None:
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
                    outcome = first.failure.outcome
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


# --------------------------------------------------------------------------------------------------------------
# JSON views of the fleet
# --------------------------------------------------------------------------------------------------------------


def _queue(hosted: Hosted) -> dict[str, int]:
    running, waiting = hosted.generations()
    return {
        "running": running,
        "waiting": waiting,
        "in_flight": hosted.in_flight,
        "parallel": hosted.parallel,
        "max_queue": hosted.config.max_queue,
        "limit": hosted.limit,
    }


def instance_json(hosted: Hosted) -> dict[str, Any]:
    inst = hosted.instance
    state = inst.state
    sup = hosted.supervisor
    runner: dict[str, Any] | None = None
    if sup is not None and sup.pid is not None:
        memory = sup.footprint
        runner = {
            "pid": sup.pid,
            "status": tag_of(sup.status),
            # footprint: what killing the group frees (anonymous + shmem + swap + GPU), beside the raw figures
            "memory": {"footprint": memory.footprint, **msgspec.to_builtins(memory)} if memory is not None else None,
            "log": str(sup.output_log) if sup.output_log else None,
            "cgroup": str(sup.cgroup) if sup.cgroup is not None else None,
            "node": sup.node,
        }
    cause = inst.cause
    return {
        "id": hosted.id,
        "object": "instance",
        "created": int(hosted.created_at),
        "engine": hosted.instance.spec.engine,
        "model": hosted.config.model,
        "options": hosted.config.options,
        "state": tag_of(state),
        "detail": msgspec.to_builtins(state),
        "reason": inst.unavailable_reason(),
        "ready": isinstance(state, InstanceReady),
        "runner": runner,
        "pids": list(inst.pids),
        "restarts": inst.restarts,
        "failures": {kind.value: count for kind, count in inst.failures.items()},  # every failed life, by cause
        "queue": _queue(hosted),
        "cause": cause_json(cause) if cause is not None else None,
        "history": [
            {
                "at": f.at,
                "life": f.life,
                "pid": f.pid,
                "detected_in": f.detected_in,
                "cause": cause_json(f.cause),
                "log": f.log,
            }
            for f in inst.history
        ],
        "life": _life(state),
        "backoff_remaining": (  # seconds until a restarting instance's next life starts
            round(max(state.resume_at - time.monotonic(), 0.0), 2) if isinstance(state, InstanceRestarting) else None
        ),
        "tokens": hosted.tokens(),  # completion tokens so far: two reads give tokens/s
        "fit": inst.fit.message if inst.fit is not None else None,
        "measured": inst.measured.describe() if inst.measured is not None else None,
        "restart": msgspec.to_builtins(hosted.config.restart),
        "deadlines": msgspec.to_builtins(hosted.config.deadlines),
        "replicas": [_replica(r, hosted.serving.get(r, 0)) for r in hosted.replicas],
        "spread": hosted.config.spread,
        # A multi-rank instance's ranks now (address, node, pid, status); requests go to rank 0.
        "ranks": sup.ranks() if isinstance(sup, RankGroup) else None,
    }


def _life(state: Any) -> int | None:
    return getattr(state, "life", None)


def node_json(memory: NodeMemory, started_at: float) -> dict[str, Any]:
    """This machine as the dashboard and ``tether status`` show it: the worker, and memory as tether measures it."""
    return {
        "pid": os.getpid(),
        "version": tether.__version__,
        "uptime": round(time.time() - started_at, 1),
        "memory": {
            "available": memory.available,
            "total": memory.cgroup_limit if memory.cgroup_limit is not None else memory.host_total,
            "source": memory.source,
            "host_total": memory.host_total,
            "host_available": memory.host_available,
        },
        "gpus": [{"index": g.index, "name": g.name, "used": g.total - g.free, "total": g.total} for g in memory.gpus]
        or None,
        "gpu_reason": memory.gpu_reason,
    }


class LogOutside(TetherError):
    """A log path that is not a regular file inside the worker's log directory (a symlink out of it, say)."""


def read_log(path: Path, lines: int, root: Path) -> tuple[list[str], bool]:
    """The last ``lines`` lines of a log file inside ``root`` (reading at most ``LOG_TAIL_BYTES`` from its end), and
    whether there was more before them. ``LogOutside`` when the path, its symlinks followed, leaves ``root`` or is
    no regular file: a request reads runner logs, nothing else on the disk."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise LogOutside(f"{path} is not inside the log directory {root}")
    fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # swapped for a symlink since: refused
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LogOutside(f"{path} is not a regular file")
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - LOG_TAIL_BYTES, 0))
        text = f.read().decode(errors="replace")
    found = text.splitlines()
    if size > LOG_TAIL_BYTES:
        found = found[1:]  # the first line read is likely cut
    return found[-lines:], size > LOG_TAIL_BYTES or len(found) > lines


def _replica(inst: Instance, serving: int) -> dict[str, Any]:
    sup = inst.supervisor
    return {
        "name": inst.name,
        "state": tag_of(inst.state),
        "node": sup.node if sup is not None else None,
        "pid": sup.pid if sup is not None else None,
        "serving": serving,
        "restarts": inst.restarts,
        "cause": cause_json(inst.cause) if inst.cause is not None else None,
    }


# --------------------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------------------


def create_app(
    scheduler: Scheduler,
    policy: Policy | None = None,
    *,
    cluster: ClusterView | None = None,
    log_dir: Path | None = None,
) -> Guard:
    """The ASGI app for ``scheduler`` and its fleet (which the caller owns: the app starts and stops instances only
    when asked, or when the scheduler loads, unloads and evicts models), behind the guard of ``policy`` (default:
    a loopback listener's, no key). Runner logs are read from ``log_dir`` (default: this worker's) and nowhere else.
    """
    policy = policy if policy is not None else Policy()
    logs = (log_dir if log_dir is not None else default_log_dir()).resolve()
    app = FastAPI(title="tether", docs_url=None, redoc_url=None, openapi_url=None)
    fleet = scheduler.fleet
    metrics = Metrics(fleet, scheduler)
    for hosted in fleet.list():  # instances added before the app existed
        metrics.watch(hosted)
    app.state.metrics = metrics

    # Errors map to responses by their type, and an invalid field's name becomes the error's ``param``.
    @app.exception_handler(InvalidField)
    async def invalid(_: Request, exc: InvalidField) -> Response:
        return _error(400, str(exc), "invalid_request_error", code="invalid_request", param=exc.field)

    @app.exception_handler(InstanceExists)
    async def exists(_: Request, exc: InstanceExists) -> Response:
        return _error(409, str(exc), "invalid_request_error", code="instance_exists", param="id")

    @app.exception_handler(DoesNotFit)
    async def does_not_fit(_: Request, exc: DoesNotFit) -> Response:
        extra: dict[str, Any] = {"nodes": list(exc.result.nodes)} if exc.result.nodes else {}
        return _error(507, str(exc), "insufficient_memory", code="does_not_fit", **extra)

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> Response:
        return _error(404, str(exc), "invalid_request_error", code="not_found")

    @app.exception_handler(Unavailable)
    async def unavailable(_: Request, exc: Unavailable) -> Response:
        extra: dict[str, Any] = {"retry_after": exc.retry_after}
        if exc.cause is not None:
            extra["cause"] = cause_json(exc.cause)
        return _error(503, str(exc), "server_error", code="unavailable", **extra)

    @app.exception_handler(GenerationFailed)
    async def generation_failed(_: Request, exc: GenerationFailed) -> Response:
        f = exc.failure
        return _error(f.status, f.message, f.type, code=f.code, **f.extra)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, _: ClientDisconnect) -> Response:
        """The client left while its body was arriving: nobody to answer, nothing started, nothing to log but that.
        (Unhandled, it reached uvicorn as an "Exception in ASGI application" traceback.) 499 is nginx's name for it,
        seen only in the access log."""
        log.info("%s %s: the client closed the connection before its body arrived", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(request: Request, exc: BodyTooLarge) -> Response:
        return too_large(request.url.path, exc)

    @app.exception_handler(EngineImportRefused)
    async def import_refused(_: Request, exc: EngineImportRefused) -> Response:
        return _error(403, str(exc), "permission_error", code="engine_import_disabled", param=exc.field)

    api = Api(scheduler, metrics)
    respond, planned = api.respond, api.planned

    async def generate(request: Request, kind: Literal["chat", "completion"]) -> Response:
        started = time.monotonic()
        endpoint = "chat" if kind == "chat" else "completions"
        body = openai.decode(kind, await request.body())
        model_id = scheduler.resolve(body.model)
        plan = planned(model_id, endpoint, lambda: openai.plan(body))
        request_id = new_request_id("chatcmpl" if kind == "chat" else "cmpl")
        shaper = openai.Shaper(kind, request_id, model_id, plan)
        return await respond(model_id, plan, shaper, request_id, endpoint, started)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        body = embeddings.decode(await request.body())
        model_id = scheduler.resolve(body.model)
        inputs = planned(model_id, "embeddings", lambda: embeddings.inputs(body))
        chunks = await api.embed(model_id, inputs, new_request_id("embd"), "embeddings")
        return Response(embeddings.body(chunks, model_id, body.encoding_format), media_type="application/json")

    # Other dialects: each module adds its routes, answering through ``api`` (one line each, here).
    responses.routes(app, api)
    ollama.routes(app, api)
    dashboard.routes(app)  # `/`: the page for a browser, Ollama's probe answer for anything else

    async def model_json(model_id: str) -> dict[str, Any]:
        """A model as OpenAI lists it, with what tether knows beside: its state, footprint or estimate, keep-alive."""
        slot = scheduler.slots.get(model_id)
        hosted = fleet.get(model_id) if slot is None else slot.hosted
        created = int(hosted.created_at if hosted is not None else scheduler.started_at)
        entry: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "tether"}
        sup = hosted.supervisor if hosted is not None else None
        if sup is not None and sup.alive:
            await sup.sample_memory()
        if slot is not None:
            await scheduler.estimate(slot)
            entry.update(scheduler.view(slot))
        elif hosted is not None:
            memory = sup.footprint if sup is not None and sup.alive else None
            entry.update(
                state="loaded" if isinstance(hosted.instance.state, InstanceReady) else tag_of(hosted.instance.state),
                engine=hosted.instance.spec.engine,
                model=hosted.config.model,
                pinned=True,  # added through POST /v1/instances: it stays until it is deleted
                footprint=memory.footprint if memory is not None else None,
            )
        return entry

    @app.get("/v1/models")
    async def models() -> Response:
        data = []
        for name in scheduler.names():
            with contextlib.suppress(NotFound):  # an instance deleted while the list was read
                data.append(await model_json(name))
        return _json({"object": "list", "data": data})

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> Response:
        try:
            return _json(await model_json(scheduler.resolve_exact(model_id)))
        except NotFound:
            served = ", ".join(scheduler.names()) or "none"
            message = f"model {model_id!r} is not served here; models: {served}"
            return _error(404, message, "invalid_request_error", code="model_not_found", param="model")

    @app.post("/v1/instances")
    async def add_instance(request: Request) -> Response:
        config = openai.decode_body(_instance_decoder, await request.body(), "instance")
        try:
            hosted = await scheduler.add_instance(config)
        except InvalidField as exc:  # of the instance, not of a generation request: its own code
            return _error(400, str(exc), "invalid_request_error", code="invalid_instance", param=exc.field)
        return _json(instance_json(hosted), status=201)

    async def fresh(hosted: Hosted) -> dict[str, Any]:
        """The instance with its runner's memory sampled now (tens of µs), not up to a sampling interval old, and the
        requests it serves now."""
        sup = hosted.supervisor
        if sup is not None and sup.alive:
            await sup.sample_memory()
        return {**instance_json(hosted), "in_flight_requests": fleet.in_flight(hosted)}

    @app.get("/v1/instances")
    async def list_instances() -> Response:
        memory = await anyio.to_thread.run_sync(scheduler.memory)
        return _json(
            {
                "object": "list",
                "data": [await fresh(h) for h in fleet.list()],
                "node": node_json(memory, scheduler.started_at),
                "scheduler": scheduler_json(scheduler),
                **({"cluster": cluster.view()} if cluster is not None else {}),
            }
        )

    @app.get("/v1/instances/{instance_id}/log")
    async def instance_log(instance_id: str, request: Request) -> Response:
        """The runner log of one life of an instance (its current one by default): the last ``lines`` lines."""
        query = request.query_params
        numbers: dict[str, int | None] = {"life": None, "lines": 200}
        for name in numbers:
            raw = query.get(name)
            if raw is None:
                continue
            try:
                numbers[name] = int(raw)
            except ValueError:
                message = f"{name} must be an integer, got {raw!r}"
                return _error(400, message, "invalid_request_error", code="invalid_request", param=name)
        life, lines = numbers["life"], numbers["lines"] or 0
        hosted = fleet.get(instance_id)
        inst = hosted.instance
        current = _life(inst.state)
        wanted = current if life is None else life
        path: str | None = None
        if wanted is not None and wanted == current and hosted.supervisor is not None:
            log_path = hosted.supervisor.output_log
            path = str(log_path) if log_path is not None else None
        else:
            path = next((f.log for f in inst.history if f.life == wanted), None)
        lives = sorted({f.life for f in inst.history} | ({current} if current is not None else set()))
        if path is None:
            message = f"no log for life {wanted} of {instance_id}: lives with a log are {lives or 'none'}"
            return _error(404, message, "invalid_request_error", code="not_found", param="life")
        if not 1 <= lines <= LOG_LINES:
            return _error(
                400, f"lines must be in [1, {LOG_LINES}], got {lines}", "invalid_request_error", param="lines"
            )
        node = hosted.supervisor.node if hosted.supervisor is not None else None
        where = f" (the runner ran on node {node[:8]}: its log is on that node)" if node else ""
        try:
            found, truncated = await anyio.to_thread.run_sync(read_log, Path(path), lines, logs)
        except LogOutside as exc:
            if node:  # another node's log directory: not readable from here
                message = f"cannot read the log of life {wanted} of {instance_id} at {path}{where}"
                return _error(404, message, "invalid_request_error", code="not_found")
            log.warning("refused to read %s for the log of %s: %s", path, instance_id, exc)
            message = (
                f"refused to read the log of life {wanted} of {instance_id}: {exc}; a request reads runner logs in "
                "this worker's log directory only (was the file replaced by a link?)"
            )
            return _error(403, message, "permission_error", code="log_outside")
        except OSError as exc:
            message = f"cannot read the log of life {wanted} of {instance_id} at {path}{where}: {exc.strerror or exc}"
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the log became a symlink after it was checked
                return _error(403, message, "permission_error", code="log_outside")
            return _error(404, message, "invalid_request_error", code="not_found")
        return _json({"id": instance_id, "life": wanted, "path": path, "lines": found, "truncated": truncated})

    @app.get("/v1/instances/{instance_id}")
    async def get_instance(instance_id: str) -> Response:
        return _json(await fresh(fleet.get(instance_id)))

    @app.delete("/v1/instances/{instance_id}")
    async def delete_instance(instance_id: str) -> Response:
        hosted = await scheduler.remove(instance_id)
        return _json({"id": hosted.id, "object": "instance", "deleted": True, "state": tag_of(hosted.instance.state)})

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel_request(request_id: str) -> Response:
        reply = await fleet.cancel(request_id)
        state = reply.state.value if reply.state is not None else None
        return _json({"id": request_id, "outcome": reply.outcome, "detail": reply.detail, "state": state})

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        states = {h.id: tag_of(h.instance.state) for h in fleet.list()}
        ready = any(state == "ready" for state in states.values())
        return _json({"ready": ready, "instances": states}, status=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    document = _encode(schema.openapi(auth=policy.api_key is not None))

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return Response(document, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Starlette's own answers (no such route, a method a route does not take) in OpenAI's error shape."""
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            message = f"no route {request.url.path}: GET /openapi.json lists the routes"
        elif exc.status_code == 405:  # Starlette names only the first route of the path: name every method it takes
            methods: set[str] = set()
            for route in app.router.routes:
                if route.matches(request.scope)[0] is Match.PARTIAL:
                    methods |= getattr(route, "methods", None) or set()
            headers["Allow"] = ", ".join(sorted(methods - {"HEAD"})) or headers.get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
        else:
            message = str(exc.detail)
        reply = _error(exc.status_code, message, "invalid_request_error", code=_CODES.get(exc.status_code))
        reply.headers.update(headers)
        return reply

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error in the API")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", code="internal_error")

    guard = Guard(app, policy)
    guard.listeners.add(lambda refusal: metrics.guard_refusals.labels(refusal.reason).inc())
    return guard
