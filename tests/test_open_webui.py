"""Open WebUI 0.12.4 against a live ``tether serve`` on the default model, in a real headless Chromium (issue 34).

What a new user does: point Open WebUI at tether (as its Ollama backend, and as its OpenAI backend), pick the model,
send a message in Open WebUI's default setup (its 36 built-in tools attached, title / tags / follow-up tasks on), and
watch the answer stream in. Open WebUI runs from its own venv (``make openwebui``, a prerequisite of ``make test``),
offline, with no sign-in and a throwaway data directory; RAG embeds through tether's ``/api/embed`` (an embedding
instance of the default model) instead of a sentence-transformers model it would download.

Between Open WebUI and tether sits a small recording proxy (here, not in tether) that keeps every request Open WebUI
sends; ``TETHER_RECORD_OPEN_WEBUI=1`` saves the representative ones as tests/fixtures/open_webui/*.json, which
``test_open_webui_shapes.py`` replays without Open WebUI. Every wait is bounded; nothing sleeps to let things settle.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from conftest import OPEN_WEBUI_EMBED as EMBED
from conftest import Server, wait_until
from tether.kernel.pids import group_members

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = [pytest.mark.model, pytest.mark.browser, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
OPEN_WEBUI = Path(os.environ.get("TETHER_OPEN_WEBUI") or ROOT / ".venv-openwebui" / "bin" / "open-webui")
OPEN_WEBUI_VERSION = "0.12.4"  # the Makefile's pin
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "open_webui"
RECORD = os.environ.get("TETHER_RECORD_OPEN_WEBUI") == "1"
STARTUP_S = 120.0  # Open WebUI's imports and first start (migrations, its frontend copied): ~40 s on 2 busy cores
STOP_S = 15.0
ANSWER_S = 200.0  # a chat's whole answer: the 6.5k-token prompt of its tools is read first (~50 s on 2 idle cores)
OPENAI_PREFIX = "openai"  # Open WebUI's prefix for the OpenAI connection's models, so both backends list the model
MESSAGE = "Say hello in one short sentence."


# --------------------------------------------------------------------------------------------------------------
# A recording reverse proxy: what Open WebUI really sends to tether
# --------------------------------------------------------------------------------------------------------------

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade", "host"}


@dataclass
class Exchange:
    """One request Open WebUI sent through the proxy, and tether's answer as it streamed."""

    method: str
    path: str
    body: Any
    status: int = 0
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (seconds since the request, bytes)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def text(self) -> str:
        return b"".join(chunk for _, chunk in self.chunks).decode("utf-8", "replace")

    def kind(self) -> str | None:
        """Which representative request this is (the fixture's name), or None for the rest (model lists, ...)."""
        body = self.body if isinstance(self.body, dict) else {}
        dialect = {"/api/chat": "ollama", "/v1/chat/completions": "openai"}.get(self.path)
        if self.path == "/api/embed":
            return "ollama_embed"
        if dialect is None or self.method != "POST":
            return None
        roles = [m.get("role") for m in body.get("messages") or ()]
        if "tool" in roles:  # the model called a tool, Open WebUI ran it and sends the result back
            return f"{dialect}_chat_tool_result"
        if body.get("tools"):
            return f"{dialect}_chat_tools"
        task = str((body.get("messages") or [{}])[-1].get("content", ""))
        tasks = (("a concise title", "title"), ("Predict 3-5 useful messages", "follow_ups"), ("broad tags", "tags"))
        for needle, name in tasks:  # Open WebUI's task prompts (its config.py's DEFAULT_*_PROMPT_TEMPLATE)
            if needle in task:
                return f"{dialect}_{name}"
        return f"{dialect}_other"


