"""``tether serve``'s settings as one validated value, from four places: the command line's flags, then ``TETHER_*``
environment variables, then a TOML file (``--config`` or ``TETHER_CONFIG``), then the defaults written here.

pydantic-settings reads the environment and merges the places in that order; every value goes through the same
parser whatever its place (sizes: ``units.parse_size``, durations: ``units.parse_duration``), and an error names
the flag, variable or file key the bad value came from, an unknown key the closest valid one. The file's keys are the
flags' long names with ``_`` for ``-`` (``--max-queue`` is ``max_queue``), and its ``[[models]]`` tables are the
model catalog (as a ``--catalog`` file's), so one file holds a whole server. Relative paths in the file are relative
to the file.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BeforeValidator, Field, InstanceOf, ValidationError
from pydantic_settings import BaseSettings, InitSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from tether import env, units
from tether.errors import InvalidField, did_you_mean
from tether.fleet.catalog import keep_alive_seconds
from tether.node.hangs import Deadlines
from tether.node.settings import SupervisorSettings
from tether.protocol import Fault

PREFIX = "TETHER_"
_FILE_VALUES: ContextVar[dict[str, Any]] = ContextVar("tether_config_file", default={})  # noqa: B039 (never mutated)


def parse_fault(value: object) -> Fault:
    """A debug-engine fault: ``KIND[:PHASE[:AFTER_TOKENS]]`` (``segv:generate:5``, ``exit:load``, ``slow``), or a
    table of ``Fault``'s fields; ``ValueError`` saying what is wrong."""
    if isinstance(value, Fault):
        return value
    if isinstance(value, str):
        parts = value.split(":")
        fields: dict[str, object] = {"kind": parts[0]}
        if len(parts) > 1 and parts[1]:
            fields["phase"] = parts[1]
        if len(parts) > 2 and parts[2]:
            try:
                fields["after_tokens"] = int(parts[2])
            except ValueError:
                raise ValueError(f"bad fault {value!r}: AFTER_TOKENS {parts[2]!r} is no number") from None
        value = fields
    try:
        return msgspec.convert(value, Fault)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad fault {value!r}: {exc} (format KIND[:PHASE[:AFTER_TOKENS]])") from None


def parse_deadline(text: str) -> tuple[str, float]:
    """``NAME=SECONDS`` (``token_gap=60``, ``load_stall=10m``); NAME is a field of ``Deadlines``."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep:
        raise ValueError(f"bad deadline {text!r}: use NAME=SECONDS, e.g. token_gap=60")
    _check_deadline_name(name)
    try:
        return name, units.parse_duration(value)
    except ValueError:
        raise ValueError(f"bad deadline {text!r}: {value!r} is no number of seconds or duration") from None


def _check_deadline_name(name: str) -> None:
    names = Deadlines.__struct_fields__
    if name not in names:
        raise ValueError(f"unknown deadline {name!r}{did_you_mean(name, names)}")


def parse_ranks(value: object) -> int | str:
    """A number of ranks, or ``auto`` (placement chooses, for an engine that splits the model)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"bad ranks {value!r}: give a number of ranks or 'auto'")
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"bad ranks {value!r}: give a number of ranks or 'auto'") from None


def gpu_layers(value: object) -> str | None:
    """``--n-gpu-layers``: ``auto`` or a count of layers >= 0 (kept as text, the engine option's spelling)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text == "auto" or (text.isdigit() and not isinstance(value, bool)):
        return text
    raise ValueError(f"bad n_gpu_layers {value!r}: give a number of layers (0: the CPU only) or 'auto'")


def _seconds(value: object) -> object:
    return units.parse_duration(value) if isinstance(value, str | int | float) else value


def _size(value: object) -> object:
    return units.parse_size(value) if isinstance(value, str | int) else value


def _keep_alive(value: object) -> object:
    """The fleet's rule: a negative or huge keep-alive is forever."""
    return keep_alive_seconds(value, "keep_alive") if isinstance(value, str | int | float) else value


