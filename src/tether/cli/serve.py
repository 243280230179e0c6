"""``tether serve``: a worker with its first model loaded, more loaded on demand, and the HTTP API in front of them
(the main job).

The worker owns the fleet and its scheduler (the catalog: ``--models``, ``--catalog``, the built-in default model).
uvicorn serves the app on a socket bound before the model loads (a taken port fails fast, not after a load).
SIGINT/SIGTERM are handled here, not by uvicorn (which would re-raise them after its own shutdown and kill the worker
before its runners are stopped): the server stops accepting, open requests get a short grace, then every instance
stops within its bound, so nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio
import uvicorn

from tether import env
from tether.cli import settings as settings_of
from tether.cli.common import (
    EXIT_CANNOT_BIND,
    EXIT_DOES_NOT_FIT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    deadlines_from,
    declared_only,
    engine_options,
    fail,
    reap_at_start,
)
from tether.cli.settings import ServeSettings
from tether.errors import EngineImportRefused, InvalidField, TetherError, UnknownEngine
from tether.fleet.catalog import (
    DEFAULT_KEEP_ALIVE,
    FOREVER,
    Catalog,
    Model,
    builtin_default,
    catalog_models,
    read_catalog_file,
    scan_models_dir,
)
from tether.fleet.fleet import Fleet, InstanceConfig, Unavailable
from tether.fleet.scheduler import Scheduler, SchedulerSettings
from tether.node.fit import DoesNotFit
from tether.node.instance import InstanceFailed, InstanceReady, InstanceRestarting, InstanceState, RestartPolicy
from tether.node.upkeep import Upkeep, interval_from_env
from tether.serve.app import create_app
from tether.serve.guard import Policy, Refusal, check_host_pattern, check_origin_pattern
from tether.serve.tracing import TRACEMALLOC, start_tracing, tracing_wanted

if TYPE_CHECKING:
    from tether.cluster.coordinator import Cluster  # only with --ray: single-node tether never imports Ray

log = logging.getLogger("tether.serve")
KEEP_ALIVE_S = 30  # seconds an idle keep-alive connection is kept


class _Server(uvicorn.Server):
    """uvicorn without its signal handling: the worker decides how to stop (runners first, then exit)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP. Without it every
    # response after the first on a keep-alive connection waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # Listening now, not when uvicorn starts serving: "listening on" is printed before that, and a client acting
        # on it was refused (over a second with --ray); its connection now waits in the backlog instead.
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def instance_config(settings: ServeSettings) -> InstanceConfig:
    return InstanceConfig(
        id=settings.name,
        engine=settings.engine,
        model=str(settings.model.resolve()) if settings.model else None,
        options=declared_only(engine_options(settings), settings.engine),
        faults=settings.faults,
        restart=RestartPolicy(mode=settings.restart),
        resume=not settings.no_resume,
        deadlines=deadlines_from(settings),
        memory_limit=settings.memory_limit,
        max_queue=settings.max_queue,
        force=settings.force,
        replicas=settings.replicas,
        ranks=settings.ranks,
    )


def build_catalog(settings: ServeSettings, first: InstanceConfig) -> Catalog:
    """The models this worker serves: its first (``first``, loaded at start), the config file's ``[[models]]``, a
    ``--catalog`` file's, every GGUF in ``--models``, and the built-in default model (when installed and not
    catalogued under its id already)."""
    many = settings.models_dir is not None or settings.catalog is not None or bool(settings.models)
    keep = settings.keep_alive
    default_keep = keep if keep is not None else DEFAULT_KEEP_ALIVE if many else FOREVER
    catalog = Catalog([Model(first.default_id(), first, (), default_keep, False, "the command line")])
    if settings.models:
        source = str(settings.config) if settings.config is not None else settings_of.env_name("models")
        tables = {"models": [dict(table) for table in settings.models]}
        for model in catalog_models(tables, source, None, default_keep, settings.allow_engine_import):
            catalog.add(model)
    if settings.catalog is not None:
        for model in read_catalog_file(
            settings.catalog, default_keep, allow_engine_import=settings.allow_engine_import
        ):
            catalog.add(model)
    if settings.models_dir is not None:
        for model in scan_models_dir(settings.models_dir, default_keep, first):
            catalog.add(model)
    builtin = builtin_default(default_keep, first)
    if builtin is not None and catalog.find(builtin.id) is None:
        catalog.add(builtin)
    return catalog


