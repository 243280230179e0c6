"""The one engine registry: names and aliases to an engine class, its option defaults, its memory estimator and
its sizing.

Three ways to name an engine, resolved in this order:

1. a built-in: ``llama.cpp`` (aliases ``llamacpp``, ``llama``) or ``debug``;
2. an installed plugin: an entry point in group ``tether.engines`` (its name is the engine's name; a distribution
   gives one class several names by declaring several entry points);
3. a class named where it is: ``package.module:Class`` (importable by the worker and its runners) or
   ``path/to/file.py:Class`` (a file, made absolute so a runner started elsewhere finds the same one).

Every caller resolves through here (the worker to check options and fit, the runner to build the engine), so an
alias cannot reach an engine by a path that skips a check. Classes are imported on first use: naming the built-ins
imports no engine library, and a runner imports only the engine it runs. Runs in both processes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tether.engines.base import NO_OPTIONS, Engine, EngineLoadError, MemoryEstimate, Sizable, batched
from tether.errors import EngineImportRefused, InvalidField, UnknownEngine
from tether.protocol import EngineSpec

ENTRY_POINT_GROUP = "tether.engines"
CONTRACT = ("load", "warmup", "generate", "close")


@dataclass(frozen=True)
class EngineEntry:
    """One engine as the registry knows it: ``target`` ("module:Class" or "file.py:Class") and where it came from."""

    name: str
    target: str
    aliases: tuple[str, ...] = ()
    origin: str = "built-in"

    def load(self) -> type[Any]:
        """The engine class (imported once); ``UnknownEngine`` says why it cannot be had."""
        return _import_class(self.name, self.target)

    @property
    def options(self) -> Mapping[str, Any]:
        """The option names the engine takes and their defaults (empty when the engine does not declare them)."""
        declared = getattr(self.load(), "options", None)
        return MappingProxyType(dict(declared)) if isinstance(declared, Mapping) else NO_OPTIONS


BUILT_IN = (
    EngineEntry("llama.cpp", "tether.engines.llamacpp.engine:LlamaCppEngine", aliases=("llamacpp", "llama")),
    EngineEntry("debug", "tether.engines.debug:DebugEngine"),
)


def _plugins() -> list[EngineEntry]:
    from importlib.metadata import entry_points  # only when a name is not a built-in: it scans every distribution

    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origin = f"entry point of {dist.name} {dist.version}" if dist is not None else "entry point"
        found.append(EngineEntry(ep.name, ep.value, origin=origin))
    return found


def installed() -> list[EngineEntry]:
    """Every engine that can be named by name: the built-ins, then the plugins' entry points."""
    return [*BUILT_IN, *_plugins()]


def names() -> list[str]:
    """The names of the installed engines (without aliases), for help texts and errors."""
    return [entry.name for entry in installed()]


def resolve(name: str) -> EngineEntry:
    """The engine ``name`` names; ``UnknownEngine`` (listing what is installed) when it names none."""
    for entry in BUILT_IN:
        if name == entry.name or name in entry.aliases:
            return entry
    if ":" in name:
        module, _, attr = name.rpartition(":")
        if module.endswith(".py"):
            path = str(Path(module).expanduser().resolve())
            return EngineEntry(f"{path}:{attr}", f"{path}:{attr}", origin="file")
        return EngineEntry(name, name, origin="module")
    plugins = _plugins()
    for entry in plugins:
        if name == entry.name:
            return entry
    raise UnknownEngine(name, [*(e.name for e in BUILT_IN), *(e.name for e in plugins)])


def imports_code(name: str) -> bool:
    """Whether ``name`` names an engine by module or file path (importing it runs that code), rather than a
    built-in or an installed entry point."""
    try:
        return resolve(name).origin in ("module", "file")
    except UnknownEngine:  # refused anyway, with the list of engines
        return False


def check_import(name: str, allowed: bool, where: str) -> None:
    """``EngineImportRefused`` when ``name`` would import code that ``where`` (a request, a catalog file) may not
    ask for unless the worker was started with ``--allow-engine-import``. Nothing is imported to decide."""
    if not allowed and imports_code(name):
        raise EngineImportRefused(name, where)


def canonical(name: str) -> str:
    """The one name of the engine ``name`` names (an alias's engine, a file made absolute)."""
    return resolve(name).name


def engine_class(name: str) -> type[Any]:
    return resolve(name).load()


def create_engine(spec: EngineSpec) -> Engine:
    """Build (but do not load) the engine a spec names: the constructor checks its options (``EngineLoadError``)."""
    engine: Engine = engine_class(spec.engine)(spec)
    return engine


def parallel(spec: EngineSpec) -> int:
    """How many generations a runner of ``spec`` serves at once (1 for an engine that does not batch)."""
    return batched(create_engine(spec)).parallel


def spec_problem(spec: EngineSpec) -> InvalidField | None:
    """Why the engine would refuse ``spec`` (an unknown engine, bad options), found without loading anything."""
    try:
        create_engine(spec)
    except UnknownEngine as exc:
        return exc
    except EngineLoadError as exc:
        return InvalidField("options", str(exc))
    except Exception as exc:  # an engine of your own that fails in its constructor: refused, never a 500
        return InvalidField("options", f"engine {spec.engine!r} failed to build with {spec.options!r}: {_what(exc)}")
    return None


def splits_model(name: str) -> bool:
    """Whether the engine divides one model among the ranks of a multi-rank instance (each rank holds a share, as
    llama.cpp's layer split does) rather than giving each rank a whole copy (as the debug ring does)."""
    return bool(getattr(engine_class(name), "splits_model", False))


def estimate(spec: EngineSpec) -> MemoryEstimate | None:
    """What the engine says a runner of ``spec`` will need, or None when the engine declares no estimator."""
    estimator = getattr(engine_class(spec.engine), "estimate_memory", None)
    if estimator is None:
        return None
    try:
        result: MemoryEstimate | None = estimator(spec)
    except InvalidField:  # a model file it cannot read (InvalidModel), say
        raise
    except Exception as exc:  # a bug in an engine's estimator: refused with what it raised, never a 500
        raise InvalidField("engine", f"the memory estimate of engine {spec.engine!r} failed: {_what(exc)}") from exc
    return result


def sizing(name: str) -> Sizable | None:
    """How the engine sizes what it left to the memory (its ``sizing``: GPU layers, a context), or None when it
    sizes nothing (its options run as given)."""
    found: Sizable | None = getattr(engine_class(name), "sizing", None)
    return found


def _what(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=64)
def _import_class(name: str, target: str) -> type[Any]:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UnknownEngine(name, names(), f"engine {name!r} is not 'module:Class'")
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # anything the module raises on import: the engine cannot be had
        raise UnknownEngine(
            name,
            names(),
            f"engine {name!r}: cannot import {module_name} ({type(exc).__name__}: {exc})",
        ) from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise UnknownEngine(name, names(), f"engine {name!r}: {module_name} has no class {attr!r}")
    missing = [method for method in CONTRACT if not callable(getattr(cls, method, None))]
    if missing:
        raise UnknownEngine(
            name,
            names(),
            f"engine {name!r}: {cls.__qualname__} lacks {', '.join(missing)} of the engine contract "
            f"({', '.join(CONTRACT)})",
        )
    return cls


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    module_name = f"tether_engine_{abs(hash(str(path))):x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
