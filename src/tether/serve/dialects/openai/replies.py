"""OpenAI's reply types (what ``/openapi.json`` says of the answers the shaper writes), and a model as OpenAI lists
it.
"""

from __future__ import annotations

from typing import Literal

import anyio
import msgspec
from msgspec import UNSET, UnsetType

from tether.fleet.facts import ListedModel, capabilities
from tether.fleet.scheduler import Scheduler
from tether.node.instance import InstanceReady
from tether.protocol import (
    tag_of,
)
from tether.serve import views


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # of prompt_tokens, those whose KV the prompt cache supplied (not prefilled)


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int  # of completion_tokens, those that wrote only a reasoning model's thinking
    accepted_prediction_tokens: int  # tokens drafted from the request's ``prediction`` that the answer kept
    rejected_prediction_tokens: int  # tokens drafted from it and thrown away (they cost steps, not completion tokens)


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    speculation: views.SpeculationUsage  # tether's: speculative decoding's drafts and steps for this answer
    resumed: int  # tether's: times the answer went on from where it stood on a new runner after its runner died


class ChatLogprobs(msgspec.Struct):
    """``logprobs: true``: each generated token's log-probability under the model, and the ``top_logprobs`` most
    likely tokens at its position."""

    content: list[views.LogprobOut]
    refusal: None


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions API's logprobs (``logprobs: n``). With ``echo`` the prompt's tokens come first, and
    the first of them has null for its logprob and its alternatives (nothing precedes it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class FunctionCallDelta(msgspec.Struct):
    name: str | UnsetType = UNSET  # in a call's first delta
    arguments: str = ""  # more of the arguments' JSON text (the deltas joined are the arguments)


class ToolCallDelta(msgspec.Struct):
    """One streamed call's piece, as OpenAI streams it: the first carries its id, type and name, the next more of
    its arguments."""

    index: int
    function: FunctionCallDelta
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET


FinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # null when the answer is tool calls
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | UnsetType = UNSET  # a reasoning model's thinking (llama-server's and DeepSeek's field)


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class ChatDelta(msgspec.Struct):
    role: Literal["assistant"] | None = None  # in the first chunk
    content: str | None = None  # absent in the chunk that carries the finish reason
    tool_calls: list[ToolCallDelta] | None = None  # a tool answer: a call's opening, or more of its arguments
    reasoning_content: str | UnsetType = UNSET  # more of a reasoning model's thinking


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]  # empty in the usage chunk (``stream_options.include_usage``)
    usage: Usage | None = None


class TextChunkChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None


class CompletionChunk(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChunkChoice]
    usage: Usage | None = None


async def model_out(scheduler: Scheduler, model_id: str) -> views.ModelOut:
    """A model as OpenAI lists it, with what tether knows beside: its state, footprint or estimate, keep-alive."""
    fleet = scheduler.fleet
    slot = scheduler.slots.get(model_id)
    hosted = fleet.get(model_id) if slot is None else slot.hosted
    created = int(hosted.created_at if hosted is not None else scheduler.started_at)
    out = views.ModelOut(id=model_id, object="model", created=created, owned_by="tether")
    spec = hosted.instance.spec if slot is None and hosted is not None else None
    if slot is not None:
        spec = slot.model.config.spec()
    if spec is not None:  # ["embedding"] for an embedding instance: not one to offer for chat
        # off the loop: "thinking" is read from the model's template (its GGUF's header, once per file version)
        out.capabilities = await anyio.to_thread.run_sync(capabilities, ListedModel(model_id, spec, created))
    sup = hosted.supervisor if hosted is not None else None
    if sup is not None and sup.alive:
        await sup.sample_memory()
    if slot is not None:
        await scheduler.estimate(slot)
        seen = views.catalog_model_out(slot, scheduler.now())
        for name in seen.__struct_fields__:
            setattr(out, name, getattr(seen, name))
    elif hosted is not None:
        memory = sup.footprint if sup is not None and sup.alive else None
        state = hosted.instance.state
        out.state = "loaded" if isinstance(state, InstanceReady) else tag_of(state)
        out.engine = hosted.instance.spec.engine
        out.model = hosted.config.model
        out.pinned = True  # added through POST /v1/instances: it stays until it is deleted
        out.footprint = memory.footprint if memory is not None else None
    return out
