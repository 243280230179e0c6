"""The model catalog: every model a worker can serve, loaded or not, under its id and aliases.

Built once at start from ``tether serve``'s own model, ``--models DIR`` (every ``*.gguf`` in it, named by its file's
stem) and ``--catalog FILE`` (TOML: a default ``keep_alive``, then ``[[models]]`` tables taking every field of
``POST /v1/instances`` plus ``id``, ``aliases``, ``keep_alive``, ``pinned``, and ``chat_template``, ``deterministic``
and ``speculation`` as fields for those options), with the built-in default model always in it (when installed).
Paths in a file are relative to it; an unknown field, a bad duration or a name two models claim stops the server
before it listens. A request naming a catalogued model that is not loaded makes the scheduler
(``tether.fleet.scheduler``) load it. The file's format, by example: docs/many-models.md, "The catalog file".
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from tether.engines import chat_templates, registry
from tether.errors import InvalidField, did_you_mean
from tether.fleet.fleet import ID_PATTERN, InstanceConfig
from tether.models import DefaultModelMissing, default_model_path
from tether.protocol import documented
from tether.units import DURATION, parse_duration

FOREVER = math.inf
DEFAULT_KEEP_ALIVE = 300.0  # Ollama's default: five minutes idle, then unloaded
LONGEST_KEEP_ALIVE = 1e9  # seconds (31 years); longer is for ever (and no date overflows)
KeepAlive = Annotated[float, documented()] | Annotated[str, documented(pattern=DURATION)]


def keep_alive_seconds(value: float | str | None, field: str = "keep_alive") -> float | None:
    """``keep_alive`` in seconds: a number of seconds or a duration ("5m", "1h30m"), as Ollama takes it; 0 means
    "unload after this request", a negative value (or one beyond ``LONGEST_KEEP_ALIVE``) forever (``math.inf``);
    None when not given."""
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError:
        raise InvalidField(
            field, f"{field} must be a number of seconds or a duration such as '5m' or '1h', got {value!r}"
        ) from None
    return FOREVER if seconds < 0 or seconds > LONGEST_KEEP_ALIVE else seconds


def describe_keep_alive(seconds: float) -> str:
    """``5m``, ``forever``, ``0 s (unload when idle)``: for messages and listings."""
    if math.isinf(seconds):
        return "forever"
    if seconds == 0:
        return "0 s (unload when idle)"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


class ModelEntry(InstanceConfig, frozen=True, forbid_unknown_fields=True):
    """One catalogued model: an instance config (as ``POST /v1/instances`` takes it) plus how it is scheduled."""

    aliases: tuple[str, ...] = ()
    chat_template: str | None = None  # the engine option of that name, a file's path relative to the catalog
    deterministic: bool | None = None  # the engine option of that name
    speculation: bool | None = None  # the engine option of that name
    keep_alive: KeepAlive | None = None  # None: the catalog's default
    pinned: bool = False  # loaded at start; never unloaded by keep-alive nor evicted


class CatalogFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    keep_alive: KeepAlive | None = None
    models: tuple[ModelEntry, ...] = ()


@dataclass(frozen=True)
class Model:
    """A catalogued model as the scheduler uses it: its id, its instance config, its keep-alive in seconds."""

    id: str
    config: InstanceConfig
    aliases: tuple[str, ...]
    keep_alive: float
    pinned: bool
    source: str  # where it was catalogued: "the command line", "--models /srv/models", "catalog.toml", "built in"


class Catalog:
    """The models a worker can serve, by id and alias (an Ollama client's ``name:latest`` finds ``name``)."""

    def __init__(self, models: list[Model] | None = None) -> None:
        self._models: dict[str, Model] = {}
        self._names: dict[str, str] = {}  # id or alias -> id
        for model in models or ():
            self.add(model)

    def add(self, model: Model) -> None:
        """Catalogue ``model``; a name (id or alias) that is taken already is an ``InvalidField`` naming both."""
        for alias in model.aliases:
            if not ID_PATTERN.match(alias):
                raise InvalidField("aliases", f"alias {alias!r} of {model.id!r} ({model.source}) is no valid name")
        for name in (model.id, *model.aliases):
            taken = self._names.get(name)
            if taken is not None:
                other = self._models[taken]
                raise InvalidField(
                    "id",
                    f"the name {name!r} of model {model.id!r} ({model.source}) is taken by model {other.id!r} "
                    f"({other.source}): give one of them another id or alias",
                )
        self._models[model.id] = model
        for name in (model.id, *model.aliases):
            self._names[name] = model.id

    def find(self, name: str | None) -> Model | None:
        if name is None:
            return None
        found = self._names.get(name)
        if found is None and name.endswith(":latest"):
            found = self._names.get(name.removesuffix(":latest"))
        return self._models.get(found) if found is not None else None

    def get(self, model_id: str) -> Model | None:
        return self._models.get(model_id)

    def __iter__(self) -> Iterator[Model]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._models


def entry_model(entry: ModelEntry, default_keep_alive: float, source: str, base: Path | None = None) -> Model:
    """A catalog file's (or the command line's) entry as a ``Model``: its id settled, its model path absolute, its
    config checked (the same checks as ``POST /v1/instances``)."""
    model_path = entry.model
    if model_path is not None and base is not None and not Path(model_path).is_absolute():
        model_path = str((base / model_path).resolve())
    options = entry.options
    if entry.chat_template is not None:
        if "chat_template" in options:
            raise InvalidField("chat_template", f"{source}: set chat_template once, as a field or as an option")
        chosen = entry.chat_template
        if chosen not in chat_templates.BUILTIN and base is not None and not Path(chosen).is_absolute():
            chosen = str((base / chosen).resolve())
        options = {**options, "chat_template": chosen}
    if entry.deterministic is not None:
        if "deterministic" in options:
            raise InvalidField("deterministic", f"{source}: set deterministic once, as a field or as an option")
        options = {**options, "deterministic": entry.deterministic}
    if entry.speculation is not None:
        if "speculation" in options:
            raise InvalidField("speculation", f"{source}: set speculation once, as a field or as an option")
        options = {**options, "speculation": entry.speculation}
    config = msgspec.structs.replace(entry, model=model_path, options=options)
    problem = config.check()
    if problem is not None:
        raise InvalidField(problem.field, f"model {config.default_id()!r} ({source}): {problem}")
    fields = {f: getattr(config, f) for f in InstanceConfig.__struct_fields__}
    instance = InstanceConfig(**{**fields, "id": config.default_id()})
    try:
        seconds = keep_alive_seconds(entry.keep_alive)
    except InvalidField as exc:
        raise InvalidField("keep_alive", f"model {instance.default_id()!r} ({source}): {exc}") from None
    return Model(
        id=instance.default_id(),
        config=instance,
        aliases=tuple(entry.aliases),
        keep_alive=default_keep_alive if seconds is None else seconds,
        pinned=entry.pinned,
        source=source,
    )


def read_catalog_file(path: Path, default_keep_alive: float, *, allow_engine_import: bool = False) -> list[Model]:
    """The models of a TOML catalog file; anything wrong is an ``InvalidField`` naming the file and the field. An
    engine named by module or file path is ``EngineImportRefused`` (before anything is imported) unless
    ``allow_engine_import``: a file is not the operator's command line."""
    try:
        data: Any = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidField("catalog", f"cannot read the catalog {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidField("catalog", f"the catalog {path} is not valid TOML: {exc}") from exc
    return catalog_models(data, str(path), path.parent, default_keep_alive, allow_engine_import)


def catalog_models(
    data: Any, source: str, base: Path | None, default_keep_alive: float, allow_engine_import: bool
) -> list[Model]:
    """The models of a catalog's tables (``{"keep_alive": ..., "models": [...]}``, from a ``--catalog`` file or a
    ``--config`` file's ``[[models]]``), model paths relative to ``base``; ``source`` names where they came from."""
    _check_keys(data, CatalogFile, source)
    for index, entry in enumerate(data.get("models", ()) if isinstance(data.get("models"), list) else ()):
        _check_keys(entry, ModelEntry, f"{source}, models[{index}]")
    try:
        parsed = msgspec.convert(data, CatalogFile)
    except msgspec.ValidationError as exc:
        raise InvalidField("catalog", f"the catalog {source} is invalid: {exc}") from exc
    try:
        fallback = keep_alive_seconds(parsed.keep_alive)
    except InvalidField as exc:
        raise InvalidField("keep_alive", f"the catalog {source}: {exc}") from None
    default = default_keep_alive if fallback is None else fallback
    for entry in parsed.models:
        named = f"model {entry.id!r}" if entry.id is not None else "a model"  # default_id() would import it
        registry.check_import(entry.engine, allow_engine_import, f"{named} of the catalog {source}")
    return [entry_model(entry, default, source, base=base) for entry in parsed.models]


def _check_keys(table: object, struct: type[msgspec.Struct], where: str) -> None:
    """An unknown key of ``table`` is an ``InvalidField`` naming it and the closest of ``struct``'s fields."""
    if not isinstance(table, dict):
        return
    known = [field.encode_name for field in msgspec.structs.fields(struct)]
    for key in table:
        if key not in known:
            raise InvalidField(str(key), f"{where}: unknown key {key!r}{did_you_mean(str(key), known)}")


def scan_models_dir(directory: Path, default_keep_alive: float, template: InstanceConfig) -> list[Model]:
    """Every ``*.gguf`` in ``directory`` (not below it), named by its stem, with ``template``'s engine options."""
    if not directory.is_dir():
        raise InvalidField("models", f"--models {directory}: no such directory")
    models = []
    for path in sorted(directory.glob("*.gguf")):
        entry = ModelEntry(
            id=path.stem if ID_PATTERN.match(path.stem) else None,
            engine="llama.cpp",
            model=str(path.resolve()),
            options=dict(template.options) if template.engine == "llama.cpp" else {},
        )
        if entry.id is None:
            raise InvalidField(
                "models", f"--models {directory}: {path.name}'s stem is no valid id ({ID_PATTERN.pattern})"
            )
        models.append(entry_model(entry, default_keep_alive, f"--models {directory}"))
    return models


def builtin_default(default_keep_alive: float, template: InstanceConfig) -> Model | None:
    """The built-in default model (with ``template``'s llama.cpp options), or None when it is not installed."""
    try:
        stem = default_model_path().stem
    except DefaultModelMissing:
        return None
    options = dict(template.options) if template.engine == "llama.cpp" else {}
    return entry_model(ModelEntry(id=stem, options=options), default_keep_alive, "built in")
