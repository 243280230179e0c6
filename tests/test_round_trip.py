"""What tether returns, it accepts back (promise 11): every reply object of every dialect is valid input on the next
turn, as each client's idiom sends it, and means what it meant there.

The replies are tether's own: generations (thinking, text, tool calls in each tool format, cut by the length limit
or not, with logprobs or not) are fed to each dialect's real shaper, whole and streamed, and what a client holds
afterwards is sent back the way its SDK or agent loop does: OpenAI's message as it came, as the openai SDK's
``model_dump()`` and as the SDK sends a message object (``exclude_unset``), or joined from the stream's deltas; the
Responses API's ``response.output`` items (the stateless loop, the Agents SDK's ``to_input_list()``); Ollama's
message, as it came and as the ollama client's model sends it. Each next request is decoded and planned as the
server does it: never refused, and its assistant turn holds the reply's thinking, text and calls.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args, get_origin, get_type_hints

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tether.serve.app  # noqa: F401  (every route module registers its bodies on import)
from tether.protocol import Chunk, TokenLogprob, TopLogprob
from tether.serve import views
from tether.serve.dialects import fields, ollama, openai, responses, shapes
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.conversation import Turn

EXAMPLES = 400  # per dialect: 1,200 generated replies in all

# --------------------------------------------------------------------------------------------------------------
# The reply types and the input types they come back as: every field of a reply is a field of its input
# --------------------------------------------------------------------------------------------------------------

REPLIES: list[tuple[type[msgspec.Struct], type[msgspec.Struct], str | None]] = [
    (openai.AssistantMessage, shapes.MessageIn, "chat message"),
    (openai.ToolCallOut, shapes.ToolCallIn, None),
    (openai.FunctionCallOut, shapes.FunctionCallIn, None),
    (openai.ToolCallDelta, shapes.ToolCallIn, None),  # a streamed call, joined by index, as clients keep it
    (responses.OutputMessage, responses.ResponsesInputItem, "responses input item"),
    (responses.OutputFunctionCall, responses.ResponsesInputItem, "responses input item"),
    (responses.OutputReasoning, responses.ResponsesInputItem, "responses input item"),
    (responses.OutputText, responses.ResponsesInputText, None),
    (responses.ReasoningText, responses.ResponsesInputText, None),
    (ollama.OllamaMessageOut, ollama.OllamaMessage, "Ollama chat message"),
    (ollama.OllamaToolCallOut, ollama.OllamaToolCall, None),
    (ollama.OllamaFunctionOut, ollama.OllamaFunctionCall, None),
]


def wire_names(struct: type[msgspec.Struct]) -> set[str]:
    """A struct's fields as the wire names them, its tag field (a Responses item's ``type``) included."""
    names = set(struct.__struct_encode_fields__)
    tag = struct.__struct_config__.tag_field
    return names | ({tag} if tag else set())


@pytest.mark.parametrize(("reply", "given", "title"), REPLIES, ids=[r.__name__ for r, _, _ in REPLIES])
def test_every_field_of_a_reply_is_a_field_of_the_input_it_comes_back_as(
    reply: type[msgspec.Struct], given: type[msgspec.Struct], title: str | None
) -> None:
    missing = wire_names(reply) - wire_names(given)
    assert not missing, f"{reply.__name__}'s {sorted(missing)} would be refused when sent back as {given.__name__}"
    if title is not None:
        struct, policies = fields.registered()[title]
        assert struct is given
        names = dict(zip(struct.__struct_encode_fields__, struct.__struct_fields__, strict=True))
        for name in wire_names(reply):
            policy = policies[names[name]]
            assert policy.returned, f"{title}: {name} comes back in replies: register it returned (round-trip)"
            assert policy.kind != "refused", f"{title}: {name} comes back in replies and cannot be refused"


def test_a_reply_struct_without_its_input_fails_the_check() -> None:
    """The check above can fail: a reply field no input declares is caught."""

    class Reply(msgspec.Struct):
        role: str
        mood: str

    assert wire_names(Reply) - wire_names(shapes.MessageIn) == {"mood"}


def test_each_reply_struct_nested_in_a_reply_is_listed() -> None:
    """The structs inside the listed replies are listed too, so none escapes the check."""
    listed = {reply for reply, _, _ in REPLIES}
    nested: set[type] = set()
    for reply in listed:
        for hint in get_type_hints(reply).values():
            stack = [hint]
            while stack:
                kind = stack.pop()
                if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
                    nested.add(kind)
                stack.extend(get_args(kind))
                if get_origin(kind) is types.UnionType:
                    stack.extend(get_args(kind))
    exempt = {openai.FunctionCallDelta}  # a streamed call's pieces: joined into a FunctionCallOut's shape
    assert nested - listed - exempt <= {views.LogprobOut, views.TopLogprobOut}


# --------------------------------------------------------------------------------------------------------------
# Generated answers
# --------------------------------------------------------------------------------------------------------------

FORMATS = {"generic": toolkit.GENERIC, "hermes": toolkit.HERMES, "mistral": toolkit.MISTRAL, "llama3": toolkit.LLAMA3}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]
NAMES = [tool["function"]["name"] for tool in TOOLS]

words = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@dataclass(frozen=True)
class Generation:
    """What a model wrote: its thinking, then its answer's text in a tool format (``fmt``), in pieces."""

    fmt: str
    tools: bool  # the request offered tools
    reasoning: list[str]
    answer: list[str]
    finish: Literal["stop", "length"]
    logprobs: bool

    def chunks(self) -> list[Chunk]:
        pieces = [Chunk("t", "", reasoning=r) for r in self.reasoning if r]
        pieces += [Chunk("t", text, logprobs=self._logprobs(text)) for text in self.answer if text]
        last = Chunk("t", "", 0, self.finish, prompt_tokens=7, completion_tokens=len(pieces))
        return [*pieces, last]

    def _logprobs(self, text: str) -> tuple[TokenLogprob, ...]:
        if not self.logprobs:
            return ()
        top = (TopLogprob("x", -2.5, b"x"),)
        return (TokenLogprob(text, -0.25, text.encode(), top),)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@st.composite