def command(args: argparse.Namespace) -> int:
    try:
        settings = settings_of.load(settings_of.given_flags(args))
    except InvalidField as exc:
        return fail(str(exc), EXIT_USAGE)
    for warning in settings_of.unknown_environment():
        print(f"tether: warning: {warning}", file=sys.stderr)
    if tracing_wanted():  # TETHER_TRACEMALLOC=1: trace from the start, so a snapshot sees every allocation kept
        start_tracing()
        print(f"tether: tracing allocations ({TRACEMALLOC}=1): POST /v1/debug/tracemalloc", file=sys.stderr)
    reap_at_start(settings)
    return anyio.run(serve, settings, args.verbose)


async def serve(settings: ServeSettings, verbose: int = 0) -> int:
    """Run the server until SIGINT/SIGTERM; the exit status says how it ended."""

    api_key = settings.api_key
    if api_key and settings.no_auth:
        return fail(
            "--no-auth and an API key (--api-key or TETHER_API_KEY) contradict each other: pick one", EXIT_USAGE
        )
    try:
        config = instance_config(settings)
        hosts = [check_host_pattern(h) for h in settings.allowed_hosts]
        origins = [check_origin_pattern(o) for o in settings.cors_origins]
        upkeep = Upkeep(interval_from_env())
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    problem = config.check()
    if isinstance(problem, UnknownEngine):
        return fail(str(problem), EXIT_USAGE)
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as exc:
        print(
            f"tether: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}; choose another --port",
            file=sys.stderr,
        )
        return EXIT_CANNOT_BIND
    listen = sock.getsockname()[0]
    policy = Policy(listen, tuple(hosts), tuple(origins), api_key, settings.max_body)
    if not policy.loopback and not api_key:
        if not settings.no_auth:
            sock.close()
            return fail(
                f"refusing to serve {settings.host} (not loopback) without an API key: anyone who can reach this "
                "address could start instances, import engines, read runner logs and use the models. Set --api-key "
                f"KEY (or {env.API_KEY}), or pass --no-auth to serve it open on purpose",
                EXIT_USAGE,
            )
        print(
            f"tether: warning: serving {settings.host} without an API key (--no-auth): anyone who can reach it can "
            "use it",
            file=sys.stderr,
        )
    try:
        catalog = build_catalog(settings, config)
    except (InvalidField, EngineImportRefused) as exc:
        sock.close()
        return fail(str(exc), EXIT_USAGE)
    began = time.monotonic()
    url = f"http://{settings.host}:{sock.getsockname()[1]}"
    async with contextlib.AsyncExitStack() as stack:
        cluster = None
        if settings.ray is not None:
            try:
                cluster = await stack.enter_async_context(ray_cluster(settings))
            except TetherError as exc:
                sock.close()
                return fail(str(exc), EXIT_FAILED)
            nodes = ", ".join(f"{link.short} ({link.host})" for link in cluster.links.values())
            print(f"tether: Ray cluster: node agents on {nodes}", file=sys.stderr, flush=True)
        return await _serve(settings, verbose, sock, catalog, config, url, began, policy, cluster, upkeep)


class _RefusalReport:
    """The first refusal of each Host or Origin, said on stderr (the page that sent it never shows the answer, so
    an operator whose browser client stopped working learns why here); at most ``LIMIT`` lines in all."""

    LIMIT = 32

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def __call__(self, refusal: Refusal) -> None:
        key = (refusal.reason, refusal.value)
        if refusal.reason not in ("host", "origin") or key in self.seen or len(self.seen) >= self.LIMIT:
            return
        self.seen.add(key)
        what = "Host" if refusal.reason == "host" else "Origin"
        flag = "--allowed-hosts" if refusal.reason == "host" else "--cors-origins"
        print(
            f"tether: refused a request with {what} {refusal.value[:200]!r} (first of its kind; counted in "
            f"tether_guard_refusals): allow it with {flag} if it is yours",
            file=sys.stderr,
            flush=True,
        )


