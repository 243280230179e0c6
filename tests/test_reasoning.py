"""A reasoning model's thinking kept apart from its answer (issue 49): which templates think, and the split of the
text as it streams, whatever the deltas' boundaries."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, gguf_with_template, model_missing, serving, wait_until
from tether.engines.reasoning import ReasoningFormat, Splitter, detect, opens_in_prompt
from tether.models import default_model_path

pytestmark = [pytest.mark.timeout(120)]

FMT = ReasoningFormat()
# a Qwen3-style template's essentials: it names the closing tag and reads enable_thinking
SWITCHABLE = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"


def split(pieces: list[str], inside: bool = False) -> tuple[str, str]:
    splitter = Splitter(FMT, inside)
    thought, said = "", ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        thought, said = thought + r, said + a
    r, a = splitter.flush()
    return thought + r, said + a


def every_cut(text: str) -> list[list[str]]:
    """``text`` cut into two and three pieces at every place (and one piece per character)."""
    cuts = [[text], list(text)]
    for i in range(len(text) + 1):
        cuts.append([text[:i], text[i:]])
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        cuts.append([text[:i], text[i:j], text[j:]])
    return cuts


@pytest.mark.parametrize(
    ("text", "inside", "expected"),
    [
        ("<think>I should greet.</think>\n\nHello!", False, ("I should greet.", "Hello!")),
        ("\n<think>\nhm\n</think>Hi", False, ("\nhm\n", "Hi")),
        ("Hello, no thinking.", False, ("", "Hello, no thinking.")),
        ("  Hello <think>x</think>", False, ("", "  Hello <think>x</think>")),  # a later tag is the answer's text
        ("I think it is Paris.</think>\nParis.", True, ("I think it is Paris.", "Paris.")),  # the prompt opened it
        ("cut short inside the thinking </thi", True, ("cut short inside the thinking </thi", "")),
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),
        ("<thinking>not the tag", False, ("", "<thinking>not the tag")),
        ("", True, ("", "")),
    ],
)
def test_the_split_is_the_same_whatever_the_deltas_boundaries(
    text: str, inside: bool, expected: tuple[str, str]
) -> None:
    for pieces in every_cut(text):
        assert split(pieces, inside) == expected, pieces


def test_nothing_is_held_back_longer_than_a_tag_could_need() -> None:
    splitter = Splitter(FMT, inside=True)
    assert splitter.feed("step one, </") == ("step one, ", "")
    assert splitter.feed("b> and on") == ("</b> and on", "")
    assert splitter.feed("</think>") == ("", "")
    assert splitter.feed("\n\nThe answer") == ("", "The answer")


def test_a_template_thinks_when_it_names_the_closing_tag_and_is_switchable_when_it_reads_enable_thinking() -> None:
    assert detect(None) is None and detect("{{ messages }}") is None
    assert detect("{{ '<think>\\n' }} ... </think>") == ReasoningFormat(switchable=False)
    assert detect(SWITCHABLE) == ReasoningFormat(switchable=True)
    assert opens_in_prompt("<|im_start|>assistant\n<think>\n", FMT)
    assert not opens_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n", FMT)
    assert not opens_in_prompt("<|im_start|>assistant\n", FMT)


# --------------------------------------------------------------------------------------------------------------
# A reasoning template written into a real GGUF, served: every dialect keeps the thinking apart
# --------------------------------------------------------------------------------------------------------------

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TAGS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def thinker_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's GGUF with a Qwen3-style reasoning template in place of its own (tensors as they were):
    its generation prompt opens the thinking block, so the model writes its answer inside it."""
    missing = model_missing()
    if missing:
        pytest.skip(missing)
    path = tmp_path_factory.mktemp("thinker") / "thinker-smollm2.gguf"
    return gguf_with_template(path, (TEMPLATES / "think.jinja").read_text())


@pytest.fixture(scope="module")
def thinker(thinker_gguf: Path) -> Iterator[Server]:
    with serving("--model", str(thinker_gguf), "--name", "thinker", "--threads", "1", "--n-ctx", "1024") as server:
        yield server


def no_tags(*texts: str | None) -> bool:
    return not any(tag in (text or "") for text in texts for tag in TAGS)


@pytest.mark.model
def test_openai_chat_gives_reasoning_content_apart_whole_and_streamed(thinker: Server) -> None:
    client = thinker.openai()
    whole = client.chat.completions.create(model="thinker", messages=QUESTION, temperature=0, max_tokens=48)
    message = whole.choices[0].message
    thought = getattr(message, "reasoning_content", None)
    assert thought and "Paris" in thought, message  # the model answers inside the block its prompt opened
    assert no_tags(thought, message.content), message
    pieces, said = [], []
    for chunk in client.chat.completions.create(
        model="thinker", messages=QUESTION, temperature=0, max_tokens=48, stream=True
    ):
        if chunk.choices:
            delta = chunk.choices[0].delta
            pieces.append(getattr(delta, "reasoning_content", None) or "")
            said.append(delta.content or "")
    assert "".join(pieces) == thought and "".join(said) == (message.content or "")
    assert sum(1 for p in pieces if p) >= 3, "the thinking streamed in pieces"
    # a limit inside the thinking: "length", with the thinking so far and no answer
    cut = client.chat.completions.create(model="thinker", messages=QUESTION, temperature=0, max_tokens=4)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.content
    assert thought.startswith(getattr(cut.choices[0].message, "reasoning_content", "") or "!"), cut


