"""The front door of ``tether serve``: who may ask (Host, Origin, the API key) and how much (the body), decided
before any route runs.

A server on 127.0.0.1 is reachable from every web page its user opens: DNS rebinding makes a foreign name's page
read it as same-origin (Ollama's CVE-2024-28224), and a "simple" cross-origin request (a form, a no-cors ``fetch``)
is served without a CORS preflight. So, in this order: **Host** (on a loopback listener only loopback names or
``--allowed-hosts``), **Origin** (a request carrying one, or a browser's cross-site request without one, only from
the server's own origin or ``--cors-origins``; only then CORS headers and preflights), **the API key** (constant-time,
on every route but the probes and the dashboard's shell), **the body limit** (413, declared and as it arrives).
Refusals answer in the route's own error shape: Ollama's under ``/api/``, OpenAI's elsewhere. Each rule as a user
meets it: docs/security.md, "What is checked, in order".
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether import env
from tether.errors import BodyTooLarge
from tether.node.listeners import Listeners
from tether.serve.statuses import refused, too_large

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/"})  # answer without the API key (probes, the dashboard's shell)
OPEN_PREFIXES = ("/ui/",)  # the dashboard's static assets: no data in them, every call they make needs the key
DEFAULT_MAX_BODY = 4 << 20
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CORS_METHODS = "GET, HEAD, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"  # what a preflight allows when it names no headers
CORS_EXPOSED = "X-Request-Id, Retry-After"  # response headers a page of an allowed origin may read
CORS_MAX_AGE = "600"
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")  # a host name as a browser sends it (punycode, no trailing dot)
_PORT = re.compile(r"[0-9]{1,5}")
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")  # scheme://authority: an origin's shape, whatever its scheme
_TOKENS = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")  # a header-name list
_DEFAULT_PORTS = {"http": 80, "https": 443}


# --------------------------------------------------------------------------------------------------------------
# Names: hosts and origins as the headers carry them
# --------------------------------------------------------------------------------------------------------------


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header's (or an origin's) host, lowercased, and port; None when it is malformed.

    ``[::1]:8000`` gives ``("::1", 8000)``; a bare IPv6 address, an empty name, a name with characters no browser
    sends (a trailing dot included: ``localhost.`` is resolved by DNS, not by the browser) are malformed.
    """
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            return None
    else:
        host, _, port_text = value.partition(":")
        host = host.lower()
        if ":" in port_text or not _NAME.fullmatch(host):
            return None
    port: int | None = None
    if port_text:
        if not _PORT.fullmatch(port_text) or int(port_text) > 65535:
            return None
        port = int(port_text)
    return host, port


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as ``split_host`` gives it) names this machine's loopback: ``localhost``, 127.0.0.0/8, ::1
    (an IPv4-mapped loopback address included)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclass(frozen=True)