def _comma_list(value: object) -> object:
    """Repeated flags, a TOML list or one comma-separated string, as one list of non-empty entries."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        return value
    found: list[object] = []
    for item in items:
        found += [p.strip() for p in item.split(",") if p.strip()] if isinstance(item, str) else [item]
    return found


def _deadlines(value: object) -> object:
    """``[deadlines]`` as a table, ``NAME=SECONDS`` flags, or ``name=s,name=s`` in the environment."""
    if isinstance(value, str):
        value = _comma_list(value)
    if isinstance(value, list | tuple):
        return dict(parse_deadline(v) if isinstance(v, str) else v for v in value)
    if isinstance(value, Mapping):
        for name in value:
            _check_deadline_name(str(name))
        return {name: units.parse_duration(seconds) for name, seconds in value.items()}
    return value


def _path(value: object) -> object:
    return Path(value).expanduser() if isinstance(value, str | Path) else value


Seconds = Annotated[float, BeforeValidator(_seconds), Field(ge=0)]
Size = Annotated[int, BeforeValidator(_size)]
Names = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_comma_list)]
FilePath = Annotated[Path, BeforeValidator(_path)]


class ServeSettings(BaseSettings):
    """Everything ``tether serve`` runs with. The field names are the file's keys and, upper-cased after
    ``TETHER_``, the environment's names; what each means is in the flag's help (``tether serve --help``) and the
    generated settings reference."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX,
        env_ignore_empty=True,  # TETHER_API_KEY= (empty) is no key, as before
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    config: FilePath | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, repr=False)
    allowed_hosts: Names = ()
    cors_origins: Names = ()
    allow_engine_import: bool = False
    no_auth: bool = False
    # the first model, loaded at start
    engine: str = "llama.cpp"
    model: FilePath | None = None
    name: str | None = None
    n_ctx: int | None = Field(None, gt=0)
    parallel: int | None = Field(None, gt=0)
    threads: int | None = Field(None, gt=0)
    prompt_cache_ram: Size | None = None
    chat_template: str | None = None
    deterministic: bool = False
    speculation: bool = False
    n_gpu_layers: Annotated[str | None, BeforeValidator(gpu_layers)] = None
    gpu: str | None = None
    gpu_memory_limit: Size | None = None
    restart: Literal["on-failure", "never"] = "on-failure"
    no_resume: bool = False
    max_queue: int = Field(16, ge=0)
    max_body: Size = units.parse_size("4M")
    memory_limit: Size | None = None
    faults: Annotated[
        tuple[Annotated[InstanceOf[Fault], BeforeValidator(parse_fault)], ...], NoDecode, BeforeValidator(_comma_list)
    ] = ()
    stop_timeout: Seconds = 10.0
    deadlines: Annotated[dict[str, float], NoDecode, BeforeValidator(_deadlines)] = Field(default_factory=dict)
    force: bool = False
    no_reap: bool = False
    # many models
    models_dir: FilePath | None = None
    catalog: FilePath | None = None
    keep_alive: Annotated[float | None, BeforeValidator(_keep_alive)] = None
    max_loaded: int | None = Field(None, gt=0)
    load_wait: Seconds = 300.0
    reclaim_timeout: Seconds = 10.0
    reclaim_poll: Seconds | None = None
    models: tuple[dict[str, Any], ...] = Field(
        (),
        description="the model catalog: one table per model (`[[models]]`: id, model, aliases, options, keep_alive, "
        "pinned, and every field of POST /v1/instances), as in a --catalog file",
    )
    # cluster (Ray)
    ray: str | None = None
    replicas: int = Field(1, gt=0)
    ranks: Annotated[int | Literal["auto"], BeforeValidator(parse_ranks)] = 1
    node_memory_limit: Size | None = None
    heartbeat_interval: Seconds = 0.2
    lost_after: Seconds = 1.0
    lease: Seconds = 3.0

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (the init values), then the environment, then the file: the first place that sets a key wins."""
        return init_settings, env_settings, InitSettingsSource(settings_cls, init_kwargs=_FILE_VALUES.get())

    def supervision(self) -> SupervisorSettings:
        """How this worker supervises its runners: built here once, handed to the fleet and from it to every life."""
        return SupervisorSettings(stop_timeout=self.stop_timeout)


KEYS: tuple[str, ...] = tuple(ServeSettings.model_fields)
PATH_KEYS = ("config", "model", "models_dir", "catalog")


def env_name(key: str) -> str:
    return PREFIX + key.upper()


def load(flags: Mapping[str, Any]) -> ServeSettings:
    """The settings from ``flags`` (only those given on the command line), the environment and the config file
    (``flags["config"]`` or ``TETHER_CONFIG``); ``InvalidField`` names every bad value's place."""
    path = flags.get("config") or os.environ.get(env_name("config")) or None
    config = Path(path).expanduser() if path else None
    values = read_file(config) if config is not None else {}
    token = _FILE_VALUES.set(values)
    try:
        return ServeSettings(**{**flags, "config": config})
    except ValidationError as exc:
        raise InvalidField("config", _explain(exc, flags, values, config)) from None
    finally:
        _FILE_VALUES.reset(token)


