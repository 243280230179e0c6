"""The operator's routes: instances (start, list, read, stop, their runner logs), cancelling a request by id,
probes and metrics. Every answer is a ``views`` struct; every error an ``Answer`` from ``statuses``."""

from __future__ import annotations

import errno
import logging
import os
import stat
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import Response

from tether import env
from tether.errors import InvalidField, TetherError
from tether.fleet.fleet import Hosted, InstanceConfig
from tether.protocol import tag_of
from tether.serve import views
from tether.serve.dialects.plan import decode_body
from tether.serve.generation import Api
from tether.serve.metrics import CONTENT_TYPE
from tether.serve.routes import Route, json_answer, json_response, path_parameter, text_answer
from tether.serve.statuses import Answer
from tether.serve.tracing import TRACE_TOP, TRACE_TOP_LIMIT, TraceSnapshots, tracing_wanted

log = logging.getLogger("tether.api")

LOG_LINES = 2000  # the most lines one read of a runner's log returns
LOG_TAIL_BYTES = 1 << 20  # and the most bytes it reads, from the end
_instance_decoder = msgspec.json.Decoder(InstanceConfig)


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


def _bad(param: str, message: str) -> Response:
    return Answer(400, "invalid_request_error", "invalid_request", message, param).response("/v1/instances")


def _not_found(message: str, param: str | None = None) -> Response:
    return Answer(404, "invalid_request_error", "not_found", message, param).response("/v1/instances")


def _log_outside(message: str) -> Response:
    return Answer(403, "permission_error", "log_outside", message).response("/v1/instances")


LOG_QUERY: tuple[dict[str, Any], ...] = (
    {"name": "life", "in": "query", "required": False, "schema": {"type": "integer"}},
    {
        "name": "lines",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": LOG_LINES, "default": 200},
    },
)


def routes(api: Api, logs: Path, cluster: views.ClusterView | None) -> list[Route]:
    """The operator's routes over ``api``'s fleet; runner logs are read from ``logs`` and nowhere else."""
    return Admin(api, logs, cluster).routes()


