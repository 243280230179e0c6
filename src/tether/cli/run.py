"""``tether run PROMPT``: load a model in a supervised runner, stream one answer, and exit non-zero with the
runner's cause when the runner fails. SIGINT and SIGTERM stop the runner (bounded) before the command exits."""

from __future__ import annotations

import argparse
import signal
import sys
import time

import anyio
import msgspec

from tether.cli.common import (
    EXIT_DOES_NOT_FIT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    deadlines_from,
    declared_only,
    engine_name,
    engine_options,
    fail,
    reap_at_start,
)
from tether.engines import registry
from tether.errors import InvalidField
from tether.node import fit
from tether.node.memory import process_memory
from tether.node.settings import SupervisorSettings
from tether.node.supervisor import Supervisor
from tether.node.tasks import RunnerUnavailable, TaskFailed
from tether.protocol import (
    ChatMessage,
    Chunk,
    EngineSpec,
    ErrorChunk,
    Failed,
    GenerateParams,
    Loading,
    RunnerStatus,
    TaskState,
    TaskStatus,
)

_json = msgspec.json.Encoder()


def command(args: argparse.Namespace) -> int:
    reap_at_start(args)
    return anyio.run(_main_with_signals, args)


def _engine_spec(args: argparse.Namespace) -> EngineSpec:
    options = declared_only(engine_options(args), engine_name(args))
    known = registry.resolve(engine_name(args)).options
    if "parallel" not in options and "parallel" in known:
        options["parallel"] = 1  # one prompt: one sequence's cache, not a server's batch of them
    if "prompt_cache_ram" not in options and "prompt_cache_ram" in known:
        options["prompt_cache_ram"] = 0  # one prompt: nothing to keep for a next one
    load_faults = tuple(f for f in args.faults if f.phase != "generate")
    return EngineSpec(
        engine=engine_name(args),
        model=str(args.model.resolve()) if args.model else None,
        options=options,
        faults=load_faults,
    )


def _params(args: argparse.Namespace) -> GenerateParams:
    gen_faults = tuple(f for f in args.faults if f.phase == "generate")
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


async def _run(args: argparse.Namespace) -> int:
    try:
        spec = _engine_spec(args)
    except InvalidField as exc:  # an engine that names none
        return fail(str(exc), EXIT_USAGE)
    refused = registry.spec_problem(spec)
    if refused is not None:
        return fail(str(refused), EXIT_USAGE)
    params = _params(args)
    problem = params.check()
    if problem:
        return fail(f"invalid request: {problem}", EXIT_USAGE)
    emit_json = args.json

    def emit(obj: object) -> None:
        sys.stdout.write(_json.encode(obj).decode() + "\n")
        sys.stdout.flush()

    try:
        admitted = fit.assess(spec, override=args.force, sized=True)
    except InvalidField as exc:  # a model file the estimate cannot read
        return fail(str(exc))
    if not admitted.ok:
        return fail(admitted.message, EXIT_DOES_NOT_FIT)
    if admitted.overridden:
        print(f"tether: --force: {admitted.message}", file=sys.stderr)
    estimate = admitted.estimate
    spec = admitted.spec or spec  # n_ctx "auto" sized to the memory
    try:
        deadlines = deadlines_from(args)
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    supervisor = Supervisor(spec, SupervisorSettings(stop_timeout=args.stop_timeout), deadlines=deadlines)
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
                if isinstance(event, Chunk) and event.is_progress:
                    continue  # a long prompt's prefill advancing: nothing to show
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
        return EXIT_FAILED
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
        return EXIT_FAILED
    if isinstance(supervisor.status, Failed):
        return EXIT_FAILED
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
