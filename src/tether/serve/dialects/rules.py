"""JSON Schema rules several request bodies state in ``/openapi.json``: what one field's type cannot say alone.

Each is enforced by the plans' own checks, with a message that says why; here it is written once for every body it
applies to (a dialect's ``SCHEMA_RULES`` names them), so the API fuzzer holds every API to the same rule.
"""

from __future__ import annotations

from typing import Any

LOGPROBS_RULE = {  # top_logprobs needs logprobs: true (chat, and Ollama's chat and generate)
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}
ASSISTANT_CALLS_RULE = {  # only an assistant turn carries tool_calls (OpenAI's and Ollama's messages)
    "if": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
    "then": {"properties": {"role": {"const": "assistant"}}},
}


def assistant_only(field: str) -> dict[str, Any]:
    """Only an assistant turn carries ``field`` (its thinking, sent back)."""
    return {
        "if": {"required": [field], "properties": {field: {"type": "string"}}},
        "then": ASSISTANT_CALLS_RULE["then"],
    }


TOOL_CHOICE_RULE = {  # a tool_choice that demands a call needs tools to call (chat, and the Responses API)
    "if": {
        "required": ["tool_choice"],
        "properties": {"tool_choice": {"anyOf": [{"type": "object"}, {"const": "required"}]}},
    },
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}
STRUCTURED_FORMAT = {  # a structured-output format: JSON, or a JSON schema
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["json_object", "json_schema"]}},
}


def structured_beside_tools(field: str, structured: dict[str, Any]) -> dict[str, Any]:
    """A request with tools in play and ``field`` set to a ``structured`` format: refused (tools answer in the
    grammar's JSON shape, so there is no second shape beside it): the schema says so under ``not``."""
    return {
        "type": "object",
        "required": ["tools", field],
        "properties": {
            "tools": {"type": "array", "minItems": 1},
            "tool_choice": {"not": {"const": "none"}},
            field: structured,
        },
    }