class Admin:
    """The operator's handlers, one method each, over ``api``'s fleet, and the table that routes to them."""

    def __init__(self, api: Api, logs: Path, cluster: views.ClusterView | None) -> None:
        self.scheduler, self.fleet, self.metrics = api.scheduler, api.fleet, api.metrics
        self.logs = logs
        self.cluster = cluster
        self.traces = TraceSnapshots(logs / "tracemalloc")

    def routes(self) -> list[Route]:
        instance = (path_parameter("instance_id"),)
        debug: list[Route] = []
        if tracing_wanted() and tracemalloc.is_tracing():  # off by default: no route, no cost
            debug.append(
                Route(
                    path="/v1/debug/tracemalloc",
                    method="POST",
                    endpoint=self.tracemalloc_snapshot,
                    summary="snapshot the worker's traced allocations; what grew since the baseline, by traceback",
                    answers={"200": {"description": "the snapshot and the top growth"}},
                    errors=(400,),
                    documented=False,  # a debugging aid the operator turns on (TETHER_TRACEMALLOC=1), not the API
                )
            )
        return [
            *debug,
            Route(
                path="/v1/instances",
                method="POST",
                endpoint=self.add_instance,
                summary="start an instance (it loads in the background)",
                answers={"201": json_answer(views.InstanceOut, "created; loading")},
                errors=(400, 409, 413, 507),
                body=InstanceConfig,
            ),
            Route(
                path="/v1/instances",
                method="GET",
                endpoint=self.list_instances,
                summary="every instance, the node, the scheduler (and the cluster, on Ray)",
                answers={"200": json_answer(views.InstanceList, "the instances")},
            ),
            Route(
                path="/v1/instances/{instance_id}/log",
                method="GET",
                endpoint=self.instance_log,
                summary="the last lines of a life's runner log (the current life unless ``life`` names another)",
                answers={"200": json_answer(views.RunnerLog, "its lines")},
                errors=(400, 404),
                parameters=(*instance, *LOG_QUERY),
            ),
            Route(
                path="/v1/instances/{instance_id}",
                method="GET",
                endpoint=self.get_instance,
                summary="one instance, its runner's memory sampled now",
                answers={"200": json_answer(views.InstanceOut, "the instance")},
                errors=(404,),
                parameters=instance,
            ),
            Route(
                path="/v1/instances/{instance_id}",
                method="DELETE",
                endpoint=self.delete_instance,
                summary="stop an instance (its requests end cancelled) and remove it",
                answers={"200": json_answer(views.Deleted, "stopped and removed")},
                errors=(404,),
                parameters=instance,
            ),
            Route(
                path="/v1/requests/{request_id}/cancel",
                method="POST",
                endpoint=self.cancel_request,
                summary="cancel a generation by its id (the response's ``id`` and ``x-request-id``)",
                answers={"200": json_answer(views.CancelOut, "what the cancel did")},
                parameters=(path_parameter("request_id"),),
            ),
            Route(
                path="/healthz",
                method="GET",
                endpoint=self.healthz,
                summary="liveness",
                answers={"200": json_answer(views.Health, "the worker answers")},
            ),
            Route(
                path="/readyz",
                method="GET",
                endpoint=self.readyz,
                summary="readiness: 200 when an instance is ready",
                answers={
                    "200": json_answer(views.Readiness, "an instance is ready"),
                    "503": json_answer(views.Readiness, "no instance is ready"),
                },
            ),
            Route(
                path="/metrics",
                method="GET",
                endpoint=self.prometheus,
                summary="Prometheus metrics",
                answers={"200": text_answer("text exposition")},
            ),
        ]

    # --- instances ---------------------------------------------------------------------------------------------

    async def add_instance(self, request: Request) -> Response:
        config = decode_body(_instance_decoder, await request.body(), "instance")
        try:
            hosted = await self.scheduler.add_instance(config)
        except InvalidField as exc:  # of the instance, not of a generation request: its own code
            refused = Answer(400, "invalid_request_error", "invalid_instance", str(exc), exc.field)
            return refused.response("/v1/instances")
        return json_response(views.instance_out(hosted), status=201)

    async def list_instances(self) -> Response:
        memory = await anyio.to_thread.run_sync(self.scheduler.memory)
        return json_response(
            views.InstanceList(
                object="list",
                data=[await self.fresh(h) for h in self.fleet.list()],
                node=views.node_out(memory, self.scheduler.started_at),
                scheduler=views.scheduler_out(self.scheduler),
                cluster=views.cluster_out(self.cluster) if self.cluster is not None else msgspec.UNSET,
            )
        )

    async def get_instance(self, instance_id: str) -> Response:
        return json_response(await self.fresh(self.fleet.get(instance_id)))

    async def delete_instance(self, instance_id: str) -> Response:
        hosted = await self.scheduler.remove(instance_id)
        state = tag_of(hosted.instance.state)
        return json_response(views.Deleted(id=hosted.id, object="instance", deleted=True, state=state))

    async def fresh(self, hosted: Hosted) -> views.InstanceOut:
        """The instance with its runner's memory sampled now (tens of µs), not up to a sampling interval old, and
        the requests it serves now."""
        sup = hosted.supervisor
        if sup is not None and sup.alive:
            await sup.sample_memory()
        return views.instance_out(hosted, msgspec.convert(self.fleet.in_flight(hosted), list[views.RequestOut]))

    # --- runner logs -------------------------------------------------------------------------------------------

    async def instance_log(self, instance_id: str, request: Request) -> Response:
        """The runner log of one life of an instance (its current one by default): the last ``lines`` lines."""
        numbers = _integers(request, {"life": None, "lines": 200})
        if isinstance(numbers, Response):
            return numbers
        life, lines = numbers["life"], numbers["lines"] or 0
        hosted = self.fleet.get(instance_id)
        wanted, path, lives = _log_of(hosted, life)
        if path is None or wanted is None:
            message = f"no log for life {wanted} of {instance_id}: lives with a log are {lives or 'none'}"
            return _not_found(message, "life")
        if not 1 <= lines <= LOG_LINES:
            return _bad("lines", f"lines must be in [1, {LOG_LINES}], got {lines}")
        node = hosted.supervisor.node if hosted.supervisor is not None else None
        where = f" (the runner ran on node {node[:8]}: its log is on that node)" if node else ""
        try:
            found, truncated = await anyio.to_thread.run_sync(read_log, Path(path), lines, self.logs)
        except LogOutside as exc:
            if node:  # another node's log directory: not readable from here
                return _not_found(f"cannot read the log of life {wanted} of {instance_id} at {path}{where}")
            log.warning("refused to read %s for the log of %s: %s", path, instance_id, exc)
            return _log_outside(
                f"refused to read the log of life {wanted} of {instance_id}: {exc}; a request reads runner logs in "
                "this worker's log directory only (was the file replaced by a link?)"
            )
        except OSError as exc:
            message = f"cannot read the log of life {wanted} of {instance_id} at {path}{where}: {exc.strerror or exc}"
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the log became a symlink after it was checked
                return _log_outside(message)
            return _not_found(message)
        return json_response(views.RunnerLog(id=instance_id, life=wanted, path=path, lines=found, truncated=truncated))

    # --- requests, probes, metrics -----------------------------------------------------------------------------

    async def cancel_request(self, request_id: str) -> Response:
        reply = await self.fleet.cancel(request_id)
        state = reply.state.value if reply.state is not None else None
        cancelled = reply.outcome == "requested"  # an ended request's cancel is no error: a 200 saying so
        return json_response(
            views.CancelOut(id=request_id, outcome=reply.outcome, detail=reply.detail, state=state, cancelled=cancelled)
        )

    async def healthz(self) -> Response:
        return json_response(views.Health(status="ok"))

    async def readyz(self) -> Response:
        states = {h.id: tag_of(h.instance.state) for h in self.fleet.list()}
        ready = any(state == "ready" for state in states.values())
        return json_response(views.Readiness(ready=ready, instances=states), status=200 if ready else 503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def tracemalloc_snapshot(self, request: Request) -> Response:
        """Snapshot the traced allocations (the first, or ``rebase=1``: the baseline) and answer the ``top``
        tracebacks that grew most since the baseline. The files go where this worker writes its logs, never where
        a request says."""
        query = request.query_params
        raw = query.get("top", str(TRACE_TOP))
        try:
            top = int(raw)
        except ValueError:
            return _bad("top", f"top must be an integer, got {raw!r}")
        if not 1 <= top <= TRACE_TOP_LIMIT:
            return _bad("top", f"top must be in [1, {TRACE_TOP_LIMIT}], got {top}")
        snapshot = await self.traces.take(top, env.flag("rebase", False, query))
        return Response(msgspec.json.encode(snapshot), media_type="application/json")


def _integers(request: Request, defaults: dict[str, int | None]) -> dict[str, int | None] | Response:
    """The query's integers named in ``defaults`` (each absent one its default), or the 400 for one that is not."""
    numbers = dict(defaults)
    for name in numbers:
        raw = request.query_params.get(name)
        if raw is None:
            continue
        try:
            numbers[name] = int(raw)
        except ValueError:
            return _bad(name, f"{name} must be an integer, got {raw!r}")
    return numbers


def _log_of(hosted: Hosted, life: int | None) -> tuple[int | None, str | None, list[int]]:
    """The life wanted (``life``, or the current one), its log's path (None: it has none), and the lives that have
    one (for the message when it has none)."""
    inst = hosted.instance
    current = views.life_of(inst.state)
    wanted = current if life is None else life
    path: str | None = None
    if wanted is not None and wanted == current and hosted.supervisor is not None:
        log_path = hosted.supervisor.output_log
        path = str(log_path) if log_path is not None else None
    else:
        path = next((f.log for f in inst.history if f.life == wanted), None)
    lives = sorted({f.life for f in inst.history} | ({current} if current is not None else set()))
    return wanted, path, lives
