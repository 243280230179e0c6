"""Models' own tool-call formats (issue 34): read from the chat template, rendered by it, parsed back.

Fast tests of the serving side: which format a template defines (``tools.detect``), the plan a chat gets in each
(the tools go to the template, not into a system message; earlier calls and results stay structured), the answer
parser for each syntax (``tools.NativeStream``: any chunking tells the same calls, a cut leaks nothing, repeats and
calls past the bound are dropped) and the grammar the runner builds. ``tests/test_native_tools.py`` serves a copy of
the default model whose template is Hermes-style.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from test_tool_stream import ADD, told
from tether.engines.llamacpp.tools import LEADING_SPACE, ROOT, template_messages, tool_grammar
from tether.protocol import ChatMessage, MessageCall, ToolSyntax
from tether.serve.dialects import openai as openai_dialect
from tether.serve.dialects import tools as toolkit

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
HERMES_TEMPLATE = (TEMPLATES / "hermes.jinja").read_text()
# The markers each family's templates are recognised by (these snippets are written here, not taken from a model).
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}{% endif %}[TOOL_CALLS]{% endfor %}"
)
MISTRAL_ARGS_TEMPLATE = MISTRAL_TEMPLATE + "{{ call.name }}[ARGS]{{ call.arguments }}"
LLAMA3_TEMPLATE = (
    '{% if tools %}<|start_header_id|>user<|end_header_id|>Answer {"name": function name, "parameters": '
    "dictionary of argument name and its value}.{% endif %}<|eot_id|>"
)
CHATML_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_each_template_is_recognised_by_its_own_markers() -> None:
    assert toolkit.detect(HERMES_TEMPLATE) is toolkit.HERMES
    assert toolkit.detect(MISTRAL_TEMPLATE) is toolkit.MISTRAL
    assert toolkit.detect(LLAMA3_TEMPLATE) is toolkit.LLAMA3
    # Mistral's newer name[ARGS]arguments form, a template without tools, and no template: the generic format.
    for template in (MISTRAL_ARGS_TEMPLATE, CHATML_TEMPLATE, "", HERMES_TEMPLATE.replace("tools", "helpers")):
        assert toolkit.detect(template) is toolkit.GENERIC


def request(messages: list[dict[str, Any]], **fields: Any) -> openai_dialect.ChatRequest:
    body = {"model": "m", "messages": messages, "tools": [WEATHER, ADD], **fields}
    return msgspec.json.decode(json.dumps(body), type=openai_dialect.ChatRequest)


ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21 C"},
]


def test_a_native_plan_gives_the_template_the_tools_and_the_history_as_it_was() -> None:
    plan = openai_dialect.chat_plan(request(ROUND_TRIP), toolkit.HERMES)
    params = plan.params
    syntax = params.tool_syntax
    assert syntax is not None and params.json_schema is None
    assert [m.role for m in params.messages or ()] == ["user", "assistant", "tool"]  # no generic system prompt
    assistant, result = (params.messages or ())[1:]
    assert assistant.tool_calls == (MessageCall("call_a", "get_weather", '{"city": "Paris"}'),)
    assert (result.tool_call_id, result.name, result.content) == ("call_a", "get_weather", "sunny, 21 C")
    assert [t["function"]["name"] for t in json.loads(syntax.tools)] == ["get_weather", "add"]
    assert (syntax.before, syntax.after, syntax.separator, syntax.lead) == (
        "<tool_call>\n",
        "\n</tool_call>",
        "\n",
        "<tool_call>",
    )
    assert syntax.text and syntax.max_calls == toolkit.MAX_PARALLEL_CALLS
    call_schema = json.loads(syntax.call_schema)
    assert [c["properties"]["name"]["const"] for c in call_schema["anyOf"]] == ["get_weather", "add"]
    # The engine's view: OpenAI's shapes, each call's arguments an object (templates write them with tojson).
    rendered = template_messages(params.messages or ())
    assert rendered[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert rendered[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_a", "name": "get_weather"}

    generic = openai_dialect.chat_plan(request(ROUND_TRIP), toolkit.GENERIC).params
    assert generic.tool_syntax is None and generic.json_schema is not None
    assert [m.role for m in generic.messages or ()] == ["system", "user", "assistant", "user"]
    assert all(not m.tool_calls and m.tool_call_id is None for m in generic.messages or ())


def test_each_choice_shapes_the_native_answer() -> None:
    def syntax(fmt: toolkit.ToolFormat, messages: list[dict[str, Any]] = ROUND_TRIP[:1], **fields: Any) -> ToolSyntax:
        made = openai_dialect.chat_plan(request(messages, **fields), fmt).params.tool_syntax
        assert made is not None
        return made

    required = syntax(toolkit.HERMES, tool_choice="required")
    assert not required.text and required.max_calls == toolkit.MAX_PARALLEL_CALLS
    named = syntax(toolkit.HERMES, tool_choice={"type": "function", "function": {"name": "add"}})
    assert [t["function"]["name"] for t in json.loads(named.tools)] == ["add"] and not named.text
    assert syntax(toolkit.HERMES, parallel_tool_calls=False).max_calls == 1
    assert syntax(toolkit.LLAMA3).max_calls == 1  # Llama 3 writes one call a turn
    assert "parameters" in json.loads(syntax(toolkit.LLAMA3).call_schema)["anyOf"][0]["required"]
    repeated = [*ROUND_TRIP, ROUND_TRIP[1], ROUND_TRIP[2]]  # the same call again: the answer must be text now
    settled = syntax(toolkit.HERMES, repeated)
    assert settled.max_calls == 0 and settled.text and len(json.loads(settled.tools)) == 2
    with pytest.raises(Exception, match="response_format cannot be combined with tools"):
        openai_dialect.chat_plan(request(ROUND_TRIP[:1], response_format={"type": "json_object"}), toolkit.HERMES)


def test_mistral_gets_the_nine_character_call_ids_its_templates_demand() -> None:
    params = openai_dialect.chat_plan(request(ROUND_TRIP), toolkit.MISTRAL).params
    call = (params.messages or ())[1].tool_calls[0]
    result = (params.messages or ())[2]
    assert re.fullmatch(r"[0-9a-zA-Z]{9}", call.id) and result.tool_call_id == call.id


def native(fmt: toolkit.ToolFormat, text: str, pieces: list[int], max_calls: int = 8) -> tuple[Any, list[Any]]:
    stream = toolkit.NativeStream(fmt, max_calls)
    events: list[Any] = []
    for start, end in zip([0, *pieces], [*pieces, len(text)], strict=True):
        events += stream.feed(text[start:end])
    return stream, events + stream.finish()


HERMES_CALLS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a":17,"b":25}}\n</tool_call>\n'  # a repeat: dropped
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x}{\\"<tool_call>"}}\n</tool_call>'
)
MISTRAL_CALLS = (
    '[TOOL_CALLS][{"name": "add", "arguments": {"a": 17, "b": 25}}, '
    '{"name": "get_weather", "arguments": {"city": "x}{\\"<tool_call>"}}]'
)
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "x}{\\"<tool_call>"}}'
EXPECTED = [("add", {"a": 17, "b": 25}), ("get_weather", {"city": 'x}{"<tool_call>'})]


@pytest.mark.parametrize(
    ("fmt", "answer", "expected"),
    [
        (toolkit.HERMES, HERMES_CALLS, EXPECTED),
        (toolkit.MISTRAL, MISTRAL_CALLS, EXPECTED),
        (toolkit.LLAMA3, LLAMA3_CALL, EXPECTED[1:]),
    ],
    ids=["hermes", "mistral", "llama3"],
)
def test_every_chunking_of_native_calls_tells_the_same_calls(
    fmt: toolkit.ToolFormat, answer: str, expected: list[Any]
) -> None:
    for pieces in [[i] for i in range(1, len(answer))] + [list(range(1, len(answer)))]:
        stream, events = native(fmt, answer, pieces)
        text, calls = told(events)
        assert not text and stream.content is None and stream.complete
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected
        assert all(c["closed"] for c in calls.values()) and stream.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize(("fmt", "answer"), [(toolkit.HERMES, HERMES_CALLS), (toolkit.MISTRAL, MISTRAL_CALLS)])
def test_a_cut_native_answer_reports_whole_calls_only_and_no_markup(fmt: toolkit.ToolFormat, answer: str) -> None:
    for end in range(len(fmt.lead) + 1, len(answer)):
        stream, events = native(fmt, answer[:end], [end // 2])
        text, calls = told(events)
        assert not text and stream.content is None
        assert stream.finish_reason("length") in ("length", "tool_calls")
        for call in calls.values():  # what streamed is the start of a real call's arguments; closed ones are whole
            assert call["arguments"] in answer and (not call["closed"] or json.loads(call["arguments"]))
        assert all((c.name, json.loads(c.arguments)) in EXPECTED for c in stream.calls)


def test_native_text_answers_pass_through_and_the_bound_holds() -> None:
    for text in ("Sunny in Paris.", "<b>bold</b> and <tool_call> later", " <tool", "{not a call"):
        stream, events = native(toolkit.HERMES, text, [3])
        assert told(events)[0] == text == stream.content and not stream.calls
        assert stream.finish_reason("length") == "length" and stream.finish_reason("stop") == "stop"
    many = "\n".join(
        f'<tool_call>\n{{"name": "add", "arguments": {{"a": {i}, "b": 1}}}}\n</tool_call>' for i in range(12)
    )
    assert [json.loads(c.arguments)["a"] for c in toolkit.parse(many, 3, toolkit.HERMES)[1]] == [0, 1, 2]


def test_the_runner_grammar_is_calls_in_the_syntax_or_text_that_does_not_start_as_one() -> None:
    call = 'root ::= "{" "}"\n'
    hermes = ToolSyntax(
        tools="[]", call_schema="{}", before="<tool_call>\n", after="\n</tool_call>", separator="\n", max_calls=3
    )
    grammar = tool_grammar(hermes, call)
    rules = dict(line.split(" ::= ", 1) for line in grammar.strip().splitlines())
    assert rules[ROOT] == f"{LEADING_SPACE} ( {ROOT}-calls | {ROOT}-text )"  # a few newlines may lead either
    assert rules[f"{ROOT}-calls"] == f'{ROOT}-call ("\\x0A" {ROOT}-call){{0,2}}'
    assert rules[f"{ROOT}-call"] == '"\\x3Ctool\\x5Fcall\\x3E\\x0A" root "\\x0A\\x3C\\x2Ftool\\x5Fcall\\x3E"'
    # A text may not begin "<tool_call>" once its leading whitespace is left out (its first character is neither
    # whitespace nor "<"; or a start of the lead, then anything else; or a cut inside it).
    assert rules[f"{ROOT}-text"].startswith("( [^\\x3C\\x20\\x09\\x0A\\x0D] .* | ")
    assert rules[f"{ROOT}-text"].endswith(")?")
    assert rules[f"{ROOT}-text"].count("[^") == len("<tool_call>")
    only_calls = tool_grammar(msgspec.structs.replace(hermes, text=False), call)
    assert f"{ROOT}-text" not in only_calls and f"{ROOT} ::= {LEADING_SPACE} ( {ROOT}-calls )\n" in only_calls
    only_text = tool_grammar(msgspec.structs.replace(hermes, max_calls=0), call)
    assert f"{ROOT}-calls" not in only_text and f"{ROOT} ::= {LEADING_SPACE} ( {ROOT}-text )\n" in only_text
    assert ToolSyntax(tools="[]", call_schema="{}").lead == "{"  # a bare call (Llama 3) starts with its object


def test_generic_messages_do_not_carry_native_fields() -> None:
    message = ChatMessage(role="user", content="hi")
    assert template_messages([message]) == [{"role": "user", "content": "hi"}]


# --------------------------------------------------------------------------------------------------------------
# The grammar as llama.cpp reads it: which answers it lets through, token by token
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab() -> Any:
    """The default model's vocabulary (``vocab_only``: no weights), to run grammars over real tokens."""
    from conftest import model_missing
    from tether.models import default_model_path

    missing = model_missing()
    if missing:
        pytest.skip(missing)
    import llama_cpp.llama_cpp as lib

    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(default_model_path()).encode(), params)
    assert model, "the default model's vocabulary did not load"
    yield lib, model, lib.llama_model_get_vocab(model)
    lib.llama_model_free(model)


