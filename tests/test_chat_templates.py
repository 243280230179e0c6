"""Chat templates a user can set (issue 49): a base model's GGUF (Gemma 3 270M, which carries no template) chats once
one is set as an instance option, a catalog field or ``--chat-template``, and without one its chat is a 400 that says
how to set one. The built-in templates render as their formats are written; a name that is not one, or a file that
is not a Jinja template, is refused when the instance is created, not at its first chat."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Server, gemma_missing, gemma_path, run_options, serving
from tether.engines.chat_templates import BUILTIN, TemplateError, resolve
from tether.errors import InvalidField
from tether.fleet.catalog import catalog_models
from tether.models import default_model_path
from tether.serve.dialects import tools as toolkit

pytestmark = [pytest.mark.timeout(120)]

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is the capital of France?"},
]
# What each built-in writes for CHAT (bos "<s>", eos "</s>"), as each format is documented by its model's makers
RENDERED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    "Hello!<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "gemma": "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama2": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] What is the capital of "
    "France? [/INST]",
    "mistral-v7": "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]Hello!</s>[INST]What is the capital of "
    "France?[/INST]",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nWhat is the "
    "capital of France?<|end|>\n<|assistant|>\n",
    "zephyr": "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n<|user|>\nWhat is the capital "
    "of France?</s>\n<|assistant|>\n",
}
CUSTOM = "{% for m in messages %}[[{{ m['role'] }}]] {{ m['content'] }}\n{% endfor %}[[assistant]] "


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_each_built_in_template_writes_its_format(name: str) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(template=BUILTIN[name].text, eos_token="</s>", bos_token="<s>")
    assert formatter(messages=CHAT).prompt == RENDERED[name]


def test_a_name_that_is_no_template_and_a_broken_file_are_refused_saying_what_exists(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match=r"did you mean 'gemma'\?.*built in are chatml, "):
        resolve("gema")
    with pytest.raises(TemplateError, match=r"did you mean 'mistral-v7'\?"):
        resolve("Mistral_V7")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(TemplateError, match=r"broken.jinja is not a valid Jinja template: line 1"):
        resolve(str(broken))
    good = tmp_path / "good.jinja"
    good.write_text(CUSTOM)
    assert resolve("good.jinja", base=tmp_path).text == CUSTOM


def test_the_catalog_field_is_the_option_with_a_file_relative_to_the_catalog(tmp_path: Path) -> None:
    (tmp_path / "custom.jinja").write_text(CUSTOM)
    data = {"models": [{"id": "a", "chat_template": "custom.jinja"}, {"id": "b", "chat_template": "gemma"}]}
    models = catalog_models(data, "catalog.toml", tmp_path, 300.0, False)
    assert [m.config.options["chat_template"] for m in models] == [str(tmp_path / "custom.jinja"), "gemma"]
    twice = {"models": [{"id": "c", "chat_template": "gemma", "options": {"chat_template": "chatml"}}]}
    with pytest.raises(InvalidField, match="set chat_template once"):
        catalog_models(twice, "catalog.toml", tmp_path, 300.0, False)


def test_the_flag_sets_the_option_and_a_files_path_is_made_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_options("--chat-template", "gemma") == {"chat_template": "gemma"}
    monkeypatch.chdir("/tmp")
    assert run_options("--chat-template", "mine.jinja") == {"chat_template": "/tmp/mine.jinja"}


# --------------------------------------------------------------------------------------------------------------
# A base model's GGUF, served
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma() -> Path:
    missing = gemma_missing()
    if missing:
        pytest.skip(missing)
    return gemma_path()


@pytest.fixture(scope="module")
def served(gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Gemma three ways in one catalog, beside SmolLM2 (the default model): without a template, with the catalog
    field naming a file beside the catalog, and (added per test) with the instance option."""
    folder = tmp_path_factory.mktemp("catalog")
    (folder / "custom.jinja").write_text(CUSTOM)
    common = f'model = "{gemma}"\noptions = {{ n_ctx = 1024, parallel = 2, n_threads = 1 }}\n'
    smol = '[[models]]\nid = "smol"\noptions = { n_ctx = 1024, parallel = 2, n_threads = 1 }\n'
    (folder / "catalog.toml").write_text(
        f'[[models]]\nid = "bare"\n{common}\n[[models]]\nid = "filed"\nchat_template = "custom.jinja"\n{common}\n'
        + smol
    )
    with serving("--engine", "debug", "--name", "boot", "--catalog", str(folder / "catalog.toml")) as server:
        yield server


def chat(server: Server, model: str, **fields: Any) -> Any:
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0, **fields}
    return server.http.post("/v1/chat/completions", json=body, timeout=90)


@pytest.mark.model
def test_a_base_model_without_a_template_is_a_400_that_says_how_to_set_one(served: Server) -> None:
    response = chat(served, "bare")
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "has no chat template" in message and "chat_template" in message and "--chat-template" in message, message
    assert "gemma" in message, message  # the built-ins are named


