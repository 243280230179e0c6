"""OpenAI's wire format: request bodies in, completion objects and SSE chunks out, errors in OpenAI's shape.

Bodies are decoded with msgspec (typed, with the offending field named in the error) into structs that refuse
fields they do not declare, as OpenAI's API does. Every declared field is honoured or refused with a 400 naming
it, or is metadata that changes nothing; each struct registers which (``fields``), and the docs' field reference is made
from that. A request becomes a ``Plan``: the ``GenerateParams`` the runner gets, plus how the answer is shaped
(streaming, usage, logprobs, tool calls).

One module per job: ``requests`` (the bodies and their fields' policies), ``planning`` (a request to the ``Plan``
it runs), ``replies`` (the reply types, and a model as OpenAI lists it), ``shaper`` (the stream shaped into
replies), ``handlers`` (the routes). This package re-exports what the app, the tests and the benchmarks use.
"""

from tether.serve.dialects.openai.handlers import routes
from tether.serve.dialects.openai.planning import chat_plan, completion_plan
from tether.serve.dialects.openai.replies import (
    AssistantMessage,
    ChatCompletionChunk,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from tether.serve.dialects.openai.requests import BEYOND_SCHEMA, SCHEMA_RULES, ChatRequest, CompletionRequest, decode
from tether.serve.dialects.openai.shaper import DONE, OpenAIShaper

__all__ = [
    "BEYOND_SCHEMA",
    "DONE",
    "SCHEMA_RULES",
    "AssistantMessage",
    "ChatCompletionChunk",
    "ChatRequest",
    "CompletionRequest",
    "FunctionCallDelta",
    "FunctionCallOut",
    "OpenAIShaper",
    "ToolCallDelta",
    "ToolCallOut",
    "chat_plan",
    "completion_plan",
    "decode",
    "routes",
]