class Recorder:
    """A threaded HTTP proxy on 127.0.0.1 that forwards to ``target`` chunk by chunk (streams stay streams) and
    records every exchange: the test sees Open WebUI's real requests without touching tether's source."""

    def __init__(self, target: str) -> None:
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()
        self.client = httpx.Client(base_url=target, timeout=httpx.Timeout(600, connect=10))
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def forward(self) -> None:
                recorder.forward(self)

            do_GET = do_POST = do_DELETE = do_PUT = do_HEAD = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        exchange = Exchange(handler.command, handler.path, body)
        with self.lock:
            self.exchanges.append(exchange)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_BY_HOP}
        start = time.monotonic()
        try:
            request = self.client.build_request(handler.command, handler.path, content=raw, headers=headers)
            response = self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            exchange.status = 502
            exchange.chunks.append((time.monotonic() - start, repr(exc).encode()))
            exchange.done.set()
            with contextlib.suppress(OSError):
                handler.send_error(502, repr(exc))
            return
        exchange.status = response.status_code
        try:
            handler.send_response(response.status_code)
            for key, value in response.headers.items():
                if key.lower() not in HOP_BY_HOP and key.lower() != "content-encoding":
                    handler.send_header(key, value)
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            for chunk in response.iter_bytes():
                exchange.chunks.append((time.monotonic() - start, chunk))
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        except OSError:  # Open WebUI closed its end (its stop button, its shutdown): ours to tether closes too
            handler.close_connection = True
        finally:
            response.close()
            exchange.done.set()

    def of_model(self, model: str) -> list[Exchange]:
        """The generations asked of ``model``, in the order Open WebUI sent them."""
        with self.lock:
            return [e for e in self.exchanges if isinstance(e.body, dict) and e.body.get("model") == model]

    def of_kind(self, kind: str) -> list[Exchange]:
        with self.lock:
            return [e for e in self.exchanges if e.kind() == kind]

    def wait_kind(self, kind: str, timeout: float) -> Exchange:
        """The first exchange of ``kind`` once it has ended (bounded)."""
        wait_until(lambda: self.of_kind(kind), timeout, f"Open WebUI sends tether a {kind} request")
        exchange = self.of_kind(kind)[0]
        assert exchange.done.wait(timeout), f"tether's answer to the {kind} request did not end within {timeout} s"
        return exchange

    def dump(self, path: Path) -> None:
        """Every exchange (its request and tether's answer) into ``path``, to read when a test fails."""
        with self.lock:
            exchanges = list(self.exchanges)
        records = [
            {"method": e.method, "path": e.path, "kind": e.kind(), "status": e.status, "body": e.body, "answer": e.text}
            for e in exchanges
        ]
        path.write_text(json.dumps(records, indent=1, ensure_ascii=False))
        print(f"Open WebUI's requests to tether: {path}")
        for e in exchanges:
            if e.kind():
                print(f"  {e.method} {e.path} ({e.kind()}): {e.status}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()


def save_fixtures(recorder: Recorder) -> None:
    """The first request of each representative kind, as Open WebUI sent it, with the status tether gave it."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    saved: set[str] = set()
    with recorder.lock:
        exchanges = list(recorder.exchanges)
    for exchange in exchanges:
        kind = exchange.kind()
        if kind is None or kind in saved or kind.endswith("_other"):
            continue
        saved.add(kind)
        record = {
            "recorded_from": f"Open WebUI {OPEN_WEBUI_VERSION}, default setup, against tether serve",
            "method": exchange.method,
            "path": exchange.path,
            "body": exchange.body,
        }
        (FIXTURES / f"{kind}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        print(f"fixture: {FIXTURES / kind}.json ({exchange.status})")


# --------------------------------------------------------------------------------------------------------------
# Open WebUI as a child process
# --------------------------------------------------------------------------------------------------------------


def open_webui_missing() -> str | None:
    if not os.access(OPEN_WEBUI, os.X_OK):
        return f"Open WebUI is not installed at {OPEN_WEBUI} (`make openwebui` installs it; `make test` does)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def open_webui_env(data_dir: Path, backend: str) -> dict[str, str]:
    """Open WebUI offline and single-user, its data in ``data_dir``, both its backends ``backend`` (tether)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLLAMA", "OPENAI", "TETHER", "PYTEST"))}
    env.update(
        DATA_DIR=str(data_dir),
        WEBUI_AUTH="False",  # single user, no sign-in (that user is the admin)
        WEBUI_SECRET_KEY="tether-test",  # else it writes .webui_secret_key into its working directory
        OFFLINE_MODE="true",  # no version check, no model downloads, no pip installs for tools
        HF_HUB_OFFLINE="1",
        ANONYMIZED_TELEMETRY="false",
        DO_NOT_TRACK="true",
        SCARF_NO_ANALYTICS="true",
        RAG_EMBEDDING_ENGINE="ollama",  # RAG embeds with tether (/api/embed), not a model it would download
        RAG_EMBEDDING_MODEL=EMBED,
        OLLAMA_BASE_URL=backend,
        OPENAI_API_BASE_URL=f"{backend}/v1",
        OPENAI_API_KEY="none",
        OPENAI_API_CONFIGS=json.dumps({"0": {"prefix_id": OPENAI_PREFIX}}),
        # Greedy, as a user pins a model's sampling in its Advanced Params: sampled at Open WebUI's default, the
        # 135M model now and then calls its tools in a loop until the prompt outgrows n_ctx (a clear 400 from
        # tether, as from llama-server), so what a run tests would be the dice's, not tether's.
        DEFAULT_MODEL_PARAMS=json.dumps({"temperature": 0}),
    )
    return env


class OpenWebUI:
    """``open-webui serve`` on a free port in its own process group, its output in a log file; ``stop`` is
    bounded and leaves no process of the group."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "open-webui.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(OPEN_WEBUI), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"Open WebUI exited ({code}) before it was healthy; its log ends:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)  # polling a port that answers nothing yet: no event to wait on
        raise AssertionError(f"Open WebUI was not healthy within {timeout} s; its log ends:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        if group_members(self.proc.pid):  # a helper it started outlived it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        wait_until(lambda: not group_members(self.proc.pid), 5, f"Open WebUI's processes (group {self.proc.pid}) gone")


# --------------------------------------------------------------------------------------------------------------
# The stack: tether, the proxy, Open WebUI, one browser session
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Stack:
    server: Server
    model: str
    recorder: Recorder
    webui: OpenWebUI
    browser: Browser
    timings: dict[str, float]


@pytest.fixture(scope="module")
def stack(open_webui_server: Server, browser: Browser, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """tether (``open_webui_server``: the default model at its default context, and an embedding instance for RAG),
    the recording proxy, and Open WebUI pointed at it (Ollama and OpenAI), started once for the module and stopped
    (bounded) after it."""
    missing = open_webui_missing()
    if missing:
        pytest.skip(missing)
    server = open_webui_server
    workdir = tmp_path_factory.mktemp("open-webui")
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    model = next(m["id"] for m in server.http.get("/v1/models").json()["data"] if m["id"] != EMBED)
    recorder = Recorder(server.url)
    webui = OpenWebUI(workdir, open_webui_env(workdir / "data", recorder.url))
    try:
        webui.wait_healthy()
        timings["startup_s"] = round(time.monotonic() - t0, 1)
        ready = Stack(server, model, recorder, webui, browser, timings)
        first_visit(ready)
        yield ready
    finally:
        webui.stop()
        recorder.close()
        recorder.dump(workdir / "exchanges.json")
        if RECORD:
            save_fixtures(recorder)
        print(f"Open WebUI against tether, timings: {timings}")


def first_visit(stack: Stack) -> None:
    """A fresh Open WebUI shows its admin (the no-sign-in user) the release notes once: see them off, so each
    test starts from the chat page."""
    from playwright.sync_api import expect

    context = stack.browser.new_context(viewport={"width": 1366, "height": 768})
    try:
        page = context.new_page()
        page.goto(stack.webui.url, timeout=60_000)
        page.get_by_role("button", name="Okay, Let's Go!").click(timeout=60_000)
        expect(page.get_by_role("button", name="Okay, Let's Go!")).to_be_hidden()
    finally:
        context.close()


@pytest.fixture
def page(stack: Stack) -> Iterator[Page]:
    context = stack.browser.new_context(viewport={"width": 1366, "height": 768})
    tab = context.new_page()
    tab.set_default_timeout(30_000)
    try:
        yield tab
    finally:
        context.close()


# What the page showed of the answer, each time it changed: [seconds since sending, characters, done?]. "done" is
# Open WebUI's own: it shows the answer's copy button only once the message is done.
WATCH = """() => {
    window.__answer = [];
    const t0 = performance.now();
    const look = () => {
        const answers = document.querySelectorAll('#response-content-container');
        if (!answers.length) return;
        const text = answers[answers.length - 1].innerText.trim();
        const done = document.querySelectorAll('.copy-response-button').length > 0;
        const last = window.__answer[window.__answer.length - 1];
        if (!last || last[1] !== text.length || last[2] !== done)
            window.__answer.push([(performance.now() - t0) / 1000, text.length, done]);
    };
    new MutationObserver(look).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""

# Open WebUI's record of the chat the page is showing (the no-sign-in user's token is in localStorage).
STORED_CHAT = """async () => {
    const id = location.pathname.split('/c/')[1];
    const r = await fetch('/api/v1/chats/' + id, {headers: {Authorization: 'Bearer ' + localStorage.token}});
    return await r.json();
}"""


@dataclass
class Answer:
    seen: list[tuple[float, int, bool]]  # what the page showed, as WATCH records it
    message: dict[str, Any]  # Open WebUI's stored assistant message
    text: str  # the page's final text of the answer


def chat(stack: Stack, page: Page, model_id: str, message: str = MESSAGE) -> Answer:
    """Pick ``model_id`` in Open WebUI's model selector, send ``message`` as a user would, wait (bounded) for the
    answer to be done; what the page showed meanwhile, and what Open WebUI stored."""
    from playwright.sync_api import expect

    page.goto(stack.webui.url)
    selector = page.locator("#model-selector-model-button")
    selector.click()
    page.locator(f'button[role="option"][data-value="{model_id}"]').click()
    expect(selector).to_have_attribute("aria-label", f"Selected model: {model_id}")
    page.evaluate(WATCH)
    page.locator("#chat-input").click()
    page.keyboard.type(message)
    sent = time.monotonic()
    page.locator("#send-message-button").click()
    expect(page.locator(".copy-response-button")).to_be_visible(timeout=ANSWER_S * 1000)
    stack.timings[f"{model_id} answer_s"] = round(time.monotonic() - sent, 1)
    seen = [(float(t), int(n), bool(d)) for t, n, d in page.evaluate("window.__answer")]
    stored = page.evaluate(STORED_CHAT)
    messages = stored["chat"]["history"]["messages"]
    message = next(m for m in messages.values() if m["role"] == "assistant")
    text = page.locator("#response-content-container").last.inner_text().strip()
    return Answer(seen, message, text)


def assert_streamed(answer: Answer, exchange: Exchange) -> None:
    """The answer appeared in the page and grew before it was done, and finished without an error."""
    assert not answer.message.get("error"), f"Open WebUI shows an error: {answer.message['error']}"
    assert answer.message.get("done") is True, answer.message
    assert answer.text, "the answer is empty in the page"
    growing = sorted({n for _, n, done in answer.seen if n > 0 and not done})
    assert len(growing) >= 2, f"the answer did not grow in the page before it was done (seen: {answer.seen})"
    assert exchange.status == 200, f"tether answered {exchange.status}: {exchange.text[:2000]}"
    parts = [t for t, chunk in exchange.chunks if chunk.strip()]
    assert len(parts) >= 3 and parts[-1] > parts[0], f"tether's answer did not stream: {len(parts)} chunks"


# --------------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------------


def test_a_chat_streams_with_tether_as_the_ollama_backend(stack: Stack, page: Page) -> None:
    answer = chat(stack, page, stack.model)
    request = stack.recorder.wait_kind("ollama_chat_tools", 5)
    assert len(request.body["tools"]) >= 30, "Open WebUI's default setup attaches its built-in tools"
    assert_streamed(answer, request)
    lines = [json.loads(line) for line in request.text.splitlines() if line.strip()]
    assert lines[-1]["done"] is True, lines[-1]
    title = stack.recorder.wait_kind("ollama_title", ANSWER_S)
    assert title.status == 200, f"the title task: tether answered {title.status}: {title.text[:2000]}"


def test_rag_embeds_through_the_ollama_backend(stack: Stack, page: Page) -> None:
    """A file uploaded to Open WebUI is chunked and embedded with tether's /api/embed (Open WebUI's RAG)."""
    page.goto(stack.webui.url)
    page.wait_for_function("Boolean(localStorage.token)")  # the no-sign-in user's session, once the app has it
    uploaded = page.evaluate(
        """async () => {
            const form = new FormData();
            form.append('file', new File(['tether supervises runners. ' .repeat(200)], 'notes.txt',
                                         {type: 'text/plain'}));
            const r = await fetch('/api/v1/files/?process=true&process_in_background=false', {
                method: 'POST', body: form, headers: {Authorization: 'Bearer ' + localStorage.token}});
            return {status: r.status, body: await r.json()};
        }"""
    )
    assert uploaded["status"] == 200, uploaded
    embed = stack.recorder.wait_kind("ollama_embed", 60)
    assert embed.status == 200, f"tether answered /api/embed {embed.status}: {embed.text[:2000]}"
    assert embed.body["model"] == EMBED and embed.body.get("truncate") is True, embed.body
    token = page.evaluate("localStorage.token")
    file_url = f"{stack.webui.url}/api/v1/files/{uploaded['body']['id']}"

    def processed() -> bool:
        stored = httpx.get(file_url, headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
        status = (stored.get("data") or {}).get("status")
        assert status != "failed", f"Open WebUI could not process the file: {stored['data']}"
        return status == "completed"

    wait_until(processed, 60, "Open WebUI has the uploaded file chunked and embedded")


def test_a_chat_streams_with_tether_as_the_openai_backend(stack: Stack, page: Page) -> None:
    answer = chat(stack, page, f"{OPENAI_PREFIX}.{stack.model}")
    request = stack.recorder.wait_kind("openai_chat_tools", 5)
    assert len(request.body["tools"]) >= 30, "Open WebUI's default setup attaches its built-in tools"
    assert_streamed(answer, request)
    assert request.text.rstrip().endswith("data: [DONE]"), request.text[-500:]


THINKER = "thinker"
# Open WebUI's built-in tool categories (a model's meta.builtinTools switches each; unset is on)
BUILTIN_TOOLS = (
    "time", "user_input", "files", "knowledge", "chats", "subagents", "memory", "web_search", "image_generation",
    "code_interpreter", "notes", "channels", "skills", "tasks", "automations", "calendar", "notifications",
)  # fmt: skip
# A model's settings in Open WebUI (its admin's Workspace → Models), saved with the no-sign-in user's token.
MODEL_SETTINGS = """async (model) => {
    const r = await fetch('/api/v1/models/create', {method: 'POST', body: JSON.stringify({params: {}, ...model}),
        headers: {Authorization: 'Bearer ' + localStorage.token, 'Content-Type': 'application/json'}});
    return {status: r.status, body: await r.text()};
}"""
TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"
SCREENSHOT = "open-webui-thinking.png"
MAX_TOKENS = 400  # a reply's bound in the thinking model's settings: its thinking, a call and an answer take ~100


def test_a_thinking_model_shows_its_thinking_and_a_tool_call_after_it_runs(
    stack: Stack, page: Page, tmp_path: Path
) -> None:
    """A reasoning model (a Qwen3-style template with Hermes calls over the default model's weights) as Open WebUI's
    Ollama backend, with its time tools (the model's settings in Open WebUI keep that one category of its built-in
    tools, so the prompt is short): the thinking shows in Open WebUI's collapsible thinking block with the answer
    below it, and the tool call the model makes after its thinking runs; Open WebUI then sends the turn back with
    its ``thinking`` (an Ollama message's), which tether accepts."""
    # deterministic: the greedy answer (this 135M model's call) is the request's own, whatever its prompt's prefill
    # shared a batch with or took from the cache (greedy alone, a 7k-token prompt gave a call cold and none warm)
    options = {"chat_template": str(TEMPLATES / "think-tools.jinja"), "parallel": 2, "deterministic": True}
    stack.server.add_instance({"id": THINKER, "options": options}, 90)
    page.goto(stack.webui.url)
    page.wait_for_function("Boolean(localStorage.token)")
    only_time = {category: category == "time" for category in BUILTIN_TOOLS}
    # and its Max Tokens: the tool's result carries the time to the second, so each run's greedy answer is another
    # text, and in one of four make test runs it repeated the result until the context was full (7,573 tokens,
    # 160 s)
    meta, params = {"builtinTools": only_time}, {"max_tokens": MAX_TOKENS}
    settings = {"id": THINKER, "name": THINKER, "meta": meta, "params": params}
    made = page.evaluate(MODEL_SETTINGS, settings)
    assert made["status"] == 200, made
    answer = chat(stack, page, THINKER, "What is the date today? Call a tool.")
    asked = [e for e in stack.recorder.of_model(THINKER) if e.body.get("tools")]  # the chat (not its title task)
    first = asked[0]
    assert first.done.wait(5) and first.status == 200, f"tether answered {first.status}: {first.text[:2000]}"
    lines = [json.loads(line) for line in first.text.splitlines() if line.strip()]
    thought = [i for i, line in enumerate(lines) if line.get("message", {}).get("thinking")]
    called = [i for i, line in enumerate(lines) if line.get("message", {}).get("tool_calls")]
    assert thought and called and max(thought) < min(called), "the model thought, then called a tool"
    name = lines[called[0]]["message"]["tool_calls"][0]["function"]["name"]
    assert name in [t["function"]["name"] for t in first.body["tools"]], name

    def results() -> list[Exchange]:
        return [e for e in stack.recorder.of_model(THINKER) if any(m.get("role") == "tool" for m in e.body["messages"])]

    wait_until(results, ANSWER_S, "Open WebUI sends the tool's result")
    follow = results()[0]
    assert follow.done.wait(ANSWER_S) and follow.status == 200, f"{follow.status}: {follow.text[:2000]}"
    sent = [m for m in follow.body["messages"] if m.get("role") == "assistant" and m.get("tool_calls")]
    assert sent and sent[0].get("thinking"), "Open WebUI sends the thinking back (an Ollama message's)"
    assert not answer.message.get("error"), answer.message
    assert answer.text, "the answer is empty in the page"
    from playwright.sync_api import expect

    # Open WebUI folds the thinking and the call into one group ("Explored get_current_timestamp") above the
    # answer: opened, it shows the thinking block, and that opened, the thinking
    page.get_by_role("button", name="Toggle details").first.click()
    before_call = page.get_by_text("Thought", exact=True).first  # the thinking that led to the call
    expect(before_call).to_be_visible()
    expect(page.get_by_text("View Result from get_current_timestamp").first).to_be_visible()  # the call that ran
    before_call.click()
    expect(page.get_by_text("Thought for").first).to_be_visible()  # and the thinking after the tool's result
    folder = Path(os.environ.get("TETHER_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / SCREENSHOT), full_page=True, animations="disabled")
    print(f"screenshot: {folder / SCREENSHOT}")
    if os.environ.get("TETHER_UPDATE_DOCS") == "1":  # the clients page's picture
        shutil.copyfile(folder / SCREENSHOT, ROOT / "docs" / SCREENSHOT)
