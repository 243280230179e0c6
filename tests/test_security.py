"""Nobody in who doesn't belong (promise 8): a server on 127.0.0.1 is reachable from every web page its user opens.

The first part drives the guard in process (fast): names, origins, CORS, the error shapes. The rest runs real
``tether serve`` children: the requests of the report that opened issue 30 (a "simple" cross-origin POST, DNS
rebinding's Host, both at once), the clients that must keep working (the openai and ollama SDKs, ``tether status``,
``curl -d``), engine import, an open address without a key, runner logs that lead out of the log directory, and a
real Chromium: a page of another origin cannot start an instance (a ``no-cors`` fetch, a form POST), a page whose
name resolves to 127.0.0.1 (rebinding, by Chromium's own resolver rules) is refused, and an allowed origin can.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import ollama
import pytest
from starlette.types import Receive, Scope, Send

from conftest import CHROMIUM, TETHER, Server, debug_server, http_site, wait_until
from tether.engines import registry
from tether.serve.guard import Guard, Policy, check_host_pattern, check_origin_pattern, is_loopback, split_host

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_runners")]


# --------------------------------------------------------------------------------------------------------------
# The guard in process
# --------------------------------------------------------------------------------------------------------------


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    """The app behind the guard: says it was reached."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"reached": true}'})


@contextlib.asynccontextmanager
async def guarded(policy: Policy) -> Any:
    transport = httpx.ASGITransport(app=Guard(_ok, policy))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
        yield client


def test_hosts_parse_as_a_browser_sends_them() -> None:
    assert split_host("LocalHost:8000") == ("localhost", 8000)
    assert split_host("[::1]:8000") == ("::1", 8000)
    assert split_host("[::ffff:127.0.0.1]") == ("::ffff:7f00:1", None)
    assert split_host("127.0.0.1") == ("127.0.0.1", None)
    for bad in ("localhost.", "::1", "[::1", "[::1]x", "local host", "", ":80", "a:99999", "a:b", "a:1:2", "é.fr"):
        assert split_host(bad) is None, bad
    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.255.0.9", "::1", "::ffff:7f00:1"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "::", "localhost.evil", "2130706433", "x"))


@pytest.mark.anyio
async def test_a_loopback_listener_answers_to_loopback_names_only() -> None:
    async with guarded(Policy("127.0.0.1")) as client:
        for host in ("127.0.0.1:8000", "localhost:1", "LOCALHOST", "[::1]:8000", "127.0.0.2"):
            assert (await client.get("/v1/models", headers={"Host": host})).status_code == 200, host
        for host in ("evil.example:8000", "127.0.0.1.nip.io", "0.0.0.0:8000", "localhost.", "tether.lan"):
            refused = await client.get("/v1/models", headers={"Host": host})
            assert refused.status_code == 403, host
            error = refused.json()["error"]
            assert error["code"] == "host_not_allowed" and error["host"] == host
            if host == "localhost.":  # resolved by DNS, not by the browser: malformed here
                assert "is malformed" in error["message"]
            else:
                assert (
                    "DNS rebinding" in error["message"] and f"--allowed-hosts {host.split(':')[0]}" in error["message"]
                )
        ollama_shaped = await client.post("/api/chat", headers={"Host": "evil.example"})
        assert ollama_shaped.status_code == 403 and isinstance(ollama_shaped.json()["error"], str)
        assert ollama_shaped.json()["code"] == "host_not_allowed"
    hosts = tuple(check_host_pattern(h) for h in ("tether.lan", "*.corp", ".home", "pinned.lan:9000"))
    async with guarded(Policy("127.0.0.1", allowed_hosts=hosts)) as client:
        for host, status in {
            "tether.lan:8000": 200,
            "a.b.corp": 200,
            "corp": 403,
            "home": 200,
            "x.home": 200,
            "pinned.lan:9000": 200,
            "pinned.lan:9001": 403,
            "evil.example": 403,
        }.items():
            assert (await client.get("/", headers={"Host": host})).status_code == status, host
    async with guarded(Policy("0.0.0.0")) as client:  # open listener, no list: any name (the key guards it)
        assert (await client.get("/", headers={"Host": "tether.lan"})).status_code == 200
    async with guarded(Policy("0.0.0.0", allowed_hosts=("tether.lan",))) as client:
        assert (await client.get("/", headers={"Host": "other.lan"})).status_code == 403
        assert (await client.get("/", headers={"Host": "localhost:8000"})).status_code == 200


