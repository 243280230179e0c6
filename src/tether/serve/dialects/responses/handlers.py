"""The Responses API's routes: ``POST /v1/responses``, and the stored-response routes, which find nothing stored."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tether.serve import views
from tether.serve.dialects import thinking
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.responses.planning import effort, plan, uses_tools
from tether.serve.dialects.responses.replies import RESPONSE_EVENTS, ResponseObject, new_id
from tether.serve.dialects.responses.requests import ResponsesRequest, decode
from tether.serve.dialects.responses.shaper import ResponsesShaper
from tether.serve.generation import Api
from tether.serve.routes import GENERATION_ERRORS, SSE, Route, json_answer, path_parameter, ref
from tether.serve.statuses import Answer

ENDPOINT = "responses"  # the metrics' endpoint label


NOT_STORED = (
    "tether stores no responses (every response is store: false), so there is no response {id!r} to {what}; "
    "to stop a generation in flight, POST /v1/requests/{{id}}/cancel with the response's id"
)


def _not_stored(response_id: str, what: str) -> Response:
    message = NOT_STORED.format(id=response_id, what=what)
    return Answer(404, "invalid_request_error", "not_found", message, "response_id").response("/v1/responses")


def _events() -> dict[str, Any]:
    """One server-sent event of a Responses stream: its ``event`` name and the typed JSON it carries."""
    names = [struct.__struct_config__.tag for struct in RESPONSE_EVENTS]
    payload = {"anyOf": [ref(struct) for struct in RESPONSE_EVENTS]}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return {"type": "object", "required": ["event", "data"], "properties": {"event": {"enum": names}, "data": data}}


def routes(api: Api) -> list[Route]:
    """``POST /v1/responses``, and the stored-response routes, which find nothing stored."""
    return ResponsesHandlers(api).routes()


class ResponsesHandlers:
    """The Responses API's handlers, one method each, answering through ``api``, and the table that routes to
    them."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.scheduler = api.scheduler

    def routes(self) -> list[Route]:
        answer = {
            "200": {
                "description": "the response object (``stream: false``) or its typed server-sent events, from "
                "``response.created`` to ``response.completed`` (``response.incomplete`` when the length limit "
                "ended it), or ``response.failed`` and an ``error`` event carrying the cause when the runner fails",
                "content": {"application/json": {"schema": ref(ResponseObject)}, SSE: {"schema": _events()}},
            }
        }
        stored = "/v1/responses/{response_id}"
        nothing = {"404": json_answer(views.ErrorBody, "no such response: tether stores no responses")}
        what = "a stored response: tether stores none (store is false), so always 404"
        at = (path_parameter("response_id"),)
        return [
            Route(
                path="/v1/responses",
                method="POST",
                endpoint=self.create_response,
                summary="OpenAI Responses API, stateless (store false; previous_response_id refused)",
                answers=answer,
                errors=GENERATION_ERRORS,
                body=ResponsesRequest,
            ),
            Route(
                path=stored,
                method="GET",
                endpoint=self.get_response,
                summary=f"retrieve {what}",
                answers=nothing,
                parameters=at,
            ),
            Route(
                path=stored,
                method="DELETE",
                endpoint=self.delete_response,
                summary=f"delete {what}",
                answers=nothing,
                parameters=at,
            ),
            Route(
                path=f"{stored}/cancel",
                method="POST",
                endpoint=self.cancel_response,
                summary=f"cancel {what}",
                answers=nothing,
                parameters=at,
            ),
            Route(
                path=f"{stored}/input_items",
                method="GET",
                endpoint=self.input_items,
                summary=f"list the input items of {what}",
                answers=nothing,
                parameters=at,
            ),
        ]

    async def create_response(self, request: Request) -> Response:
        started = time.monotonic()
        body = decode(await request.body())
        model_id = self.scheduler.resolve(body.model)
        fmt = await toolkit.format_for(self.scheduler, model_id) if uses_tools(body) else toolkit.GENERIC
        think = await thinking.switch(self.scheduler, model_id, thinking.wanted(effort(body)), "reasoning.effort")
        planned = self.api.planned(model_id, ENDPOINT, lambda: plan(body, fmt, think))
        response_id = new_id("resp")
        shaper = ResponsesShaper(response_id, model_id, planned)
        return await self.api.respond(model_id, planned, shaper, response_id, ENDPOINT, started)

    async def get_response(self, response_id: str) -> Response:
        return _not_stored(response_id, "retrieve")

    async def delete_response(self, response_id: str) -> Response:
        return _not_stored(response_id, "delete")

    async def cancel_response(self, response_id: str) -> Response:
        return _not_stored(response_id, "cancel")

    async def input_items(self, response_id: str) -> Response:
        return _not_stored(response_id, "list the input items of")