def grammar_takes(vocab: Any, grammar: str, root: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets ``text`` through (as the tokenizer splits it) to a state where it
    may end: each token checked against the grammar's state, then accepted."""
    import ctypes

    lib, _, vocab_ = vocab
    sampler = lib.llama_sampler_init_grammar(vocab_, grammar.encode(), root.encode())
    assert sampler, grammar
    try:
        ids = (lib.llama_token * (len(text) + 8))()
        count = lib.llama_tokenize(vocab_, text.encode(), len(text.encode()), ids, len(ids), False, True)
        candidates = [*ids[:count], lib.llama_vocab_eos(vocab_)]
        for position, token in enumerate(candidates):
            data = lib.llama_token_data(token, 1.0, 0.0)
            array = lib.llama_token_data_array(ctypes.pointer(data), 1, -1, False)
            lib.llama_sampler_apply(sampler, ctypes.byref(array))
            if data.logit == float("-inf"):
                return False
            if position < count:
                lib.llama_sampler_accept(sampler, token)
        return True
    finally:
        lib.llama_sampler_free(sampler)


@pytest.mark.model
def test_no_call_slips_through_as_text_behind_leading_whitespace(vocab: Any) -> None:
    """A text answer may not start as a call does even after newlines (a model writes some after its thinking):
    else the serving side would read a call the grammar never held to its schema. Calls may follow newlines."""
    from tether.engines.llamacpp.engine import schema_grammar

    hermes = ToolSyntax(
        tools="[]", call_schema=json.dumps(WEATHER["function"]["parameters"]), before="<tool_call>\n",
        after="\n</tool_call>", separator="\n", max_calls=2,
    )  # fmt: skip
    grammar = tool_grammar(hermes, schema_grammar(hermes.call_schema))
    call = '<tool_call>\n{"city": "Paris"}\n</tool_call>'
    assert grammar_takes(vocab, grammar, ROOT, "It is sunny.")
    assert grammar_takes(vocab, grammar, ROOT, call)
    assert grammar_takes(vocab, grammar, ROOT, f"\n\n{call}")
    assert not grammar_takes(vocab, grammar, ROOT, '\n\n<tool_call>\n{"town": 1}\n</tool_call>')  # the schema holds
    assert not grammar_takes(vocab, grammar, ROOT, "\n\n<tool_call> not a call")
    assert not grammar_takes(vocab, grammar, ROOT, " <tool_call>")
    # after the model's thinking the answer is owed: no empty text
    owed = tool_grammar(hermes, schema_grammar(hermes.call_schema), owed=True)
    assert grammar_takes(vocab, grammar, ROOT, "") and grammar_takes(vocab, grammar, ROOT, "\n")
    assert not grammar_takes(vocab, owed, ROOT, "") and not grammar_takes(vocab, owed, ROOT, "\n\n")
    assert grammar_takes(vocab, owed, ROOT, "\n\nIt is sunny.") and grammar_takes(vocab, owed, ROOT, f"\n{call}")


@pytest.mark.model
def test_a_generic_answer_in_text_says_something(vocab: Any) -> None:
    """The generic format's text branch is a non-empty string: sampled with Open WebUI's 36 tools, the 135M model
    wrote ``{"response": ""}`` about once in 50 turns, a message with nothing in it (3 of 150 seeds); calls still
    pass, and an agent loop's forced text answer holds the same bound."""
    from tether.engines.llamacpp.engine import schema_grammar

    auto = toolkit.ToolPlan((toolkit.Tool("add", "adds", ADD["function"]["parameters"]),), "auto")
    for plan in (auto, toolkit.ToolPlan(auto.tools, toolkit.ANSWER)):
        grammar = schema_grammar(json.dumps(plan.schema()))
        assert grammar_takes(vocab, grammar, "root", '{"response": "Hi."}')
        assert not grammar_takes(vocab, grammar, "root", '{"response": ""}')
    grammar = schema_grammar(json.dumps(auto.schema()))
    assert grammar_takes(vocab, grammar, "root", '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}')
