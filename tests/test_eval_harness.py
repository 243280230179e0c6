"""Evaluation harnesses against a live ``tether serve`` on the default model: token-id prompts, ``echo`` with
``logprobs`` (the prompt's tokens scored, as lm-eval's loglikelihood asks), text that is always whole text (a
completion cut inside a character ends before it), and lm-eval itself (``local-completions``) running a
multiple-choice task end to end, offline, with the server as its tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Document, Server, debug_server

pytestmark = [pytest.mark.timeout(300)]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def document(model_server: Server) -> Document:
    return Document(model_server.http.get("/openapi.json").json())


def complete(server: Server, document: Document, **body: Any) -> dict[str, Any]:
    response = server.http.post("/v1/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = document.check(response, "/v1/completions", "post")
    return answer


def test_echo_scores_the_prompt_with_the_logprobs_the_generation_path_gives(
    model_server: Server, document: Document
) -> None:
    ids = model_server.http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    generated = complete(model_server, document, prompt=[ids], max_tokens=1, logprobs=1)["choices"][0]
    [token] = generated["logprobs"]["tokens"]
    [logprob] = generated["logprobs"]["token_logprobs"]
    scored_ids = ids + model_server.http.post("/tokenize", json={"prompt": token}).json()["tokens"]
    assert len(scored_ids) == len(ids) + 1

    # lm-eval's loglikelihood request, and the prompt alone (max_tokens 0): the prompt's tokens, scored
    for max_tokens in (1, 0):
        body = {"prompt": [scored_ids], "max_tokens": max_tokens, "logprobs": 1, "echo": True, "seed": 1234}
        answer = complete(model_server, document, **body)
        choice, usage = answer["choices"][0], answer["usage"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(scored_ids) + max_tokens, lp["tokens"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes the first token
        assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
        # the generated token, scored as a prompt token: the same logprob (a prompt row, not a decode row)
        assert lp["token_logprobs"][len(ids)] == pytest.approx(logprob, abs=1e-3)
        assert lp["tokens"][len(ids)] == token
        assert choice["text"].startswith(PROMPT + token)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(scored_ids), max_tokens)
        assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]

    # a text prompt echoes as sent, and the openai client takes the answer
    client = model_server.openai()
    echoed = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = echoed.choices[0]
    assert choice.text.startswith(PROMPT) and choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None and choice.logprobs.token_logprobs[0] is None
    assert "".join(choice.logprobs.tokens or []) == choice.text

    # streamed, the prompt leads the first chunk
    with model_server.http.stream(
        "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "echo": True, "stream": True}
    ) as response:
        texts = [json.loads(line[6:])["choices"] for line in response.iter_lines() if line.startswith("data: {")]
    first = next(choices[0]["text"] for choices in texts if choices and choices[0]["text"])
    assert first.startswith(PROMPT)


def test_echo_on_the_debug_engine_leads_with_the_prompt_and_its_first_token_has_no_logprob() -> None:
    """The serving side of echo, without a model: the debug engine's words are its tokens."""
    with debug_server() as server:
        document = Document(server.http.get("/openapi.json").json())
        body = {"prompt": "alpha beta gamma", "max_tokens": 2, "echo": True, "logprobs": 1}
        choice = complete(server, document, **body)["choices"][0]
        assert choice["text"].startswith("alpha beta gamma ")
        assert choice["logprobs"]["token_logprobs"][:3] == [None, 0.0, 0.0]
        assert choice["logprobs"]["top_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) == 5
        alone = complete(server, document, **{**body, "max_tokens": 0})
        assert alone["choices"][0]["text"] == "alpha beta gamma" and alone["choices"][0]["finish_reason"] == "length"
        assert alone["usage"]["completion_tokens"] == 0
        for bad, param, words in (
            ({"prompt": "x", "max_tokens": 0}, "max_tokens", "0 only with echo"),
            ({"prompt": [1, 2], "max_tokens": 1}, None, "has no tokenizer"),
            ({"prompt": ["a", 1]}, "prompt", "prompt must be one prompt"),
        ):
            response = server.http.post("/v1/completions", json=bad)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and words in error["message"], error


def test_a_completion_cut_inside_a_character_ends_before_it_and_its_logprobs_keep_the_bytes(
    model_server: Server,
) -> None:
    """Greedy, this chat answers in Japanese: its first token is the first two bytes of a three-byte character."""
    body = {"messages": [{"role": "user", "content": "Translate 'thank you' into Japanese."}], "temperature": 0}
    long = model_server.http.post("/v1/chat/completions", json={**body, "max_tokens": 12, "logprobs": True}).json()
    pieces = [bytes(e["bytes"]) for e in long["choices"][0]["logprobs"]["content"]]
    cuts = [n for n in range(1, len(pieces) + 1) if not _whole(b"".join(pieces[:n]))]
    assert cuts, f"the answer never ends a token inside a character: {pieces}"
    n = cuts[0]
    for stream in (False, True):
        response = model_server.http.post(
            "/v1/chat/completions", json={**body, "max_tokens": n, "logprobs": True, "stream": stream}
        )
        content, finish, entries = _chat_answer(response, stream)
        raw = b"".join(pieces[:n])
        assert finish == "length" and "\ufffd" not in content, (content, raw)
        assert content.encode() == raw[: len(content.encode())] and len(raw) - len(content.encode()) in (1, 2, 3)
        assert b"".join(bytes(e["bytes"]) for e in entries) == raw  # the logprobs keep the unfinished bytes


def _whole(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _chat_answer(response: httpx.Response, stream: bool) -> tuple[str, str, list[dict[str, Any]]]:
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], choice["logprobs"]["content"]
    content, finish, entries = "", "", []
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
            entries += (choice.get("logprobs") or {}).get("content") or []
    return content, finish, entries


CAPITALS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "What is the capital of Germany?", "choices": ["Rome", "Berlin", "Lisbon"], "answer": 1},
    {"question": "What is the capital of Italy?", "choices": ["Vienna", "Athens", "Rome"], "answer": 2},
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lm_eval_runs_a_multiple_choice_task_by_loglikelihood_offline(model_server: Server, tmp_path: Path) -> None:
    """lm-eval 0.4.13's ``local-completions`` finds the server's tokenizer routes (``tokenizer_backend`` auto:
    remote), tokenizes each question and answer with them and scores every choice with ``echo`` and ``logprobs``;
    the data set is a JSONL file and the task a YAML file written here, nothing comes from a hub."""
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CAPITALS))
    (tmp_path / "tether_capitals.yaml").write_text(
        "task: tether_capitals\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("lm_eval")),
            "--model",
            "local-completions",
            "--model_args",
            f"base_url={model_server.url}/v1/completions,model=SmolLM2,max_retries=1",
            "--tasks",
            "tether_capitals",
            "--include_path",
            str(tmp_path),
            "--output_path",
            str(tmp_path / "out"),
        ],
        env={**os.environ, **offline},
        capture_output=True,
        text=True,
        timeout=500,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "Using remote tokenizer" in log and "Running loglikelihood requests" in log, log[-4000:]
    [results] = list((tmp_path / "out").rglob("results_*.json"))
    scores = json.loads(results.read_text())["results"]["tether_capitals"]
    assert 0.0 <= scores["acc,none"] <= 1.0, scores  # that it ran on the model's logprobs, not how well
