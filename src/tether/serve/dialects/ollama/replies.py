"""Ollama's reply types (JSON objects and NDJSON lines; errors: ``views.OllamaErrorBody``), and the models
described from their GGUF headers (``/api/tags``, ``/api/ps``, ``/api/show``).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from tether.fleet.facts import ListedModel, ModelFacts, capabilities, options_of
from tether.fleet.fleet import Hosted
from tether.serve import views
from tether.serve.dialects.ollama.planning import DEFAULTS

FOREVER = "9999-12-31T23:59:59Z"  # expires_at of a model that stays loaded (pinned, busy, keep-alive forever)


class OllamaFunctionOut(msgspec.Struct):
    index: int
    name: str
    arguments: Any  # an object, matching the tool's parameters (grammar-constrained)


class OllamaToolCallOut(msgspec.Struct):
    id: str
    function: OllamaFunctionOut


class OllamaMessageOut(msgspec.Struct):
    role: Literal["assistant"]
    content: str
    tool_calls: list[OllamaToolCallOut] | None = None
    thinking: str | UnsetType = UNSET  # a reasoning model's thinking (kept apart from content whether or not asked)


# "load" / "unload": a request without a prompt, answered once its model is loaded (or, with keep_alive 0, unloaded)
OllamaDoneReason = Literal["stop", "length", "load", "unload"]


class OllamaChatChunk(msgspec.Struct):
    model: str
    created_at: str  # RFC 3339
    message: OllamaMessageOut
    done: Literal[False]
    logprobs: list[views.LogprobOut] | None = None


class OllamaChatDone(msgspec.Struct):
    """The last line of a chat stream, or the whole answer; durations in nanoseconds (absent for "load")."""

    model: str
    created_at: str
    message: OllamaMessageOut
    done: Literal[True]
    done_reason: OllamaDoneReason
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[views.LogprobOut] | None = None
    truncated_messages: int | UnsetType = UNSET  # the chat's oldest turns left out to fit the context (when any)
    resumed: int | UnsetType = UNSET  # tether's: times it went on on a new runner after its runner died (when any)


class OllamaGenerateChunk(msgspec.Struct):
    model: str
    created_at: str
    response: str
    done: Literal[False]
    thinking: str | UnsetType = UNSET
    logprobs: list[views.LogprobOut] | None = None


class OllamaGenerateDone(msgspec.Struct):
    model: str
    created_at: str
    response: str
    done: Literal[True]
    done_reason: OllamaDoneReason
    thinking: str | UnsetType = UNSET
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[views.LogprobOut] | None = None
    truncated_messages: int | UnsetType = UNSET  # the chat's oldest turns left out to fit the context (when any)
    resumed: int | UnsetType = UNSET  # tether's: times it went on on a new runner after its runner died (when any)


class OllamaEmbedOut(msgspec.Struct):
    model: str
    embeddings: list[list[float]]  # unit length, one per input
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingOut(msgspec.Struct):
    embedding: list[float]  # empty for an empty prompt


class OllamaDetails(msgspec.Struct):
    """From the model's GGUF header; empty strings where there is no model file (the debug engine)."""

    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class OllamaTag(msgspec.Struct):
    name: str
    model: str
    modified_at: str
    size: int  # the model file's
    digest: str  # sha256 of the file's path, size and mtime
    details: OllamaDetails
    capabilities: list[str]  # Ollama's names: "completion", "tools", "embedding" (an embedding instance: that alone)


class OllamaTags(msgspec.Struct):
    models: list[OllamaTag]


class OllamaLoaded(msgspec.Struct):
    name: str
    model: str
    modified_at: str
    size: int  # the runner's footprint plus its resident mapped weights
    digest: str
    details: OllamaDetails
    size_vram: int
    expires_at: str  # far future: an instance stays loaded until it is removed
    context_length: int | UnsetType = UNSET  # the model's n_ctx, when it sets one


class OllamaPs(msgspec.Struct):
    models: list[OllamaLoaded]


class OllamaShow(msgspec.Struct):
    modelfile: str
    parameters: str
    template: str  # the GGUF's chat template (Jinja, not a Go template)
    license: str
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersion(msgspec.Struct):
    version: str  # the Ollama release whose API tether speaks (tether's own: the X-Tether-Version header)


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def loaded(kind: Literal["chat", "generate"], model: str) -> dict[str, Any]:
    """Ollama's answer to a request without a prompt: the model is loaded (here: it is ready)."""
    obj: dict[str, Any] = {"model": model, "created_at": rfc3339(time.time())}
    if kind == "chat":
        obj["message"] = {"role": "assistant", "content": ""}
    else:
        obj["response"] = ""
    return {**obj, "done": True, "done_reason": "load"}


def parameters_text(item: ListedModel) -> str:
    """Ollama's ``parameters``: the defaults a request without options gets here."""
    options = options_of(item)
    values: dict[str, Any] = {**DEFAULTS}
    if isinstance(options.get("n_ctx"), int):
        values["num_ctx"] = options["n_ctx"]
    return "\n".join(f"{name:<30} {value}" for name, value in values.items())


def details_of(f: ModelFacts) -> OllamaDetails:
    return msgspec.convert(f.details, OllamaDetails)


def tag_out(item: ListedModel, f: ModelFacts) -> OllamaTag:
    return OllamaTag(
        name=item.id,
        model=item.id,
        modified_at=rfc3339(f.modified_at),
        size=f.size,
        digest=f.digest,
        details=details_of(f),
        capabilities=capabilities(item),
    )


async def loaded_out(hosted: Hosted, f: ModelFacts, expires_in: float | None) -> OllamaLoaded:
    """A loaded model: its memory sampled now (the footprint, plus the mapped weights that are resident), and when
    keep-alive unloads it (``expires_in`` seconds from now; None: not counting down)."""
    size, vram = f.size, 0
    sup = hosted.supervisor
    if sup is not None and sup.alive:
        memory = await sup.sample_memory()
        if memory is not None:
            size, vram = memory.footprint + memory.file, memory.gpu or 0
    item = ListedModel.of(hosted)
    n_ctx = options_of(item).get("n_ctx")
    return OllamaLoaded(
        name=item.id,
        model=item.id,
        modified_at=rfc3339(f.modified_at),
        size=size,
        digest=f.digest,
        details=details_of(f),
        size_vram=vram,
        expires_at=FOREVER if expires_in is None else rfc3339(time.time() + expires_in),
        context_length=n_ctx if isinstance(n_ctx, int) else UNSET,
    )
