"""The dashboard (``GET /``) in a real headless Chromium against a live ``tether serve --engine debug``.

Debian's ``chromium`` driven by Playwright for Python (``executable_path``: Playwright's own browser download is not
used). Every wait is Playwright's bounded ``expect`` / ``wait_for`` on what the page shows, or ``wait_until`` on the
server; nothing sleeps to let things settle. Screenshots go to ``$TETHER_SCREENSHOTS`` (else the test's tmp_path),
and with ``TETHER_UPDATE_DOCS=1`` also to ``docs/`` for the README.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from conftest import WAIT_MS, Server, debug_server, pid_alive, wait_until

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page, ViewportSize

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_runners")]

DOCS = Path(__file__).resolve().parent.parent / "docs"
VIEWPORT: ViewportSize = {"width": 1366, "height": 768}  # a laptop screen: the page must work there
NO_RATE = re.compile("^(0|\N{EN DASH}|n/a)$")  # what the tokens/s figure says before a stream shows in it


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab (its own sessionStorage) at 1366x768 that fails the test on any uncaught script error."""
    context = browser.new_context(viewport=VIEWPORT, color_scheme="light")
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.set_default_timeout(WAIT_MS)
    try:
        yield tab
    finally:
        context.close()
    assert not errors, f"the page raised: {errors}"


DOCS_SHOTS = {"overview", "failure"}  # the README's pictures