class Origin:
    """A web origin, ``scheme://host[:port]``, with its effective port."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, value: str) -> Origin | None:
        """The origin an ``Origin`` header names; None for ``null`` (sandboxed pages, ``file:``) or anything
        malformed."""
        scheme, sep, authority = value.partition("://")
        scheme = scheme.lower()
        if not sep or scheme not in _DEFAULT_PORTS:
            return None
        split = split_host(authority)
        if split is None:
            return None
        host, port = split
        return cls(scheme, host, port if port is not None else _DEFAULT_PORTS[scheme])


def check_host_pattern(entry: str) -> str:
    """An ``--allowed-hosts`` entry, normalized: ``name``, ``name:port``, ``*.domain``, ``.domain`` or ``*``;
    ``ValueError`` saying what is wrong otherwise."""
    entry = entry.strip().lower()
    if entry == "*":
        return entry
    bare = entry[2:] if entry.startswith("*.") else entry[1:] if entry.startswith(".") else entry
    if split_host(bare) is None:
        raise ValueError(
            f"--allowed-hosts: {entry!r} is no host name: give names ('tether.lan'), with a port if it must match "
            "('tether.lan:8000'), '*.domain' for every name below a domain, or '*' for any"
        )
    return entry


def check_origin_pattern(entry: str) -> str:
    """A ``--cors-origins`` entry, normalized: ``scheme://host[:port]`` (a ``*`` matches any run of characters; any
    scheme, so ``vscode-webview://*`` works), ``null`` or ``*`` (every origin but ``null``); ``ValueError`` saying
    what is wrong otherwise."""
    entry = entry.strip().lower().removesuffix("/")
    if entry in ("*", "null"):
        return entry
    if not _ORIGIN.fullmatch(entry):
        raise ValueError(
            f"--cors-origins: {entry!r} is no web origin: give each as a page's address bar shows it, scheme, host and "
            "port without a path ('http://localhost:3000'), '*' in it for any run of characters "
            "('http://localhost:*'), or '*' alone for every site"
        )
    return entry


@dataclass(frozen=True)
class Policy:
    """Who may reach the server: the listener's address, the operator's allow-lists, the API key, the body limit."""

    listen: str = "127.0.0.1"  # the address the socket is bound to, as it says it
    allowed_hosts: tuple[str, ...] = ()  # check_host_pattern's forms
    cors_origins: tuple[str, ...] = ()  # check_origin_pattern's forms
    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY

    @property
    def loopback(self) -> bool:
        """Whether the listener is on loopback (so every Host is checked: see the module's doc)."""
        return is_loopback(self.listen.strip("[]").lower())

    def host_allowed(self, host: str, port: int | None) -> bool:
        if is_loopback(host) or "*" in self.allowed_hosts:
            return True
        if not self.loopback and not self.allowed_hosts:
            return True  # an open listener without a list: any name reaches it (the API key guards it)
        for entry in self.allowed_hosts:
            if entry.startswith("*."):  # every name below the domain
                if host.endswith(entry[1:]):
                    return True
                continue
            if entry.startswith("."):  # the domain and every name below it
                if host.endswith(entry) or host == entry[1:]:
                    return True
                continue
            split = split_host(entry)
            if split is not None and split[0] == host and split[1] in (None, port):
                return True
        return False

    def origin_allowed(self, origin: str) -> bool:
        """Whether ``--cors-origins`` lets pages of ``origin`` (the header's value) call the server."""
        value = origin.lower()
        if value == "null":
            return "null" in self.cors_origins
        if not _ORIGIN.fullmatch(value):
            return False
        return any(entry == "*" or _glob(entry).fullmatch(value) for entry in self.cors_origins)


@functools.lru_cache(maxsize=256)
def _glob(entry: str) -> re.Pattern[str]:
    """An origin pattern as a regex: ``*`` matches any run of characters, everything else itself (``[::1]`` is an
    address, not a character class as fnmatch would read it)."""
    return re.compile(".*".join(re.escape(part) for part in entry.split("*")))


# --------------------------------------------------------------------------------------------------------------
# The middleware
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A request the guard refused: why (``host``, ``origin``, ``api_key``, ``body``), the value refused (the Host,
    the Origin), and the message the client got."""

    reason: str
    value: str
    message: str


def _shown(value: str) -> str:
    return repr(value if len(value) <= 200 else value[:200] + "...")


class Guard:
    """Pure ASGI middleware enforcing ``policy`` on every HTTP request before it reaches ``app`` (see the module's
    doc for the order and why)."""

    def __init__(self, app: ASGIApp, policy: Policy) -> None:
        self.app = app
        self.policy = policy
        self.expected = f"Bearer {policy.api_key}".encode() if policy.api_key else None
        self.listeners: Listeners[Refusal] = Listeners("guard refusal")  # told of every refusal (metrics, the CLI)

    async def _refuse(
        self, reason: str, value: str, reply: Response, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.listeners(Refusal(reason, value, bytes(reply.body).decode(errors="replace")))
        await reply(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name, []).append(value)
        host_values = headers.get(b"host", [])
        refusal = self._host_refusal(path, host_values)
        if refusal is not None:
            shown = b", ".join(host_values).decode("latin-1")
            await self._refuse("host", shown, refusal, scope, receive, send)
            return
        origin, refusal = self._origin(scope, path, headers)
        if refusal is not None:
            shown = b", ".join(headers.get(b"origin", [b"(none: Sec-Fetch-Site)"])).decode("latin-1")
            await self._refuse("origin", shown, refusal, scope, receive, send)
            return
        if origin is not None:  # an allowed foreign origin: CORS headers on every answer, preflights answered here
            if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
                await self._preflight(origin, headers)(scope, receive, send)
                return
            send = _with_cors(send, origin)
        if self.expected is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            given = _one(headers, b"authorization") or b""
            if not hmac.compare_digest(given, self.expected):
                reply = refused(
                    path,
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server was started "
                    "with (--api-key or TETHER_API_KEY)",
                    "invalid_request_error",
                    "invalid_api_key",
                )
                await self._refuse("api_key", "", reply, scope, receive, send)
                return
        declared = _one(headers, b"content-length")
        limit = self.policy.max_body
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(
                "body", declared.decode(), too_large(path, BodyTooLarge(int(declared), limit)), scope, receive, send
            )
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(seen, limit)
            return message

        await self.app(scope, limited, send)

    def _host_refusal(self, path: str, values: Sequence[bytes]) -> Response | None:
        """A 403 for a Host this server must not answer to; None when it may (no Host at all is HTTP/1.0's way,
        never a browser's)."""
        policy = self.policy
        for raw in values:
            value = raw.decode("latin-1")
            split = split_host(value)
            if split is not None and policy.host_allowed(*split):
                continue
            if split is None:
                message = (
                    f"refused: Host {_shown(value)} is malformed: a browser sends a name (no trailing dot) or an "
                    "address, and a port; send this machine's name or address"
                )
            else:
                name = split[0]
                if policy.loopback:
                    why = (
                        f"this server listens on the loopback address {policy.listen} and answers to loopback names "
                        "only: a request naming another host is what a web page sends through DNS rebinding"
                    )
                else:
                    why = f"it is not among the hosts this server answers to ({', '.join(policy.allowed_hosts)})"
                message = (
                    f"refused: Host {_shown(value)} is not allowed: {why}. To serve this name, start tether with "
                    f"--allowed-hosts {name} (or {env.ALLOWED_HOSTS}={name})"
                )
            return refused(path, 403, message, "permission_error", "host_not_allowed", host=value)
        return None

    def _origin(self, scope: Scope, path: str, headers: dict[bytes, list[bytes]]) -> tuple[str | None, Response | None]:
        """The foreign origin whose answers need CORS headers (None: same-origin or no browser), or the 403 for a
        request a page of another origin must not make."""
        values = headers.get(b"origin", [])
        if not values:
            site = (_one(headers, b"sec-fetch-site") or b"").decode("latin-1").lower()
            if scope["method"] in UNSAFE_METHODS and site in ("cross-site", "same-site"):
                message = (
                    f"refused: a {site} {scope['method']} from a web page (Sec-Fetch-Site: {site}) without an Origin: "
                    f"tether serves no other site's pages unless they are allowed with --cors-origins (or "
                    f"{env.CORS_ORIGINS})"
                )
                return None, refused(path, 403, message, "permission_error", "origin_not_allowed")
            return None, None
        origin = values[0].decode("latin-1")
        if len(values) == 1:
            if self._own(origin, headers):
                return None, None
            if self.policy.origin_allowed(origin):
                return origin, None
        host = (_one(headers, b"host") or b"").decode("latin-1")
        message = (
            f"refused: a page at {_shown(origin)} may not use this server (a cross-origin request to {host or 'it'}): "
            f"a web page may call tether only from tether's own pages or from an origin allowed with --cors-origins "
            f"{origin} (or {env.CORS_ORIGINS}={origin})"
        )
        return None, refused(path, 403, message, "permission_error", "origin_not_allowed", origin=origin)

    @staticmethod
    def _own(origin: str, headers: dict[bytes, list[bytes]]) -> bool:
        """Whether ``origin`` is this server's own: its host and port are the request's ``Host`` (already checked)."""
        parsed = Origin.parse(origin)
        host = _one(headers, b"host")
        if parsed is None or host is None:
            return False
        split = split_host(host.decode("latin-1"))
        if split is None:
            return False
        name, port = split
        return parsed.host == name and parsed.port == (port if port is not None else _DEFAULT_PORTS[parsed.scheme])

    @staticmethod
    def _preflight(origin: str, headers: dict[bytes, list[bytes]]) -> Response:
        """The answer to an allowed origin's CORS preflight: every method the API takes, the headers it asked for."""
        asked = (_one(headers, b"access-control-request-headers") or b"").decode("latin-1").strip()
        allow = {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": asked if asked and _TOKENS.fullmatch(asked) else CORS_HEADERS,
            "Access-Control-Max-Age": CORS_MAX_AGE,
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        }
        if _one(headers, b"access-control-request-private-network") == b"true":  # Chrome's Private Network Access
            allow["Access-Control-Allow-Private-Network"] = "true"
        return Response(status_code=204, headers=allow)


def _one(headers: dict[bytes, list[bytes]], name: bytes) -> bytes | None:
    values = headers.get(name)
    return values[0] if values else None


def _with_cors(send: Send, origin: str) -> Send:
    """``send``, with CORS headers for ``origin`` added to the response's start."""
    extra = [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-expose-headers", CORS_EXPOSED.encode()),
        (b"vary", b"Origin"),
    ]

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return sending
