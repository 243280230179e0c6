"""OpenAI's embeddings API: ``POST /v1/embeddings`` from an instance started for embeddings.

An embedding is a task like a generation (``EmbedParams``): the same queue, deadlines, cancel and failure
causes; the runner returns the pooled, L2-normalised vector of each input on its final chunk. Inputs are strings;
token-id arrays and ``dimensions`` are refused (the vector's size is the model's).
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Request
from fastapi.responses import Response

from tether.errors import InvalidField
from tether.fleet.fleet import new_request_id
from tether.protocol import Chunk, EmbedParams, documented
from tether.serve.dialects.fields import HONOURED, LIMITED, METADATA, FieldPolicy, register
from tether.serve.dialects.plan import MAX_INPUTS, decode_body, embedding_tasks
from tether.serve.generation import Api
from tether.serve.routes import GENERATION_ERRORS, Route, json_answer, json_response


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | Annotated[list[str], documented(minItems=1, maxItems=MAX_INPUTS)]
    model: str | None = None
    encoding_format: Annotated[str, documented(enum=["float", "base64"])] = "float"
    dimensions: Annotated[Any, documented(type="null", description="the model's size only")] = None
    user: str | None = None


class EmbeddingOut(msgspec.Struct):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # ``encoding_format: base64``: little-endian float32, base64


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    """One unit-length vector per input, in order."""

    object: Literal["list"]
    data: list[EmbeddingOut]
    model: str
    usage: EmbeddingUsage


register(
    "POST /v1/embeddings",
    EmbeddingRequest,
    {
        "input": FieldPolicy(LIMITED, "a string or a list of strings (token-id arrays are refused)"),
        "model": FieldPolicy(HONOURED, "an instance started with the llama.cpp option `embedding: true`"),
        "encoding_format": FieldPolicy(HONOURED, "`float` or `base64` (little-endian float32)"),
        "dimensions": FieldPolicy(LIMITED, "absent only: the vector has the model's size"),
        "user": FieldPolicy(METADATA),
    },
)

_decoder = msgspec.json.Decoder(EmbeddingRequest)


def decode(body: bytes) -> EmbeddingRequest:
    return decode_body(_decoder, body)


def inputs_of(request: EmbeddingRequest) -> list[EmbedParams]:
    """One embedding task per input."""
    if request.dimensions is not None:
        raise InvalidField(
            "dimensions", "dimensions is not supported: the vector has the model's size (omit dimensions)"
        )
    if request.encoding_format not in ("float", "base64"):
        raise InvalidField(
            "encoding_format", f"encoding_format must be 'float' or 'base64', got {request.encoding_format!r}"
        )
    texts = [request.input] if isinstance(request.input, str) else request.input
    if not texts:
        raise InvalidField("input", "input must hold at least one string")
    return embedding_tasks(texts)


def vector(values: tuple[float, ...], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return list(values)


def body(chunks: list[Chunk], model: str, encoding: str) -> EmbeddingList:
    """The list object: one embedding per input, in order, with the prompt tokens they took."""
    tokens = sum(chunk.prompt_tokens for chunk in chunks)
    data = [
        EmbeddingOut(object="embedding", index=i, embedding=vector(chunk.embedding or (), encoding))
        for i, chunk in enumerate(chunks)
    ]
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return EmbeddingList(object="list", data=data, model=model, usage=usage)


def routes(api: Api) -> list[Route]:
    """``POST /v1/embeddings``."""

    async def create_embeddings(request: Request) -> Response:
        request_body = decode(await request.body())
        model_id = api.scheduler.resolve(request_body.model)
        inputs = api.planned(model_id, "embeddings", lambda: inputs_of(request_body))
        chunks = await api.embed(model_id, inputs, new_request_id("embd"), "embeddings")
        return json_response(body(chunks, model_id, request_body.encoding_format))

    return [
        Route(
            path="/v1/embeddings",
            method="POST",
            endpoint=create_embeddings,
            summary="OpenAI embeddings, from an instance started with the llama.cpp option embedding: true",
            answers={"200": json_answer(EmbeddingList, "the vectors")},
            errors=GENERATION_ERRORS,
            body=EmbeddingRequest,
        )
    ]