def read_file(path: Path) -> dict[str, Any]:
    """The config file's keys, its relative paths made relative to it; its model tables' too."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidField("config", f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidField("config", f"the config file {path} is not valid TOML: {exc}") from None
    if "config" in data:
        raise InvalidField("config", f"{path}: a config file cannot name another config file (key 'config')")
    base = path.parent
    for key in PATH_KEYS:
        if isinstance(data.get(key), str):
            data[key] = str(base / Path(data[key]).expanduser())
    for entry in data.get("models", ()) if isinstance(data.get("models"), list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("model"), str):
            entry["model"] = str(base / Path(entry["model"]).expanduser())
    return data


def _explain(exc: ValidationError, flags: Mapping[str, Any], values: Mapping[str, Any], config: Path | None) -> str:
    """Every error of ``exc`` as one line naming where the value came from."""
    lines = []
    for error in exc.errors(include_url=False):
        key = str(error["loc"][0]) if error["loc"] else "?"
        if error["type"] == "extra_forbidden":
            lines.append(f"{config}: unknown key {key!r}{did_you_mean(key, KEYS)}")
            continue
        message = str(error["msg"]).removeprefix("Value error, ")
        lines.append(f"{_place(key, flags, values, config)}: {message} (got {error.get('input')!r})")
    return "; ".join(lines)


def _place(key: str, flags: Mapping[str, Any], values: Mapping[str, Any], config: Path | None) -> str:
    if key in flags:
        return "--" + key.replace("_", "-")
    if os.environ.get(env_name(key)):
        return env_name(key)
    if key in values:
        return f"{config}: key {key!r}"
    return key


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave: the serve parser sets no defaults (``argparse.SUPPRESS``), so only flags
    the user typed are in ``args``; the command's own entries (command, -v) are not settings."""
    return {key: value for key, value in vars(args).items() if key in KEYS}


def unknown_environment() -> Iterator[str]:
    """A warning for each ``TETHER_*`` variable that is neither a setting nor one of tether's other variables: a
    misspelt variable would otherwise be ignored in silence."""
    known = {env_name(key) for key in KEYS} | {
        value for value in vars(env).values() if isinstance(value, str) and value.startswith(PREFIX)
    }
    for name in sorted(os.environ):
        if name.upper().startswith(PREFIX) and name.upper() not in known:
            close = difflib.get_close_matches(name.upper(), sorted(known), n=1, cutoff=0.6)
            hint = f": did you mean {close[0]}?" if close else ""
            yield f"{name} is no tether setting, ignored{hint}"
