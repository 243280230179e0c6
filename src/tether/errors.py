"""tether's errors: one root, and the typed errors callers tell apart by type (never by their text).

Shared by every process side (it imports nothing at run time). Each error's message says what happened, why,
and what to do; its attributes carry what a caller maps (the API maps types to status codes and
``InvalidField.field`` to the OpenAI error's ``param``; the CLI maps them to exit codes).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


class TetherError(Exception):
    """The root of every error tether raises on purpose."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """The end of an "unknown name" message: ``: did you mean 'port'?`` for the closest of ``choices``, else the
    valid names."""
    names = sorted(choices)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f": did you mean {close[0]!r}?" if close else f": valid names are {', '.join(names)}"


class InvalidField(TetherError, ValueError):
    """A value tether refuses: ``field`` names it (None: the input as a whole) and ``why`` says what is wrong.

    A ``ValueError`` too, so msgspec turns one raised in a struct's ``__post_init__`` into a validation error.
    """

    def __init__(self, field: str | None, why: str) -> None:
        super().__init__(why)
        self.field = field
        self.why = why


class UnknownEngine(InvalidField):
    """An engine name that names no installed engine; ``installed`` lists the ones there are."""

    def __init__(self, name: str, installed: Sequence[str], detail: str | None = None) -> None:
        listed = ", ".join(repr(n) for n in installed)
        why = detail or f"unknown engine {name!r}"
        super().__init__(
            "engine",
            f"{why}: installed engines are {listed}; or name one as 'package.module:Class' or 'path/file.py:Class'",
        )
        self.name = name
        self.installed = tuple(installed)


class EngineImportRefused(TetherError):
    """An engine named by module or file path where code may not be imported on the asker's say-so (a request, a
    catalog file) because the worker was not started with ``--allow-engine-import``."""

    field = "engine"

    def __init__(self, name: str, where: str) -> None:
        super().__init__(
            f"engine {name!r} names code to import ({where}), and this worker imports engine code only from its own "
            "command line (--engine) or installed engines (built-ins, 'tether.engines' entry points): start "
            "`tether serve` with --allow-engine-import to let instances name engines by module or file path, or "
            "install the engine as an entry point"
        )
        self.name = name


class InvalidModel(InvalidField):
    """A model that cannot be used: a file that is missing, unreadable or not a model the engine can load."""

    def __init__(self, why: str) -> None:
        super().__init__("model", why)


class ModelRequired(InvalidField):
    """A request named no model while several are served: which one is ambiguous."""

    def __init__(self, why: str) -> None:
        super().__init__("model", why)


class NotFound(TetherError, LookupError):
    """No such instance, model or request."""


class InstanceExists(TetherError):
    """An instance with that id is already served."""

    def __init__(self, instance_id: str, why: str | None = None) -> None:
        super().__init__(why or f"an instance {instance_id!r} exists already: DELETE it first or choose another id")
        self.instance_id = instance_id


class BodyTooLarge(TetherError):
    """A body over the limit: declared so up front, or found so while it arrives (then ``size`` is a lower bound)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"request body of at least {size} bytes exceeds the limit of {limit} bytes (--max-body)")
