"""OpenAI's routes: chat and text completions, and the models a request can name."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response

from tether.errors import NotFound
from tether.fleet.fleet import new_request_id
from tether.serve import views
from tether.serve.dialects import template_args, thinking
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.openai.planning import plan, thinking_wanted, uses_tools
from tether.serve.dialects.openai.replies import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    model_out,
)
from tether.serve.dialects.openai.requests import ChatRequest, CompletionRequest, decode
from tether.serve.dialects.openai.shaper import OpenAIShaper
from tether.serve.generation import Api
from tether.serve.routes import GENERATION_ERRORS, SSE, Route, json_answer, json_response, path_parameter, ref, sse_of
from tether.serve.statuses import Answer


def _generation_answer(whole: type, chunk: type) -> dict[str, Any]:
    events = sse_of({"anyOf": [ref(chunk), ref(views.ErrorBody)]})
    return {
        "200": {
            "description": f"the {whole.__name__} (``stream: false``) or its chunks as server-sent events, which end "
            "with ``data: [DONE]``, or with an error event carrying the cause when the runner fails",
            "content": {"application/json": {"schema": ref(whole)}, SSE: {"schema": events}},
        }
    }


def routes(api: Api) -> list[Route]:
    """Chat and text completions, and the models a request can name."""
    scheduler = api.scheduler

    async def generate(request: Request, kind: Literal["chat", "completion"]) -> Response:
        started = time.monotonic()
        endpoint = "chat" if kind == "chat" else "completions"
        body = decode(kind, await request.body())
        model_id = scheduler.resolve(body.model)
        fmt, think = toolkit.GENERIC, None
        if isinstance(body, ChatRequest):
            if uses_tools(body):
                fmt = await toolkit.format_for(scheduler, model_id)
            want, _ = thinking_wanted(body)
            switch = "reasoning_effort" if body.reasoning_effort is not None else template_args.ENABLE_THINKING
            think = await thinking.switch(scheduler, model_id, want, switch)
            await template_args.check(scheduler, model_id, body.chat_template_kwargs)
        planned = api.planned(model_id, endpoint, lambda: plan(body, fmt, think))
        request_id = new_request_id("chatcmpl" if kind == "chat" else "cmpl")
        shaper = OpenAIShaper(kind, request_id, model_id, planned)
        return await api.respond(model_id, planned, shaper, request_id, endpoint, started)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def models() -> Response:
        data = []
        for name in scheduler.names():
            with contextlib.suppress(NotFound):  # an instance deleted while the list was read
                data.append(await model_out(scheduler, name))
        return json_response(views.ModelList(object="list", data=data))

    async def model(model_id: str) -> Response:
        try:
            return json_response(await model_out(scheduler, scheduler.resolve_exact(model_id)))
        except NotFound:
            served = ", ".join(scheduler.names()) or "none"
            message = f"model {model_id!r} is not served here; models: {served}"
            answer = Answer(404, "invalid_request_error", "model_not_found", message, "model")
            return answer.response("/v1/models")

    return [
        Route(
            path="/v1/chat/completions",
            method="POST",
            endpoint=chat_completions,
            summary="OpenAI chat completion",
            answers=_generation_answer(ChatCompletion, ChatCompletionChunk),
            errors=GENERATION_ERRORS,
            body=ChatRequest,
        ),
        Route(
            path="/v1/completions",
            method="POST",
            endpoint=completions,
            summary="OpenAI (legacy) text completion",
            answers=_generation_answer(Completion, CompletionChunk),
            errors=GENERATION_ERRORS,
            body=CompletionRequest,
        ),
        Route(
            path="/v1/models",
            method="GET",
            endpoint=models,
            summary="every model a request can name, loaded or not",
            answers={"200": json_answer(views.ModelList, "the models")},
        ),
        Route(
            path="/v1/models/{model_id}",
            method="GET",
            endpoint=model,
            summary="one model a request can name",
            answers={"200": json_answer(views.ModelOut, "the model")},
            errors=(404,),
            parameters=(path_parameter("model_id"),),
        ),
    ]
