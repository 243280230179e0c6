"""Ollama's routes: the handlers and the table the app serves and ``/openapi.json`` describes."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Literal

import anyio
from fastapi import Request
from fastapi.responses import Response

import tether
from tether.fleet.catalog import keep_alive_seconds
from tether.fleet.facts import ListedModel, capabilities, facts, listed
from tether.fleet.fleet import Unavailable, new_request_id
from tether.node.instance import InstanceReady
from tether.serve import views
from tether.serve.dialects import thinking
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.ollama.planning import (
    chat_plan,
    embed_inputs,
    embed_texts,
    generate_plan,
    show_model,
    uses_tools,
    wants_thinking,
)
from tether.serve.dialects.ollama.replies import (
    OllamaChatChunk,
    OllamaChatDone,
    OllamaEmbeddingOut,
    OllamaEmbedOut,
    OllamaGenerateChunk,
    OllamaGenerateDone,
    OllamaPs,
    OllamaShow,
    OllamaTags,
    OllamaVersion,
    details_of,
    loaded,
    loaded_out,
    ns,
    parameters_text,
    rfc3339,
    tag_out,
)
from tether.serve.dialects.ollama.requests import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    decode,
)
from tether.serve.dialects.ollama.shaper import OllamaShaper
from tether.serve.dialects.plan import Plan
from tether.serve.generation import Api
from tether.serve.routes import GENERATION_ERRORS, NDJSON, Route, json_answer, json_response, ref

# What /api/version answers: Open WebUI and the ollama clients compare it against the Ollama release a feature needs
# (Open WebUI warns below its minimum); tether speaks the API of this release (its fields, its NDJSON, its errors).
# tether's own version is in the X-Tether-Version header.
OLLAMA_VERSION = "0.12.6"
TETHER_VERSION = "X-Tether-Version"


def _generation_answer(chunk: type, done: type) -> dict[str, Any]:
    lines = {"type": "array", "items": {"anyOf": [ref(chunk), ref(done), ref(views.OllamaErrorBody)]}}
    return {
        "200": {
            "description": f"the {done.__name__} (``stream: false``) or NDJSON lines (the default): pieces, then a "
            "``done: true`` line with the counts and durations, or an ``error`` line carrying the cause when the "
            "runner fails",
            "content": {"application/json": {"schema": ref(done)}, NDJSON: {"schema": lines}},
        }
    }


def routes(api: Api) -> list[Route]:
    """Ollama's routes, answering through ``api``; their errors take Ollama's shape by their path (``statuses``)."""
    return OllamaHandlers(api).routes()


class OllamaHandlers:
    """Ollama's handlers, one method each, answering through ``api``, and the table that routes to them."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.scheduler = api.scheduler

    def routes(self) -> list[Route]:
        errors = GENERATION_ERRORS
        return [
            Route(
                path="/api/chat",
                method="POST",
                endpoint=self.chat,
                summary="Ollama chat",
                answers=_generation_answer(OllamaChatChunk, OllamaChatDone),
                errors=errors,
                body=OllamaChatRequest,
            ),
            Route(
                path="/api/generate",
                method="POST",
                endpoint=self.generate,
                summary="Ollama completion",
                answers=_generation_answer(OllamaGenerateChunk, OllamaGenerateDone),
                errors=errors,
                body=OllamaGenerateRequest,
            ),
            Route(
                path="/api/embed",
                method="POST",
                endpoint=self.embed,
                summary="Ollama embeddings, one unit-length vector per input",
                answers={"200": json_answer(OllamaEmbedOut, "the vectors")},
                errors=errors,
                body=OllamaEmbedRequest,
            ),
            Route(
                path="/api/embeddings",
                method="POST",
                endpoint=self.embeddings,
                summary="Ollama's older embeddings route: one prompt, one vector",
                answers={"200": json_answer(OllamaEmbeddingOut, "the vector")},
                errors=errors,
                body=OllamaEmbeddingsRequest,
            ),
            Route(
                path="/api/tags",
                method="GET",
                endpoint=self.tags,
                summary="every model, as Ollama lists them",
                answers={"200": json_answer(OllamaTags, "them")},
            ),
            Route(
                path="/api/ps",
                method="GET",
                endpoint=self.ps,
                summary="the loaded models",
                answers={"200": json_answer(OllamaPs, "them")},
            ),
            Route(
                path="/api/show",
                method="POST",
                endpoint=self.show,
                summary="one model: its GGUF metadata, chat template and capabilities",
                answers={"200": json_answer(OllamaShow, "the model")},
                errors=(400, 404, 413),
                body=OllamaShowRequest,
            ),
            Route(
                path="/api/version",
                method="GET",
                endpoint=self.version,
                summary="the Ollama release whose API tether speaks (tether's own version: the X-Tether-Version "
                "header)",
                answers={"200": json_answer(OllamaVersion, "it")},
            ),
        ]

    # --- generation --------------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self.generation(request, "chat")

    async def generate(self, request: Request) -> Response:
        return await self.generation(request, "generate")

    async def generation(self, request: Request, kind: Literal["chat", "generate"]) -> Response:
        started = time.monotonic()
        endpoint = f"ollama_{kind}"
        struct = OllamaChatRequest if kind == "chat" else OllamaGenerateRequest
        body: OllamaChatRequest | OllamaGenerateRequest = decode(struct, await request.body())
        model_id = self.scheduler.resolve(body.model)
        plan = self.api.planned(model_id, endpoint, await self.planner(body, model_id))
        if plan is None:
            return await self.load(kind, model_id, body)
        request_id = new_request_id(f"ollama-{kind}")
        shaper = OllamaShaper(kind, model_id, plan, started, request_id)
        return await self.api.respond(model_id, plan, shaper, request_id, endpoint, started)

    async def planner(
        self, body: OllamaChatRequest | OllamaGenerateRequest, model_id: str
    ) -> Callable[[], Plan | None]:
        """What makes the request's plan once it is admitted, with what the model says first: whether its template
        can switch thinking, its tool format (a chat's), whether it has a template (a generation's)."""
        think = await thinking.switch(self.scheduler, model_id, wants_thinking(body), "think")
        if isinstance(body, OllamaChatRequest):
            fmt = await toolkit.format_for(self.scheduler, model_id) if uses_tools(body) else toolkit.GENERIC
            return functools.partial(chat_plan, body, fmt, think)
        templated = body.raw or await toolkit.template_of(self.scheduler, model_id) != ""
        return functools.partial(generate_plan, body, think, templated)

    async def load(
        self, kind: Literal["chat", "generate"], model_id: str, body: OllamaChatRequest | OllamaGenerateRequest
    ) -> Response:
        """A request with nothing to generate: Ollama's "load the model" (or, with keep_alive 0, "unload it":
        ``ollama stop``), answered once it is done."""
        keep = keep_alive_seconds(body.keep_alive)
        if keep == 0:
            await self.scheduler.unload(model_id, "keep_alive 0 with nothing to generate (ollama stop)")
            answer = {**loaded(kind, model_id), "done_reason": "unload"}
        else:
            async with self.scheduler.lease(model_id, keep) as hosted:
                if not isinstance(hosted.instance.state, InstanceReady):
                    inst = hosted.instance
                    raise Unavailable(inst.unavailable_reason(), retry_after=hosted.retry_after(), cause=inst.cause)
            answer = loaded(kind, model_id)
        if body.stream:
            return Response(views.encode(answer) + b"\n", media_type=NDJSON)
        return json_response(answer)

    # --- embeddings --------------------------------------------------------------------------------------------

    async def embed(self, request: Request) -> Response:
        started = time.monotonic()
        body = decode(OllamaEmbedRequest, await request.body())
        model_id = self.scheduler.resolve(body.model)
        inputs = self.api.planned(model_id, "ollama_embed", lambda: embed_inputs(embed_texts(body), body))
        keep = keep_alive_seconds(body.keep_alive)
        embed_id = new_request_id("ollama-embed")
        chunks = await self.api.embed(model_id, inputs, embed_id, "ollama_embed", keep) if inputs else []
        return json_response(
            OllamaEmbedOut(
                model=model_id,
                embeddings=[list(c.embedding or ()) for c in chunks],
                total_duration=ns(time.monotonic() - started),
                load_duration=0,
                prompt_eval_count=sum(c.prompt_tokens for c in chunks),
            )
        )

    async def embeddings(self, request: Request) -> Response:
        body = decode(OllamaEmbeddingsRequest, await request.body())
        model_id = self.scheduler.resolve(body.model)
        inputs = self.api.planned(model_id, "ollama_embeddings", lambda: embed_inputs([body.prompt or ""], body))
        if not body.prompt:  # Ollama answers an empty prompt with an empty vector (it loads the model)
            return json_response(OllamaEmbeddingOut(embedding=[]))
        keep = keep_alive_seconds(body.keep_alive)
        chunks = await self.api.embed(model_id, inputs, new_request_id("ollama-embd"), "ollama_embeddings", keep)
        return json_response(OllamaEmbeddingOut(embedding=list(chunks[0].embedding or ())))

    # --- models ------------------------------------------------------------------------------------------------

    async def tags(self) -> Response:
        models = []
        for item in listed(self.scheduler):
            models.append(tag_out(item, await anyio.to_thread.run_sync(facts, item)))
        return json_response(OllamaTags(models=models))

    async def ps(self) -> Response:
        models = []
        now = self.scheduler.now()
        for hosted in self.api.fleet.list():
            if isinstance(hosted.instance.state, InstanceReady):
                slot = self.scheduler.slots.get(hosted.id)
                expires = slot.expires_in(now) if slot is not None else None
                f = await anyio.to_thread.run_sync(facts, ListedModel.of(hosted))
                models.append(await loaded_out(hosted, f, expires))
        return json_response(OllamaPs(models=models))

    async def show(self, request: Request) -> Response:
        model_id = self.scheduler.resolve(show_model(decode(OllamaShowRequest, await request.body())))
        item = next(i for i in listed(self.scheduler) if i.id == model_id)
        f = await anyio.to_thread.run_sync(facts, item)
        return json_response(
            OllamaShow(
                modelfile="",
                parameters=parameters_text(item),
                template=f.template,
                license=f.license,
                details=details_of(f),
                model_info=f.model_info,
                capabilities=capabilities(item),
                modified_at=rfc3339(f.modified_at),
            )
        )

    async def version(self) -> Response:
        return json_response(OllamaVersion(version=OLLAMA_VERSION), headers={TETHER_VERSION: tether.__version__})