@pytest.mark.anyio
async def test_origins_the_server_own_or_allowed_get_in_and_only_allowed_ones_get_cors() -> None:
    allowed = ("http://app.example:3000", "http://localhost:*", "http://[::1]:3000")
    async with guarded(Policy("127.0.0.1", cors_origins=allowed)) as client:
        own = await client.post("/v1/instances", headers={"Origin": "http://127.0.0.1:8000"})
        assert own.status_code == 200 and "access-control-allow-origin" not in own.headers
        plain = await client.post("/v1/instances")  # curl, the SDKs: no Origin
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
        allowed = await client.post("/v1/instances", headers={"Origin": "http://app.example:3000"})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "http://app.example:3000"
        assert "X-Request-Id" in allowed.headers["access-control-expose-headers"]
        assert (await client.get("/", headers={"Origin": "http://localhost:5173"})).status_code == 200
        assert (await client.get("/", headers={"Origin": "http://[::1]:3000"})).status_code == 200
        assert (await client.get("/", headers={"Origin": "http://:3000"})).status_code == 403  # no glob class
        preflight = await client.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://app.example:3000",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
                "Access-Control-Request-Private-Network": "true",
            },
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-private-network"] == "true"
        for origin in ("http://evil.example", "null", "http://127.0.0.1:8001", "https://app.example:3000", "x"):
            refused = await client.post("/v1/instances", headers={"Origin": origin})
            assert refused.status_code == 403, origin
            assert refused.json()["error"]["code"] == "origin_not_allowed"
            assert refused.headers["x-content-type-options"] == "nosniff"
            assert "access-control-allow-origin" not in refused.headers
            assert f"--cors-origins {origin}" in refused.json()["error"]["message"]
        foreign_preflight = await client.options(
            "/v1/instances", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        )
        assert foreign_preflight.status_code == 403 and "access-control-allow-origin" not in foreign_preflight.headers
        twice = await client.post("/v1/instances", headers=[("Origin", "http://127.0.0.1:8000"), ("Origin", "x")])
        assert twice.status_code == 403
        # A browser's cross-site POST that carries no Origin (older browsers' forms): Sec-Fetch-Site gives it away.
        sneaky = await client.post("/v1/instances", headers={"Sec-Fetch-Site": "cross-site"})
        assert sneaky.status_code == 403 and sneaky.json()["error"]["code"] == "origin_not_allowed"
        link = await client.get("/", headers={"Sec-Fetch-Site": "cross-site"})  # a link to the dashboard: fine
        assert link.status_code == 200