def ray_cluster(settings: ServeSettings) -> Cluster:
    """The Ray cluster ``--ray`` names (``local``: start one here), with its node agents."""
    from tether.cluster.coordinator import Cluster, ClusterSettings

    cluster_settings = ClusterSettings(
        address=None if settings.ray == "local" else settings.ray,
        interval=settings.heartbeat_interval,
        lost_after=settings.lost_after,
        lease=settings.lease,
        node_memory_limit=settings.node_memory_limit,
        stop_timeout=settings.stop_timeout,
    )
    cluster = Cluster(cluster_settings)
    cluster.listeners.add(lambda e: print(f"tether: node {e.node[:8]} {e.kind}: {e.why}", file=sys.stderr, flush=True))
    return cluster


async def _serve(
    settings: ServeSettings,
    verbose: int,
    sock: socket.socket,
    catalog: Catalog,
    config: InstanceConfig,
    url: str,
    began: float,
    policy: Policy,
    cluster: Cluster | None,
    upkeep: Upkeep,
) -> int:
    fleet = Fleet(settings.supervision(), cluster=cluster)
    scheduling = SchedulerSettings(
        max_loaded=settings.max_loaded,
        load_wait=settings.load_wait,
        reclaim_timeout=settings.reclaim_timeout,
        reclaim_poll=settings.reclaim_poll,
        allow_engine_import=settings.allow_engine_import,
    )
    scheduler = Scheduler(
        fleet,
        catalog,
        scheduling,
        default=config.default_id(),
        placement=cluster.place if cluster is not None else None,
    )
    scheduler.listeners.add(lambda d: print(f"tether: {d.kind} {d.model}: {d.reason}", file=sys.stderr, flush=True))
    async with fleet, scheduler:
        try:
            hosted = await scheduler.load_now(config.default_id(), "loaded at start")
        except DoesNotFit as exc:
            sock.close()
            return fail(str(exc), EXIT_DOES_NOT_FIT)
        except (InvalidField, Unavailable) as exc:  # the model, the options or another field of the instance
            sock.close()
            return fail(str(exc), EXIT_FAILED)

        def report(state: InstanceState) -> None:
            if isinstance(state, InstanceReady) and not state.healthy:
                print(
                    f"tether: {hosted.id} ready (runner pid {state.pid}, life {state.life}) after "
                    f"{time.monotonic() - began:.1f} s; serving {url}/v1",
                    file=sys.stderr,
                    flush=True,
                )
            elif isinstance(state, InstanceRestarting):
                print(
                    f"tether: {hosted.id}: {state.cause.summary}; restarting in {state.delay:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            elif isinstance(state, InstanceFailed):
                print(f"tether: {hosted.id} failed: {state.cause.render()}\n  {state.reason}", file=sys.stderr)

        hosted.instance.add_state_listener(report)
        print(f"tether: listening on {url} (loading {hosted.id})", file=sys.stderr, flush=True)
        app = create_app(scheduler, policy, cluster=cluster, upkeep=upkeep)
        app.listeners.add(_RefusalReport())
        server = _Server(
            uvicorn.Config(
                app,
                lifespan="off",
                access_log=verbose > 0,
                log_level="info" if verbose else "warning",
                timeout_graceful_shutdown=max(1, int(settings.stop_timeout / 4)),
                # Longer than clients keep an idle connection (httpx and so openai-python: 5 s, uvicorn's own default
                # too): at equal timeouts a client reuses the connection just as the server closes it, and that
                # request fails with a connection error before the server ever sees it.
                timeout_keep_alive=KEEP_ALIVE_S,
            )
        )
        stopping: list[float] = []
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        print(f"tether: {signal.Signals(signum).name} received, stopping", file=sys.stderr, flush=True)
                        stopping.append(time.monotonic())
                        server.should_exit = True
                        return

            tg.start_soon(watch_signals)
            if upkeep.interval > 0:
                upkeep.freeze()  # what exists now lives as long as the worker: collections walk only what requests make
                tg.start_soon(upkeep.run)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()
    now = time.monotonic()
    took = f" in {now - stopping[0]:.1f} s" if stopping else ""
    print(f"tether: stopped{took} (up {now - began:.1f} s)", file=sys.stderr)
    return EXIT_OK