@pytest.mark.model
def test_reasoning_effort_none_turns_thinking_off_through_the_template(thinker: Server) -> None:
    client = thinker.openai()
    off = client.chat.completions.create(
        model="thinker", messages=QUESTION, temperature=0, max_tokens=48, reasoning_effort="none"
    )
    message = off.choices[0].message
    assert message.content and not getattr(message, "reasoning_content", None), message
    assert no_tags(message.content)


@pytest.mark.model
def test_ollama_think_true_and_false_in_the_ollama_client(thinker: Server) -> None:
    import ollama

    client = ollama.Client(host=thinker.url)
    on = client.chat(model="thinker", messages=QUESTION, think=True, options={"temperature": 0, "num_predict": 48})
    assert on.message.thinking and no_tags(on.message.thinking, on.message.content), on.message
    streamed = list(
        client.chat(
            model="thinker", messages=QUESTION, think=True, stream=True, options={"temperature": 0, "num_predict": 48}
        )
    )
    assert "".join(part.message.thinking or "" for part in streamed) == on.message.thinking
    off = client.chat(model="thinker", messages=QUESTION, think=False, options={"temperature": 0, "num_predict": 48})
    assert off.message.content and not off.message.thinking, off.message
    generated = client.generate(model="thinker", prompt=QUESTION[0]["content"], options={"num_predict": 24})
    assert generated.thinking and not generated.response and no_tags(generated.thinking), generated


@pytest.mark.model
def test_the_responses_api_gives_a_reasoning_item_before_the_message(thinker: Server) -> None:
    client = thinker.openai()
    whole = client.responses.create(model="thinker", input=QUESTION[0]["content"], max_output_tokens=48, temperature=0)
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"], kinds
    reasoning = whole.output[0]
    assert reasoning.content and "Paris" in reasoning.content[0].text and no_tags(reasoning.content[0].text)
    deltas, done = [], None
    for event in client.responses.create(
        model="thinker", input=QUESTION[0]["content"], max_output_tokens=48, stream=True, temperature=0
    ):
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            done = event.response
    assert done is not None and "".join(deltas) == reasoning.content[0].text
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert done.usage is not None and done.usage.output_tokens_details.reasoning_tokens > 0


@pytest.mark.model
def test_what_a_template_cannot_do_is_refused_saying_why(thinker: Server, tmp_path: Path) -> None:
    always = {"chat_template": str(TEMPLATES / "think-always.jinja"), "n_ctx": 512, "parallel": 1, "n_threads": 1}
    thinker.add_instance({"id": "always", "model": str(default_model_path()), "options": always}, 60)
    off = thinker.http.post("/api/chat", json={"model": "always", "messages": QUESTION, "think": False})
    assert off.status_code == 400 and "cannot turn thinking off" in off.json()["error"], off.text
    on = thinker.http.post("/api/chat", json={"model": "always", "messages": QUESTION, "stream": False})
    assert on.status_code == 200 and on.json()["message"]["thinking"], on.text
    plain = {"chat_template": "chatml", "n_ctx": 512, "parallel": 1, "n_threads": 1}
    thinker.add_instance({"id": "plain", "model": str(default_model_path()), "options": plain}, 60)
    asked = thinker.http.post(
        "/v1/chat/completions", json={"model": "plain", "messages": QUESTION, "reasoning_effort": "high"}
    )
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "reasoning_effort", asked.text
    assert "does not think" in asked.json()["error"]["message"]
    shown = thinker.http.post("/api/show", json={"model": "thinker"}).json()
    assert "thinking" in shown["capabilities"], shown["capabilities"]


@pytest.mark.model
def test_a_thinking_stream_and_a_structured_answer_after_thinking_resume_inside_the_block(thinker_gguf: Path) -> None:
    """Promise 10 inside a thinking block: the runner SIGKILLed a few tokens into the thinking of a plain stream and
    of one whose JSON answer waits for the thinking to close (the grammar held back, a closing tag owed); on a
    deterministic instance both resume to the thinking and the answer they have alone, the JSON whole."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    bodies = [
        {"model": "thinker", "messages": QUESTION, "temperature": 0, "max_tokens": 48},
        {
            "model": "thinker",
            "messages": QUESTION,
            "temperature": 0,
            "max_tokens": 60,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        },
    ]
    args = ("--model", str(thinker_gguf), "--name", "thinker", "--threads", "1", "--n-ctx", "1024", "--parallel", "2")
    with serving(*args, "--deterministic") as server:
        alone = []
        for body in bodies:
            message = server.http.post("/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
            alone.append((message.get("reasoning_content") or "", message.get("content") or ""))
        got: list[list[str]] = [["", "", ""] for _ in bodies]  # thinking, answer, error
        seen = [0 for _ in bodies]

        def read(i: int) -> None:
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**bodies[i], "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        got[i][2] += json.dumps(event["error"]) if "error" in event else ""
                        for choice in event.get("choices", []):
                            got[i][0] += choice["delta"].get("reasoning_content") or ""
                            got[i][1] += choice["delta"].get("content") or ""
                            seen[i] += 1

        pid = server.instance("thinker")["runner"]["pid"]
        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        wait_until(lambda: min(seen) >= 4, 30, "a few tokens into each one's thinking")
        os.kill(pid, signal.SIGKILL)
        for thread in threads:
            thread.join(60)
        assert server.instance("thinker")["restarts"] == 1
    for (thought, said, error), (alone_thought, alone_said) in zip(got, alone, strict=True):
        assert not error and thought == alone_thought and said == alone_said, (error, thought, said, alone)
    assert json.loads(got[1][1])["city"], got[1]
