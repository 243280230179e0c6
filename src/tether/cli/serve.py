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
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio
import uvicorn

from tether import env
from tether.cli.common import (
    EXIT_CANNOT_BIND,
    EXIT_DOES_NOT_FIT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    deadlines_from,
    engine_options,
    fail,
    reap_at_start,
)
from tether.errors import EngineImportRefused, InvalidField, TetherError, UnknownEngine
from tether.fleet.catalog import (
    DEFAULT_KEEP_ALIVE,
    FOREVER,
    Catalog,
    Model,
    builtin_default,
    keep_alive_seconds,
    read_catalog_file,
    scan_models_dir,
)
from tether.fleet.fleet import Fleet, InstanceConfig, Unavailable
from tether.fleet.scheduler import Scheduler
from tether.node.fit import DoesNotFit
from tether.node.instance import InstanceFailed, InstanceReady, InstanceRestarting, InstanceState, RestartPolicy
from tether.node.upkeep import Upkeep, interval_from_env
from tether.serve.app import create_app
from tether.serve.guard import Policy, Refusal, check_host_pattern, check_origin_pattern, patterns
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


def instance_config(args: argparse.Namespace) -> InstanceConfig:
    return InstanceConfig(
        id=args.name,
        engine=args.engine,
        model=str(args.model.resolve()) if args.model else None,
        options=engine_options(args),
        faults=tuple(args.fault),
        restart=RestartPolicy(mode=args.restart),
        deadlines=deadlines_from(args),
        memory_limit=args.memory_limit,
        max_queue=args.max_queue,
        force=args.force,
        replicas=args.replicas,
        ranks=args.ranks,
    )


def build_catalog(args: argparse.Namespace, first: InstanceConfig) -> Catalog:
    """The models this worker serves: its first (``first``, loaded at start), a ``--catalog`` file's, every GGUF in
    ``--models``, and the built-in default model (when installed and not catalogued under its id already)."""
    many = args.models is not None or args.catalog is not None
    keep = keep_alive_seconds(args.keep_alive, "--keep-alive")
    default_keep = keep if keep is not None else DEFAULT_KEEP_ALIVE if many else FOREVER
    catalog = Catalog([Model(first.default_id(), first, (), default_keep, False, "the command line")])
    if args.catalog is not None:
        for model in read_catalog_file(args.catalog, default_keep, allow_engine_import=args.allow_engine_import):
            catalog.add(model)
    if args.models is not None:
        for model in scan_models_dir(args.models, default_keep, first):
            catalog.add(model)
    builtin = builtin_default(default_keep, first)
    if builtin is not None and catalog.find(builtin.id) is None:
        catalog.add(builtin)
    return catalog


def command(args: argparse.Namespace) -> int:
    if tracing_wanted():  # TETHER_TRACEMALLOC=1: trace from the start, so a snapshot sees every allocation kept
        start_tracing()
        print(f"tether: tracing allocations ({TRACEMALLOC}=1): POST /v1/debug/tracemalloc", file=sys.stderr)
    reap_at_start(args)
    return anyio.run(serve, args)


async def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; the exit status says how it ended."""

    api_key = args.api_key or os.environ.get(env.API_KEY) or None
    if api_key and args.no_auth:
        return fail(
            "--no-auth and an API key (--api-key or TETHER_API_KEY) contradict each other: pick one", EXIT_USAGE
        )
    try:
        config = instance_config(args)
        hosts = [check_host_pattern(h) for h in patterns(args.allowed_hosts, os.environ.get(env.ALLOWED_HOSTS))]
        origins = [check_origin_pattern(o) for o in patterns(args.cors_origins, os.environ.get(env.CORS_ORIGINS))]
        upkeep = Upkeep(interval_from_env())
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    problem = config.check()
    if isinstance(problem, UnknownEngine):
        return fail(str(problem), EXIT_USAGE)
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(
            f"tether: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; choose another --port",
            file=sys.stderr,
        )
        return EXIT_CANNOT_BIND
    listen = sock.getsockname()[0]
    policy = Policy(listen, tuple(hosts), tuple(origins), api_key, args.max_body)
    if not policy.loopback and not api_key:
        if not args.no_auth:
            sock.close()
            return fail(
                f"refusing to serve {args.host} (not loopback) without an API key: anyone who can reach this address "
                "could start instances, import engines, read runner logs and use the models. Set --api-key KEY (or "
                f"{env.API_KEY}), or pass --no-auth to serve it open on purpose",
                EXIT_USAGE,
            )
        print(
            f"tether: warning: serving {args.host} without an API key (--no-auth): anyone who can reach it can use it",
            file=sys.stderr,
        )
    try:
        catalog = build_catalog(args, config)
    except (InvalidField, EngineImportRefused) as exc:
        sock.close()
        return fail(str(exc), EXIT_USAGE)
    began = time.monotonic()
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    async with contextlib.AsyncExitStack() as stack:
        cluster = None
        if args.ray is not None:
            try:
                cluster = await stack.enter_async_context(ray_cluster(args))
            except TetherError as exc:
                sock.close()
                return fail(str(exc), EXIT_FAILED)
            nodes = ", ".join(f"{link.short} ({link.host})" for link in cluster.links.values())
            print(f"tether: Ray cluster: node agents on {nodes}", file=sys.stderr, flush=True)
        return await _serve(args, sock, catalog, config, url, began, policy, cluster, upkeep)


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


def ray_cluster(args: argparse.Namespace) -> Cluster:
    """The Ray cluster ``--ray`` names (``local``: start one here), with its node agents."""
    from tether.cluster.coordinator import Cluster, ClusterSettings

    settings = ClusterSettings(
        address=None if args.ray == "local" else args.ray,
        interval=args.heartbeat_interval,
        lost_after=args.lost_after,
        lease=args.lease,
        node_memory_limit=args.node_memory_limit,
        stop_timeout=args.stop_timeout,
    )
    cluster = Cluster(settings)
    cluster.listeners.add(lambda e: print(f"tether: node {e.node[:8]} {e.kind}: {e.why}", file=sys.stderr, flush=True))
    return cluster


async def _serve(
    args: argparse.Namespace,
    sock: socket.socket,
    catalog: Catalog,
    config: InstanceConfig,
    url: str,
    began: float,
    policy: Policy,
    cluster: Cluster | None,
    upkeep: Upkeep,
) -> int:
    fleet = Fleet(stop_timeout=args.stop_timeout, cluster=cluster)
    scheduler = Scheduler(
        fleet,
        catalog,
        max_loaded=args.max_loaded,
        load_wait=args.load_wait,
        reclaim_timeout=args.reclaim_timeout,
        reclaim_poll=args.reclaim_poll,
        default=config.default_id(),
        placement=cluster.place if cluster is not None else None,
        allow_engine_import=args.allow_engine_import,
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
                access_log=args.verbose > 0,
                log_level="info" if args.verbose else "warning",
                timeout_graceful_shutdown=max(1, int(args.stop_timeout / 4)),
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
