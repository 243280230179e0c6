"""Shared fixtures: anyio on asyncio, helpers that keep every wait bounded, and the test tiers' markers.

A test that uses a fixture needing the real model, a Ray cluster or a browser gets that fixture's marker here
(``FIXTURE_MARKERS``), so it cannot be forgotten; ``fuzz`` and ``slow`` are set by the tests themselves. ``make
check`` runs what carries none of them.
"""

from __future__ import annotations

import contextlib
import copy
import http.server
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import openai
import pytest

from tether.chaos.target import ServeChild
from tether.fleet.fleet import Hosted
from tether.kernel.cgroups import create_child_cgroup, remove_cgroup
from tether.kernel.pids import alive, live_processes
from tether.kernel.ports import RankPorts
from tether.models import PACKAGED, DefaultModelMissing, default_model_path, pulled_path
from tether.node.instance import Instance, InstanceReady
from tether.node.orphans import sweep_stale_cgroups
from tether.node.ranks import RankGroup
from tether.protocol import EngineSpec, Fault, GenerateParams

if TYPE_CHECKING:
    from playwright.sync_api import Browser

    from tether.chaos.cluster import RayCluster

FIXTURE_MARKERS = {
    "model_server": "model",
    "open_webui_server": "model",
    "llama_engine": "model",
    "cluster": "cluster",
    "ray_cluster": "cluster",
    "browser": "browser",
    "page": "browser",
}
# What `make test` runs alone, after the rest has run on 3 workers (``serial``): a Ray cluster or Open WebUI (each
# takes the whole machine, and the cluster's loss bounds are tight), Open WebUI's 6,500-token tools prompt replayed
# (its prefill alone takes ~25 s of both cores), a real-model test whose claim needs two fixed llama.cpp threads
# (beside other work each step waits at the barriers for a core: ~10x slower), and the tests that leave orphans, dead
# workers' cgroups or held ports on purpose and then look at them, where any other test's starting worker would reap
# them (``reap_at_start``): those carry ``@pytest.mark.serial`` themselves, or their module is listed here.
SERIAL_MARKERS = frozenset({"cluster"})
# What keeps a core busy for many seconds (real-model decoding): ``make test`` runs these one at a time on one worker
# (``--dist loadgroup``), while the other workers take the tests that wait on processes. Three of them at once on two
# cores only made each one 3-4x slower (llama.cpp's threads spin for cores they cannot get); for the same reason a
# real-model test runs one thread unless its claim is about threads (beside two other workers a second thread spun
# at llama.cpp's barriers: about a quarter more CPU for the same tokens).
CORES_GROUP = "cores"
SERIAL_MODULES = frozenset({"test_orphans", "test_open_webui", "test_open_webui_shapes"})
# Modules whose tests share a costly module-scoped fixture (a real-model server of their own, the built site): each
# runs on one worker (``--dist loadgroup``), so the fixture is set up once rather than on every worker that draws one
# of its tests (measured: ~45 s of the tier's work, 3-6 s a setup).
GROUPED_MODULES = frozenset(
    {
        "test_native_tools",
        "test_reasoning",
        "test_reasoning_loops",
        "test_docs",
        "test_openai_features",
        "test_ollama_parity",
    }
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            marker = FIXTURE_MARKERS.get(fixture)
            if marker is not None:
                item.add_marker(marker)
        module = item.module.__name__ if isinstance(item, pytest.Function) else ""
        if module in SERIAL_MODULES or any(item.get_closest_marker(m) for m in SERIAL_MARKERS):
            item.add_marker("serial")
        if item.get_closest_marker("cores"):
            item.add_marker(pytest.mark.xdist_group(CORES_GROUP))
        elif module in GROUPED_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))


