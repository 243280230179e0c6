"""The model's tokenizer over HTTP, as llama-server's and vLLM's clients (and lm-eval's remote tokenizer) call it:
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``, every answer checked against the served OpenAPI
document. The tokenizer is the runner's (the default model's, SmolLM2: no BOS added, ``<|im_end|>`` is id 2)."""

from __future__ import annotations

import pytest

from conftest import Document, Server, debug_server

pytestmark = [pytest.mark.timeout(120)]

TEXT = "Hello 🙂 naïve 日本語<|im_end|>"


@pytest.fixture(scope="module")
def document(model_server: Server) -> Document:
    return Document(model_server.http.get("/openapi.json").json())


def test_tokenize_and_detokenize_in_llama_servers_shape_round_trip_with_pieces(
    model_server: Server, document: Document
) -> None:
    http = model_server.http
    plain = document.check(http.post("/tokenize", json={"content": TEXT}), "/tokenize", "post")
    assert set(plain) == {"tokens"} and all(isinstance(t, int) for t in plain["tokens"])
    assert plain["tokens"][-1] == 2  # the special token written in the text is parsed as the token it names
    pieces = document.check(http.post("/tokenize", json={"content": TEXT, "with_pieces": True}), "/tokenize", "post")
    assert [t["id"] for t in pieces["tokens"]] == plain["tokens"]
    # each piece is its text, or its bytes where they are not whole UTF-8; together they are the text's bytes
    raw = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in (t["piece"] for t in pieces["tokens"]))
    assert raw == TEXT.encode()
    back = document.check(http.post("/detokenize", json={"tokens": plain["tokens"]}), "/detokenize", "post")
    assert back == {"content": TEXT, "prompt": TEXT}  # llama-server's name and vLLM's
    assert http.post("/tokenize", json={"content": "", "add_special": True}).json() == {"tokens": []}  # no BOS here


def test_tokenize_in_vllms_shape_counts_and_renders_a_chat_with_the_models_template(
    model_server: Server, document: Document
) -> None:
    http = model_server.http
    plain = http.post("/tokenize", json={"content": TEXT}).json()["tokens"]
    body = {"model": "SmolLM2", "prompt": TEXT, "add_special_tokens": False, "return_token_strs": True}
    vllm = document.check(http.post("/tokenize", json=body), "/tokenize", "post")
    assert vllm["tokens"] == plain and vllm["count"] == len(plain)
    assert vllm["max_model_len"] == 2048  # the instance's n_ctx
    assert len(vllm["token_strs"]) == len(plain) and vllm["token_strs"][-1] == "<|im_end|>"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["content"]
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_info_names_the_special_tokens_the_context_and_the_template(
    model_server: Server, document: Document
) -> None:
    info = document.check(model_server.http.get("/tokenizer_info"), "/tokenizer_info")
    assert (info["eos_token"], info["eos_token_id"], info["bos_token"], info["bos_token_id"]) == (
        "<|im_end|>",
        2,
        "<|im_start|>",
        1,
    )
    assert info["add_bos_token"] is False and info["tokenizer_class"] == "gpt2"
    assert info["model_max_length"] == 2048 and info["vocab_size"] == 49152
    assert "<|im_start|>" in info["chat_template"]
    # lm-eval's remote tokenizer finds the EOS id by tokenizing its text
    assert model_server.http.post("/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"] == [2]


def test_ids_outside_the_vocabulary_and_malformed_bodies_are_400s_that_say_why(model_server: Server) -> None:
    http = model_server.http
    for path, body in (
        ("/detokenize", {"tokens": [1, 49152]}),
        ("/v1/completions", {"prompt": [5, 99999], "max_tokens": 1}),
    ):
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "at index 1" in message and "49152 tokens" in message and "ids 0 to 49151" in message, message
    both = http.post("/tokenize", json={"content": "a", "prompt": "b"})
    assert both.status_code == 400 and "exactly one of 'content'" in both.json()["error"]["message"], both.text
    negative = http.post("/detokenize", json={"tokens": [-1]})
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "tokens[0]", negative.text


def test_the_debug_engine_refuses_tokenizer_requests_saying_it_has_no_tokenizer() -> None:
    with debug_server() as server:
        for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})):
            response = server.http.post(path, json=body)
            assert response.status_code == 400, response.text
            assert "has no tokenizer" in response.json()["error"]["message"]
        assert server.http.get("/tokenizer_info").status_code == 400
