"""The OpenAPI document served at ``/openapi.json``, written from the route table the app serves.

Paths come from the ``Route``s themselves (``app`` registers the same list), request bodies from the very structs
the API decodes with, and responses from the structs every answer is encoded from (``views``' and each dialect's
own), so neither half can drift from what is served. Both halves are checked against a live server by the API
fuzzer (``bench/fuzz.py``, ``tests/test_fuzz.py``): schema-valid bodies must be served, invalid ones refused with a
4xx, and every response must match what is written here; ``tests/test_http_api.py`` compares real answers' keys
with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec

from tether.serve import views
from tether.serve.dialects import embeddings, ollama, openai, responses, shapes, tokenizer
from tether.serve.dialects.ollama import replies as ollama_replies
from tether.serve.dialects.openai import replies as openai_replies
from tether.serve.dialects.responses import replies as responses_replies
from tether.serve.guard import OPEN_PATHS
from tether.serve.routes import REF, Route, json_answer
from tether.serve.statuses import WHEN, shape_of

RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds until the instance can take the request (absent when retrying cannot help)",
        "schema": {"type": "integer", "minimum": 1},
    }
}


# where the answers' structs are defined (a dialect package's ``replies``; a request struct is named by its body)
ANSWER_MODULES = (views, openai_replies, embeddings, tokenizer, responses_replies, ollama_replies)
RULE_MODULES = (shapes, openai, responses, ollama, tokenizer)  # their SCHEMA_RULES: what a field's type cannot say


def answer_structs() -> list[type]:
    """Every public struct the answer modules define: the components a ``$ref`` in a route's answers may name (the
    single-module dialects' request structs among them, which their bodies name anyway)."""
    return [
        obj
        for module in ANSWER_MODULES
        for name, obj in vars(module).items()
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == module.__name__
        and not name.startswith("_")
    ]


def errors(path: str, *statuses: int) -> dict[str, Any]:
    """The error answers ``statuses`` of the route at ``path``, in its shape (Ollama's under ``/api/``)."""
    body = views.OllamaErrorBody if shape_of(path) == "ollama" else views.ErrorBody
    return {str(s): json_answer(body, WHEN[s], RETRY_AFTER if s == 503 else None) for s in statuses}


def operation(route: Route, auth: bool) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": route.summary, **route.notes}
    if route.parameters:
        op["parameters"] = list(route.parameters)
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(route.body)}}}
    # The guard's answers come before any route: a Host or Origin refused (403) on every route, the key (401) on
    # every route but the open ones, the body limit (413) where there is a body.
    guard = [403] + ([413] if route.body is not None else []) + ([401] if auth and route.path not in OPEN_PATHS else [])
    op["responses"] = {**route.answers, **errors(route.path, *sorted({*route.errors, *guard}))}
    if auth and route.path not in OPEN_PATHS:
        op["security"] = [{"bearer": []}]
    return op


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": REF.format(name=struct.__name__)}


def openapi(routes: Sequence[Route], *, auth: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (``auth``: the server wants a bearer key on every route but the open
    ones)."""
    bodies = [route.body for route in routes if route.body is not None]
    _, components = msgspec.json.schema_components([*bodies, *answer_structs()], ref_template=REF)
    for name, rules in {name: rules for module in RULE_MODULES for name, rules in module.SCHEMA_RULES.items()}.items():
        components[name].update(rules)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if route.documented:
            paths.setdefault(route.path, {})[route.method.lower()] = operation(route, auth)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tether", "version": _version(), "description": "A supervised inference worker's API."},
        "paths": paths,
        "components": {"schemas": components},
    }
    if auth:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def _version() -> str:
    try:
        return version("tether")
    except PackageNotFoundError:
        return "0"