def test_allow_lists_are_checked_when_the_server_starts() -> None:
    assert check_origin_pattern("HTTP://LocalHost:3000/") == "http://localhost:3000"
    assert check_origin_pattern("vscode-webview://*") == "vscode-webview://*"
    for bad in ("localhost:3000", "http://x/path", "http://"):
        with pytest.raises(ValueError, match="no web origin"):
            check_origin_pattern(bad)
    with pytest.raises(ValueError, match="no host name"):
        check_host_pattern("http://tether.lan")
    out = subprocess.run(
        [*TETHER, "serve", "--engine", "debug", "--port", "0", "--cors-origins", "localhost:3000"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 64 and "--cors-origins: 'localhost:3000' is no web origin" in out.stderr, out.stderr


def test_code_import_is_refused_on_the_wire_by_default() -> None:
    assert registry.imports_code("pkg.mod:Engine") and registry.imports_code("/x/engine.py:Engine")
    assert not registry.imports_code("debug") and not registry.imports_code("llama")
    assert not registry.imports_code("no-such-engine")  # refused anyway, listing the engines


# --------------------------------------------------------------------------------------------------------------
# A real server: the report's requests, and the clients that must keep working
# --------------------------------------------------------------------------------------------------------------


def _port(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _refusals(server: Server) -> dict[str, float]:
    """tether_guard_refusals by reason, read from /metrics."""
    found: dict[str, float] = {}
    for line in server.http.get("/metrics").text.splitlines():
        if line.startswith("tether_guard_refusals_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] = float(line.rsplit(" ", 1)[1])
    return found


def _ids(server: Server) -> list[str]:
    return [i["id"] for i in server.http.get("/v1/instances").json()["data"]]


@pytest.mark.slow
def test_the_reported_requests_are_refused_and_nothing_starts() -> None:
    with debug_server("--name", "d") as server:
        port, runners = _port(server), server.runners()  # the runner and its guard
        pid = server.instance("d")["runner"]["pid"]
        body = json.dumps({"id": "csrf1", "engine": "debug"})
        simple = server.http.post(
            "/v1/instances",
            content=body,
            headers={"Content-Type": "text/plain", "Origin": "http://evil.example"},
        )
        assert simple.status_code == 403 and simple.json()["error"]["code"] == "origin_not_allowed", simple.text
        rebound = server.http.get("/v1/instances", headers={"Host": f"evil.example:{port}"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        assert str(pid) not in rebound.text and "runner" not in rebound.text  # nothing of the instances
        both = server.http.post(
            "/v1/instances",
            content=json.dumps({"id": "csrf2", "engine": "debug"}),
            headers={"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"},
        )
        assert both.status_code == 403 and both.json()["error"]["code"] == "host_not_allowed"
        # Every other thing such a page could do: stop, cancel, read a log, load a model through Ollama's route.
        foreign = {"Host": f"evil.example:{port}"}
        assert server.http.delete("/v1/instances/d", headers=foreign).status_code == 403
        assert server.http.get("/v1/instances/d/log", headers=foreign).status_code == 403
        assert server.http.post("/v1/requests/x/cancel", headers={"Origin": "http://evil.example"}).status_code == 403
        load = server.http.post("/api/generate", json={"model": "d"}, headers={"Origin": "http://evil.example"})
        assert load.status_code == 403 and isinstance(load.json()["error"], str)
        assert _ids(server) == ["d"] and server.runners() == runners
        assert _refusals(server) == {"host": 4.0, "origin": 3.0}
        said = server.drain()
        assert any("refused a request with Host 'evil.example:" in line for line in said), said
        assert any("refused a request with Origin 'http://evil.example'" in line for line in said), said


@pytest.mark.slow
def test_what_runs_on_loopback_keeps_working() -> None:
    with debug_server() as server:
        port = _port(server)
        completion = server.openai().completions.create(model="debug", prompt="hi", max_tokens=4)
        assert completion.choices[0].text
        chat = ollama.Client(host=server.url, timeout=60).chat(
            model="debug", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4}
        )
        assert chat.done and chat.message.content
        status = subprocess.run(
            [*TETHER, "status", "--url", f"http://localhost:{port}"], capture_output=True, text=True, timeout=30
        )
        assert status.returncode == 0 and "debug" in status.stdout, status.stderr
        curl = subprocess.run(
            ["curl", "-sS", "-d", '{"prompt": "hello", "max_tokens": 3}', f"{server.url}/v1/completions"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert curl.returncode == 0 and json.loads(curl.stdout)["usage"]["completion_tokens"] == 3, curl.stdout
        started = subprocess.run(
            ["curl", "-sS", "-d", '{"id": "by-curl", "engine": "debug"}', f"{server.url}/v1/instances"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert json.loads(started.stdout)["id"] == "by-curl", started.stdout
        # The dashboard's own calls: same-origin, so the Origin is the Host's.
        own = server.http.post(
            "/v1/instances",
            json={"id": "own", "engine": "debug"},
            headers={"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
        )
        assert own.status_code == 201 and "access-control-allow-origin" not in own.headers
        assert sorted(_ids(server)) == ["by-curl", "debug", "own"]
        assert _refusals(server) == {}


@pytest.mark.slow
def test_hosts_and_origins_the_operator_allows_get_in_from_flags_or_the_environment() -> None:
    """From the environment alone, or from flags, which win over it (as every setting's flag does)."""
    env = dict(os.environ, TETHER_ALLOWED_HOSTS="box.lan", TETHER_CORS_ORIGINS="http://ui.lan:3000")
    with debug_server(env=env) as server:
        port = _port(server)
        assert server.http.get("/v1/models", headers={"Host": f"box.lan:{port}"}).status_code == 200
        answer = server.http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://ui.lan:3000"}
        )
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://ui.lan:3000"
    with debug_server("--allowed-hosts", "tether.lan,*.home", "--cors-origins", "http://app.lan", env=env) as server:
        port = _port(server)
        for host in (f"tether.lan:{port}", "nas.home"):
            assert server.http.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("other.lan", f"box.lan:{port}"):  # the flag's list replaced the environment's
            assert server.http.get("/v1/models", headers={"Host": host}).status_code == 403, host
        answer = server.http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://app.lan"}
        )
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://app.lan"
        refused = server.http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://ui.lan:3000"}
        )
        assert refused.status_code == 403


@pytest.mark.slow
def test_engine_import_is_refused_on_the_wire_unless_the_worker_allows_it(tmp_path: Path) -> None:
    """Named by file or by module, through POST /v1/instances or a catalog file: refused with a 403 (or, for the
    catalog, exit 64) naming the flag, and the module is never imported (it would leave a file behind if it were)."""
    marker = tmp_path / "imported"
    engine_file = tmp_path / "marker_engine.py"
    engine_file.write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\n"
        "class Engine:\n"
        "    def __init__(self, spec): pass\n"
        "    def load(self, progress): pass\n"
        "    def warmup(self): pass\n"
        "    def generate(self, params, cancelled):\n"
        "        from tether.engines import Delta\n"
        "        yield Delta(text='x', finish_reason='stop', prompt_tokens=1, completion_tokens=1)\n"
        "    def close(self): pass\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with debug_server(env=env) as server:
        for engine in (f"{engine_file}:Engine", "marker_engine:Engine"):
            refused = server.http.post("/v1/instances", json={"id": "mine", "engine": engine})
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert error["code"] == "engine_import_disabled" and error["param"] == "engine"
            assert "--allow-engine-import" in error["message"]
        assert not marker.exists() and _ids(server) == ["debug"]
    catalog = tmp_path / "models.toml"
    catalog.write_text(f'[[models]]\nid = "mine"\nengine = "{engine_file}:Engine"\n')
    out = subprocess.run(
        [*TETHER, "serve", "--engine", "debug", "--port", "0", "--catalog", str(catalog)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert out.returncode == 64 and "--allow-engine-import" in out.stderr and "models.toml" in out.stderr, out.stderr
    assert not marker.exists()
    with debug_server("--allow-engine-import", "--catalog", str(catalog), env=env) as server:
        assert "mine" in [m["id"] for m in server.http.get("/v1/models").json()["data"]]
        server.add_instance({"id": "by-file", "engine": f"{engine_file}:Engine"})
        assert marker.read_text() == "ran"


@pytest.mark.slow
def test_an_open_address_needs_a_key_or_a_stated_no_auth() -> None:
    refused = subprocess.run(
        [*TETHER, "serve", "--engine", "debug", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 64, refused.stderr
    assert "refusing to serve 0.0.0.0 (not loopback) without an API key" in refused.stderr
    assert "--api-key" in refused.stderr and "--no-auth" in refused.stderr and "listening" not in refused.stderr
    both = subprocess.run(
        [*TETHER, "serve", "--engine", "debug", "--host", "0.0.0.0", "--port", "0", "--no-auth", "--api-key", "k"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert both.returncode == 64 and "contradict" in both.stderr
    with debug_server("--host", "0.0.0.0", "--no-auth") as server:
        assert any("without an API key (--no-auth)" in line for line in server.drain())
        local = f"http://127.0.0.1:{_port(server)}"
        assert httpx.get(f"{local}/v1/models", headers={"Host": "tether.lan"}).status_code == 200
    with debug_server("--host", "0.0.0.0", "--api-key", "sesame", "--allowed-hosts", "tether.lan") as server:
        local = f"http://127.0.0.1:{_port(server)}"
        with httpx.Client(base_url=local, timeout=30) as http:
            assert http.get("/v1/instances").status_code == 401
            assert http.get("/healthz").status_code == 200
            page = http.get("/", headers={"Accept": "text/html"})
            assert page.status_code == 200 and "<html" in page.text.lower()  # the shell: no data without the key
            keyed = {"Authorization": "Bearer sesame"}
            assert http.get("/v1/instances", headers=keyed).status_code == 200
            assert http.get("/v1/instances", headers={**keyed, "Host": "tether.lan"}).status_code == 200
            assert http.get("/v1/instances", headers={**keyed, "Host": "evil.lan"}).status_code == 403


@pytest.mark.slow
def test_log_reads_stay_inside_the_log_directory(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's private notes\n")
    with debug_server() as server:
        instance = server.instance("debug")
        log_path = Path(instance["runner"]["log"])
        assert server.http.get("/v1/instances/debug/log").status_code == 200
        for sneaky in ("..%2F..%2F..%2Fetc%2Fpasswd", "%2e%2e", "..", "debug%2F..%2F..%2Fsecret"):
            answer = server.http.get(f"/v1/instances/{sneaky}/log")
            assert answer.status_code == 404 and "root:" not in answer.text, (sneaky, answer.text)
        # A link put where the log was (by anyone who can write the log directory): not followed.
        link = log_path.with_suffix(".link")
        link.symlink_to(secret)
        link.replace(log_path)
        refused = server.http.get("/v1/instances/debug/log")
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "log_outside" and "private notes" not in refused.text
        # A failed life's log in the history, replaced the same way.
        os.kill(instance["runner"]["pid"], signal.SIGKILL)
        wait_until(lambda: server.instance("debug")["life"] == 2, 20, "the second life")
        first = Path(server.instance("debug")["history"][0]["log"])
        link = first.with_suffix(".link2")
        link.symlink_to(secret)
        link.replace(first)
        refused = server.http.get("/v1/instances/debug/log", params={"life": 1})
        assert refused.status_code == 403 and "private notes" not in refused.text, refused.text


# --------------------------------------------------------------------------------------------------------------
# A real browser
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def site(pages: dict[str, str]) -> Iterator[str]:
    """A web site of its own (another origin than tether's) serving ``pages`` by path; its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, "").encode()
            self.send_response(200 if self.path in pages else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http_site(Handler) as url:
        yield url


def csrf_form(target: str, instance_id: str) -> str:
    """The classic JSON-over-text/plain form: its one field's name and value join into a JSON body."""
    # {"id": ..., "engine": "debug", "model": "  +  =  +  "}   (the debug engine reads no model file)
    name = json.dumps({"id": instance_id, "engine": "debug", "model": ""})[:-2]
    return (
        f'<form id="f" method="POST" action="{target}/v1/instances" enctype="text/plain">'
        f"<input type=\"hidden\" name='{name}' value='\"}}'></form>"
    )


NO_CORS_FETCH = """async ([target, id]) => {
  const answer = await fetch(target + "/v1/instances", {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "text/plain"}, body: JSON.stringify({id, engine: "debug"})});
  return answer.type;
}"""

CORS_FETCH = """async ([target, id]) => {
  const made = await fetch(target + "/v1/instances", {method: "POST",
    headers: {"Content-Type": "application/json"}, body: JSON.stringify({id, engine: "debug"})});
  const completion = await fetch(target + "/v1/completions", {method: "POST",
    headers: {"Content-Type": "application/json"},
    body: JSON.stringify({model: "debug", prompt: "hi", max_tokens: 2})});
  return {status: made.status, body: await made.json(), requestId: completion.headers.get("x-request-id")};
}"""


def test_a_page_of_another_origin_cannot_start_an_instance(browser: Browser) -> None:
    with debug_server() as server, site({"/": "<title>elsewhere</title>"}) as elsewhere:
        page = browser.new_context().new_page()
        page.goto(f"{elsewhere}/")
        assert page.evaluate(NO_CORS_FETCH, [server.url, "by-fetch"]) == "opaque"  # sent; its answer unreadable
        wait_until(lambda: _refusals(server).get("origin") == 1.0, 10, "the no-cors fetch refused")
        with pytest.raises(Exception, match="Failed to fetch"):  # a CORS fetch: its preflight is refused
            page.evaluate(CORS_FETCH, [server.url, "by-cors"])
        assert _refusals(server).get("origin") == 2.0
        page.set_content(csrf_form(server.url, "by-form"))
        with page.expect_navigation():
            page.evaluate("document.getElementById('f').submit()")
        assert "origin_not_allowed" in page.content()  # the form's navigation shows tether's refusal
        assert _refusals(server).get("origin") == 3.0
        assert _ids(server) == ["debug"]
        page.context.close()


def test_the_same_form_from_an_allowed_origin_works_and_reads_the_answer(browser: Browser) -> None:
    with site({"/": "<title>my app</title>"}) as app, debug_server("--cors-origins", app) as server:
        page = browser.new_context().new_page()
        page.goto(f"{app}/")
        answer = page.evaluate(CORS_FETCH, [server.url, "from-app"])
        assert answer["status"] == 201 and answer["body"]["id"] == "from-app", answer
        assert answer["requestId"], answer  # an exposed header: the page reads it
        page.set_content(csrf_form(server.url, "by-form"))
        with page.expect_navigation():
            page.evaluate("document.getElementById('f').submit()")
        wait_until(lambda: "by-form" in _ids(server), 10, "the allowed form's instance")
        assert _refusals(server) == {}
        page.context.close()


def test_dns_rebinding_in_a_real_browser_is_refused(browser: Browser) -> None:
    """Chromium told that evil.example is 127.0.0.1 (its resolver rules, as a rebinding DNS answer would make
    it): tether's page does not load under that name, and a script in that origin can neither read nor start."""
    with debug_server() as server:
        port = _port(server)
        chromium = browser.browser_type.launch(
            executable_path=CHROMIUM, timeout=60_000, args=["--host-resolver-rules=MAP evil.example 127.0.0.1"]
        )
        try:
            page = chromium.new_page()
            answer = page.goto(f"http://evil.example:{port}/")
            assert answer is not None and answer.status == 403
            assert "host_not_allowed" in page.content() and page.locator("#app").count() == 0
            script = """async () => {
              const read = await fetch("/v1/instances");
              const made = await fetch("/v1/instances", {method: "POST", headers: {"Content-Type": "text/plain"},
                body: JSON.stringify({id: "rebound", engine: "debug"})});
              return [read.status, made.status, await read.text()];
            }"""
            read, made, text = page.evaluate(script)  # same-origin to the page: the rebinding attacker's seat
            assert (read, made) == (403, 403) and "runner" not in text
        finally:
            chromium.close()
        assert _ids(server) == ["debug"]
        assert _refusals(server)["host"] >= 3
