"""OpenAI's chat and text completion requests to plans: the ``GenerateParams`` the runner gets, plus how the answer
is shaped (streaming, usage, logprobs, tool calls); every refusal names its field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tether.errors import InvalidField
from tether.fleet.catalog import keep_alive_seconds
from tether.protocol import (
    GenerateParams,
)
from tether.serve.dialects import template_args, thinking
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.conversation import NamedTool, latest_calls
from tether.serve.dialects.openai.requests import (
    MAX_COMPLETION_LOGPROBS,
    MAX_STOPS,
    ChatRequest,
    CompletionRequest,
    NamedChoice,
    OpenAIRequest,
    ResponseFormat,
)
from tether.serve.dialects.plan import DEFAULT_MAX_TOKENS, Plan, checked, schema_text
from tether.serve.dialects.shapes import (
    declared_tools,
    message_turns,
    prediction_text,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOPS:
        raise InvalidField("stop", f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}")
    return tuple(stops)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidField("logit_bias", f"logit_bias keys are token ids (digits, as strings), got {key!r}")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _refuse_set(request: msgspec.Struct, names: tuple[str, ...], why: str) -> None:
    for name in names:
        if getattr(request, name) is not None:
            raise InvalidField(name, f"{name} is not supported by this server ({why}): remove it from the request")


def sampling(request: OpenAIRequest, max_tokens: int | None, default_max: int) -> dict[str, Any]:
    """The ``GenerateParams`` fields chat and text completion requests share."""
    if request.n != 1:
        raise InvalidField("n", f"n must be 1 (one choice per request; send n requests for n answers), got {request.n}")
    return {
        "max_tokens": default_max if max_tokens is None else max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop": _stops(request.stop),
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": _logit_bias(request.logit_bias),
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repeat_penalty": request.repeat_penalty,
        "prediction": prediction_text(request.prediction),
    }


def response_schema(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.type == "json_schema":
        if fmt.json_schema is None or not fmt.json_schema.schema:
            raise InvalidField("response_format.json_schema", "response_format json_schema needs json_schema.schema")
        return schema_text(fmt.json_schema.schema, "response_format.json_schema.schema")
    raise InvalidField(
        "response_format.type", f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}"
    )


def uses_tools(request: ChatRequest) -> bool:
    """Whether the chat declares tools or carries earlier calls or results (its model's tool format matters)."""
    return bool(request.tools) or any(m.tool_calls or m.role == "tool" for m in request.messages)


def chat_plan(request: ChatRequest, fmt: toolkit.ToolFormat = toolkit.GENERIC, thinking: bool | None = None) -> Plan:
    _refuse_set(request, ("audio", "web_search_options", "verbosity"), "text only")
    _refuse_set(request, ("functions", "function_call"), "deprecated by OpenAI: send tools and tool_choice")
    if request.store:
        raise InvalidField("store", "store must be false or absent: this server stores no completions")
    if request.modalities is not None and set(request.modalities) - {"text"}:
        raise InvalidField("modalities", f'modalities must be ["text"] (text output only), got {request.modalities}')
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
    turns = message_turns(request.messages)
    messages = toolkit.engine_messages(turns, fmt)
    choice = request.tool_choice
    named = NamedTool(choice.function.name) if isinstance(choice, NamedChoice) else choice
    tools = toolkit.plan(declared_tools(request.tools), named, request.parallel_tool_calls, fmt)
    tools = toolkit.settle(tools, latest_calls(turns))
    json_schema = response_schema(request.response_format)
    syntax = None
    if tools is not None:
        json_schema, syntax = tools.apply(messages, json_schema, "response_format")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    _, template_kwargs = thinking_wanted(request)
    params = GenerateParams(
        messages=tuple(messages),
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        json_schema=json_schema,
        tool_syntax=syntax,
        thinking=thinking,
        template_kwargs=template_kwargs,
        **sampling(request, max_tokens, DEFAULT_MAX_TOKENS),
    )
    return Plan(
        checked(params),
        model=request.model,
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=request.logprobs,
        tools=tools,
        keep_alive=keep_alive_seconds(request.keep_alive),
    )


def thinking_wanted(request: ChatRequest) -> tuple[bool | None, str | None]:
    """Thinking on, off or unsaid (``reasoning_effort``, and ``chat_template_kwargs.enable_thinking``, which must
    agree), and the JSON text of the template's other variables (``template_args.split``)."""
    return template_args.split(request.chat_template_kwargs, thinking.wanted(request.reasoning_effort))


def completion_prompt(prompt: str | list[str | int | list[int]]) -> str | tuple[int, ...]:
    """The one prompt of a completions request: its text, or its token ids (OpenAI's legacy shapes: a string, token
    ids, or a list of one of them). Several prompts in one request (a batch) are refused: send one request each."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(item, int) for item in prompt):
        return tuple(item for item in prompt if isinstance(item, int))
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0] if isinstance(prompt[0], str) else tuple(prompt[0])
    kinds = sorted({"string" if isinstance(i, str) else "token id" if isinstance(i, int) else "list" for i in prompt})
    raise InvalidField(
        "prompt",
        f"prompt must be one prompt: a string, a list of token ids, or a list of one of them; got a list of "
        f"{len(prompt)} items ({', '.join(kinds)}). Send one request per prompt",
    )


def completion_plan(request: CompletionRequest) -> Plan:
    if request.suffix:
        raise InvalidField("suffix", "suffix is not supported by this server")
    if request.best_of not in (None, 1):
        raise InvalidField("best_of", f"best_of must be 1 (one candidate per request), got {request.best_of}")
    prompt = completion_prompt(request.prompt)
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidField("logprobs", f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {request.logprobs}")
    params = GenerateParams(
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_ids=None if isinstance(prompt, str) else prompt,
        echo=request.echo,
        logprobs=request.logprobs,
        **sampling(request, request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS),
    )
    return Plan(
        checked(params),
        model=request.model,
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=request.logprobs is not None,
        keep_alive=keep_alive_seconds(request.keep_alive),
    )