TEST_BOUND_S = 45.0
"""No test runs longer (its call, in ``make test`` beside the others): a longer proof belongs in bench/ or a campaign.
"""
_over_bound: list[tuple[float, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > TEST_BOUND_S:
        _over_bound.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every run names the tests over the bound (beside ``--durations``' slowest), so one that grows is seen the day
    it does."""
    if _over_bound:
        terminalreporter.section(f"over the {TEST_BOUND_S:.0f} s bound a test may take")
        for duration, nodeid in sorted(_over_bound, reverse=True):
            terminalreporter.write_line(f"{duration:7.1f} s  {nodeid}")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def private_runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own runner registry and log directory, so tests never see (or reap) each other's records
    or write into the user's."""
    path = tmp_path_factory.mktemp("runtime")
    monkeypatch.setenv("TETHER_RUNTIME_DIR", str(path))
    monkeypatch.setenv("TETHER_LOG_DIR", str(tmp_path_factory.mktemp("logs")))
    return path


# --------------------------------------------------------------------------------------------------------------
# One local Ray cluster for the tests in a row that use one
# --------------------------------------------------------------------------------------------------------------

_ray: RayCluster | None = None


def shared_ray(tmp_path_factory: pytest.TempPathFactory) -> RayCluster:
    """The local Ray cluster (``chaos.cluster.RayCluster``: a head without CPUs and 3 nodes) that the cluster tests
    and campaigns share, with its 3 nodes: each start and stop costs ~7 s, so it starts on first use and stops after
    the last test of a row that carries the ``cluster`` marker (idle, it takes ~4% of this machine). Its nodes'
    agents keep their records in a directory of its own (the ranks campaign checks them there)."""
    global _ray
    if _ray is None:
        from tether.chaos.cluster import RayCluster

        try:
            _ray = RayCluster(tmp_path_factory.mktemp("ray-nodes"))
        except Exception as exc:  # pragma: no cover - the machine cannot run Ray at all
            pytest.skip(f"a local Ray cluster cannot start here: {exc}")
    else:
        _ray.ensure()
    return _ray


def _stop_ray() -> None:
    global _ray
    if _ray is not None:
        ray, _ray = _ray, None
        ray.shutdown()


@pytest.fixture
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> RayCluster:
    return shared_ray(tmp_path_factory)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a test's teardown (a module's coordinator stopped with it): the shared Ray cluster stops unless the
    next test carries the ``cluster`` marker."""
    try:
        return (yield)
    finally:
        if nextitem is None or nextitem.get_closest_marker("cluster") is None:
            _stop_ray()


def pytest_sessionfinish() -> None:
    _stop_ray()


@pytest.fixture(autouse=True, scope="session")
def sweep_runner_cgroups() -> Iterator[None]:
    """Drills SIGKILL workers, which then cannot remove their runners' cgroups: sweep them when the session ends."""
    yield
    sweep_stale_cgroups()


@pytest.fixture
def debug_spec() -> EngineSpec:
    return EngineSpec(engine="debug")


pid_alive = alive  # True while ``pid`` exists and is not a zombie


def debug(*faults: Fault, **options: object) -> EngineSpec:
    """A debug engine spec with these load-time faults and options."""
    return EngineSpec(engine="debug", options=dict(options), faults=faults)


def prompt(max_tokens: int = 8, *faults: Fault) -> GenerateParams:
    """A raw prompt for the debug engine, with these per-request faults."""
    return GenerateParams(prompt="tell me about supervision", max_tokens=max_tokens, faults=faults)


def model_missing() -> str | None:
    """Why the tests that need the real default model cannot run here (None when they can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (run `make install`)"
    try:
        default_model_path()
    except DefaultModelMissing as exc:
        return f"the default model is missing: {exc}"
    return None


GEMMA = PACKAGED["gemma3-270m"]  # the second family: sliding-window attention, a base model without chat template


def gemma_path() -> Path:
    """Where ``tether pull gemma3-270m`` (``make test`` runs it) keeps Gemma 3 270M's GGUF."""
    return pulled_path(GEMMA)


def gemma_missing() -> str | None:
    """Why the tests that need Gemma 3 270M cannot run here (None when they can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (run `make install`)"
    path = gemma_path()
    if not path.is_file() or path.stat().st_size != GEMMA.size:
        return f"Gemma 3 270M is not pulled (looked for {path}): run `tether pull gemma3-270m` (242 MiB, once)"
    return None


@pytest.fixture
def no_leftover_runners() -> Iterator[None]:
    """Fail a test that leaves a tether runner of this process behind."""
    yield
    me = os.getpid()
    leftovers = []
    for proc in live_processes():
        if proc.ppid != me:
            continue
        try:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"tether.runner" in cmdline:
            leftovers.append(proc.pid)
    assert not leftovers, f"runner processes left behind: {leftovers}"


CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
MakeCgroup = Callable[[int], Path]


@pytest.fixture
def memory_cgroup() -> Iterator[MakeCgroup]:
    """Make fresh cgroup-v1 memory cgroups with a limit (swap included), removed after the test.

    Skips, saying why, where there is no writable v1 memory hierarchy: real OOM kills and limits need one.
    """
    created: list[Path] = []

    def make(limit: int) -> Path:
        if not (CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists():
            pytest.skip(f"no cgroup v1 memory hierarchy at {CGROUP_V1_MEMORY}: cannot set a memory limit")
        path = CGROUP_V1_MEMORY / f"tether-test-{uuid.uuid4().hex[:8]}x"  # never tether-<runner>-<worker pid>
        try:
            path.mkdir()
        except OSError as exc:
            pytest.skip(f"cannot create a memory cgroup at {path}: {exc}")
        created.append(path)
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # with swap, the process would swap instead of being killed
                memsw.write_text(str(limit))
        except OSError as exc:
            pytest.skip(f"cannot set a memory limit on {path}: {exc}")
        return path

    yield make
    for path in created:
        for child in sorted((c for c in path.glob("**/*") if c.is_dir()), reverse=True):
            child.rmdir()  # a runner cgroup below it that its worker could not remove
        deadline = time.monotonic() + 5  # the last members leave as the kernel finishes tearing them down
        while path.exists():
            try:
                path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


@pytest.fixture
def own_cgroups() -> None:
    """Skip (saying why) where this machine gives runners no memory cgroups of their own."""
    probe, why = create_child_cgroup(f"tether-probe-{uuid.uuid4().hex[:8]}x")
    if probe is None:
        pytest.skip(f"no per-runner cgroups here: {why}")
    remove_cgroup(probe)


def wait_until(predicate: Any, timeout: float, what: str | Callable[[], str]) -> None:
    """Re-check a server-side condition until it holds (bounded); the server has no push channel to wait on.
    ``what`` says what was awaited (a callable: worded when it fails, with what it found)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------------------------
# Answers checked against the served /openapi.json
# --------------------------------------------------------------------------------------------------------------


def _closed(node: Any) -> Any:
    """``node`` (a JSON Schema) with every object that lists its properties closed to others."""
    if isinstance(node, dict):
        out = {key: _closed(value) for key, value in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(item) for item in node]
    return node


class Document:
    """The served OpenAPI document, and validation of an answer against one route's stated response."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = _closed(copy.deepcopy(document))

    def schema(self, path: str, method: str, status: int, media: str = "application/json") -> dict[str, Any]:
        answer = self.document["paths"][path][method]["responses"][str(status)]
        return {**answer["content"][media]["schema"], "components": self.document["components"]}

    def check(self, response: httpx.Response, path: str, method: str = "get") -> Any:
        body = response.json()
        schema = self.schema(path, method, response.status_code)
        jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
        return body


# --------------------------------------------------------------------------------------------------------------
# `tether serve` as a child process
# --------------------------------------------------------------------------------------------------------------

TETHER = [sys.executable, "-m", "tether"]


def chaos(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``tether chaos ARGS --json`` run to its end: the process, and the summary its last line printed."""
    out = subprocess.run([*TETHER, "chaos", *args, "--json"], capture_output=True, text=True, timeout=timeout)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    return out, json.loads(lines[-1])


class Server(ServeChild):
    """A `tether serve` child for tests: with an API key and an HTTP client, and a bounded stop."""

    def __init__(
        self,
        *args: str,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        cgroup: Path | None = None,
        startup: float = 30.0,
    ) -> None:
        super().__init__(*args, *(("--api-key", api_key) if api_key else ()), env=env, cgroup=cgroup, startup=startup)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=30)

    def wait_ready(self, timeout: float = 60) -> int:
        """Wait for the next 'ready' report; return the runner pid."""
        return int(self.wait_for(r"ready \(runner pid (\d+)", timeout).group(1))

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        key = self.headers.get("Authorization", "Bearer none").split(" ", 1)[1]
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120, **kwargs)

    def add_instance(self, body: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
        """``POST /v1/instances``, then wait (bounded) until the new instance is ready; return it."""
        response = self.http.post("/v1/instances", json=body)
        assert response.status_code == 201, response.text
        instance_id = response.json()["id"]
        wait_until(lambda: self.instance(instance_id)["ready"], timeout, f"instance {instance_id} ready")
        return self.instance(instance_id)

    def instance(self, instance_id: str) -> dict[str, Any]:
        response = self.http.get(f"/v1/instances/{instance_id}")
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.http.close()


@contextlib.contextmanager
def serving(
    *args: str,
    api_key: str | None = None,
    ready: bool = True,
    env: dict[str, str] | None = None,
    cgroup: Path | None = None,
) -> Iterator[Server]:
    """A `tether serve` child for the block (ready unless ``ready`` is False), stopped (bounded) after it; in the
    memory ``cgroup`` when given."""
    server = Server(*args, api_key=api_key, env=env, cgroup=cgroup)
    try:
        if ready:
            server.wait_ready()
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()
        server.proc.kill() if server.proc.poll() is None else None


@pytest.fixture(scope="session")
def model_server() -> Iterator[Server]:
    """`tether serve` on the default model (1 thread, n_ctx 2048), loaded once and shared by every test that only
    asks it for generations (a test that changes a worker, or makes a claim about one, starts its own)."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    with serving("--threads", "1", "--n-ctx", "2048") as server:
        yield server


def gguf_with_template(path: Path, template: str) -> Path:
    """A copy of the default model's GGUF at ``path`` with ``template`` as its chat template, every tensor as it was
    (llama.cpp's own ``gguf`` library): a model whose GGUF carries the template under test."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(default_model_path()), "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None
    writer = gguf.GGUFWriter(str(path), arch.contents(), endianess=reader.endianess)
    details = MetadataDetails(gguf.GGUFValueType.STRING, template)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: details}, [])
    return path


