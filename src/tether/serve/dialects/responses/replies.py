"""The Responses API's reply types: the ``response`` object, its output items and its stream's typed events."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tether.fleet.fleet import new_request_id
from tether.serve import views


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: dict[str, int]  # ``cached_tokens`` (from the prompt cache), ``cache_write_tokens`` (0)
    output_tokens: int
    # ``reasoning_tokens``: those that wrote only thinking; ``accepted_prediction_tokens`` and
    # ``rejected_prediction_tokens``: tokens drafted from the request's ``prediction``, kept or thrown away
    output_tokens_details: dict[str, int]
    total_tokens: int
    speculation: views.SpeculationUsage  # tether's: speculative decoding's drafts and steps for this answer
    resumed: int  # tether's: times the answer went on from where it stood on a new runner after its runner died


class OutputText(msgspec.Struct):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]  # always empty
    logprobs: list[views.LogprobOut]  # with ``include: ["message.output_text.logprobs"]`` or ``top_logprobs``


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str  # what the ``function_call_output`` item that answers it names
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]  # incomplete: a limit cut its arguments (streams only)


class ReasoningText(msgspec.Struct):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(msgspec.Struct, tag_field="type", tag="reasoning"):
    """A reasoning model's thinking, before the message it led to."""

    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any]  # always empty: the thinking itself is in ``content``
    content: list[ReasoningText]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class ResponseFailure(msgspec.Struct):
    """Why a response failed: tether's error code (a runner failure's cause kind), its message and ``cause``."""

    code: str
    message: str
    cause: views.CauseOut | None = None
    completion_tokens: int | None = None


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseObject(msgspec.Struct):
    """A ``response`` (``object: "response"``), never stored; it echoes the request's settings."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: ResponseFailure | None
    incomplete_details: IncompleteDetails | None  # the length limit ended it
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None  # null until it ends
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int | None
    truncation: Literal["disabled"]
    store: bool
    background: bool
    previous_response_id: None
    reasoning: dict[str, Any] | None  # the request's ``reasoning`` echoed


class ResponseCreated(msgspec.Struct, tag_field="type", tag="response.created"):
    sequence_number: int
    response: ResponseObject


class ResponseInProgress(msgspec.Struct, tag_field="type", tag="response.in_progress"):
    sequence_number: int
    response: ResponseObject


class ResponseCompleted(msgspec.Struct, tag_field="type", tag="response.completed"):
    sequence_number: int
    response: ResponseObject


class ResponseIncomplete(msgspec.Struct, tag_field="type", tag="response.incomplete"):
    """The length limit ended it (``max_output_tokens``)."""

    sequence_number: int
    response: ResponseObject


class ResponseFailed(msgspec.Struct, tag_field="type", tag="response.failed"):
    """The runner failed (or the request was cancelled) mid-stream: ``response.error`` says why; an ``error``
    event follows and ends the stream."""

    sequence_number: int
    response: ResponseObject


class OutputItemAdded(msgspec.Struct, tag_field="type", tag="response.output_item.added"):
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemDone(msgspec.Struct, tag_field="type", tag="response.output_item.done"):
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartAdded(msgspec.Struct, tag_field="type", tag="response.content_part.added"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(msgspec.Struct, tag_field="type", tag="response.content_part.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(msgspec.Struct, tag_field="type", tag="response.output_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[views.LogprobOut]


class ReasoningTextDelta(msgspec.Struct, tag_field="type", tag="response.reasoning_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(msgspec.Struct, tag_field="type", tag="response.reasoning_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class OutputTextDone(msgspec.Struct, tag_field="type", tag="response.output_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[views.LogprobOut]


class FunctionCallArgumentsDelta(msgspec.Struct, tag_field="type", tag="response.function_call_arguments.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(msgspec.Struct, tag_field="type", tag="response.function_call_arguments.done"):
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(msgspec.Struct, tag_field="type", tag="error"):
    """The last event of a failed stream; ``error`` is OpenAI's error object (with the cause), which the openai
    client raises as an ``APIError``."""

    sequence_number: int
    code: str
    message: str
    param: None
    error: views.ErrorDetail


RESPONSE_EVENTS = (
    ResponseCreated,
    ResponseInProgress,
    OutputItemAdded,
    ContentPartAdded,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemDone,
    ResponseCompleted,
    ResponseIncomplete,
    ResponseFailed,
    ResponseErrorEvent,
)


def new_id(prefix: str) -> str:
    return new_request_id(prefix, "_")
