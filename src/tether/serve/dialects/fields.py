"""Honour or refuse, never ignore: what tether does with every field of every request body it decodes.

Each request struct registers a policy for each of its fields. ``tests/test_fields.py`` walks every field of every
registered struct and fails when one has no policy, or when a field's policy is not what a request shows (an
honoured field must change what is generated or how it is answered, a refused one must be a 400 naming it, a
metadata one must change nothing); the docs' field reference page is ``markdown()``, generated at every build.
Request structs refuse fields they do not declare (as OpenAI's own API does), so a misspelt or unsupported
parameter is a 400 naming it, not a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import msgspec

Kind = Literal["honoured", "extension", "limited", "refused", "metadata"]
KINDS: dict[Kind, str] = {
    "honoured": "honoured as the API defines it",
    "extension": "honoured: a llama.cpp extension to the API",
    "limited": "honoured for the values named, refused (400) for others",
    "refused": "refused with a 400 naming it when set",
    "metadata": "accepted and recorded nowhere: it changes nothing",
}

HONOURED: Final[Kind] = "honoured"
EXTENSION: Final[Kind] = "extension"
LIMITED: Final[Kind] = "limited"
REFUSED: Final[Kind] = "refused"
METADATA: Final[Kind] = "metadata"


@dataclass(frozen=True)
class FieldPolicy:
    """``returned``: tether's own replies carry the field, so a client sends it back on its next turn (a reply is
    always valid input): it is honoured, or metadata, never refused."""

    kind: Kind
    note: str = ""
    returned: bool = False


_REGISTRY: dict[str, tuple[type[msgspec.Struct], dict[str, FieldPolicy]]] = {}


def register(title: str, struct: type[msgspec.Struct], policies: dict[str, FieldPolicy]) -> None:
    """Declare what ``title`` (e.g. "POST /v1/chat/completions") does with each of ``struct``'s fields."""
    _REGISTRY[title] = (struct, policies)


def registered() -> dict[str, tuple[type[msgspec.Struct], dict[str, FieldPolicy]]]:
    return dict(_REGISTRY)


def encoded_name(struct: type[msgspec.Struct], attr: str) -> str:
    """The field's name on the wire (``struct`` may rename, e.g. a field that is a Python keyword)."""
    names = dict(zip(struct.__struct_fields__, struct.__struct_encode_fields__, strict=True))
    return names[attr]


def markdown() -> str:
    """The field reference: every registered body, every field, what tether does with it."""
    lines: list[str] = []
    for title, (struct, policies) in _REGISTRY.items():
        lines += [f"**{title}**", "", "| field | tether | in replies | note |", "|---|---|---|---|"]
        for attr in struct.__struct_fields__:
            policy = policies[attr]
            back = "round-trip" if policy.returned else ""
            lines.append(f"| `{encoded_name(struct, attr)}` | {policy.kind} | {back} | {policy.note} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
