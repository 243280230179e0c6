"""The ASGI app of a serving worker, assembled: one route table (the operator's routes, every dialect's, the
dashboard's) registered with FastAPI and written into ``/openapi.json``, one exception handler answering through
``statuses``' table, and the guard in front of it all."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from tether.errors import TetherError
from tether.fleet.scheduler import Scheduler
from tether.node.output import default_log_dir
from tether.node.upkeep import Upkeep
from tether.serve import admin, dashboard, schema, views
from tether.serve.dialects import embeddings, ollama, openai, responses, tokenizer
from tether.serve.generation import Api
from tether.serve.guard import Guard, Policy
from tether.serve.metrics import Metrics
from tether.serve.routes import Route
from tether.serve.statuses import Answer, answer_for

log = logging.getLogger("tether.api")
_CODES = {404: "not_found", 405: "method_not_allowed"}


def route_table(api: Api, logs: Path, cluster: views.ClusterView | None) -> list[Route]:
    """Every route the app serves, in the order they match."""
    return [
        *openai.routes(api),
        *embeddings.routes(api),
        *tokenizer.routes(api),
        *responses.routes(api),
        *ollama.routes(api),
        *dashboard.routes(),  # `/`: the page for a browser, Ollama's probe answer for anything else
        *admin.routes(api, logs, cluster),
    ]


def create_app(
    scheduler: Scheduler,
    policy: Policy | None = None,
    *,
    cluster: views.ClusterView | None = None,
    log_dir: Path | None = None,
    upkeep: Upkeep | None = None,
) -> Guard:
    """The ASGI app for ``scheduler`` and its fleet (which the caller owns: the app starts and stops instances only
    when asked, or when the scheduler loads, unloads and evicts models), behind the guard of ``policy`` (default:
    a loopback listener's, no key). Runner logs are read from ``log_dir`` (default: this worker's) and nowhere else.
    ``upkeep``'s collections, when given, are observed in ``/metrics``.
    """
    policy = policy if policy is not None else Policy()
    logs = (log_dir if log_dir is not None else default_log_dir()).resolve()
    app = FastAPI(title="tether", docs_url=None, redoc_url=None, openapi_url=None)
    fleet = scheduler.fleet
    metrics = Metrics(fleet, scheduler)
    for hosted in fleet.list():  # instances added before the app existed
        metrics.watch(hosted)
    if upkeep is not None:
        metrics.watch_upkeep(upkeep)
    app.state.metrics = metrics
    api = Api(scheduler, metrics)

    document = b""

    async def openapi_json() -> Response:
        return Response(document, media_type="application/json")

    table = route_table(api, logs, cluster)
    whole = {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}
    table.append(
        Route(path="/openapi.json", method="GET", endpoint=openapi_json, summary="this document", answers=whole)
    )
    for route in table:
        methods = [route.method, "HEAD"] if route.head else [route.method]
        app.add_api_route(route.path, route.endpoint, methods=methods, include_in_schema=False)
    document = views.encode(schema.openapi(table, auth=policy.api_key is not None))

    @app.exception_handler(TetherError)
    async def answer(request: Request, exc: TetherError) -> Response:
        """Every error of tether's a route raises, answered by ``statuses``' table in the route's shape."""
        found = answer_for(exc)
        if found is None:
            return await unexpected(request, exc)
        return found.response(request.url.path)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, _: ClientDisconnect) -> Response:
        """The client left while its body was arriving: nobody to answer, nothing started, nothing to log but that.
        (Unhandled, it reached uvicorn as an "Exception in ASGI application" traceback.) 499 is nginx's name for it,
        seen only in the access log."""
        log.info("%s %s: the client closed the connection before its body arrived", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error in the API", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return Answer(500, "server_error", "internal_error", message).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Starlette's own answers (no such route, a method a route does not take) in the route's error shape."""
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
        code = _CODES.get(exc.status_code)
        return Answer(exc.status_code, "invalid_request_error", code, message).response(request.url.path, headers)

    guard = Guard(app, policy)
    guard.listeners.add(lambda refusal: metrics.guard_refusals.labels(refusal.reason).inc())
    return guard
