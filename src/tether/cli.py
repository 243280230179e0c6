"""The ``tether`` command.

``tether run PROMPT`` loads a model in a supervised runner, streams the answer, and exits non-zero with the
runner's cause when the runner fails. SIGINT and SIGTERM stop the runner (bounded) before the command exits.
``tether serve`` runs a worker with the HTTP API (OpenAI-compatible, admin, metrics) in front of a model instance;
``tether status`` shows the instances of a running server. ``tether orphans`` lists (and with ``--reap`` stops)
runners that outlived their worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import anyio
import msgspec

from tether import fit, orphans
from tether.engines.base import ENGINE_NAMES
from tether.hangs import Deadlines
from tether.memory import ProcessMemory, format_bytes, node_memory, process_memory
from tether.models import DefaultModelMissing
from tether.protocol import (
    ChatMessage,
    Chunk,
    EngineSpec,
    ErrorChunk,
    Failed,
    Fault,
    GenerateParams,
    Loading,
    RunnerStatus,
    TaskState,
    TaskStatus,
)
from tether.registry import Registry
from tether.supervisor import RunnerUnavailable, Supervisor, TaskFailed

# SmolLM2-135M answers plain questions well with a short neutral system message; the default system prompt its
# template inserts otherwise ("... named SmolLM, trained by Hugging Face") derails it at temperature 0.
DEFAULT_SYSTEM = "You are a helpful AI assistant."

EXIT_OK = 0
EXIT_RUNNER_FAILED = 2
EXIT_DOES_NOT_FIT = 3
EXIT_USAGE = 64  # EX_USAGE: the command line is wrong
EXIT_INTERRUPTED = 130

_json = msgspec.json.Encoder()


def _parse_fault(text: str) -> Fault:
    """``KIND[:PHASE[:AFTER_TOKENS]]``, e.g. ``segv:generate:5`` or ``exit:load`` or ``slow``."""
    parts = text.split(":")
    try:
        fields: dict[str, object] = {"kind": parts[0]}
        if len(parts) > 1 and parts[1]:
            fields["phase"] = parts[1]
        if len(parts) > 2 and parts[2]:
            fields["after_tokens"] = int(parts[2])
        return msgspec.convert(fields, Fault)
    except (msgspec.ValidationError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"bad fault {text!r}: {exc} (format KIND[:PHASE[:AFTER_TOKENS]])") from exc


def _parse_deadline(text: str) -> tuple[str, float]:
    """``NAME=SECONDS``, e.g. ``token_gap=60``; NAME is a field of ``tether.hangs.Deadlines``."""
    name, sep, value = text.partition("=")
    names = ", ".join(Deadlines.__struct_fields__)
    if not sep or name not in Deadlines.__struct_fields__:
        raise argparse.ArgumentTypeError(f"bad deadline {text!r}: use NAME=SECONDS with NAME one of {names}")
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad deadline {text!r}: {value!r} is not a number of seconds") from None
    return name, seconds


def _parse_size(text: str) -> int:
    """Bytes, or a number with a K/M/G/T suffix (binary: 512M = 512 MiB)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value, unit = (text[:-1], text[-1].lower()) if text and text[-1].lower() in units else (text, "")
    try:
        return int(float(value) * units.get(unit, 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use bytes or a number with K, M, G or T") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: runner output too)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="answer one prompt with a model in a supervised runner")
    run.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    run.add_argument("--engine", choices=ENGINE_NAMES, default="llama.cpp")
    run.add_argument("--model", type=Path, default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument(
        "--system",
        default=DEFAULT_SYSTEM,
        help=f"system message for chat models (default {DEFAULT_SYSTEM!r}; '' = the model template's own)",
    )
    run.add_argument("--raw", action="store_true", help="send the prompt as a raw completion, no chat template")
    run.add_argument("--n-ctx", type=int, default=None, help="context length (llama.cpp)")
    run.add_argument("--threads", type=int, default=None, help="CPU threads (llama.cpp)")
    run.add_argument("--json", action="store_true", help="print every event as one JSON line on stdout")
    run.add_argument(
        "--fault",
        type=_parse_fault,
        action="append",
        default=[],
        help="debug engine fault KIND[:PHASE[:AFTER_TOKENS]], e.g. segv:generate:5 (repeatable)",
    )
    run.add_argument("--stop-timeout", type=float, default=10.0, help="bound on stopping the runner (s)")
    defaults = Deadlines()
    run.add_argument(
        "--deadline",
        type=_parse_deadline,
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="how long a phase may go without progress before the runner counts as hung (repeatable); defaults: "
        + ", ".join(f"{name}={getattr(defaults, name):g}" for name in Deadlines.__struct_fields__),
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="load even when the fit check says the model does not fit the memory available",
    )
    run.add_argument(
        "--no-reap",
        action="store_true",
        help=f"do not reap runners of dead workers at start (also: {orphans.AUTO_REAP_ENV}=0)",
    )

    srv = sub.add_parser(
        "serve",
        help="serve a model over HTTP: OpenAI-compatible API, instance admin, /metrics",
        description="Start a worker with one model instance (the built-in default model unless --model) in a "
        "supervised runner, and the HTTP API: /v1/chat/completions, /v1/completions, /v1/models, /v1/instances, "
        "/healthz, /readyz, /metrics. SIGINT/SIGTERM stop it within the stop bound.",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (also: TETHER_API_KEY)")
    srv.add_argument("--engine", choices=ENGINE_NAMES, default="llama.cpp")
    srv.add_argument("--model", type=Path, default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    srv.add_argument("--name", default=None, help="the instance's id and model name (default: the GGUF's stem)")
    srv.add_argument("--n-ctx", type=int, default=None, help="context length (llama.cpp)")
    srv.add_argument("--threads", type=int, default=None, help="CPU threads (llama.cpp)")
    srv.add_argument("--restart", choices=("on-failure", "never"), default="on-failure", help="restart policy")
    srv.add_argument("--max-queue", type=int, default=16, help="generations in flight before 503 (default 16)")
    srv.add_argument("--max-body", type=_parse_size, default="4M", help="request body limit (default 4M)")
    srv.add_argument("--memory-limit", type=_parse_size, default=None, help="memory limit of the runner's cgroup")
    srv.add_argument("--stop-timeout", type=float, default=10.0, help="bound on stopping a runner (s)")
    srv.add_argument(
        "--deadline", type=_parse_deadline, action="append", default=[], metavar="NAME=SECONDS", help="hang deadline"
    )
    srv.add_argument("--fault", type=_parse_fault, action="append", default=[], help="debug engine fault")
    srv.add_argument("--force", action="store_true", help="load even when the fit check says it does not fit")
    srv.add_argument("--no-reap", action="store_true", help="do not reap runners of dead workers at start")

    st = sub.add_parser("status", help="show the instances and runners of a running tether server")
    st.add_argument("--url", default=None, help="the server (default http://127.0.0.1:PORT)")
    st.add_argument("--port", type=int, default=8000)
    st.add_argument("--api-key", default=None, help="its API key (also: TETHER_API_KEY)")
    st.add_argument("--json", action="store_true", help="the server's JSON as it is")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server (default 5)")

    orph = sub.add_parser(
        "orphans",
        help="list tether runners that outlived their worker, with the memory they hold",
        description="List tether runners whose worker is gone (and runner records whose process group lives on), "
        "with their memory side by side: RSS, USS, PSS, anonymous, file-backed, swap and GPU. "
        "Exit status: 0 when none are found or all were reaped, 1 when orphans are left.",
    )
    orph.add_argument("--reap", action="store_true", help="stop them: SIGTERM to the whole group, grace, SIGKILL")
    orph.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)")
    orph.add_argument("--json", action="store_true", help="one JSON object on stdout")
    orph.add_argument("--all", action="store_true", help="also list healthy runners (their worker is alive)")
    return parser


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """The engine options a command line sets (``--n-ctx``, ``--threads``), for ``run`` and ``serve`` alike."""
    options: dict[str, object] = {}
    if args.n_ctx is not None:
        options["n_ctx"] = args.n_ctx
    if args.threads is not None:
        options["n_threads"] = args.threads
    return options


def deadlines_from(args: argparse.Namespace) -> Deadlines:
    """The hang deadlines ``--deadline NAME=SECONDS`` set, the rest at their defaults; ``ValueError`` says what is
    wrong with a value."""
    return Deadlines(**dict(args.deadline))


def _engine_spec(args: argparse.Namespace) -> EngineSpec:
    options = engine_options(args)
    load_faults = tuple(f for f in args.fault if f.phase != "generate")
    return EngineSpec(
        engine=args.engine,
        model=str(args.model.resolve()) if args.model else None,
        options=options,
        faults=load_faults,
    )


def _params(args: argparse.Namespace) -> GenerateParams:
    gen_faults = tuple(f for f in args.fault if f.phase == "generate")
    common = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stop": tuple(args.stop),
        "seed": args.seed,
        "faults": gen_faults,
    }
    if args.raw:
        return GenerateParams(prompt=args.prompt, **common)
    messages = ([ChatMessage("system", args.system)] if args.system else []) + [ChatMessage("user", args.prompt)]
    return GenerateParams(messages=tuple(messages), **common)


class _Progress:
    """Loading progress on stderr: one rewritten line on a terminal, a few plain lines otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_shown = -1.0

    def __call__(self, status: RunnerStatus) -> None:
        if not self.enabled or not isinstance(status, Loading):
            return
        if not self.tty and status.progress < 1.0 and status.progress - self.last_shown < 0.25:
            return
        self.last_shown = status.progress
        end = "\r" if self.tty and status.progress < 1.0 else "\n"
        print(f"loading {status.progress * 100:5.1f}% {status.detail}", end=end, file=sys.stderr, flush=True)


def _reap_at_start() -> None:
    """A worker starting: reap the runners dead workers left behind, and say so even without -v."""
    for result in orphans.reap_at_start():
        state = "reaped" if result.ok else "could not reap"
        print(
            f"tether: {state} orphaned {result.group.label} of dead worker {result.group.worker_pid} "
            f"({len(result.gone)} process{'' if len(result.gone) == 1 else 'es'}): "
            f"freed {format_bytes(result.freed.footprint)}",
            file=sys.stderr,
        )


async def _run(args: argparse.Namespace) -> int:
    spec = _engine_spec(args)
    params = _params(args)
    problem = params.check()
    if problem:
        print(f"tether: invalid request: {problem}", file=sys.stderr)
        return 2
    emit_json = args.json

    def emit(obj: object) -> None:
        sys.stdout.write(_json.encode(obj).decode() + "\n")
        sys.stdout.flush()

    try:
        estimate = fit.estimate_for_spec(spec)
    except (fit.GgufError, DefaultModelMissing) as exc:
        print(f"tether: {exc}", file=sys.stderr)
        return EXIT_RUNNER_FAILED
    if estimate is not None:
        node = node_memory()
        admitted = fit.check_fit(estimate, node.available, node.source, override=args.force)
        if not admitted.ok:
            print(f"tether: {admitted.message}", file=sys.stderr)
            return EXIT_DOES_NOT_FIT
        if admitted.overridden:
            print(f"tether: --force: {admitted.message}", file=sys.stderr)
    try:
        deadlines = deadlines_from(args)
    except ValueError as exc:
        print(f"tether: {exc}", file=sys.stderr)
        return EXIT_USAGE
    supervisor = Supervisor(spec, stop_timeout=args.stop_timeout, deadlines=deadlines)
    if emit_json:
        supervisor.add_status_listener(lambda status: emit({"type": "status", "status": status}))
    else:
        supervisor.add_status_listener(_Progress(enabled=True))
    began = time.monotonic()
    try:
        async with supervisor as sup:
            if not emit_json:
                print(f"{sup.name}: pid {sup.pid}", file=sys.stderr)
            await sup.ready()
            loaded = time.monotonic()
            measured = None
            if estimate is not None and sup.pid is not None:
                memory = process_memory(sup.pid)
                measured = fit.record_measured(estimate, memory) if memory is not None else None
            handle = await sup.generate(params)
            first: float | None = None
            final: TaskStatus | None = None
            tokens = 0
            async for event in handle:
                if emit_json:
                    emit(event)
                if isinstance(event, Chunk):
                    first = first or time.monotonic()
                    tokens += event.tokens
                    if not emit_json:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                elif isinstance(event, ErrorChunk) and not emit_json:
                    print(f"\ntether: {event.message}", file=sys.stderr)
                elif isinstance(event, TaskStatus) and event.state.terminal:
                    final = event
            done = time.monotonic()
    except (TaskFailed, RunnerUnavailable) as exc:
        cause = supervisor.cause
        print(f"\ntether: {cause.render() if cause else exc}", file=sys.stderr)
        return EXIT_RUNNER_FAILED
    assert final is not None
    if not emit_json:
        sys.stdout.write("\n")
        if final.state is TaskState.COMPLETE:
            decode_s = max(done - (first or done), 1e-9)
            print(
                f"[{tokens} tokens; load {loaded - began:.2f} s, first token {(first or done) - loaded:.3f} s, "
                f"{(tokens - 1) / decode_s if tokens > 1 else 0:.1f} tokens/s]",
                file=sys.stderr,
            )
            if measured is not None:
                print(f"[memory: {measured.describe()}]", file=sys.stderr)
    if final.state is TaskState.FAILED:
        if not emit_json:
            detail = final.cause.render() if final.cause else final.error
            print(f"tether: {detail}", file=sys.stderr)
        return EXIT_RUNNER_FAILED
    if isinstance(supervisor.status, Failed):
        return EXIT_RUNNER_FAILED
    return EXIT_OK


async def _main_with_signals(args: argparse.Namespace) -> int:
    """Run the command; SIGINT/SIGTERM cancel it, and the supervisor's exit stops the runner (bounded)."""
    result = EXIT_INTERRUPTED
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    print(f"\ntether: {signal.Signals(signum).name} received, stopping", file=sys.stderr)
                    tg.cancel_scope.cancel()
                    return

        async def work() -> None:
            nonlocal result
            result = await _run(args)
            tg.cancel_scope.cancel()

        tg.start_soon(watch_signals)
        tg.start_soon(work)
    return result


def _memory_json(m: ProcessMemory | None) -> dict[str, int | None] | None:
    if m is None:
        return None
    return {
        "rss": m.rss,
        "uss": m.uss,
        "pss": m.pss,
        "anon": m.anon,
        "file": m.file,
        "swap": m.swap,
        "gpu": m.gpu,
        "footprint": m.footprint,
    }


def _group_json(group: orphans.RunnerGroup, now: float) -> dict[str, object]:
    return {
        "pid": group.pid,
        "ppid": group.ppid,
        "runner_alive": group.runner is not None,
        "age_s": round(group.age(now), 3),
        "runner_id": group.runner_id,
        "worker_pid": group.worker_pid,
        "engine": group.engine,
        "model": group.model,
        "orphan": group.orphan,
        "reason": group.reason,
        "watchdog": group.watchdog,
        "cgroup": str(group.cgroup.path) if group.cgroup is not None else None,
        "memory": _memory_json(group.memory),
        "members": [
            {
                "pid": p.pid,
                "ppid": p.ppid,
                "role": group.role(p),
                "command": p.command,
                "memory": _memory_json(p.memory),
            }
            for p in group.members
        ],
    }


def _age(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _table(rows: list[list[str]]) -> list[str]:
    """Rows (the first is the header) as aligned lines."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _status(args: argparse.Namespace) -> int:
    """Ask a running server for its instances and print them as a table (or its JSON)."""
    import httpx

    from tether.serving import API_KEY_ENV

    url = (args.url or f"http://127.0.0.1:{args.port}").rstrip("/")
    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(f"{url}/v1/instances", headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(
            f"tether: cannot reach a tether server at {url}: {exc}; is `tether serve` running there?", file=sys.stderr
        )
        return 1
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        print(f"tether: {url} answered {response.status_code}: {message}", file=sys.stderr)
        return 1
    instances = response.json()["data"]
    if args.json:
        print(json.dumps(instances, indent=2))
        return 0
    if not instances:
        print(f"no instances at {url}")
        return 0
    rows = [["INSTANCE", "STATE", "PID", "ENGINE", "MODEL", "FOOTPRINT", "RSS", "RESTARTS", "QUEUE", "FAILURES"]]
    for inst in instances:
        runner = inst.get("runner") or {}
        memory = runner.get("memory") or {}
        model = Path(inst["model"]).name if inst.get("model") else "default model"
        rows.append(
            [
                inst["id"],
                inst["state"],
                str(runner.get("pid", "-")),
                inst["engine"],
                model[:40],
                format_bytes(memory.get("footprint")) if memory else "-",
                format_bytes(memory.get("rss")) if memory else "-",
                str(inst["restarts"]),
                f"{inst['queue']['in_flight']}/{inst['queue']['limit']}",
                str(len(inst["history"])),
            ]
        )
    lines = _table(rows)
    print(lines[0])
    for line, inst in zip(lines[1:], instances, strict=True):
        print(line)
        if not inst["ready"]:
            print(f"    {inst['reason']}")
        for failure in inst["history"][-3:]:
            when = time.strftime("%H:%M:%S", time.localtime(failure["at"]))
            print(f"    {when} life {failure['life']} (pid {failure['pid']}): {failure['cause']['summary']}")
    return 0


def _print_groups(groups: list[orphans.RunnerGroup], now: float) -> None:
    header = ["PID", "PPID", "AGE", "RUNNER", "MODEL", "RSS", "USS", "PSS", "ANON", "FILE", "SWAP", "GPU", "PROCS"]
    rows = [header]
    for g in groups:
        m = g.memory
        model = Path(g.model).name if g.model else (f"{g.engine}: default model" if g.engine else "?")
        sizes = (m.rss, m.uss, m.pss, m.anon, m.file, m.swap, m.gpu)
        rows.append(
            [str(g.pid or "-"), str(g.ppid or "-"), _age(g.age(now)), g.runner_id, model[:32]]
            + [format_bytes(x) for x in sizes]
            + [str(len(g.members))]
        )
    for i, line in enumerate(_table(rows)):
        print(line)
        if i:
            g = groups[i - 1]
            print(f"    {g.reason}")
            print("    processes: " + ", ".join(f"{p.pid} {g.role(p)}" for p in g.members))


def _orphans(args: argparse.Namespace) -> int:
    now = time.time()
    registry = Registry()
    found = orphans.scan(registry)
    results = orphans.reap_all(found, registry, grace=args.grace) if args.reap else []
    failed = [r for r in results if not r.ok]
    if args.json:
        report: dict[str, object] = {
            "orphans": [_group_json(g, now) for g in found.orphans],
            "stale_records": [{"path": str(s.path), "pid": s.pid, "why": s.why} for s in found.stale],
            "gpu": {"available": found.gpu.available, "reason": found.gpu.reason},
        }
        if args.all:
            report["healthy"] = [_group_json(g, now) for g in found.healthy]
        if args.reap:
            report["reaped"] = [
                {
                    "pid": r.group.pid,
                    "ok": r.ok,
                    "killed_with": r.killed_with,
                    "gone": r.gone,
                    "survivors": r.survivors,
                    "refused": [{"pid": pid, "why": why} for pid, why in r.refused],
                    "freed": _memory_json(r.freed),
                    "seconds": round(r.seconds, 3),
                }
                for r in results
            ]
        print(_json.encode(report).decode())
    else:
        shown = found.orphans + (found.healthy if args.all else [])
        if shown:
            _print_groups(shown, now)
        if shown and not found.gpu.available:
            print(f"(GPU memory: n/a, {found.gpu.reason})", file=sys.stderr)
        total = ProcessMemory.total(g.memory for g in found.orphans)
        if not found.orphans:
            print("no orphaned tether runners")
        elif not args.reap:
            print(
                f"{len(found.orphans)} orphaned runner(s) holding {format_bytes(total.footprint)} "
                f"(anonymous + swap + GPU; RSS {format_bytes(total.rss)}). Stop them: tether orphans --reap"
            )
        for r in results:
            for pid, why in r.refused:
                print(f"left pid {pid} alone: {why}")
            if r.ok:
                print(
                    f"reaped {r.group.label} ({len(r.gone)} processes) with {r.killed_with} in {r.seconds:.2f} s: "
                    f"freed {format_bytes(r.freed.footprint)} (RSS {format_bytes(r.freed.rss)})"
                )
            else:
                print(f"could not reap {r.group.label}: {r.survivors} survived SIGKILL (stuck in the kernel?)")
        if args.reap and found.stale:
            print(f"removed {len(found.stale)} stale runner record(s) from {registry.path}")
    if args.reap:
        return 1 if failed else 0
    return 1 if found.orphans else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The command reports causes itself; logs are for -v (runner output lines need -vv).
    level = logging.CRITICAL + 1 if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "orphans":
        return _orphans(args)
    if args.command == "run":
        if not args.no_reap and orphans.auto_reap_enabled():
            _reap_at_start()
        return anyio.run(_main_with_signals, args)
    if args.command == "serve":
        from tether import serving  # the HTTP stack is imported only by the command that needs it

        if not args.no_reap and orphans.auto_reap_enabled():
            _reap_at_start()
        return anyio.run(serving.serve, args)
    if args.command == "status":
        return _status(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
