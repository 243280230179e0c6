"""OpenAI's Predicted Outputs (``prediction``) from the HTTP API to the engine and back, and what speculative decoding
reports: usage's ``completion_tokens_details`` (Responses: ``output_tokens_details``) and tether's ``speculation``,
``/metrics`` and ``GET /v1/instances``.

The shapers are fed final chunks with every count set, so the exact usage each dialect writes is checked here; a live
``tether serve --engine debug --speculation`` proves the field is accepted in every shape, refused naming it in
every other, and that the counts cross the runner's pipe (the debug engine drafts nothing: its draft and prediction
counts are 0, and it takes one step per token). The engine's drafting itself is ``test_speculation``'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from conftest import Server, debug_server, run_options, wait_until
from tether.errors import InvalidField
from tether.fleet.catalog import catalog_models
from tether.fleet.fleet import Drafts
from tether.protocol import Chunk, EmbedParams, GenerateParams, TokenizeParams, Work
from tether.serve.dialects import openai, responses
from tether.serve.dialects.shapes import Prediction, PredictionPart, prediction_text

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leftover_runners")]

ORIGINAL = "def main():\n    print('hello')\n"
PREDICTION = {"type": "content", "content": ORIGINAL}
PARTS = {
    "type": "content",
    "content": [{"type": "text", "text": "def main():\n"}, {"type": "text", "text": "    pass"}],
}
CHAT = {"messages": [{"role": "user", "content": "rename main to run"}]}
# A final chunk with every count set: 8 drafted, 6 kept (5 of them from the prediction), 2 from it thrown away, and
# the 9 completion tokens in 3 steps.
FINAL = Chunk(
    "t",
    " world",
    tokens=1,
    finish_reason="stop",
    prompt_tokens=5,
    completion_tokens=9,
    cached_tokens=1,
    draft_tokens=8,
    draft_accepted=6,
    prediction_accepted=5,
    prediction_rejected=2,
    decode_steps=3,
)
PREFIX = Chunk("t", "hello", tokens=8)
CHAT_USAGE = {
    "prompt_tokens": 5,
    "completion_tokens": 9,
    "total_tokens": 14,
    "prompt_tokens_details": {"cached_tokens": 1},
    "completion_tokens_details": {
        "reasoning_tokens": 0,
        "accepted_prediction_tokens": 5,
        "rejected_prediction_tokens": 2,
    },
    "speculation": {"draft_tokens": 8, "accepted_tokens": 6, "decode_steps": 3},
    "resumed": 0,
}
RESPONSES_USAGE = {
    "input_tokens": 5,
    "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 0},
    "output_tokens": 9,
    "output_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 5, "rejected_prediction_tokens": 2},
    "total_tokens": 14,
    "speculation": {"draft_tokens": 8, "accepted_tokens": 6, "decode_steps": 3},
    "resumed": 0,
}
BAD = [  # (prediction, the field the 400 names, words of its message)
    ({"type": "text", "content": "x"}, "prediction.type", 'must be "content"'),
    ({"type": "content", "content": 5}, "prediction.content", "Expected `str | array`"),
    ({"type": "content", "content": [{"type": "image_url", "text": "x"}]}, "prediction.content[0].type", "text parts"),
    ({"type": "content", "content": [{"type": "text"}]}, "prediction.content[0]", "missing required field `text`"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "prediction", "unknown"),
    ({"content": "x"}, "prediction", "missing required field `type`"),
    ("just text", "prediction", "Expected `object | null`"),
]


def sse_data(body: bytes) -> list[Any]:
    lines = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


# --------------------------------------------------------------------------------------------------------------
# The request: the field's shapes, and where it may go
# --------------------------------------------------------------------------------------------------------------


def test_a_prediction_is_its_text_or_its_text_parts_joined() -> None:
    assert prediction_text(None) is None
    assert prediction_text(Prediction("content", ORIGINAL)) == ORIGINAL
    parts = [PredictionPart("text", "a"), PredictionPart("text", "b")]
    assert prediction_text(Prediction("content", parts)) == "ab"
    with pytest.raises(InvalidField, match=r"prediction.content\[1\]: only text parts") as refused:
        prediction_text(Prediction("content", [PredictionPart("text", "a"), PredictionPart("image", "b")]))
    assert refused.value.field == "prediction.content[1].type"
    chat = openai.chat_plan(openai.decode("chat", json.dumps({**CHAT, "prediction": PARTS}).encode()))
    assert chat.params.prediction == "def main():\n    pass"
    body = json.dumps({"prompt": "x", "prediction": {"type": "content", "content": "y"}}).encode()
    text = openai.completion_plan(openai.decode("completion", body))
    assert text.params.prediction == "y"
    answer = responses.plan(responses.decode(json.dumps({"input": "x", "prediction": PREDICTION}).encode()))
    assert answer.params.prediction == ORIGINAL


def test_a_prediction_goes_with_a_generation_only() -> None:
    """An embedding and a tokenizer question have no ``prediction`` at all: not as a field, not on the wire (the
    runner's decoder refuses one, naming it)."""
    assert GenerateParams(prompt="x", prediction="y").check() is None
    for kind in (EmbedParams, TokenizeParams):
        assert "prediction" not in kind.__struct_fields__
        frame = msgspec.msgpack.encode({"type": kind.__struct_config__.tag, "prompt": "x", "prediction": "y"})
        with pytest.raises(msgspec.ValidationError, match="unknown field `prediction`"):
            msgspec.msgpack.decode(frame, type=Work)


# --------------------------------------------------------------------------------------------------------------
# The answer: usage, exactly, in each dialect
# --------------------------------------------------------------------------------------------------------------


def chat_plan(**extra: Any) -> Any:
    return openai.chat_plan(openai.decode("chat", json.dumps({**CHAT, **extra}).encode()))


def test_chat_usage_reports_the_prediction_and_the_drafts_whole_and_streamed() -> None:
    shaper = openai.OpenAIShaper("chat", "chatcmpl-1", "m", chat_plan(prediction=PREDICTION))
    shaper.feed(PREFIX)
    shaper.feed(FINAL)
    whole = json.loads(shaper.whole("stop", 5, 9))
    assert whole["usage"] == CHAT_USAGE
    details = ChatCompletion.model_validate(whole).usage.completion_tokens_details  # the openai client reads it
    assert details is not None and (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (5, 2)

    plan = chat_plan(prediction=PREDICTION, stream=True, stream_options={"include_usage": True})
    streaming = openai.OpenAIShaper("chat", "chatcmpl-2", "m", plan)
    body = streaming.opening() + streaming.feed(PREFIX) + streaming.feed(FINAL) + streaming.closing("stop", 5, 9)
    *chunks, done = sse_data(body)
    assert done == "[DONE]" and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == CHAT_USAGE
    assert ChatCompletionChunk.model_validate(chunks[-1]).usage is not None

    legacy = openai.OpenAIShaper(
        "completion", "cmpl-1", "m", openai.completion_plan(openai.CompletionRequest(prompt="x"))
    )
    legacy.feed(FINAL)
    text = json.loads(legacy.whole("stop", 5, 9))
    assert text["usage"] == CHAT_USAGE and Completion.model_validate(text).usage is not None


def test_without_drafts_the_keys_are_there_with_zeros() -> None:
    shaper = openai.OpenAIShaper("chat", "chatcmpl-1", "m", chat_plan())
    shaper.feed(Chunk("t", "hi", finish_reason="length", prompt_tokens=2, completion_tokens=1))
    usage = json.loads(shaper.whole("length", 2, 1))["usage"]
    assert usage["completion_tokens_details"] == {
        "reasoning_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }
    assert usage["speculation"] == {"draft_tokens": 0, "accepted_tokens": 0, "decode_steps": 0}


def test_a_reasoning_models_thinking_tokens_are_counted_in_chat_usage_too() -> None:
    shaper = openai.OpenAIShaper("chat", "chatcmpl-1", "m", chat_plan())
    shaper.feed(Chunk("t", "", tokens=4, reasoning="let me see"))
    shaper.feed(FINAL)
    assert json.loads(shaper.whole("stop", 5, 9))["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4


def test_responses_usage_reports_the_prediction_and_the_drafts_whole_and_streamed() -> None:
    body = {"input": "rename main to run", "prediction": PREDICTION}
    plan = responses.plan(responses.decode(json.dumps(body).encode()))
    for stream in (False, True):
        shaper = responses.ResponsesShaper("resp_1", "m", dataclasses.replace(plan, stream=stream))
        out = shaper.feed(PREFIX) + shaper.opening() + shaper.feed(FINAL)
        if not stream:
            whole = json.loads(shaper.whole("stop", 5, 9))
            assert whole["usage"] == RESPONSES_USAGE
            Response.model_validate(whole)
            continue
        completed = sse_data(out + shaper.closing("stop", 5, 9))[-1]
        assert completed["type"] == "response.completed" and completed["response"]["usage"] == RESPONSES_USAGE


def test_an_instances_drafts_count_steps_only_where_they_were_counted() -> None:
    drafts = Drafts()
    drafts.add(8, 6, 3, 9)
    drafts.add(0, 0, 0, 40)  # an engine that counts no steps: its tokens would make tokens per step a lie
    assert dataclasses.astuple(drafts) == (8, 6, 3, 9)


# --------------------------------------------------------------------------------------------------------------
# The switch: the flag, the catalog field and the setting set the engine option once
# --------------------------------------------------------------------------------------------------------------


def test_the_flag_and_the_catalog_field_turn_speculation_on_once(tmp_path: Any) -> None:
    assert run_options("--speculation") == {"speculation": True}
    assert run_options() == {}  # off by default: the engine's own default
    data = {"models": [{"id": "a", "speculation": True}, {"id": "b"}]}
    models = catalog_models(data, "catalog.toml", tmp_path, 300.0, False)
    assert [m.config.options.get("speculation") for m in models] == [True, None]
    twice = {"models": [{"id": "c", "speculation": False, "options": {"speculation": True}}]}
    with pytest.raises(InvalidField, match="set speculation once"):
        catalog_models(twice, "catalog.toml", tmp_path, 300.0, False)


# --------------------------------------------------------------------------------------------------------------
# A live server: the debug engine, speculation switched on by the flag (the debug engine drafts nothing either way)
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with debug_server("--speculation") as server:
        yield server


def metric(server: Server, name: str, **labels: str) -> float | None:
    """One sample of /metrics (None when absent)."""
    for line in server.http.get("/metrics").text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_flag_reaches_the_options_of_an_engine_that_takes_it_and_no_other(server: Server) -> None:
    from tether.cli.common import declared_only, engine_options
    from tether.cli.parser import build_parser

    args = build_parser().parse_args(["run", "--speculation", "--threads", "1", "a prompt"])
    assert declared_only(engine_options(args), "llama.cpp") == {"speculation": True, "n_threads": 1}
    assert server.instance("debug")["options"] == {}  # the debug engine drafts nothing: it has no such option


def test_chat_and_completions_take_a_prediction_and_report_it_streamed_or_not(server: Server) -> None:
    client = server.openai()
    for prediction in (PREDICTION, PARTS):
        answer = client.chat.completions.create(
            model="debug", messages=CHAT["messages"], max_tokens=6, prediction=prediction
        )
        usage = answer.usage
        assert usage is not None and usage.completion_tokens == 6
        details = usage.completion_tokens_details
        assert details is not None and details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0
        # the debug engine drafts nothing and steps once a token: the steps crossed the runner's pipe
        assert usage.model_extra == {
            "speculation": {"draft_tokens": 0, "accepted_tokens": 0, "decode_steps": 6},
            "resumed": 0,
        }
    stream = client.chat.completions.create(
        model="debug",
        messages=CHAT["messages"],
        max_tokens=4,
        prediction=PREDICTION,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(stream)[-1]
    assert last.usage is not None and last.usage.completion_tokens_details is not None
    assert last.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert last.usage.model_extra == {
        "speculation": {"draft_tokens": 0, "accepted_tokens": 0, "decode_steps": 4},
        "resumed": 0,
    }
    raw = server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "prediction": PREDICTION})
    assert raw.status_code == 200, raw.text
    assert raw.json()["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] == 0


def test_the_responses_api_takes_a_prediction_and_reports_it_streamed_or_not(server: Server) -> None:
    plain = server.http.post("/v1/responses", json={"input": "x", "max_output_tokens": 5, "prediction": PARTS})
    assert plain.status_code == 200, plain.text
    usage = Response.model_validate(plain.json()).usage
    assert usage is not None and usage.output_tokens == 5
    assert plain.json()["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }
    assert plain.json()["usage"]["speculation"] == {"draft_tokens": 0, "accepted_tokens": 0, "decode_steps": 5}
    body = {"input": "x", "max_output_tokens": 3, "prediction": PREDICTION, "stream": True}
    with server.http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        events = sse_data(response.read())
    final = events[-1]["response"]["usage"]
    assert final["output_tokens_details"]["accepted_prediction_tokens"] == 0
    assert final["speculation"]["decode_steps"] == 3


@pytest.mark.parametrize(("prediction", "param", "words"), BAD)
def test_a_prediction_of_another_shape_is_a_400_naming_it(
    prediction: Any, param: str, words: str, server: Server
) -> None:
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/responses", {"input": "x"}),
    ):
        response = server.http.post(path, json={**body, "prediction": prediction})
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"].startswith(param) and words in error["message"], (path, error)


def test_metrics_and_the_instance_count_drafts_and_steps(server: Server) -> None:
    before = server.instance("debug")["speculation"]
    steps = metric(server, "tether_decode_steps_total", instance="debug") or 0.0
    answer = server.http.post("/v1/completions", json={"prompt": "count", "max_tokens": 7, "prediction": PREDICTION})
    assert answer.status_code == 200, answer.text

    def counted() -> bool:  # the response is sent before its request is recorded
        return server.instance("debug")["speculation"]["decode_steps"] == before["decode_steps"] + 7

    wait_until(counted, 10, "the request's steps counted")
    assert server.instance("debug")["speculation"] == {
        "draft_tokens": 0,
        "accepted_tokens": 0,
        "decode_steps": before["decode_steps"] + 7,
        "completion_tokens": before["completion_tokens"] + 7,
    }
    assert metric(server, "tether_decode_steps_total", instance="debug") == steps + 7
    for kind in ("drafted", "draft_accepted", "prediction_accepted", "prediction_rejected"):
        assert metric(server, "tether_tokens_total", instance="debug", kind=kind) == 0.0, kind
    text = server.http.get("/metrics").text
    assert "# HELP tether_decode_steps_total Engine steps that produced completion tokens" in text