def screenshot(page: Page, name: str, tmp_path: Path) -> Path:
    """Save the viewport as dashboard-``name``.png (printing where); the README's also into docs/ when
    TETHER_UPDATE_DOCS=1."""
    folder = Path(os.environ.get("TETHER_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"dashboard-{name}.png"
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")
    if name in DOCS_SHOTS and os.environ.get("TETHER_UPDATE_DOCS") == "1":
        DOCS.mkdir(exist_ok=True)
        shutil.copyfile(path, DOCS / path.name)
        print(f"screenshot: {DOCS / path.name}")
    return path


def card(page: Page, instance_id: str) -> Locator:
    return page.locator(f'[data-testid="instance"][data-instance="{instance_id}"]')


def next_poll(page: Page) -> None:
    """Wait for the page's next successful poll of /v1/instances (it counts them on <body data-polls>)."""
    from playwright.sync_api import expect

    seen = page.evaluate("document.body.dataset.polls || '0'")
    expect(page.locator("body")).not_to_have_attribute("data-polls", seen, timeout=5_000)


def process_listed(pid: int) -> bool:
    """Whether ``ps`` lists ``pid`` (the check an operator would run)."""
    return subprocess.run(["ps", "-p", str(pid)], capture_output=True, timeout=10).returncode == 0


@dataclass
class Stream:
    """A streaming completion in a thread, so the test can act while it runs; its outcome when it ends."""

    server: Server
    model: str
    lines: list[str] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "go on", "max_tokens": 100_000, "stream": True}
        try:
            with self.server.http.stream("POST", "/v1/completions", json=body, timeout=60) as response:
                self.lines.extend(line for line in response.iter_lines() if line)
        except (httpx.HTTPError, OSError) as exc:
            self.error = exc

    def wait(self, timeout: float = 20) -> str:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the stream to {self.model} did not end within {timeout} s"
        return "\n".join(self.lines)


def slow_instance(server: Server, instance_id: str, **config: Any) -> dict[str, Any]:
    """A debug instance that streams about 50 tokens/s, so a stream lasts until the test ends it."""
    return server.add_instance({"id": instance_id, "engine": "debug", "options": {"token_seconds": 0.02}, **config})


# --------------------------------------------------------------------------------------------------------------


def test_the_page_shows_the_default_instance_ready(page: Page, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with debug_server() as server:
        listed = server.http.get("/v1/instances").json()
        pid = listed["data"][0]["runner"]["pid"]
        page.goto(server.url)
        debug = card(page, "debug")
        expect(debug).to_have_attribute("data-ready", "true")
        expect(debug.get_by_test_id("instance-state")).to_have_text("ready")
        expect(debug.get_by_test_id("instance-pid")).to_have_text(str(pid))
        expect(debug.get_by_test_id("instance-life")).to_have_text("1")
        expect(debug.get_by_test_id("instance-restarts")).to_have_text("0")
        expect(debug.get_by_test_id("instance-resumed")).to_have_text("0 / 0")  # resumed / could not
        expect(debug.get_by_test_id("instance-store")).to_have_text("0 B")  # no prompt saved beyond its runner
        expect(debug.get_by_test_id("instance-running")).to_have_text("0 of 1")
        expect(debug.get_by_test_id("instance-waiting")).to_have_text("0 of 16")
        expect(debug.get_by_test_id("instance-footprint")).to_have_text(re.compile(r"^[0-9.]+ (KiB|MiB|GiB)$"))
        no_figure = "\u2013"  # the page's dash where there is no figure: no NVIDIA GPU here (NVML says why)
        expect(debug.get_by_test_id("instance-vram")).to_have_text(no_figure)
        expect(debug.get_by_test_id("instance-gpu-layers")).to_have_text(no_figure)
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
        expect(page.get_by_test_id("login")).to_be_hidden()
        node = page.get_by_test_id("node").first
        expect(node.get_by_test_id("node-memory-source")).to_contain_text(listed["node"]["memory"]["source"])
        expect(node.get_by_test_id("node-available")).to_have_text(re.compile(r"^[0-9.]+ (MiB|GiB|TiB)$"))
        expect(page.get_by_test_id("catalog-model").filter(has_text="debug").first).to_contain_text("loaded")
        expect(page.get_by_test_id("no-failures")).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth <= innerWidth"), "wider than 1366 px"
        screenshot(page, "ready", tmp_path)

        # Light by the system's preference here; the toggle goes light, then dark, and is remembered.
        light = page.evaluate("getComputedStyle(document.body).backgroundColor")
        toggle = page.get_by_test_id("theme-toggle")
        toggle.click()
        expect(toggle).to_have_text("theme: light")
        toggle.click()
        expect(page.locator("html")).to_have_attribute("data-theme", "dark")
        assert page.evaluate("getComputedStyle(document.body).backgroundColor") != light
        screenshot(page, "ready-dark", tmp_path)
        page.reload()
        expect(page.locator("html")).to_have_attribute("data-theme", "dark")

        # The shell is static and strict; Ollama's clients probing / still get their answer.
        shell = httpx.get(f"{server.url}/", headers={"Accept": "text/html"})
        assert shell.status_code == 200 and "app.js" in shell.text
        assert "script-src 'self'" in shell.headers["content-security-policy"]
        assert "Ollama is running" in httpx.get(f"{server.url}/").text
        assert httpx.get(f"{server.url}/ui/app.js").headers["content-type"].startswith("text/javascript")
        assert httpx.get(f"{server.url}/ui/nope.js").status_code == 404
        assert httpx.head(f"{server.url}/").status_code == 200  # the `ollama` CLI's heartbeat

        # The server gone: the page says its figures are old instead of showing them as live.
        server.stop()
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "down")
        expect(page.get_by_test_id("connection-text")).to_contain_text("cannot reach the server")


def test_a_runner_killed_mid_stream_appears_on_the_open_page_with_its_cause(page: Page, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with debug_server() as server:
        slow_instance(server, "slow", restart={"initial_backoff": 1.0}, resume=False)  # the stream ends with the cause
        # A second instance whose runner crashes in native code: its failure carries a faulthandler stack.
        server.add_instance(
            {
                "id": "crashy",
                "engine": "debug",
                "faults": [{"kind": "segv", "phase": "generate", "after_tokens": 3}],
                "restart": {"initial_backoff": 3.0},
                "resume": False,
            }
        )
        page.goto(server.url)
        slow = card(page, "slow")
        expect(slow).to_have_attribute("data-ready", "true")
        page.evaluate("window.__loadedOnce = true")  # gone if the page reloads

        stream = Stream(server, "slow")
        expect(slow.get_by_test_id("request")).to_have_count(1)  # the page lists it as in flight
        expect(slow.get_by_test_id("instance-running")).to_have_text("1 of 1")
        expect(slow.get_by_test_id("instance-tps")).not_to_have_text(NO_RATE)  # tokens/s now, from two polls
        pid = server.instance("slow")["runner"]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        failure = page.locator('[data-testid="failure"][data-instance="slow"]')
        expect(failure).to_be_visible(timeout=2_000)  # the promise: on the open page within 2 s
        print(f"the SIGKILL showed on the page {time.monotonic() - killed:.2f} s after it was sent")
        expect(failure.get_by_test_id("failure-summary")).to_contain_text("SIGKILL")
        expect(failure.get_by_test_id("failure-kind")).to_have_text("signal")
        expect(failure.get_by_test_id("failure-meta")).to_contain_text(f"pid {pid}")
        assert page.evaluate("window.__loadedOnce") is True, "the page reloaded"
        assert "SIGKILL" in stream.wait(), "the stream did not end with the cause"

        evidence = failure.get_by_test_id("failure-evidence")
        expect(evidence).not_to_have_attribute("open", "")
        evidence.locator("summary").click()
        expect(evidence).to_have_attribute("open", "")
        facts = evidence.get_by_test_id("failure-facts")
        expect(facts).to_be_visible()
        expect(facts).to_contain_text("SIGKILL")
        expect(facts).to_contain_text("generating")
        next_poll(page)
        next_poll(page)
        expect(evidence).to_have_attribute("open", "")  # polls update the page in place: it stays open

        # The native crash: its stack is the evidence.
        assert server.http.post("/v1/completions", json={"model": "crashy", "prompt": "x"}).status_code == 500
        crash = page.locator('[data-testid="failure"][data-instance="crashy"]')
        expect(crash.get_by_test_id("failure-kind")).to_have_text("native_crash")
        crashy = card(page, "crashy")
        expect(crashy.get_by_test_id("instance-state")).to_have_text("restarting")  # for 3 s (+ jitter)
        expect(crashy.get_by_test_id("instance-backoff")).to_have_text(re.compile(r"^[0-3]\.[0-9] s$"))
        expect(crashy.get_by_test_id("instance-reason")).to_contain_text("Segmentation fault")
        crash.get_by_test_id("failure-evidence").locator("summary").click()
        expect(crash.get_by_test_id("failure-evidence-lines")).to_contain_text("Segmentation fault")

        # The runner's log of the failed life, in a panel.
        failure.get_by_test_id("failure-log").click()
        panel = page.get_by_test_id("log-panel")
        expect(panel).to_have_attribute("data-state", "loaded")
        expect(page.get_by_test_id("log-meta")).to_contain_text("life 1")
        expect(page.get_by_test_id("log-meta")).to_contain_text("runner-slow-1")
        page.get_by_test_id("log-close").click()
        expect(panel).to_be_hidden()
        assert page.evaluate("document.documentElement.scrollWidth <= innerWidth"), "wider than 1366 px"
        page.get_by_test_id("failure-group").first.evaluate("e => e.scrollIntoView({block: 'start'})")
        page.evaluate("window.scrollBy(0, -56)")  # below the sticky bar
        screenshot(page, "failure", tmp_path)

        # The instance comes back with a new life; a new stream shows live, and the page can cancel it.
        expect(slow.get_by_test_id("instance-life")).to_have_text("2")
        expect(slow).to_have_attribute("data-ready", "true")
        expect(slow.get_by_test_id("instance-restarts")).to_have_text("1")
        again = Stream(server, "slow")
        request = slow.get_by_test_id("request")
        expect(request).to_have_count(1)
        # At full pace (~50 tokens/s) once two seconds of the stream are in the rate: at least 10 even on a busy box.
        expect(slow.get_by_test_id("instance-tps")).to_have_text(re.compile(r"^([1-9][0-9](\.[0-9])?|[1-9][0-9]{2,})$"))
        page.evaluate("window.scrollTo(0, 0)")
        screenshot(page, "overview", tmp_path)
        request.get_by_test_id("request-cancel").click()
        expect(page.get_by_test_id("confirm")).to_be_visible()
        page.get_by_test_id("confirm-ok").click()
        expect(page.get_by_test_id("toast").filter(has_text="Cancel request")).to_contain_text("requested")
        again.wait()
        expect(request).to_have_count(0)
        assert server.instance("slow")["restarts"] == 1  # a cancel ends the request, not the runner


def test_stopping_an_instance_from_the_page_stops_its_runner(page: Page) -> None:
    from playwright.sync_api import expect

    with debug_server() as server:
        victim = server.add_instance({"id": "victim", "engine": "debug"})
        pid = victim["runner"]["pid"]
        assert process_listed(pid)
        page.goto(server.url)
        target = card(page, "victim")
        expect(target).to_have_attribute("data-ready", "true")

        target.get_by_test_id("instance-stop").click()  # asked, then cancelled: nothing happens
        expect(page.get_by_test_id("confirm-body")).to_contain_text(f"pid {pid}")
        page.get_by_test_id("confirm-cancel").click()
        expect(page.get_by_test_id("confirm")).to_be_hidden()
        next_poll(page)
        assert process_listed(pid) and server.instance("victim")["ready"]

        target.get_by_test_id("instance-stop").click()
        page.get_by_test_id("confirm-ok").click()
        toast = page.get_by_test_id("toast").filter(has_text="victim")
        expect(toast).to_contain_text("deleted")
        wait_until(lambda: not pid_alive(pid), 15, f"runner {pid} gone")
        assert not process_listed(pid), f"ps still lists runner {pid}"
        expect(target).to_have_count(0)
        expect(card(page, "debug")).to_have_attribute("data-ready", "true")  # the other instance serves on
        assert server.http.get("/v1/instances/victim").status_code == 404


def test_with_an_api_key_the_page_shows_nothing_until_logged_in(page: Page) -> None:
    from playwright.sync_api import expect

    with debug_server(api_key="s3cret-key") as server:
        pid = server.instance("debug")["runner"]["pid"]
        assert httpx.get(f"{server.url}/v1/instances").status_code == 401
        assert httpx.get(f"{server.url}/ui/app.js").status_code == 200  # the shell carries no data
        page.goto(server.url)
        expect(page.get_by_test_id("login-form")).to_be_visible()
        expect(page.get_by_test_id("app")).to_be_hidden()
        expect(page.get_by_test_id("connection-text")).to_have_text("API key needed")
        assert page.get_by_test_id("instance").count() == 0
        assert str(pid) not in page.content()

        page.get_by_test_id("login-key").fill("wrong")
        page.get_by_test_id("login-submit").click()
        expect(page.get_by_test_id("login-error")).to_contain_text("refused")
        expect(page.get_by_test_id("app")).to_be_hidden()
        assert page.get_by_test_id("instance").count() == 0

        page.get_by_test_id("login-key").fill("s3cret-key")
        page.get_by_test_id("login-submit").click()
        expect(card(page, "debug")).to_have_attribute("data-ready", "true")
        expect(card(page, "debug").get_by_test_id("instance-pid")).to_have_text(str(pid))
        expect(page.get_by_test_id("login")).to_be_hidden()
        assert page.evaluate("sessionStorage.getItem('tether.apiKey')") == "s3cret-key"

        page.reload()  # the key lasts as long as the tab
        expect(card(page, "debug")).to_have_attribute("data-ready", "true")
        page.get_by_test_id("logout").click()
        expect(page.get_by_test_id("login-form")).to_be_visible()
        assert page.get_by_test_id("instance").count() == 0
        assert page.evaluate("sessionStorage.getItem('tether.apiKey')") is None


def test_starting_an_instance_and_loading_a_model_from_the_page(page: Page, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    catalog = tmp_path / "catalog.toml"
    catalog.write_text('keep_alive = "5m"\n\n[[models]]\nid = "spare"\nengine = "debug"\n')
    with debug_server("--catalog", str(catalog)) as server:
        page.goto(server.url)
        expect(card(page, "debug")).to_have_attribute("data-ready", "true")

        form = page.get_by_test_id("start-form")
        form.get_by_test_id("start-id").fill("formed")
        form.get_by_test_id("start-engine").fill("debug")
        form.get_by_test_id("start-options").fill('{"parallel": 2}')
        form.get_by_test_id("start-submit").click()
        expect(page.get_by_test_id("confirm-body")).to_contain_text('"id":"formed"')
        page.get_by_test_id("confirm-ok").click()
        expect(page.get_by_test_id("toast").filter(has_text="formed: created")).to_be_visible()
        expect(card(page, "formed")).to_have_attribute("data-ready", "true")
        expect(card(page, "formed").get_by_test_id("instance-running")).to_have_text("0 of 2")
        assert server.instance("formed")["options"] == {"parallel": 2}

        form.get_by_test_id("start-id").fill("formed")  # the same id again: the server's refusal is shown
        form.get_by_test_id("start-submit").click()
        page.get_by_test_id("confirm-ok").click()
        refused = page.locator('[data-testid="toast"][data-kind="error"]')
        expect(refused).to_contain_text("409")
        expect(refused).to_contain_text("formed")

        form.get_by_test_id("start-options").fill("{not json")  # refused before asking the server
        form.get_by_test_id("start-submit").click()
        expect(page.get_by_test_id("start-error")).to_contain_text("options")
        expect(page.get_by_test_id("confirm")).to_be_hidden()

        spare = page.locator('[data-testid="catalog-model"][data-model="spare"]')
        expect(spare).to_contain_text("unloaded")
        spare.get_by_test_id("catalog-load").click()
        page.get_by_test_id("confirm-ok").click()
        expect(page.get_by_test_id("toast").filter(has_text="spare: load")).to_be_visible()
        expect(card(page, "spare")).to_have_attribute("data-ready", "true")
        expect(spare.locator(".model-state")).to_have_text("loaded")
        assert server.instance("spare")["ready"]


def test_a_clusters_nodes_ranks_replicas_and_gpus_are_shown(page: Page) -> None:
    """What only a Ray cluster or a GPU produces, added to a live server's answers (same shapes as
    ``GET /v1/instances`` gives there), so the page's rendering of them is checked here too."""
    from playwright.sync_api import Route, expect

    node_a, node_b = "a1" * 28, "b2" * 28
    gib = 1 << 30

    def augment(route: Route) -> None:
        response = route.fetch()
        body = response.json()
        body["node"]["gpus"] = [{"index": 0, "name": "NVIDIA H200", "used": 3 * gib, "total": 141 * gib}]
        report = {"available": 100 * gib, "source": "host MemAvailable", "host_total": 128 * gib, "cgroup_limit": None}
        body["cluster"] = {
            "address": "10.0.0.1:6379",
            "nodes": [
                {
                    "node": node_a,
                    "host": "10.0.0.2",
                    "agent_pid": 4242,
                    "state": "alive",
                    "cause": None,
                    "heard_ago": 0.2,
                    "lost_at": None,
                    "ray_notified_at": None,
                    "memory": report,
                    "runners": ["debug"],
                },
                {
                    "node": node_b,
                    "host": "10.0.0.3",
                    "agent_pid": 4343,
                    "state": "lost",
                    "cause": "no heartbeat for 3.1 s",
                    "heard_ago": 3.1,
                    "lost_at": 1.0,
                    "ray_notified_at": None,
                    "memory": None,
                    "runners": [],
                },
            ],
            "events": [{"at": time.time(), "node": node_b, "kind": "lost", "why": "no heartbeat for 3.1 s"}],
            "lost_after": 3.0,
            "lease": 10.0,
        }
        inst = body["data"][0]
        inst["ranks"] = [
            {
                "rank": 0,
                "address": "10.0.0.2:25100",
                "node": node_a,
                "pid": 11,
                "status": "ready",
                "alive": True,
                "log": None,
            },
            {
                "rank": 1,
                "address": "10.0.0.3:25101",
                "node": node_b,
                "pid": 12,
                "status": None,
                "alive": False,
                "log": None,
            },
        ]
        inst["replicas"] = [
            {
                "name": "debug.r0",
                "state": "ready",
                "node": node_a,
                "pid": 11,
                "serving": 1,
                "restarts": 0,
                "cause": None,
            },
            {
                "name": "debug.r1",
                "state": "restarting",
                "node": node_b,
                "pid": None,
                "serving": 0,
                "restarts": 1,
                "cause": {"kind": "node_lost", "summary": "node b2b2b2b2 lost: no heartbeat for 3.1 s"},
            },
        ]
        route.fulfill(response=response, json=body)

    with debug_server() as server:
        page.route("**/v1/instances", augment)
        page.goto(server.url)
        nodes = page.get_by_test_id("node")
        expect(nodes).to_have_count(3)  # the coordinator and two agents' nodes
        expect(nodes.nth(0)).to_contain_text("coordinator")
        expect(nodes.nth(0).get_by_test_id("node-gpu")).to_contain_text("NVIDIA H200: 3.00 GiB used of 141 GiB")
        expect(nodes.nth(1)).to_contain_text("10.0.0.2")
        expect(nodes.nth(1).get_by_test_id("node-available")).to_have_text("100 GiB")
        expect(nodes.nth(2).locator(".node-state")).to_have_text("lost")
        expect(nodes.nth(2)).to_contain_text("no heartbeat for 3.1 s")
        debug = card(page, "debug")
        expect(debug.get_by_test_id("instance-ranks")).to_contain_text("2 ranks")
        expect(debug.get_by_test_id("instance-ranks").locator("tr").nth(2)).to_contain_text("gone")
        expect(debug.get_by_test_id("instance-replicas")).to_contain_text("node b2b2b2b2 lost")
        expect(page.get_by_test_id("cluster-events")).to_contain_text("no heartbeat for 3.1 s")
        assert page.evaluate("document.documentElement.scrollWidth <= innerWidth"), "wider than 1366 px"
        page.unroute_all(behavior="wait")  # a poll's handler in flight finishes while the server still answers


def test_an_instance_shows_the_drafts_kept_and_tokens_per_step_once_it_has_drafted(page: Page, tmp_path: Path) -> None:
    """A dash while an instance has drafted nothing (the debug engine never drafts, though it counts its steps);
    once it has, the share of drafted tokens kept and the tokens per step, added to the live server's answer as a
    llama.cpp instance that speculated reports them."""
    from playwright.sync_api import Route, expect

    with debug_server() as server:
        answer = server.http.post("/v1/completions", json={"model": "debug", "prompt": "x", "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        wait_until(lambda: server.instance("debug")["speculation"]["decode_steps"] == 4, 10, "its steps counted")
        page.goto(server.url)
        debug = card(page, "debug")
        expect(debug).to_have_attribute("data-ready", "true")
        expect(debug.get_by_test_id("instance-drafts-kept")).to_have_text("\N{EN DASH}")
        expect(debug.get_by_test_id("instance-tokens-per-step")).to_have_text("\N{EN DASH}")

        def drafted(route: Route) -> None:
            response = route.fetch()
            body = response.json()
            speculation = {"draft_tokens": 400, "accepted_tokens": 300, "decode_steps": 200, "completion_tokens": 500}
            body["data"][0]["speculation"] = speculation
            route.fulfill(response=response, json=body)

        page.route("**/v1/instances", drafted)
        expect(debug.get_by_test_id("instance-drafts-kept")).to_have_text("75 %")
        expect(debug.get_by_test_id("instance-tokens-per-step")).to_have_text("2.50")
        assert page.evaluate("document.documentElement.scrollWidth <= innerWidth"), "wider than 1366 px"
        screenshot(page, "drafts", tmp_path)
        page.unroute_all(behavior="wait")  # a poll's handler in flight finishes while the server still answers
