"""The dashboard: one static page at ``/`` and its assets at ``/ui/<name>``, from the package's ``ui`` folder.

The files carry no data (the Guard lets them through without the API key): the page asks the same JSON API the CLI
uses, with the key the user logs in with. ``/`` is also where Ollama's clients probe (``GET``/``HEAD``, expecting
"Ollama is running"): a browser (``Accept: text/html``) gets the page, anything else that answer. No build step,
no CDN: what is in ``ui/`` is what the browser runs. The files are read once, when the routes are added, so a
request never touches the disk and a broken install says so at once; a strict Content-Security-Policy lets only
these files run and load, and only this server be asked.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources

from fastapi import Request
from fastapi.responses import Response

from tether.serve.routes import Route, text_answer

log = logging.getLogger("tether.dashboard")

UI_PACKAGE = "tether.serve"
UI_FOLDER = "ui"
PAGE = "index.html"
OLLAMA_PROBE = "Ollama is running (tether's Ollama-compatible API; a browser gets the dashboard here)"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}")  # a file in ui/, never a path
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
}
# The page runs only its own script and style; it talks to this server alone and cannot be framed.
SECURITY = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class Asset:
    """One file of the page: its bytes, its type and an ETag (so a reload costs a 304, and an upgrade is seen)."""

    body: bytes
    media_type: str
    etag: str


def load_assets() -> dict[str, Asset]:
    """Every file of ``ui/`` by name (an empty dict when the package was installed without them)."""
    assets: dict[str, Asset] = {}
    folder = resources.files(UI_PACKAGE).joinpath(UI_FOLDER)
    if not folder.is_dir():
        return assets
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if not entry.is_file() or suffix not in TYPES or not NAME.fullmatch(entry.name):
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        assets[entry.name] = Asset(body, TYPES[suffix], etag)
    return assets


def _answer(asset: Asset, request: Request) -> Response:
    headers = {**SECURITY, "ETag": asset.etag, "Cache-Control": "no-cache"}  # revalidate: a 304 when unchanged
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.media_type, headers=headers)


def _missing(what: str) -> Response:
    message = (
        f"{what} is not part of this install of tether (the package's serve/{UI_FOLDER}/ folder is missing or "
        "incomplete): reinstall tether; the JSON API (GET /v1/instances) and `tether status` still work"
    )
    return Response(message, status_code=404, media_type="text/plain; charset=utf-8", headers=SECURITY)


def wants_page(request: Request) -> bool:
    """A browser navigating (it asks for HTML), not a client probing for Ollama (``*/*`` or nothing)."""
    return "text/html" in request.headers.get("accept", "")


def routes() -> list[Route]:
    """``GET /`` (the page for a browser, Ollama's probe answer for anything else) and ``GET /ui/{name}`` (the
    page's assets, served, not documented)."""
    assets = load_assets()
    if PAGE not in assets:
        log.warning("the dashboard's files are missing from this install: GET / answers 404")

    async def page(request: Request) -> Response:
        if not wants_page(request):
            return Response(OLLAMA_PROBE, media_type="text/plain", headers={"Vary": "Accept"})
        asset = assets.get(PAGE)
        reply = _answer(asset, request) if asset is not None else _missing("the dashboard")
        reply.headers["Vary"] = "Accept"
        return reply

    async def asset(name: str, request: Request) -> Response:
        found = assets.get(name)
        return _answer(found, request) if found is not None else _missing(f"ui/{name}")

    probe = "Ollama's probe; a browser (Accept: text/html) gets the dashboard"
    return [
        Route(
            path="/",
            method="GET",
            endpoint=page,
            summary=probe,
            answers={"200": text_answer("it runs (or the dashboard's page)")},
            head=True,
        ),
        Route(
            path="/ui/{name}",
            method="GET",
            endpoint=asset,
            summary="the dashboard's assets",
            answers={},
            documented=False,
        ),
    ]
