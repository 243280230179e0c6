"""OpenAI's routes: chat and text completions, and the models a request can name."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response

from tether.errors import NotFound
from tether.fleet.fleet import new_request_id
from tether.serve import views
from tether.serve.dialects import template_args, thinking
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.openai.planning import chat_plan, completion_plan, thinking_wanted, uses_tools
from tether.serve.dialects.openai.replies import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    model_out,
)
from tether.serve.dialects.openai.requests import ChatRequest, CompletionRequest, decode
from tether.serve.dialects.openai.shaper import OpenAIShaper
from tether.serve.dialects.plan import Plan
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
    return OpenAIHandlers(api).routes()


class OpenAIHandlers:
    """OpenAI's handlers, one method each, answering through ``api``, and the table that routes to them."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.scheduler = api.scheduler

    def routes(self) -> list[Route]:
        return [
            Route(
                path="/v1/chat/completions",
                method="POST",
                endpoint=self.chat_completions,
                summary="OpenAI chat completion",
                answers=_generation_answer(ChatCompletion, ChatCompletionChunk),
                errors=GENERATION_ERRORS,
                body=ChatRequest,
            ),
            Route(
                path="/v1/completions",
                method="POST",
                endpoint=self.completions,
                summary="OpenAI (legacy) text completion",
                answers=_generation_answer(Completion, CompletionChunk),
                errors=GENERATION_ERRORS,
                body=CompletionRequest,
            ),
            Route(
                path="/v1/models",
                method="GET",
                endpoint=self.models,
                summary="every model a request can name, loaded or not",
                answers={"200": json_answer(views.ModelList, "the models")},
            ),
            Route(
                path="/v1/models/{model_id}",
                method="GET",
                endpoint=self.model,
                summary="one model a request can name",
                answers={"200": json_answer(views.ModelOut, "the model")},
                errors=(404,),
                parameters=(path_parameter("model_id"),),
            ),
        ]

    # --- generation --------------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self.generation(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.generation(request, "completion")

    async def generation(self, request: Request, kind: Literal["chat", "completion"]) -> Response:
        started = time.monotonic()
        endpoint = "chat" if kind == "chat" else "completions"
        body = decode(kind, await request.body())
        model_id = self.scheduler.resolve(body.model)
        planned = self.api.planned(model_id, endpoint, await self.planner(body, model_id))
        request_id = new_request_id("chatcmpl" if kind == "chat" else "cmpl")
        shaper = OpenAIShaper(kind, request_id, model_id, planned)
        return await self.api.respond(model_id, planned, shaper, request_id, endpoint, started)

    async def planner(self, body: ChatRequest | CompletionRequest, model_id: str) -> Callable[[], Plan]:
        """What makes the request's plan once it is admitted, with what the model says first (a chat's): its tool
        format, whether its template can switch thinking, which variables it reads."""
        if not isinstance(body, ChatRequest):
            return functools.partial(completion_plan, body)
        fmt = await toolkit.format_for(self.scheduler, model_id) if uses_tools(body) else toolkit.GENERIC
        want, _ = thinking_wanted(body)
        switch = "reasoning_effort" if body.reasoning_effort is not None else template_args.ENABLE_THINKING
        think = await thinking.switch(self.scheduler, model_id, want, switch)
        await template_args.check(self.scheduler, model_id, body.chat_template_kwargs)
        return functools.partial(chat_plan, body, fmt, think)

    # --- models ------------------------------------------------------------------------------------------------

    async def models(self) -> Response:
        data = []
        for name in self.scheduler.names():
            with contextlib.suppress(NotFound):  # an instance deleted while the list was read
                data.append(await model_out(self.scheduler, name))
        return json_response(views.ModelList(object="list", data=data))

    async def model(self, model_id: str) -> Response:
        try:
            return json_response(await model_out(self.scheduler, self.scheduler.resolve_exact(model_id)))
        except NotFound:
            served = ", ".join(self.scheduler.names()) or "none"
            message = f"model {model_id!r} is not served here; models: {served}"
            answer = Answer(404, "invalid_request_error", "model_not_found", message, "model")
            return answer.response("/v1/models")
