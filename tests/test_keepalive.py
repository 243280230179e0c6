"""`tether serve`'s listening socket: responses on a keep-alive connection are not held back by Nagle's algorithm."""

from __future__ import annotations

import asyncio
import socket
import statistics
import time

import httpx
import pytest

from conftest import debug_server
from tether.cli.serve import _bind

pytestmark = pytest.mark.slow  # each waits as long as a client's keep-alive


@pytest.mark.timeout(30)
def test_connections_accepted_on_the_listening_socket_get_tcp_nodelay() -> None:
    """asyncio (so uvicorn) sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP, and an accepted socket
    inherits the listening socket's: one made with proto 0 left every connection with Nagle's algorithm on."""
    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]

    async def main() -> int:
        got: asyncio.Queue[int] = asyncio.Queue()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.put_nowait(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            nodelay = await asyncio.wait_for(got.get(), 10)
            writer.close()
        return nodelay

    assert asyncio.run(main()) != 0


@pytest.mark.timeout(60)
def test_requests_after_the_first_on_a_keep_alive_connection_are_not_delayed() -> None:
    """With Nagle on, each response after the first on a connection waited for the client's delayed ACK (~40 ms
    on Linux) before its body went out; served at once, a probe takes a few ms even on a busy machine."""
    with debug_server() as server, httpx.Client(base_url=server.url, timeout=10) as client:
        seconds = []
        for _ in range(10):
            began = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            seconds.append(time.perf_counter() - began)
    assert statistics.median(seconds[1:]) < 0.02, seconds


@pytest.mark.timeout(60)
def test_a_connection_idle_as_long_as_a_clients_keep_alive_is_still_open() -> None:
    """uvicorn closed idle connections after 5 s, exactly when httpx (so openai-python) still reuses them: found by
    bench/load.py, whose retrying clients lost a request to that race now and then. The server now keeps an idle
    connection 30 s; this one idles past the old 5 s (the idle time is the point of the test, not a settle wait)."""
    limits = httpx.Limits(keepalive_expiry=10)  # the client keeps it longer than the 6 s idle: the server decides
    with debug_server() as server, httpx.Client(base_url=server.url, timeout=10, limits=limits) as client:
        assert client.get("/healthz").status_code == 200
        sock = _peer(client)
        time.sleep(6)
        assert client.get("/healthz").status_code == 200
        assert _peer(client) == sock  # the very same connection served it


def _peer(client: httpx.Client) -> tuple[str, int]:
    """The local address of the client's one pooled connection (it changes when the connection is replaced)."""
    pool = client._transport._pool  # type: ignore[attr-defined]
    (connection,) = pool.connections
    address: tuple[str, int] = connection._connection._network_stream.get_extra_info("socket").getsockname()
    return address
