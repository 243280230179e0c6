"""Honour or refuse, never ignore: every field of every request body, walked.

For each body registered in ``tether.serve.dialects.fields`` and each of its fields, this test sends the field
(decoded as the server decodes it, planned as the server plans it) and checks its policy is what happens: an honoured
field changes the plan (what is generated or how it is answered), a refused one is an ``InvalidField`` naming it, a
limited one is accepted for one value and refused for another, a metadata one changes nothing. A field without a
policy, or without a case here, fails the test: a new field cannot land unexamined. The docs' field reference is
generated from the same registry.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

import tether.serve.app  # noqa: F401  (every route module registers its bodies on import)
from tether.errors import InvalidField
from tether.fleet.catalog import keep_alive_seconds as keep_alive
from tether.serve.dialects import embeddings, fields, ollama, openai, responses, tokenizer
from tether.serve.dialects.plan import decode_body


@dataclass(frozen=True)
class Case:
    """``value``: what to send. ``refused``: for a limited field, a value that must be refused. ``base``: changes
    to the base body this field needs to matter (a tool result's id needs a tool message)."""

    value: Any
    refused: Any = None
    base: dict[str, Any] | None = None


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
FUNCTION_CALL = {"role": None, "content": None, "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
REASONING = {"role": None, "content": None, "type": "reasoning", "summary": []}
FUNCTION_CALL_OUTPUT = {"role": None, "content": None, "type": "function_call_output", "call_id": "c", "output": "42"}


def responses_item_plan(body: bytes) -> Any:
    """The plan of a Responses request whose input ends with this item; a refusal names the item's own field."""
    request = {"input": [{"role": "user", "content": "q"}, json.loads(body)]}
    try:
        return responses.plan(responses.decode(json.dumps(request).encode()))
    except InvalidField as exc:
        if exc.field is not None and exc.field.startswith("input[1]."):
            raise InvalidField(exc.field.removeprefix("input[1]."), str(exc)) from None
        raise


def unprefixed(plan: Callable[[bytes], Any], prefix: str) -> Callable[[bytes], Any]:
    """A nested body's refusals name ``<prefix>field`` (``options.num_ctx``): here, the field alone."""

    def planned(body: bytes) -> Any:
        try:
            return plan(body)
        except InvalidField as exc:
            raise InvalidField((exc.field or "").removeprefix(prefix), exc.why) from None

    return planned


SAMPLING = {
    "model": Case("other"),
    "max_tokens": Case(7),
    "temperature": Case(0.5),
    "top_p": Case(0.5),
    "stop": Case(["\n"]),
    "seed": Case(42),
    "presence_penalty": Case(0.5),
    "frequency_penalty": Case(0.5),
    "logit_bias": Case({"42": -100}),
    "stream": Case(True),
    "stream_options": Case({"include_usage": True}),
    "n": Case(1, refused=2),
    "user": Case("someone"),
    "top_k": Case(5),
    "min_p": Case(0.1),
    "repeat_penalty": Case(1.2),
    "keep_alive": Case("5m"),
}
CHAT_BASE = {"messages": [{"role": "user", "content": "hi"}]}
CASES: dict[str, tuple[dict[str, Any], Callable[[bytes], Any], dict[str, Case]]] = {
    "POST /v1/chat/completions": (
        CHAT_BASE,
        lambda body: openai.chat_plan(openai.decode("chat", body)),
        {
            **SAMPLING,
            "messages": Case([{"role": "user", "content": "hello"}]),
            "max_completion_tokens": Case(9),
            "logprobs": Case(True),
            "top_logprobs": Case(3, base={"logprobs": True}),
            "response_format": Case({"type": "json_object"}),
            "tools": Case([TOOL]),
            "tool_choice": Case("required", base={"tools": [TOOL]}),
            "parallel_tool_calls": Case(False, base={"tools": [TOOL]}),
            "metadata": Case({"k": "v"}),
            "store": Case(False, refused=True),
            "service_tier": Case("auto"),
            "prompt_cache_key": Case("k"),
            "safety_identifier": Case("s"),
            "modalities": Case(["text"], refused=["text", "audio"]),
            "audio": Case({"voice": "alloy", "format": "wav"}),
            "prediction": Case({"type": "content", "content": "x"}),
            "reasoning_effort": Case("low", refused="extreme"),
            "chat_template_kwargs": Case({"custom_flag": True}, refused={"messages": []}),
            "verbosity": Case("low"),
            "web_search_options": Case({}),
            "functions": Case([{"name": "f"}]),
            "function_call": Case("auto"),
        },
    ),
    "POST /v1/completions": (
        {"prompt": "hi"},
        lambda body: openai.completion_plan(openai.decode("completion", body)),
        {
            **SAMPLING,
            "prompt": Case("hello", refused=["a", "b"]),
            "logprobs": Case(2),
            "echo": Case(True),
            "suffix": Case("", refused="x"),
            "best_of": Case(1, refused=3),
            "prediction": Case({"type": "content", "content": "x"}),
        },
    ),
    "chat message": (
        {"role": "assistant", "content": "hi"},
        unprefixed(
            lambda body: openai.chat_plan(
                openai.decode(
                    "chat",
                    json.dumps({"messages": [{"role": "user", "content": "q"}, json.loads(body)]}).encode(),
                )
            ),
            "messages[1].",
        ),
        {
            "role": Case("user"),
            "content": Case("hello"),
            "name": Case("bob"),
            "tool_calls": Case([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
            "tool_call_id": Case("call_1", base={"role": "tool", "content": "42"}),
            "refusal": Case("no"),
            "reasoning_content": Case("I should greet."),
            "reasoning": Case("I should greet."),
            "annotations": Case([]),
            "audio": Case(None, refused={"id": "audio_1"}),
            "function_call": Case(None, refused={"name": "f", "arguments": "{}"}),
        },
    ),
    "POST /v1/embeddings": (
        {"input": "hi"},
        lambda body: (embeddings.inputs_of(request := embeddings.decode(body)), request.model, request.encoding_format),
        {
            "input": Case(["a", "b"], refused=[]),
            "model": Case("other"),
            "encoding_format": Case("base64", refused="hex"),
            "dimensions": Case(None, refused=64),
            "user": Case("someone"),
        },
    ),
    "POST /v1/responses": (
        {"input": "hi"},
        lambda body: responses.plan(responses.decode(body)),
        {
            "input": Case([{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]),
            "model": Case("other"),
            "instructions": Case("be brief"),
            "max_output_tokens": Case(7),
            "temperature": Case(0.5),
            "top_p": Case(0.5),
            "stream": Case(True),
            "stream_options": Case({"include_obfuscation": False}),
            "text": Case({"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}),
            "tools": Case([RESPONSES_TOOL]),
            "tool_choice": Case("required", base={"tools": [RESPONSES_TOOL]}),
            "parallel_tool_calls": Case(False, base={"tools": [RESPONSES_TOOL]}),
            "include": Case(["message.output_text.logprobs"], refused=["file_search_call.results"]),
            "top_logprobs": Case(3),
            "metadata": Case({"k": "v"}),
            "store": Case(False, refused=True),
            "background": Case(False, refused=True),
            "truncation": Case("disabled", refused="auto"),
            "max_tool_calls": Case(3),
            "user": Case("someone"),
            "safety_identifier": Case("s"),
            "prompt_cache_key": Case("k"),
            "prompt_cache_retention": Case("24h"),
            "prompt_cache_options": Case({"mode": "implicit"}),
            "service_tier": Case("auto"),
            "previous_response_id": Case("resp_1"),
            "conversation": Case("conv_1"),
            "prompt": Case({"id": "pmpt_1"}),
            "reasoning": Case({"effort": "low"}, refused={"summary": "auto"}),
            "context_management": Case([{"type": "compaction"}]),
            "moderation": Case({"model": "omni-moderation-latest"}),
            "prediction": Case({"type": "content", "content": "x"}),
        },
    ),
    "responses input item": (
        {"role": "assistant", "content": "hi"},
        responses_item_plan,
        {
            "type": Case("message", refused="item_reference"),
            "role": Case("system"),
            "content": Case([{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}]),
            "call_id": Case("call_2", base=FUNCTION_CALL_OUTPUT),
            "name": Case("g", base=FUNCTION_CALL),
            "arguments": Case('{"a": 1}', base=FUNCTION_CALL),
            "output": Case("43", base=FUNCTION_CALL_OUTPUT),
            "id": Case("msg_1"),
            "status": Case("completed"),
            "summary": Case([{"type": "summary_text", "text": "I should greet."}], base=REASONING),
            "encrypted_content": Case("gAAAAB-opaque"),
            "phase": Case("final_answer"),
            "caller": Case(None, refused={"type": "program", "caller_id": "p1"}),
            "namespace": Case(None, refused="billing"),
        },
    ),
}


def tokenize_plan(body: bytes) -> Any:
    """A tokenize body's plan; one that names no text gets ``prompt: "hi"`` (each of its three texts is a case)."""
    request = json.loads(body)
    if not {"content", "prompt", "messages"} & set(request):
        request["prompt"] = "hi"
    return tokenizer.tokenize_plan(decode_body(tokenizer._tokenize_decoder, json.dumps(request).encode()))


def detokenize_plan(body: bytes) -> Any:
    request = decode_body(tokenizer._detokenize_decoder, body)
    return tokenizer.detokenize_params(request), request.model


CASES.update(
    {
        "POST /tokenize": (
            {},
            tokenize_plan,
            {
                "content": Case("hello"),
                "add_special": Case(False),
                "parse_special": Case(True, refused=False),
                "with_pieces": Case(True),
                "model": Case("other"),
                "prompt": Case("hello"),
                "messages": Case([{"role": "user", "content": "hello"}]),
                "add_special_tokens": Case(False),
                "add_generation_prompt": Case(True, refused=False),
                "return_token_strs": Case(True),
            },
        ),
        "POST /detokenize": (
            {"tokens": [1]},
            detokenize_plan,
            {"tokens": Case([1, 2]), "model": Case("other")},
        ),
    }
)


def ollama_chat(body: bytes) -> Any:
    return ollama.chat_plan(ollama.decode(ollama.OllamaChatRequest, body))


def ollama_embed(body: bytes) -> Any:
    request = ollama.decode(ollama.OllamaEmbedRequest, body)
    return ollama.embed_inputs(ollama.embed_texts(request), request), request.model, keep_alive(request.keep_alive)


def ollama_embeddings(body: bytes) -> Any:
    request = ollama.decode(ollama.OllamaEmbeddingsRequest, body)
    return ollama.embed_inputs([request.prompt or ""], request), request.model, keep_alive(request.keep_alive)


OLLAMA_GENERATION = {
    "model": Case("other"),
    "format": Case("json"),
    "options": Case({"temperature": 0.1}),
    "stream": Case(False),
    "keep_alive": Case("5m"),
    "think": Case(True, refused="extreme"),
    "logprobs": Case(True),
    "top_logprobs": Case(3, base={"logprobs": True}),
}
OLLAMA_EMBED = {
    "model": Case("other"),
    "options": Case({}, refused={"temperature": 0.5}),
    "keep_alive": Case("5m"),
}
CASES.update(
    {
        "POST /api/chat": (
            CHAT_BASE,
            ollama_chat,
            {**OLLAMA_GENERATION, "messages": Case([{"role": "user", "content": "hello"}]), "tools": Case([TOOL])},
        ),
        "POST /api/generate": (
            {"prompt": "hi"},
            lambda body: ollama.generate_plan(ollama.decode(ollama.OllamaGenerateRequest, body)),
            {
                **OLLAMA_GENERATION,
                "prompt": Case("hello"),
                "system": Case("be brief"),
                "raw": Case(True),
                "suffix": Case("", refused="x"),
                "template": Case("", refused="{{ .Prompt }}"),
                "context": Case([], refused=[1, 2]),
                "images": Case([], refused=["aGk="]),
                "width": Case(512),
                "height": Case(512),
                "steps": Case(4),
            },
        ),
        "Ollama options": (
            {},
            unprefixed(
                lambda body: ollama_chat(json.dumps({**CHAT_BASE, "options": json.loads(body)}).encode()), "options."
            ),
            {
                "num_predict": Case(7),
                "temperature": Case(0.5),
                "top_p": Case(0.5),
                "top_k": Case(5),
                "min_p": Case(0.1),
                "seed": Case(42),
                "stop": Case(["\n"]),
                "repeat_penalty": Case(1.2),
                "presence_penalty": Case(0.5),
                "frequency_penalty": Case(0.5),
                "repeat_last_n": Case(64, refused=128),
                "typical_p": Case(1.0, refused=0.5),
                "tfs_z": Case(1.0, refused=0.5),
                "mirostat": Case(0, refused=2),
                "mirostat_tau": Case(5.0),
                "mirostat_eta": Case(0.1),
                "penalize_newline": Case(False, refused=True),
                "num_keep": Case(4),
                "num_ctx": Case(4096),
                "num_batch": Case(512),
                "num_gpu": Case(1),
                "main_gpu": Case(0),
                "num_thread": Case(2),
                "use_mmap": Case(True),
                "use_mlock": Case(False),
                "numa": Case(False),
                "low_vram": Case(False),
                "vocab_only": Case(False),
                "f16_kv": Case(True),
                "logits_all": Case(False),
                "embedding_only": Case(False),
            },
        ),
        "Ollama chat message": (
            {"role": "assistant", "content": "hi"},
            unprefixed(
                lambda body: ollama_chat(
                    json.dumps({"messages": [{"role": "user", "content": "q"}, json.loads(body)]}).encode()
                ),
                "messages[1].",
            ),
            {
                "role": Case("user"),
                "content": Case("hello"),
                "images": Case([], refused=["aGk="]),
                "tool_calls": Case([{"function": {"name": "f", "arguments": {"a": 1}}}]),
                "tool_name": Case("get_weather", base={"role": "tool", "content": "42"}),
                "tool_call_id": Case("call_1", base={"role": "tool", "content": "42"}),
                "thinking": Case("hmm"),
            },
        ),
        "POST /api/embed": (
            {"input": "hi"},
            ollama_embed,
            {
                **OLLAMA_EMBED,
                "input": Case(["a", "b"]),
                "truncate": Case(False),
                "dimensions": Case(8),
            },
        ),
        "POST /api/embeddings": ({"prompt": "hi"}, ollama_embeddings, {**OLLAMA_EMBED, "prompt": Case("hello")}),
        "POST /api/show": (
            {},
            lambda body: ollama.show_model(ollama.decode(ollama.OllamaShowRequest, body)),
            {"model": Case("other"), "name": Case("other"), "verbose": Case(False, refused=True)},
        ),
    }
)


def outcome(plan: Callable[[bytes], Any], body: dict[str, Any]) -> Any:
    try:
        return plan(json.dumps(body).encode())
    except InvalidField as exc:
        return exc


def named(error: object, name: str) -> bool:
    return isinstance(error, InvalidField) and error.field is not None and error.field.split(".")[0] == name


def test_every_registered_body_has_cases_here() -> None:
    assert set(fields.registered()) <= set(CASES), "a body with no cases: add it to CASES"


@pytest.mark.parametrize("title", sorted(CASES))
def test_every_field_is_honoured_refused_or_metadata_as_registered(title: str) -> None:
    struct, policies = fields.registered()[title]
    base, plan, cases = CASES[title]
    declared = list(struct.__struct_fields__)
    assert sorted(policies) == sorted(declared), f"{title}: policies for exactly the struct's fields"
    assert sorted(cases) == sorted(declared), f"{title}: one case per field"
    problems = []
    for attr in declared:
        name, policy, case = fields.encoded_name(struct, attr), policies[attr], cases[attr]
        start = {**base, **(case.base or {})}
        before = outcome(plan, start)
        assert not isinstance(before, InvalidField), f"{title}: the base body for {name} is refused: {before}"
        after = outcome(plan, {**start, name: case.value})
        if policy.kind in ("honoured", "extension"):
            if isinstance(after, InvalidField) or after == before:
                problems.append(f"{name} is registered {policy.kind} but changes nothing (or is refused: {after})")
        elif policy.kind == "metadata":
            if after != before:
                problems.append(f"{name} is registered metadata but changes the plan (or is refused: {after})")
        elif policy.kind == "refused":
            if not named(after, name):
                problems.append(f"{name} is registered refused but {after!r} came back")
        else:  # limited: one value accepted, one refused by name
            if isinstance(after, InvalidField):
                problems.append(f"{name}={case.value!r} should be accepted: {after}")
            refused = outcome(plan, {**start, name: case.refused})
            if not named(refused, name):
                problems.append(f"{name}={case.refused!r} should be refused naming {name}, got {refused!r}")
    assert not problems, f"{title}:\n" + "\n".join(problems)


def test_an_unknown_field_is_refused_naming_it_at_any_depth() -> None:
    for body, param in (
        ({**CHAT_BASE, "temprature": 0.2}, "temprature"),
        ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages[0].colour"),
        ({**CHAT_BASE, "response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
    ):
        with pytest.raises(InvalidField) as caught:
            openai.decode("chat", msgspec.json.encode(body))
        assert caught.value.field == param and f"unknown field {param!r}" in str(caught.value), caught.value
