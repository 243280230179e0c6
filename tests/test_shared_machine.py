"""A machine tether shares with other work (issue 34): the decode's threads step down while other processes hold the
cores, and a long prompt read beside running streams is slow, never "hung".

The governor's policy is tested with the run delay it reads replaced by a script (fast tier); the real engine is
tested beside busy-looping processes, one per core, and the deadline with a real long prompt and a real stream.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import model_missing, serving
from tether.engines.llamacpp import threads
from tether.engines.llamacpp.threads import BACKOFF, WINDOW, ThreadGovernor


class FakeLib:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def llama_set_n_threads(self, _ctx: Any, n: int, n_batch: int) -> None:
        assert n == n_batch
        self.calls.append(n)


class Clock:
    """The run delay the governor reads, and the monotonic time it sees, both set by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.delay_ns = 0
        self.now = 1000.0
        monkeypatch.setattr(threads, "run_delay_ns", lambda: self.delay_ns)
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.now)

    def window(self, governor: ThreadGovernor, waited_share: float) -> None:
        """One window of decoding in which each thread waited ``waited_share`` of the step time for a CPU."""
        governor.before()
        self.delay_ns += int(waited_share * WINDOW * governor.current * 1e9)
        self.now += WINDOW
        governor.after(WINDOW)


def test_the_governor_steps_down_under_contention_and_back_up_after_a_doubling_back_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock(monkeypatch)
    lib = FakeLib()
    governor = ThreadGovernor(lib, object(), 2)
    assert governor.enabled and governor.current == 2
    clock.window(governor, 0.1)  # ordinary scheduling noise: all threads stay
    clock.window(governor, 0.5)  # one contended window alone (a burst of the worker's own work): they stay
    clock.window(governor, 0.1)
    assert governor.current == 2 and lib.calls == []
    clock.window(governor, 0.5)  # half the step time waiting for a CPU, PATIENCE windows in a row: one thread
    clock.window(governor, 0.5)
    assert governor.current == 1 and lib.calls == [1]
    clock.now += BACKOFF[0] - WINDOW - 0.01
    clock.window(governor, 0.5)  # the back-off has not passed: still one
    assert governor.current == 1
    clock.window(governor, 0.1)  # it has: all threads again, to see
    assert governor.current == 2 and lib.calls == [1, 2]
    clock.window(governor, 0.5)  # still contended: one thread, for twice as long
    clock.window(governor, 0.5)
    assert governor.current == 1
    clock.now += 2 * BACKOFF[0] - 2 * WINDOW
    clock.window(governor, 0.1)
    assert governor.current == 1
    clock.window(governor, 0.0)
    assert governor.current == 2
    clock.window(governor, 0.0)  # a window without contention: the next back-off starts short again
    clock.window(governor, 0.5)
    clock.window(governor, 0.5)
    assert governor.current == 1
    clock.now += BACKOFF[0]
    clock.window(governor, 0.0)
    assert governor.current == 2 and lib.calls == [1, 2, 1, 2, 1, 2]


def test_a_pause_between_decodes_is_not_weighed_and_one_thread_or_no_schedstat_leaves_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock(monkeypatch)
    governor = ThreadGovernor(FakeLib(), object(), 2)
    governor.before()
    governor.after(WINDOW / 2)
    clock.now += 10  # idle between two requests: other threads' delays then are not the steps'
    clock.delay_ns += 5 * 10**9
    clock.window(governor, 0.0)
    assert governor.current == 2
    assert not ThreadGovernor(FakeLib(), object(), 1).enabled
    assert not ThreadGovernor(FakeLib(), object(), 2, adaptive=False).enabled
    monkeypatch.setattr(threads, "run_delay_ns", lambda: None)
    assert not ThreadGovernor(FakeLib(), object(), 2).enabled


@pytest.fixture
def cpu_hogs() -> Iterator[None]:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=10)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("cpu_hogs")
def test_beside_a_busy_looping_process_per_core_the_engine_decodes_on_one_thread() -> None:
    """The real engine, two threads, every core busy: within a few windows it runs on one thread (and the text is
    the same as ever: the thread count changes no row's arithmetic)."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    from tether.engines.llamacpp.engine import LlamaCppEngine
    from tether.protocol import ChatMessage, EngineSpec, GenerateParams

    engine = LlamaCppEngine(EngineSpec(options={"n_threads": 2, "parallel": 1, "n_ctx": 512, "prompt_cache": False}))
    engine.load(lambda _p, _d: None)
    try:
        batch = engine._require_batch()
        params = GenerateParams(messages=(ChatMessage("user", "Tell me a long story."),), max_tokens=400)
        deadline = time.monotonic() + 120
        while batch.threads.switches == 0 and time.monotonic() < deadline:
            for _ in engine.generate(params, lambda: batch.threads.switches > 0):
                pass
        assert batch.threads.switches >= 1 and batch.threads.current == 1
    finally:
        engine.close()


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.serial  # its 4 s deadline bounds one step: beside the suite's runners a step once took longer
@pytest.mark.timeout(240)
def test_a_long_prompt_read_beside_a_stream_restarts_its_first_token_deadline_and_is_answered() -> None:
    """A 1,500-token prompt sent while another request streams is prefilled 32 tokens a step beside it (~47 steps,
    ~5 s here), longer than a first-token deadline of 2 s: before prefill progress restarted the clock the runner
    was killed as "hung in prefill" (Open WebUI's 6,500-token tools prompt beside its title task). Now both are
    answered, and the runner lives on. (The rule itself, at any length: test_hangs.py.) The deadline bounds one step
    here (~0.2 s alone; at 1 s, one 32-token step beside 2 other test workers once took longer: hence serial)."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    with serving("--threads", "2", "--deadline", "first_token=2", "--deadline", "token_gap=30") as server:
        streaming: dict[str, Any] = {}
        first = threading.Event()

        def stream() -> None:
            body = {
                "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
                "max_tokens": 120,  # a token a step: more than the ~47 steps of the long prompt's prefill
                "logit_bias": {"0": -100, "2": -100},  # no end-of-text: it streams until the long prompt is in
                "stream": True,
            }
            with server.http.stream("POST", "/v1/chat/completions", json=body, timeout=200) as response:
                streaming["status"] = response.status_code
                parts = []
                for text in response.iter_text():
                    parts.append(text)
                    if '"content":"' in text and not first.is_set():
                        first.set()
                streaming["text"] = "".join(parts)
            first.set()

        other = threading.Thread(target=stream)
        other.start()
        try:
            assert first.wait(60), "the stream never started"
            long_prompt = "The quick brown fox jumps over the lazy dog. " * 150  # ~1,500 tokens
            started = time.monotonic()
            answer = server.http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": long_prompt + "\nSay OK."}], "max_tokens": 4},
                timeout=200,
            )
            took = time.monotonic() - started
        finally:
            other.join(timeout=200)
        assert answer.status_code == 200, answer.text[:3000]
        assert answer.json()["usage"]["prompt_tokens"] > 1200
        assert streaming.get("status") == 200 and "[DONE]" in streaming.get("text", ""), streaming.get("status")
        instances = server.http.get("/v1/instances").json()["data"]
        assert instances[0]["restarts"] == 0 and not instances[0]["history"], instances[0]
        assert took > 2.0, f"answered in {took:.1f} s: too short a prefill to outlast the 2 s deadline"
        print(f"long prompt answered in {took:.1f} s beside a stream (first-token deadline 2 s)")
