"""One config file: every ``tether serve`` flag is a key of ``--config`` and a ``TETHER_*`` variable, the three give
the same settings, a flag wins over the environment and the environment over the file, and a wrong key is refused
naming it and the closest valid one, before anything listens."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import TETHER, serving
from tether.cli import settings
from tether.cli.parser import build_parser, subcommands
from tether.cli.settings import KEYS, ServeSettings
from tether.errors import InvalidField
from tether.protocol import Fault

# Every setting with a value other than its default, three ways: flags, a variable's text, a TOML value.
SAMPLES: dict[str, tuple[list[str], str, str]] = {
    "host": (["--host", "127.0.0.2"], "127.0.0.2", '"127.0.0.2"'),
    "port": (["--port", "9123"], "9123", "9123"),
    "api_key": (["--api-key", "s3cret"], "s3cret", '"s3cret"'),
    "allowed_hosts": (
        ["--allowed-hosts", "a.lan,b.lan", "--allowed-hosts", "c.lan"],
        "a.lan,b.lan,c.lan",
        '["a.lan", "b.lan", "c.lan"]',
    ),
    "cors_origins": (["--cors-origins", "http://localhost:3000"], "http://localhost:3000", '"http://localhost:3000"'),
    "allow_engine_import": (["--allow-engine-import"], "1", "true"),
    "no_auth": (["--no-auth"], "true", "true"),
    "engine": (["--engine", "debug"], "debug", '"debug"'),
    "model": (["--model", "/srv/models/m.gguf"], "/srv/models/m.gguf", '"/srv/models/m.gguf"'),
    "name": (["--name", "smol"], "smol", '"smol"'),
    "n_ctx": (["--n-ctx", "2048"], "2048", "2048"),
    "parallel": (["--parallel", "4"], "4", "4"),
    "threads": (["--threads", "2"], "2", "2"),
    "prompt_cache_ram": (["--prompt-cache-ram", "512M"], "512M", '"512M"'),
    "chat_template": (["--chat-template", "gemma"], "gemma", '"gemma"'),
    "deterministic": (["--deterministic"], "true", "true"),
    "speculation": (["--speculation"], "true", "true"),
    "n_gpu_layers": (["--n-gpu-layers", "12"], "12", '"12"'),
    "gpu": (["--gpu", "0,1"], "0,1", '"0,1"'),
    "gpu_memory_limit": (["--gpu-memory-limit", "2G"], "2G", '"2G"'),
    "restart": (["--restart", "never"], "never", '"never"'),
    "max_queue": (["--max-queue", "3"], "3", "3"),
    "max_body": (["--max-body", "1M"], "1048576", "1048576"),
    "memory_limit": (["--memory-limit", "2G"], "2G", '"2G"'),
    "faults": (
        ["--fault", "segv:generate:5", "--fault", "exit:load"],
        "segv:generate:5,exit:load",
        '["segv:generate:5", {kind = "exit", phase = "load"}]',
    ),
    "stop_timeout": (["--stop-timeout", "5"], "5s", '"5s"'),
    "deadlines": (
        ["--deadline", "token_gap=60", "--deadline", "load_stall=2m"],
        "token_gap=60,load_stall=120",
        '{token_gap = 60, load_stall = "2m"}',
    ),
    "force": (["--force"], "yes", "true"),
    "no_reap": (["--no-reap"], "on", "true"),
    "no_resume": (["--no-resume"], "1", "true"),
    "models_dir": (["--models", "/srv/models"], "/srv/models", '"/srv/models"'),
    "catalog": (["--catalog", "/srv/catalog.toml"], "/srv/catalog.toml", '"/srv/catalog.toml"'),
    "keep_alive": (["--keep-alive", "10m"], "600", '"10m"'),
    "max_loaded": (["--max-loaded", "2"], "2", "2"),
    "load_wait": (["--load-wait", "1m"], "60", "60"),
    "reclaim_timeout": (["--reclaim-timeout", "20"], "20", "20.0"),
    "reclaim_poll": (["--reclaim-poll", "250ms"], "0.25", '"250ms"'),
    "ray": (["--ray"], "local", '"local"'),
    "replicas": (["--replicas", "3"], "3", "3"),
    "ranks": (["--ranks", "auto"], "auto", '"auto"'),
    "node_memory_limit": (["--node-memory-limit", "8G"], "8G", '"8G"'),
    "heartbeat_interval": (["--heartbeat-interval", "0.5"], "500ms", "0.5"),
    "lost_after": (["--lost-after", "2"], "2", "2"),
    "lease": (["--lease", "6"], "6s", "6"),
}
FILE_ONLY = {"config", "models"}  # the file itself; the catalog's tables (a variable as JSON, no flag)


@pytest.fixture()
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No TETHER_* setting from the test's own environment leaks into the settings read."""
    for key in KEYS:
        monkeypatch.delenv(settings.env_name(key), raising=False)
    yield monkeypatch


def from_flags(*argv: str) -> ServeSettings:
    return settings.load(settings.given_flags(build_parser().parse_args(["serve", *argv])))


def test_every_flag_is_a_setting_and_every_setting_but_the_file_and_its_tables_a_flag() -> None:
    dests = {a.dest for a in subcommands(build_parser())["serve"]._actions if a.option_strings} - {"help"}
    assert dests == set(KEYS) - {"models"}, dests ^ set(KEYS)
    assert set(SAMPLES) == set(KEYS) - FILE_ONLY, set(SAMPLES) ^ set(KEYS)