def generations(draw: st.DrawFn) -> Generation:
    tools = draw(st.booleans())
    fmt = draw(st.sampled_from(sorted(FORMATS))) if tools else "generic"
    thinking = draw(st.lists(words, max_size=3))
    call = st.tuples(st.sampled_from(NAMES), st.dictionaries(st.text(max_size=6), json_values, max_size=3))
    calls = draw(st.lists(call, max_size=1 if fmt == "llama3" else 3)) if tools and draw(st.booleans()) else []
    text = draw(words).lstrip()
    answer = written(fmt, tools, text, calls)
    finish = draw(st.sampled_from(["stop", "stop", "length"]))
    if finish == "length":  # a limit cuts the answer anywhere
        answer = answer[: draw(st.integers(0, len(answer)))]
    cuts = draw(st.lists(st.integers(0, max(len(answer), 1)), max_size=6))
    return Generation(fmt, tools, thinking, split(answer, cuts), finish, draw(st.booleans()))


def written(fmt: str, tools: bool, text: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The answer as the model writes it under the request's grammar: text, or calls in the format's syntax."""
    if not tools:
        return text
    spec = FORMATS[fmt]
    if not calls:
        if spec.native:
            return text if not text.startswith(spec.lead[:1]) else f"So, {text}"
        return json.dumps({"response": text})
    objects = [json.dumps({"name": n, spec.arguments_key: a}) for n, a in calls]
    if fmt == "generic":
        return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})
    return spec.open + spec.separator.join(spec.before + o + spec.after for o in objects) + spec.close


# --------------------------------------------------------------------------------------------------------------
# What a client holds, sent back
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """An assistant turn as the reply said it: its thinking, its text, its calls (name, arguments, id)."""

    reasoning: str | None
    text: str
    calls: tuple[tuple[str, Any, str | None], ...]


def held_of(turn: Turn) -> Held:
    return Held(turn.reasoning, turn.text, tuple((c.name, c.arguments, c.id) for c in turn.calls))


def sse(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: {")]


def shaped(shaper: Any, generation: Generation, stream: bool) -> bytes:
    out = shaper.opening() if stream else b""
    for chunk in generation.chunks():
        out += shaper.feed(chunk)
    if stream:
        return out + shaper.closing(generation.finish, 7, 3)
    return shaper.whole(generation.finish, 7, 3)


def arguments(value: Any) -> Any:
    """A call's arguments as data (OpenAI sends JSON text, Ollama an object)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


# --- OpenAI chat -----------------------------------------------------------------------------------------------


def chat_request(generation: Generation, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages}
    if generation.tools:
        body["tools"] = TOOLS
    return body


def chat_plan(generation: Generation, body: dict[str, Any]) -> Any:
    fmt = FORMATS[generation.fmt]
    return openai.chat_plan(openai.decode("chat", json.dumps(body).encode()), fmt)


def openai_message(generation: Generation, idiom: str) -> dict[str, Any]:
    """The assistant message a client holds after a chat completion, as ``idiom`` keeps it."""
    from openai.types.chat import ChatCompletion

    first = [{"role": "user", "content": "hi"}]
    plan = chat_plan(generation, chat_request(generation, first))
    shaper = openai.OpenAIShaper("chat", "chatcmpl-1", "m", plan)
    if idiom == "stream":
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for chunk in sse(shaped(shaper, generation, True)):
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    message["content"] = (message["content"] or "") + delta["content"]
                if delta.get("reasoning_content"):
                    message["reasoning_content"] = message.get("reasoning_content", "") + delta["reasoning_content"]
                for call in delta.get("tool_calls") or ():  # joined by index, as agent frameworks join them
                    calls = message.setdefault("tool_calls", [])
                    if call["index"] == len(calls):
                        calls.append({"index": call["index"], "id": call["id"], "type": "function"})
                        calls[-1]["function"] = {"name": call["function"]["name"], "arguments": ""}
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        return message
    reply = json.loads(shaped(shaper, generation, False))
    if idiom == "json":
        return dict(reply["choices"][0]["message"])
    parsed = ChatCompletion.model_validate(reply).choices[0].message
    if idiom == "model_dump":  # the idiom: every field, nulls included, reasoning_content as an extra
        return parsed.model_dump()
    return parsed.model_dump(exclude_unset=True, mode="json")  # what the SDK sends for a message object


def openai_round(generation: Generation, idiom: str) -> tuple[Held, Held]:
    message = openai_message(generation, idiom)
    said = Held(
        message.get("reasoning_content"),
        message.get("content") or "",
        tuple(
            (c["function"]["name"], arguments(c["function"]["arguments"]), c["id"])
            for c in message.get("tool_calls") or ()
        ),
    )
    history = [{"role": "user", "content": "hi"}, message]
    history += [{"role": "tool", "tool_call_id": c["id"], "content": "42"} for c in message.get("tool_calls") or ()]
    history.append({"role": "user", "content": "and then?"})
    body = chat_request(generation, history)
    plan = chat_plan(generation, body)  # decoded and planned as the server does: a refusal raises
    shown(plan, said)
    turn = shapes.message_turns(openai.decode("chat", json.dumps(body).encode()).messages)[1]
    return said, held_of(turn)


def shown(plan: Any, said: Held) -> None:
    """The engine's chat gives the turn's thinking to the template (``reasoning_content``)."""
    assistant = next(m for m in plan.params.messages if m.role == "assistant")
    assert assistant.reasoning == said.reasoning, (assistant, said)


# --- Responses -------------------------------------------------------------------------------------------------


def responses_output(generation: Generation, idiom: str) -> list[dict[str, Any]]:
    from openai.types.responses import Response

    request: dict[str, Any] = {"input": "hi"}
    if generation.tools:
        request["tools"] = [{"type": "function", **t["function"]} for t in TOOLS]
    fmt = FORMATS[generation.fmt]
    plan = responses.plan(responses.decode(json.dumps({**request, "stream": idiom == "stream"}).encode()), fmt)
    shaper = responses.ResponsesShaper("resp_1", "m", plan)
    if idiom == "stream":  # the finished response, as the stream's last event carries it
        events = sse(shaped(shaper, generation, True))
        done = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
        assert len(done) == 1, [e["type"] for e in events]
        output: list[dict[str, Any]] = done[0]["response"]["output"]
        return output
    reply = json.loads(shaped(shaper, generation, False))
    if idiom == "json":
        return list(reply["output"])
    items = Response.model_validate(reply).output
    if idiom == "model_dump":
        return [item.model_dump() for item in items]
    return [item.model_dump(exclude_unset=True, mode="json") for item in items]


def responses_round(generation: Generation, idiom: str) -> tuple[Held, Held]:
    output = responses_output(generation, idiom)
    reasoning = [p["text"] for i in output if i["type"] == "reasoning" for p in i.get("content") or ()]
    text = [p["text"] for i in output if i["type"] == "message" for p in i["content"]]
    calls = [i for i in output if i["type"] == "function_call"]
    said = Held(
        "".join(reasoning) if reasoning else None,
        "".join(text),
        tuple((c["name"], arguments(c["arguments"]), c["call_id"]) for c in calls),
    )
    history = [{"role": "user", "content": "hi"}, *output]
    history += [{"type": "function_call_output", "call_id": c["call_id"], "output": "42"} for c in calls]
    history.append({"role": "user", "content": "and then?"})
    body: dict[str, Any] = {"input": history}
    if generation.tools:
        body["tools"] = [{"type": "function", **t["function"]} for t in TOOLS]
    plan = responses.plan(responses.decode(json.dumps(body).encode()), FORMATS[generation.fmt])
    if said.reasoning is not None or said.text or said.calls:
        shown(plan, said)
    turns = responses.input_turns(responses.decode(json.dumps(body).encode()).input)
    mine = [t for t in turns[1:] if t.role == "assistant"]
    assert len(mine) <= 1, turns  # the reply's items are one assistant turn: its thinking, its text, its calls
    return said, held_of(mine[0]) if mine else Held(None, "", ())  # (a cut answer may have no item at all)


# --- Ollama ----------------------------------------------------------------------------------------------------


def ollama_message(generation: Generation, idiom: str) -> dict[str, Any]:
    from ollama import ChatResponse

    body = {"messages": [{"role": "user", "content": "hi"}], "stream": idiom == "stream"}
    if generation.tools:
        body["tools"] = TOOLS
    plan = ollama.chat_plan(ollama.decode(ollama.OllamaChatRequest, json.dumps(body).encode()), FORMATS[generation.fmt])
    assert plan is not None
    shaper = ollama.OllamaShaper("chat", "m", plan, 0.0)
    if idiom == "stream":  # the lines joined, as the ollama client's users join them
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for line in shaped(shaper, generation, True).split(b"\n")[:-1]:
            part = json.loads(line)["message"]
            message["content"] += part["content"]
            if part.get("thinking"):
                message["thinking"] = message.get("thinking", "") + part["thinking"]
            message.setdefault("tool_calls", []).extend(part.get("tool_calls") or ())
        if not message["tool_calls"]:
            del message["tool_calls"]
        return message
    reply = json.loads(shaped(shaper, generation, False))
    if idiom == "json":
        return dict(reply["message"])
    parsed = ChatResponse.model_validate(reply).message
    return parsed.model_dump(exclude_none=True, mode="json")  # what the ollama client sends for a Message


def ollama_round(generation: Generation, idiom: str) -> tuple[Held, Held]:
    message = ollama_message(generation, idiom)
    calls = message.get("tool_calls") or ()
    said = Held(
        message.get("thinking"),
        message.get("content") or "",
        tuple((c["function"]["name"], c["function"]["arguments"], c.get("id")) for c in calls),
    )
    history = [{"role": "user", "content": "hi"}, message]
    history += [{"role": "tool", "content": "42", "tool_name": c["function"]["name"]} for c in calls]
    history.append({"role": "user", "content": "and then?"})
    body: dict[str, Any] = {"messages": history}
    if generation.tools:
        body["tools"] = TOOLS
    request = ollama.decode(ollama.OllamaChatRequest, json.dumps(body).encode())
    shown(ollama.chat_plan(request, FORMATS[generation.fmt]), said)
    return said, held_of(ollama.chat_turns(request.messages)[1])


# --------------------------------------------------------------------------------------------------------------
# The property
# --------------------------------------------------------------------------------------------------------------


def truth(generation: Generation) -> Held:
    """What the generation meant: its thinking, and its answer as the tool format's parser reads it."""
    answer = "".join(generation.answer)
    thought = "".join(generation.reasoning) or None
    if not generation.tools:
        return Held(thought, answer, ())
    fmt = FORMATS[generation.fmt]
    content, calls = toolkit.parse(answer, toolkit.MAX_PARALLEL_CALLS, fmt)
    return Held(thought, content or "", tuple((c.name, json.loads(c.arguments), None) for c in calls))


def same_meaning(said: Held, sent: Held, meant: Held, complete: bool) -> None:
    assert sent == said, "the turn sent back means something else than the reply said"
    if complete:  # (a cut stream may hold a call's arguments in part: the whole answer leaves such a call out)
        assert said.reasoning == meant.reasoning and said.text == meant.text, (said, meant)
        assert [c[:2] for c in said.calls] == [c[:2] for c in meant.calls], (said.calls, meant.calls)


ROUNDS = {"openai": openai_round, "responses": responses_round, "ollama": ollama_round}
IDIOMS = {
    "openai": ["json", "model_dump", "sdk", "stream"],
    "responses": ["json", "model_dump", "sdk", "stream"],
    "ollama": ["json", "sdk", "stream"],
}


@pytest.mark.parametrize("dialect", sorted(ROUNDS))
def test_every_reply_is_accepted_back_and_means_what_it_meant(dialect: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(generation=generations(), idiom=st.sampled_from(IDIOMS[dialect]))
    def round_trip(generation: Generation, idiom: str) -> None:
        said, sent = ROUNDS[dialect](generation, idiom)
        same_meaning(said, sent, truth(generation), generation.finish == "stop" or idiom != "stream")

    round_trip()


@settings(max_examples=200, deadline=None)
@given(generation=generations().filter(lambda g: not g.tools), stream=st.booleans())
def test_a_completion_fed_back_into_the_next_prompt_is_that_prompt(generation: Generation, stream: bool) -> None:
    """The legacy completions API's loop: the choice's text appended to the prompt is the next request's prompt (a raw
    prompt is not a chat: nothing is split from it as thinking)."""
    generation = replace(generation, reasoning=[])
    prompt = "Once upon a time"
    plan = openai.completion_plan(openai.decode("completion", json.dumps({"prompt": prompt}).encode()))
    shaper = openai.OpenAIShaper("completion", "cmpl-1", "m", plan)
    body = shaped(shaper, generation, stream)
    choices = [c for chunk in sse(body) for c in chunk["choices"]] if stream else json.loads(body)["choices"]
    text = "".join(choice["text"] for choice in choices)
    assert text == "".join(generation.answer)
    again = {"prompt": prompt + text, "max_tokens": 4}
    params = openai.completion_plan(openai.decode("completion", json.dumps(again).encode())).params
    assert params.prompt == prompt + text