@pytest.mark.model
def test_the_instance_option_makes_it_chat_and_the_api_shows_the_template(served: Server, gemma: Path) -> None:
    body = {
        "id": "opted",
        "model": str(gemma),
        "options": {"chat_template": "gemma", "n_ctx": 1024, "parallel": 2, "n_threads": 1},
    }
    served.add_instance(body, 60)
    response = chat(served, "opted")
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    rendered = served.http.post("/tokenize", json={"model": "opted", "messages": CHAT, "with_pieces": True}).json()
    text = "".join(t["piece"] for t in rendered["tokens"] if isinstance(t["piece"], str))
    assert text.endswith("<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n")
    assert answer["usage"]["prompt_tokens"] == len(rendered["tokens"])
    assert served.instance("opted")["chat_template"] == "gemma"
    show = served.http.post("/api/show", json={"model": "opted"}).json()
    assert show["template"] == BUILTIN["gemma"].text
    refused = served.http.post("/v1/instances", json={**body, "id": "typo", "options": {"chat_template": "gema"}})
    assert refused.status_code == 400 and "did you mean 'gemma'?" in refused.text, refused.text


@pytest.mark.model
def test_the_catalog_field_names_a_jinja_file_beside_the_catalog(served: Server) -> None:
    response = chat(served, "filed")
    assert response.status_code == 200, response.text
    rendered = served.http.post("/tokenize", json={"model": "filed", "messages": CHAT, "with_pieces": True}).json()
    text = "".join(t["piece"] for t in rendered["tokens"] if isinstance(t["piece"], str))
    assert "[[user]] What is the capital of France?\n[[assistant]]" in text, text
    assert served.instance("filed")["chat_template"].endswith("custom.jinja")


@pytest.mark.model
def test_the_flag_makes_tether_serve_chat_with_it(gemma: Path) -> None:
    args = ("--model", str(gemma), "--name", "g", "--chat-template", "gemma")
    with serving(*args, "--n-ctx", "1024", "--parallel", "1", "--threads", "1") as server:
        response = chat(server, "g")
        assert response.status_code == 200, response.text
        assert json.loads(response.text)["usage"]["prompt_tokens"] > 20


@pytest.mark.model
def test_ollamas_generate_reads_a_template_less_models_prompt_as_written_as_ollama_does(served: Server) -> None:
    """Ollama renders a model without a template as ``{{ .Prompt }}``: the prompt as written, not a 400."""
    body = {"model": "bare", "prompt": "The capital of France is", "stream": False, "options": {"num_predict": 8}}
    answer = served.http.post("/api/generate", json={**body, "options": {"num_predict": 8, "temperature": 0}})
    assert answer.status_code == 200 and answer.json()["response"], answer.text
    raw = served.http.post("/api/generate", json={**body, "raw": True, "options": {"num_predict": 8, "temperature": 0}})
    assert raw.json()["response"] == answer.json()["response"]  # the same prompt, read the same way
    assert raw.json()["prompt_eval_count"] == answer.json()["prompt_eval_count"]
    chat = served.http.post("/api/chat", json={"model": "bare", "messages": CHAT[1:2], "stream": False})
    assert chat.status_code == 400 and "chat_template" in chat.json()["error"], chat.text


@pytest.mark.model
def test_a_user_set_template_with_native_tools_gets_its_own_tool_format(served: Server) -> None:
    """The default model with the Hermes-style template set as its chat_template: a chat with tools is written and
    answered in that template's own tool format, as one written into the GGUF is (test_native_tools)."""
    from test_tool_formats import TEMPLATES, WEATHER

    hermes = {"chat_template": str(TEMPLATES / "hermes.jinja"), "n_ctx": 2048, "parallel": 1, "n_threads": 1}
    served.add_instance({"id": "hermes-set", "model": str(default_model_path()), "options": hermes}, 60)
    ask = {"model": "hermes-set", "messages": CHAT[-1:], "tools": [WEATHER], "tool_choice": "required"}
    answer = served.http.post("/v1/chat/completions", json={**ask, "temperature": 0}, timeout=90)
    assert answer.status_code == 200, answer.text
    calls = answer.json()["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather", answer.text
    # what the serving side planned with: the template's own format, read from the option's file
    assert toolkit.detect(resolve(hermes["chat_template"]).text) is toolkit.HERMES
    assert (
        served.http.post("/api/show", json={"model": "hermes-set"}).json()["template"]
        == resolve(hermes["chat_template"]).text
    )


@pytest.mark.model
def test_a_catalog_serves_both_families_side_by_side(served: Server) -> None:
    """SmolLM2 (llama, ChatML, full attention) and Gemma 3 (its own tokenizer, sliding-window attention) loaded
    together in one worker, each chat written with its own template, asked at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda m: chat(served, m), ["smol", "filed", "smol", "filed"]))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert answers[0].json()["choices"][0]["message"] == answers[2].json()["choices"][0]["message"]  # greedy, alike
    loaded = {m["id"]: m for m in served.http.get("/v1/models").json()["data"]}
    assert loaded["smol"]["state"] == loaded["filed"]["state"] == "loaded", loaded
