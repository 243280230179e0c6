"""Engines from outside tether, and every name of an engine getting the same checks.

An engine of your own plugs in two ways: named where it is (``--engine package.module:Class`` or
``path/file.py:Class``, also ``"engine"`` in ``POST /v1/instances``), or installed as an entry point in group
``tether.engines``. Both are served here by a real ``tether serve`` and answer over HTTP; the engine module is
written to a temporary directory, never part of the package.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import TETHER, model_missing, serving
from tether.engines import registry
from tether.errors import UnknownEngine
from tether.node import fit
from tether.node.fit import DoesNotFit
from tether.protocol import EngineSpec

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leftover_runners")]

ECHO_ENGINE = textwrap.dedent(
    '''
    """An engine outside tether: it echoes the prompt word by word, after a prefix."""

    from tether.engines import Delta, EngineLoadError, Estimate


    class EchoEngine:
        name = "echo"
        options = {"prefix": "echo:", "huge": False}

        def __init__(self, spec):
            unknown = sorted(set(spec.options) - set(self.options))
            if unknown:
                raise EngineLoadError(f"unknown echo option(s) {', '.join(unknown)}: valid are prefix, huge")
            self.prefix = str(spec.options.get("prefix", "echo:"))
            if self.prefix == "boom":
                raise ZeroDivisionError("constructor bug")
            self.loaded = False

        @staticmethod
        def estimate_memory(spec):
            if spec.options.get("prefix") == "crash":
                raise RuntimeError("estimator bug")
            size = 1 << 50 if spec.options.get("huge") else 1 << 20  # 1 PiB cannot fit anywhere
            return Estimate(subject="echo buffers", parts={"buffers": size})

        def load(self, progress):
            progress(0.5, "halfway")
            progress(1.0, "loaded")
            self.loaded = True

        def warmup(self):
            assert self.loaded

        def generate(self, params, cancelled):
            text = params.prompt if params.prompt is not None else params.messages[-1].content
            words = [self.prefix, *text.split()][: params.max_tokens]
            for i, word in enumerate(words):
                if cancelled():
                    return
                last = i == len(words) - 1
                yield Delta(
                    text=(" " if i else "") + word,
                    finish_reason="stop" if last else None,
                    prompt_tokens=len(text.split()) if last else 0,
                    completion_tokens=len(words) if last else 0,
                )

        def close(self):
            self.loaded = False
    '''
)


def _env_with_path(*paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture
def echo_module(tmp_path: Path) -> Path:
    """``echo_engine.py`` in a directory of its own (not importable until put on the path)."""
    directory = tmp_path / "plugins"
    directory.mkdir()
    (directory / "echo_engine.py").write_text(ECHO_ENGINE)
    return directory


@pytest.fixture
def echo_distribution(tmp_path: Path) -> Path:
    """A throw-away installed distribution ``tether-echo`` (its metadata beside its package) declaring the echo
    engine as entry point ``echo`` (and ``parrot``: two names for one class) in group ``tether.engines``."""
    site = tmp_path / "site"
    package = site / "tether_echo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(ECHO_ENGINE)
    meta = site / "tether_echo-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: tether-echo\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text(
        "[tether.engines]\necho = tether_echo:EchoEngine\nparrot = tether_echo:EchoEngine\n"
    )
    return site


def _ask(server: object, model: str, prompt: str) -> dict[str, object]:
    response = server.http.post(  # type: ignore[attr-defined]
        "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8}
    )
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


@pytest.mark.slow
def test_an_engine_named_module_class_is_served_by_tether_serve_over_http(echo_module: Path) -> None:
    args = ("--engine", "echo_engine:EchoEngine", "--allow-engine-import")
    with serving(*args, env=_env_with_path(echo_module)) as server:
        body = _ask(server, "echo", "hello out there")  # the id is the engine's name: it has no model file
        assert body["choices"][0]["text"] == "echo: hello out there"  # type: ignore[index]
        assert body["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
            "speculation": {"draft_tokens": 0, "accepted_tokens": 0, "decode_steps": 0},  # it counts no steps
            "resumed": 0,
        }
        instance = server.instance("echo")
        assert instance["engine"] == "echo_engine:EchoEngine"
        assert instance["fit"].startswith("echo buffers fits: needs ~1.00 MiB (buffers 1.00 MiB)"), instance["fit"]
        # The same module named by its file, through the admin API (allowed by the flag): the runner finds it.
        engine = f"{echo_module / 'echo_engine.py'}:EchoEngine"
        by_file = server.add_instance({"id": "by-file", "engine": engine, "options": {"prefix": ">"}})
        assert by_file["engine"] == engine
        assert _ask(server, "by-file", "again")["choices"][0]["text"] == "> again"  # type: ignore[index]


@pytest.mark.slow
def test_an_entry_point_of_an_installed_distribution_is_an_engine_by_its_name(echo_distribution: Path) -> None:
    env = _env_with_path(echo_distribution)
    with serving("--engine", "parrot", "--name", "parrot", env=env) as server:
        assert _ask(server, "parrot", "polly")["choices"][0]["text"] == "echo: polly"  # type: ignore[index]
        server.add_instance({"id": "echo", "engine": "echo", "options": {"prefix": "~"}})
        assert _ask(server, "echo", "two words")["choices"][0]["text"] == "~ two words"  # type: ignore[index]
        unknown = server.http.post("/v1/instances", json={"id": "x", "engine": "nope"})
        assert unknown.status_code == 400
        error = unknown.json()["error"]
        assert error["param"] == "engine"
        assert "'llama.cpp', 'debug', 'echo', 'parrot'" in error["message"], error  # the plugins are listed too


@pytest.mark.slow
def test_a_plugin_estimate_is_checked_and_its_options_refused_before_a_runner_starts(echo_module: Path) -> None:
    args = ("--engine", "echo_engine:EchoEngine", "--name", "echo", "--allow-engine-import")
    with serving(*args, env=_env_with_path(echo_module)) as server:
        huge = server.http.post(
            "/v1/instances", json={"id": "huge", "engine": "echo_engine:EchoEngine", "options": {"huge": True}}
        )
        assert huge.status_code == 507, huge.text
        message = huge.json()["error"]["message"]
        assert message.startswith("echo buffers does not fit: needs ~1.00 PiB (buffers 1.00 PiB)"), message
        assert "free memory, or pass --force" in message
        bad = server.http.post(
            "/v1/instances", json={"id": "bad", "engine": "echo_engine:EchoEngine", "options": {"colour": "red"}}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "options", bad.text
        assert "unknown echo option(s) colour" in bad.json()["error"]["message"]
        for prefix, said in (("boom", "ZeroDivisionError: constructor bug"), ("crash", "RuntimeError: estimator bug")):
            buggy = server.http.post(
                "/v1/instances", json={"id": prefix, "engine": "echo_engine:EchoEngine", "options": {"prefix": prefix}}
            )
            assert buggy.status_code == 400 and said in buggy.json()["error"]["message"], buggy.text
        assert server.http.get("/v1/instances/huge").status_code == 404


@pytest.mark.slow
def test_an_engine_that_cannot_be_had_says_why_on_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("class NotAnEngine:\n    pass\n")
    cases = {
        "nope": "unknown engine 'nope': installed engines are 'llama.cpp', 'debug'",
        "no_such_module:Engine": "cannot import no_such_module (ModuleNotFoundError",
        f"{tmp_path / 'broken.py'}:Missing": "has no class 'Missing'",
        f"{tmp_path / 'broken.py'}:NotAnEngine": "lacks load, warmup, generate, close of the engine contract",
    }
    for engine, expected in cases.items():
        for command in ("run", "serve"):
            args = [*TETHER, command, *(["hi"] if command == "run" else ["--port", "0"]), "--engine", engine]
            out = subprocess.run(args, capture_output=True, text=True, timeout=30)
            assert out.returncode == 64, (args, out.returncode, out.stderr)
            assert expected in out.stderr, (engine, out.stderr)
            assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name", ["llama.cpp", "llamacpp", "llama"])
@pytest.mark.slow
def test_every_name_of_llama_cpp_runs_the_fit_check(name: str) -> None:
    """The alias bug: ``llamacpp`` was accepted and skipped the fit check. 10 M tokens of context need ~220 GiB of
    KV cache for the default model, more than any test machine has: refused under every name, before a runner."""
    if (why := model_missing()) is not None and "llama-cpp-python" not in why:
        pytest.skip(why)  # the estimate reads only the GGUF header: llama-cpp-python itself is not needed
    assert registry.canonical(name) == "llama.cpp"
    spec = EngineSpec(engine=name, options={"n_ctx": 10_000_000})
    with pytest.raises(DoesNotFit, match=r"does not fit: needs ~.* at n_ctx 10000000"):
        fit.admit(spec)
    with serving("--engine", "debug", "--name", "debug") as server:
        response = server.http.post("/v1/instances", json={"id": "big", "engine": name, "options": {"n_ctx": 10**7}})
        assert response.status_code == 507, response.text
        assert "at n_ctx 10000000" in response.json()["error"]["message"]
    out = subprocess.run(
        [*TETHER, "run", "hi", "--engine", name, "--n-ctx", "10000000"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 3 and "does not fit" in out.stderr, (out.returncode, out.stderr)


def test_an_engine_without_an_estimate_is_admitted_with_that_said(tmp_path: Path) -> None:
    source = ECHO_ENGINE.replace("def estimate_memory(spec):", "def _no_estimate(spec):")
    (tmp_path / "mute_engine.py").write_text(source)
    engine = f"{tmp_path / 'mute_engine.py'}:EchoEngine"
    result = fit.assess(EngineSpec(engine=engine))
    assert result.ok and result.estimate is None
    expected = f"no memory estimate for engine {registry.canonical(engine)!r} (it declares none): admitted without a"
    assert result.message == f"{expected} fit check"


def test_the_registry_resolves_names_aliases_and_classes_named_where_they_are(echo_module: Path) -> None:
    assert [e.name for e in registry.installed()][:2] == ["llama.cpp", "debug"]
    assert registry.resolve("llama").name == "llama.cpp"
    assert registry.resolve("llama.cpp").options["n_ctx"] == "auto"  # the engine's defaults, without loading it
    path = echo_module / "echo_engine.py"
    relative = os.path.relpath(path)
    assert registry.canonical(f"{relative}:EchoEngine") == f"{path.resolve()}:EchoEngine"
    with pytest.raises(UnknownEngine) as refused:
        registry.resolve("nope")
    assert refused.value.field == "engine" and refused.value.installed[:2] == ("llama.cpp", "debug")


@pytest.mark.anyio
async def test_an_instance_of_an_engine_named_by_its_file_gets_a_name_without_slashes(echo_module: Path) -> None:
    """The default instance name goes into runner ids, cgroup names and log file names."""
    import anyio

    from tether import GenerateParams, Instance

    spec = EngineSpec(engine=registry.canonical(f"{echo_module / 'echo_engine.py'}:EchoEngine"))
    with anyio.fail_after(30):
        async with Instance(spec) as inst:
            sup = await inst.wait_ready(20)
            text, final = await (await inst.generate(GenerateParams(prompt="by file", max_tokens=4))).text()
    assert "/" not in inst.name and inst.name.startswith("echo_engine.py_EchoEngine-")
    assert (sup.output_log is not None and sup.output_log.parent.name == "logs") or "/" not in sup.runner_id
    assert text == "echo: by file" and final.state.value == "complete"