OPEN_WEBUI_EMBED = "emb"  # the embedding instance Open WebUI's RAG uses (and its recorded /api/embed names)


@pytest.fixture(scope="session")
def open_webui_server() -> Iterator[Server]:
    """`tether serve` as a user starts it for Open WebUI (2 threads, the default n_ctx 8192: its tools' prompt is
    6,500 tokens) with an embedding instance for its RAG; TETHER_OPEN_WEBUI_SERVE_ARGS adds to its arguments.
    Shared by Open WebUI in a browser and the replay of its recorded requests, so that prompt is read from cold once
    (~25 s of both cores) and the replay finds it in the prompt cache, as a user's second chat does."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    extra = shlex.split(os.environ.get("TETHER_OPEN_WEBUI_SERVE_ARGS", ""))
    with serving("--threads", "2", *extra) as server:
        embedding = {"embedding": True, "n_ctx": 512}
        server.add_instance({"id": OPEN_WEBUI_EMBED, "engine": "llama.cpp", "options": embedding}, 90)
        yield server


def debug_server(*args: str, **kwargs: Any) -> contextlib.AbstractContextManager[Server]:
    return serving("--engine", "debug", *args, **kwargs)


@contextlib.contextmanager
def http_site(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A web server of its own on 127.0.0.1 (a free port) answering with ``handler`` for the block; its base URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


# --------------------------------------------------------------------------------------------------------------
# A real browser: Debian's chromium, driven by Playwright for Python
# --------------------------------------------------------------------------------------------------------------

CHROMIUM = os.environ.get("TETHER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
WAIT_MS = 15_000  # the longest any one thing on a page may take to show (a runner's start included)


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (None when they can)."""
    if importlib.util.find_spec("playwright") is None:
        return "Playwright for Python is not installed (`make test` installs it: pip install -e '.[dev]')"
    if not os.access(CHROMIUM, os.X_OK):
        return (
            f"no chromium at {CHROMIUM} (`make test` installs Debian's: apt-get install chromium; or set "
            "TETHER_CHROMIUM to a Chromium binary)"
        )
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless chromium for a module's tests (Playwright's own browser download is never used)."""
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()


# --- multi-rank instances -------------------------------------------------------------------------------------


def free_rank_ports(n: int) -> list[int]:
    """``n`` ports nothing listens on, below the ephemeral range (no outgoing connection takes one meanwhile)."""
    return list(RankPorts(base=26000 + os.getpid() % 4000).allocate("test", n))


def rank_group(hosted: Hosted) -> RankGroup:
    sup = hosted.supervisor
    assert isinstance(sup, RankGroup), f"not a rank group: {sup!r}"
    return sup


def rank_pids(group: RankGroup) -> list[int]:
    pids = [m.pid for m in group.members]
    assert all(pid is not None for pid in pids)
    return [pid for pid in pids if pid is not None]


async def ready_group(inst: Instance, old: set[int], timeout: float = 30) -> RankGroup:
    """Wait for a Ready life whose ranks are all new (not in ``old``)."""

    def fresh(state: Any) -> bool:
        sup = inst.supervisor
        return (
            isinstance(state, InstanceReady)
            and isinstance(sup, RankGroup)
            and not old.intersection(m.pid for m in sup.members if m.pid is not None)
        )

    await inst.wait_state(fresh, timeout)
    sup = inst.supervisor
    assert isinstance(sup, RankGroup)
    return sup


def run_options(*flags: str) -> dict[str, object]:
    """The engine options ``tether run FLAGS prompt`` sets, through the real command line parser."""
    from tether.cli.common import engine_options
    from tether.cli.parser import build_parser

    return engine_options(build_parser().parse_args(["run", *flags, "a prompt"]))
