"""OpenAI's Responses API, stateless: ``POST /v1/responses`` in, a ``response`` object or its typed SSE events out.

tether keeps no state, so the Responses API's server-side memory is refused by name rather than faked:
``store: true``, ``previous_response_id``, ``conversation``, stored ``prompt`` templates and ``background``
responses are 400s saying so, and ``GET``/``DELETE /v1/responses/{id}`` answer 404 (nothing is stored). The rest
maps onto what chat completions already do: ``instructions`` and ``input`` items become the conversation (function
calls and their outputs in the generic tool format, ``tools``), ``text.format`` is grammar-constrained structured
output, function ``tools`` are ``function_call`` output items. Every field is honoured, refused or metadata, as
registered in ``requests`` (the docs' field reference).

One module per job: ``requests`` (the body and its fields' policies), ``planning`` (a request to the ``Plan`` it
runs), ``replies`` (the reply types), ``shaper`` (the stream shaped into replies), ``handlers`` (the routes). This
package re-exports what the app, the tests and the benchmarks use.
"""

from tether.serve.dialects.responses.handlers import routes
from tether.serve.dialects.responses.planning import ResponsesPlan, input_turns, plan
from tether.serve.dialects.responses.replies import (
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
)
from tether.serve.dialects.responses.requests import (
    BEYOND_SCHEMA,
    SCHEMA_RULES,
    ResponsesInputItem,
    ResponsesInputText,
    ResponsesRequest,
    decode,
)
from tether.serve.dialects.responses.shaper import ResponsesShaper

__all__ = [
    "BEYOND_SCHEMA",
    "SCHEMA_RULES",
    "OutputFunctionCall",
    "OutputMessage",
    "OutputReasoning",
    "OutputText",
    "ReasoningText",
    "ResponsesInputItem",
    "ResponsesInputText",
    "ResponsesPlan",
    "ResponsesRequest",
    "ResponsesShaper",
    "decode",
    "input_turns",
    "plan",
    "routes",
]