def test_flags_variables_and_the_file_give_the_same_settings(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = [arg for flags, _, _ in SAMPLES.values() for arg in flags]
    by_flags = from_flags(*argv)
    for key, (_, text, _) in SAMPLES.items():
        clean_environment.setenv(settings.env_name(key), text)
    by_environment = from_flags()
    for key in SAMPLES:
        clean_environment.delenv(settings.env_name(key))
    config = tmp_path / "tether.toml"
    config.write_text("".join(f"{key} = {value}\n" for key, (_, _, value) in SAMPLES.items()))
    by_file = from_flags("--config", str(config))
    defaults = ServeSettings()
    for key in SAMPLES:
        assert getattr(by_flags, key) != getattr(defaults, key), key
        assert getattr(by_flags, key) == getattr(by_environment, key) == getattr(by_file, key), key
    assert by_flags.faults == (Fault("segv", "generate", 5), Fault("exit", "load"))
    assert by_flags.deadlines == {"token_gap": 60.0, "load_stall": 120.0}
    assert by_flags.prompt_cache_ram == 512 << 20 and by_flags.keep_alive == 600.0 and by_flags.ranks == "auto"


def test_a_flag_wins_over_the_environment_and_the_environment_over_the_file(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "tether.toml"
    config.write_text('port = 7001\nmax_queue = 1\nengine = "debug"\n')
    clean_environment.setenv("TETHER_PORT", "7002")
    clean_environment.setenv("TETHER_CONFIG", str(config))  # the file named by its variable, too
    chosen = from_flags("--port", "7003")
    assert (chosen.port, chosen.max_queue, chosen.engine, chosen.config) == (7003, 1, "debug", config)
    assert from_flags().port == 7002
    clean_environment.delenv("TETHER_PORT")
    assert from_flags().port == 7001
    clean_environment.delenv("TETHER_CONFIG")
    assert from_flags().port == 8000


def test_an_unknown_key_is_refused_naming_it_and_the_closest(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "tether.toml"
    for text, words in {
        "prot = 9000\n": "unknown key 'prot': did you mean 'port'?",
        "max_queu = 3\n": "unknown key 'max_queu': did you mean 'max_queue'?",
        "[deadlines]\ntoken_gapp = 5\n": "unknown deadline 'token_gapp': did you mean 'token_gap'?",
        "port = 'eighty'\n": f"{config}: key 'port': Input should be a valid integer",
        "max_body = '4 lots'\n": "key 'max_body': bad size '4 lots'",
        "keep_alive = 'soon'\n": "keep_alive must be a number of seconds or a duration",
        "port = 80\nport = 81\n": "is not valid TOML",
    }.items():
        config.write_text(text)
        with pytest.raises(InvalidField) as caught:
            from_flags("--config", str(config))
        assert words in str(caught.value) and str(config) in str(caught.value), caught.value
    clean_environment.setenv("TETHER_MAX_QUEUE", "-1")
    with pytest.raises(InvalidField, match="TETHER_MAX_QUEUE: Input should be greater than or equal to 0"):
        from_flags()


def test_relative_paths_in_the_file_are_relative_to_the_file(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "etc" / "tether.toml"
    config.parent.mkdir()
    config.write_text('model = "../models/a.gguf"\nmodels_dir = "models"\n[[models]]\nid = "b"\nmodel = "b.gguf"\n')
    chosen = from_flags("--config", str(config))
    assert chosen.model == config.parent / "../models/a.gguf"
    assert chosen.models_dir == config.parent / "models"
    assert chosen.models[0]["model"] == str(config.parent / "b.gguf")
    config.write_text('config = "other.toml"\n')
    with pytest.raises(InvalidField, match="cannot name another config file"):
        from_flags("--config", str(config))


def test_a_misspelt_variable_is_warned_about(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setenv("TETHER_PROT", "9000")
    assert any(
        "TETHER_PROT is no tether setting, ignored: did you mean TETHER_PORT?" in w
        for w in settings.unknown_environment()
    )


@pytest.mark.timeout(30)
def test_a_bad_config_stops_the_server_before_it_listens(tmp_path: Path) -> None:
    config = tmp_path / "tether.toml"
    config.write_text('engine = "debug"\nkeep_alive = "5m"\nmax_loded = 2\n')
    out = subprocess.run([*TETHER, "serve", "--config", str(config)], capture_output=True, text=True, timeout=25)
    assert out.returncode == 64, out.stderr
    assert f"{config}: unknown key 'max_loded': did you mean 'max_loaded'?" in out.stderr
    assert "listening" not in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_one_file_serves_a_whole_server_with_its_catalog(tmp_path: Path) -> None:
    """The server's settings and its models in one file: the first model loads at start, a catalogued one on
    demand under its alias, with the file's keep-alive."""
    config = tmp_path / "tether.toml"
    config.write_text(
        'engine = "debug"\nname = "first"\nkeep_alive = "90s"\nmax_queue = 3\n\n'
        '[deadlines]\ntoken_gap = "1m"\n\n'
        '[[models]]\nid = "second"\nengine = "debug"\naliases = ["gpt-4o-mini"]\n'
    )
    with serving("--config", str(config)) as server:
        first = server.instance("first")
        assert first["queue"]["max_queue"] == 3, first["queue"]
        chat: Any = server.openai().chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == "second" and chat.choices[0].message.content
        models = {m["id"]: m for m in server.http.get("/v1/models").json()["data"]}
        assert {"first", "second"} <= set(models), models
        assert server.stop() == 0
