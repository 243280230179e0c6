"""bench/soak.py's allocation report: the worker's tracemalloc route (off by default, behind the guard when on), and
the soak's reading of its answers; its batch target on the real default model (``model``, ``slow``)."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tether.fleet.catalog import Catalog
from tether.fleet.fleet import Fleet
from tether.fleet.scheduler import Scheduler
from tether.serve.app import create_app
from tether.serve.guard import Policy
from tether.serve.tracing import TRACEMALLOC

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import soak  # noqa: E402

pytestmark = pytest.mark.timeout(60)
KEY = "sesame"
KEPT: list[Any] = []  # what the "leak" below keeps


async def _client(tmp_path: Path, api_key: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Scheduler(Fleet(), Catalog()), Policy(api_key=api_key), log_dir=tmp_path)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=50) as client:
        yield client


@pytest.fixture
def tracing(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(TRACEMALLOC, "1")
    was = tracemalloc.is_tracing()
    tracemalloc.start(12)
    yield
    KEPT.clear()
    if not was:
        tracemalloc.stop()


def _leak() -> None:
    KEPT.extend(bytearray(1000) for _ in range(2000))  # ~2 MB kept from this line


@pytest.mark.anyio
async def test_the_tracemalloc_route_does_not_exist_unless_the_worker_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRACEMALLOC, raising=False)
    async for client in _client(tmp_path):
        reply = await client.post("/v1/debug/tracemalloc")
        assert reply.status_code == 404, reply.text
        assert "/v1/debug/tracemalloc" not in (await client.get("/openapi.json")).text
    assert not tracemalloc.is_tracing()


@pytest.mark.anyio
@pytest.mark.usefixtures("tracing")
async def test_the_tracemalloc_route_answers_what_grew_since_its_baseline_by_traceback(tmp_path: Path) -> None:
    async for client in _client(tmp_path, api_key=KEY):
        auth = {"Authorization": f"Bearer {KEY}"}
        assert (await client.post("/v1/debug/tracemalloc")).status_code == 401, "the key, as every admin route"
        foreign = {**auth, "Host": "evil.example"}
        assert (await client.post("/v1/debug/tracemalloc", headers=foreign)).status_code == 403, "DNS rebinding"
        page = {**auth, "Origin": "http://evil.example"}
        assert (await client.post("/v1/debug/tracemalloc", headers=page)).status_code == 403, "another site's page"
        bad = await client.post("/v1/debug/tracemalloc", params={"top": 0}, headers=auth)
        assert bad.status_code == 400 and "top must be in [1, 200]" in bad.text
        base = (await client.post("/v1/debug/tracemalloc", headers=auth)).json()
        assert base["baseline"] is True and base["growth"] == [] and base["traced_bytes"] > 0, base
        assert Path(base["path"]).parent == tmp_path / "tracemalloc", "where the worker writes, not a request"
        _leak()
        grown = (await client.post("/v1/debug/tracemalloc", params={"top": 5}, headers=auth)).json()
    assert grown["baseline"] is False and len(grown["growth"]) <= 5, grown
    top = grown["growth"][0]
    assert top["size_diff"] >= 2_000_000 and top["count_diff"] >= 2000, top
    assert any("test_soak.py" in frame for frame in top["traceback"]), top
    assert grown["traced_bytes"] - base["traced_bytes"] >= 2_000_000
    assert grown["malloc"]["in_use_bytes"] > 0 and grown["pymalloc"]["arenas_allocated_current"] > 0, grown
    assert grown["tasks"] >= 1 and grown["task_sites"][0]["stack"], "where the worker's tasks wait"
    assert sorted(p.name.split("-")[-1] for p in (tmp_path / "tracemalloc").iterdir()) == [
        "base.pickle",
        "last.pickle",
    ], "two files, whatever the number of snapshots"


def test_the_soak_reads_the_growth_short() -> None:
    traces = [
        {"t": 100.0, "traced_bytes": 1 << 20, "growth": []},
        {
            "t": 200.0,
            "traced_bytes": 3 << 20,
            "growth": [
                {
                    "size_diff": 2048,
                    "count_diff": 10,
                    "size": 4096,
                    "traceback": [
                        "/x/.venv/lib/python3.11/site-packages/anyio/_core/_tasks.py:3",
                        "/usr/lib/python3.11/asyncio/events.py:80",
                        "/work/main/src/tether/fleet/fleet.py:511",
                    ],
                }
            ],
        },
    ]
    assert soak.growth_sites(traces, 5) == [
        {"kib": 2.0, "blocks": 10, "site": "anyio/_core/_tasks.py:3", "via": "tether/fleet/fleet.py:511"}
    ]
    assert soak.traced_growth(traces) == 2.0
    assert soak.short_frame("/root/.pyenv/versions/3.11.7/lib/python3.11/contextlib.py:473") == "contextlib.py:473"


def test_the_batch_target_makes_only_the_faults_a_real_engine_can_take() -> None:
    assert set(soak.BATCH_FAULTS) == {"SIGKILL", "disconnect", "cancel_storm"}
    assert set(soak.debug_target().faults) == set(soak.FAULTS)
    assert soak.debug_target().config["engine"] == "debug"


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_batch_soak_quick_run_prints_its_json_line() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "soak.py"), "--target", "batch", "--quick"],
        capture_output=True,
        text=True,
        timeout=190,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "soak" and result["target"] == "batch", out.stdout
    assert out.returncode == 0 and result["ok"] is True, out.stdout[-3000:]
    assert result["engine"] == "llama.cpp" and result["parallel"] == 8, result
    assert set(result["faults"]) == {"SIGKILL", "disconnect", "cancel_storm"}, result
    assert result["restarts"] == result["runner_faults"] >= 1 and result["completed"] > 0, result
    assert all(w["rss_mib_end"] is not None for w in result["windows"]), result
