"""What users' OpenAI clients ask of a server, against a live ``tether serve`` on the default model: logprobs,
structured output, tool calls, embeddings, and the libraries built on them (instructor, LangChain).

One server for the module: the default model (parallel 4, so concurrent requests share a batch) plus an
embedding instance of the same GGUF.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from conftest import Server, model_missing, serving

pytestmark = [pytest.mark.model, pytest.mark.timeout(300), pytest.mark.usefixtures("no_leftover_runners")]

MODEL = "SmolLM2-135M-Instruct"
EMBED = "embed"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    with serving("--threads", "1", "--n-ctx", "1024", "--parallel", "4", "--name", MODEL) as server:
        server.add_instance(
            {"id": EMBED, "engine": "llama.cpp", "options": {"embedding": True, "n_ctx": 512, "n_threads": 1}}, 90
        )
        yield server


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_chat_logprobs_are_the_texts_tokens_in_both_modes(server: Server) -> None:
    client = server.openai()
    answer = client.chat.completions.create(
        model=MODEL, messages=ask("Name three colours."), max_tokens=24, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = choice.logprobs.content
    assert b"".join(bytes(e.bytes or []) for e in entries).decode() == choice.message.content
    assert len(entries) == answer.usage.completion_tokens or choice.finish_reason == "stop"
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    streamed, text = [], ""  # a second request: its text can differ (the slot's cached prompt), its rules cannot
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=ask("Name three animals."),
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.content or []
    assert text and b"".join(bytes(e.bytes or []) for e in streamed).decode() == text
    assert all(e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 3 for e in streamed)


def test_completion_logprobs_in_the_legacy_shape(server: Server) -> None:
    answer = server.openai().completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0


def test_json_schema_output_always_parses_and_validates(server: Server) -> None:
    client = server.openai()
    people = ["a baker", "a pilot", "a child", "a doctor", "a poet"] * 4  # 20 requests, 4 at a time in one batch

    def one(i: int) -> tuple[str, str]:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=ask(f"Invent {people[i]} and describe them as JSON with name, age and city."),
            max_tokens=120,
            temperature=0.7,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        return answer.choices[0].message.content or "", answer.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(len(people))))
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    # Greedy: sampled at 0.7, this model nests JSON objects past any max_tokens in ~1 answer of 4 (finish "length",
    # cut JSON): the grammar keeps the answer JSON, not short.
    json_object = client.chat.completions.create(
        model=MODEL,
        messages=ask("Describe Paris as JSON with its country and population."),
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = json_object.choices[0].message.content or ""
    assert json_object.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict), text


def test_a_tool_call_is_parsed_by_the_client_and_its_result_fed_back(server: Server) -> None:
    client = server.openai()
    messages: list[Any] = ask("What is the weather in Paris?")
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=64, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=32, temperature=0
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=ask("Weather in Rome?"),
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,
        stream=True,
    ):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    json.loads(calls[0]["arguments"])


def test_embeddings_have_the_models_size_and_identical_input_gives_an_identical_vector(server: Server) -> None:
    client = server.openai()
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today."]
    first = client.embeddings.create(model=EMBED, input=texts)  # the client asks for base64 and decodes it
    again = client.embeddings.create(model=EMBED, input=texts[0], encoding_format="float")
    assert [d.index for d in first.data] == [0, 1]
    a, b = (d.embedding for d in first.data)
    assert len(a) == len(b) == 576  # SmolLM2-135M's n_embd
    assert again.data[0].embedding == pytest.approx(a, abs=1e-6)
    assert sum(x * x for x in a) == pytest.approx(1.0, abs=1e-3)
    assert a != b and first.usage.prompt_tokens > 0
    refused = server.http.post("/v1/chat/completions", json={"model": EMBED, "messages": ask("hi")})
    assert refused.status_code == 400 and "embedding" in refused.json()["error"]["message"]
    refused = server.http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert refused.status_code == 400 and "embedding" in refused.json()["error"]["message"]


def test_instructor_extracts_a_pydantic_model(server: Server) -> None:
    import instructor
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)

    client = instructor.from_openai(server.openai())
    city = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=ask("Paris is the capital of France. Extract the city and its country."),
        max_tokens=64,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(city, City) and city.name


def test_langchain_with_structured_output(server: Server) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=40)
        age: int = Field(ge=0, le=150)

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=MODEL, temperature=0, max_tokens=64)
    person = llm.with_structured_output(Person).invoke("Invent a person with a name and an age.")
    assert isinstance(person, Person) and person.name


# Alone (``serial``): its two fixed threads wait for each other at every llama.cpp barrier, and beside make test's
# other workers a step waits for a core that is not free: ~5 s alone, 40-86 s in the shared tier.
@pytest.mark.serial
@pytest.mark.timeout(120)
def test_predicted_outputs_are_drafted_and_reported_as_openai_reports_them(server: Server) -> None:
    """A code edit with the file as its ``prediction``: a good share of the answer's tokens come from drafts (of it,
    and of the prompt's copy of it), and usage says how many in OpenAI's fields (and tether's speculation counts
    beside them). On an instance of its own with its two threads fixed: on one thread (the governor's answer to
    contention) a draft rarely pays on two cores, and the planner rightly drafts nothing."""
    code = textwrap.dedent(inspect.getsource(textwrap.indent))
    question = f"Rename the function indent to add_prefix and return the whole code:\n\n```python\n{code}```"
    options = {"n_ctx": 1024, "parallel": 1, "n_threads": 2, "adaptive_threads": False, "speculation": True}
    server.add_instance({"id": "drafts", "engine": "llama.cpp", "options": options}, 180)
    client = server.openai()
    answer = client.chat.completions.create(
        model="drafts",
        messages=ask(question),
        max_tokens=120,
        temperature=0,
        prediction={"type": "content", "content": code},
    )
    usage = answer.usage
    assert usage is not None and usage.completion_tokens_details is not None
    accepted = usage.completion_tokens_details.accepted_prediction_tokens or 0
    rejected = usage.completion_tokens_details.rejected_prediction_tokens or 0
    drafts = (usage.model_extra or {})["speculation"]
    # Drafted from the prediction or from the prompt's own copy of the file (whichever the sequence trusts more). The
    # planner drafts where its measured step costs say a draft pays, so beside the suite it drafts less: 41 of 120
    # tokens accepted alone, 28 and 20 beside make test's other workers; without drafts it is 0.
    assert drafts["accepted_tokens"] >= usage.completion_tokens // 10, (drafts, usage)
    assert drafts["accepted_tokens"] >= accepted and drafts["draft_tokens"] >= accepted + rejected
    assert drafts["decode_steps"] < usage.completion_tokens  # steps that wrote several tokens at once
