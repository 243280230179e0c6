"""The model's tokenizer over HTTP: ``POST /tokenize`` and ``POST /detokenize`` in llama-server's shape and vLLM's
(one route each takes both), and vLLM's ``GET /tokenizer_info``: what evaluation harnesses need to count a
prompt's tokens (lm-eval's ``local-completions`` finds these routes and uses them as its tokenizer, offline).

The tokenizer lives in the runner that holds the model, so each answer is a task like a generation (a
``TokenizeParams`` or ``DetokenizeParams``: the same queue, deadlines, cancel and failure causes, a model loaded on
demand), answered on its final chunk (``Chunk.tokenized``); the worker keeps no second copy of the vocabulary. A
tokenize body with ``content`` is llama-server's (``add_special`` defaults to false; ``with_pieces``), one with
``prompt`` or ``messages`` is vLLM's (``add_special_tokens`` defaults to true; its answer adds ``count`` and
``max_model_len``). Special tokens written in the text (``<|im_end|>``) are parsed as the special tokens they name,
as both servers do. A detokenize answer carries the text under both servers' names (``content`` and ``prompt``), so
either client reads it; special tokens are written out, and ids outside the vocabulary are a 400 naming the first
one, with the vocabulary's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from msgspec import UNSET, UnsetType

from tether.errors import InvalidField
from tether.fleet.fleet import new_request_id
from tether.protocol import (
    MAX_TOKENS_LIMIT,
    DetokenizeParams,
    TokenizeParams,
    TokenizerAnswer,
    TokenizerWork,
    documented,
)
from tether.serve.dialects.fields import HONOURED, LIMITED, FieldPolicy, register
from tether.serve.dialects.plan import checked, decode_body
from tether.serve.dialects.shapes import MessageIn, message_turns
from tether.serve.dialects.tools import engine_messages
from tether.serve.generation import Api
from tether.serve.routes import GENERATION_ERRORS, Route, json_answer, json_response

MAX_DETOKENIZE = 1 << 20  # token ids in one request (a bound keeps a request bounded; a context is far fewer)

TokenId = Annotated[int, documented(minimum=0, maximum=MAX_TOKENS_LIMIT)]


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    content: str | None = None  # llama-server's
    add_special: bool | None = None
    parse_special: Annotated[bool, documented(enum=[True], description="special tokens are always parsed")] = True
    with_pieces: bool = False
    model: str | None = None  # vLLM's
    prompt: str | None = None
    messages: Annotated[list[MessageIn], documented(minItems=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: Annotated[bool, documented(enum=[True], description="a generation's prompt")] = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: Annotated[list[TokenId], documented(maxItems=MAX_DETOKENIZE)]
    model: str | None = None


SCHEMA_RULES: dict[str, dict[str, Any]] = {
    # what the fields' types cannot say, for /openapi.json (the plan refuses the rest, saying so)
    "TokenizeRequest": {  # exactly one text: llama-server's content, or vLLM's prompt or messages
        "oneOf": [
            {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
            for name in ("content", "prompt", "messages")
        ]
    },
}

register(
    "POST /tokenize",
    TokenizeRequest,
    {
        "content": FieldPolicy(HONOURED, "llama-server's text to tokenize"),
        "add_special": FieldPolicy(HONOURED, "llama-server's: add the BOS token the model asks for (default false)"),
        "parse_special": FieldPolicy(LIMITED, "true only: special tokens written in the text are parsed"),
        "with_pieces": FieldPolicy(HONOURED, "each id with its piece (its bytes when they are not whole UTF-8)"),
        "model": FieldPolicy(HONOURED, "picks the model (loaded on demand)"),
        "prompt": FieldPolicy(HONOURED, "vLLM's text to tokenize"),
        "messages": FieldPolicy(HONOURED, "vLLM's: a chat, rendered with the model's template"),
        "add_special_tokens": FieldPolicy(HONOURED, "vLLM's: add the BOS token the model asks for (default true)"),
        "add_generation_prompt": FieldPolicy(LIMITED, "true only: the template's assistant opening ends the chat"),
        "return_token_strs": FieldPolicy(HONOURED, "each token's text beside the ids"),
    },
)
register(
    "POST /detokenize",
    DetokenizeRequest,
    {
        "tokens": FieldPolicy(HONOURED, "token ids of the model's vocabulary"),
        "model": FieldPolicy(HONOURED, "picks the model (loaded on demand)"),
    },
)


class TokenPiece(msgspec.Struct):
    id: int
    piece: str | list[int]  # the token's text, or its bytes when they are not whole UTF-8 (llama-server's shape)


class Tokenized(msgspec.Struct):
    """``POST /tokenize``: the token ids, each with its piece when ``with_pieces`` asked (llama-server's shape); asked
    in vLLM's shape (``prompt`` or ``messages``), with their count and the longest prompt plus answer served."""

    tokens: list[int | TokenPiece]
    count: int | UnsetType = UNSET
    max_model_len: int | UnsetType = UNSET
    token_strs: list[str] | UnsetType = UNSET  # ``return_token_strs``: each token's text


class Detokenized(msgspec.Struct):
    """``POST /detokenize``: the tokens' text, under llama-server's name and vLLM's (one route answers both)."""

    content: str
    prompt: str


class TokenizerInfo(msgspec.Struct):
    """``GET /tokenizer_info`` (vLLM's): what a client's remote tokenizer needs (lm-eval's ``tokenizer_backend``
    ``remote``), read from the model by its runner."""

    model: str
    tokenizer_class: str  # the GGUF's tokenizer family: gpt2, llama, ...
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    pad_token: str | None  # none: completions are never padded here
    add_bos_token: bool
    chat_template: str | None
    model_max_length: int  # a sequence's context (n_ctx): the longest prompt plus answer served
    vocab_size: int


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


@dataclass(frozen=True)
class TokenizePlan:
    """What a tokenize request asks the runner, and how its answer is shaped."""

    params: TokenizeParams
    model: str | None
    vllm: bool  # vLLM's shape (``prompt`` or ``messages``), else llama-server's (``content``)
    with_pieces: bool = False
    token_strs: bool = False


def tokenize_plan(request: TokenizeRequest) -> TokenizePlan:
    given = [name for name in ("content", "prompt", "messages") if getattr(request, name) is not None]
    if len(given) != 1:
        raise InvalidField(
            None,
            "send exactly one of 'content' (llama-server's shape), 'prompt' or 'messages' (vLLM's), "
            f"got {', '.join(given) or 'none'}",
        )
    if not request.parse_special:
        raise InvalidField(
            "parse_special", "parse_special must be true: special tokens written in the text are always parsed here"
        )
    if not request.add_generation_prompt:
        raise InvalidField(
            "add_generation_prompt",
            "add_generation_prompt must be true: the chat is rendered as a generation's prompt is",
        )
    vllm = request.content is None
    flags = [flag for flag in (request.add_special, request.add_special_tokens) if flag is not None]
    add_special = flags[0] if flags else vllm  # llama-server's default is false, vLLM's true
    messages = tuple(engine_messages(message_turns(request.messages))) if request.messages is not None else None
    params = TokenizeParams(
        prompt=request.content if request.content is not None else request.prompt,
        messages=messages,
        add_special=add_special,
    )
    return TokenizePlan(checked(params), request.model, vllm, request.with_pieces, request.return_token_strs)


def detokenize_params(request: DetokenizeRequest) -> DetokenizeParams:
    if len(request.tokens) > MAX_DETOKENIZE:
        raise InvalidField("tokens", f"tokens takes at most {MAX_DETOKENIZE} ids, got {len(request.tokens)}")
    for i, token in enumerate(request.tokens):
        if not 0 <= token <= MAX_TOKENS_LIMIT:
            raise InvalidField(f"tokens[{i}]", f"token ids are integers >= 0, got {token} at index {i}")
    return checked(DetokenizeParams(ids=tuple(request.tokens)))


def piece_out(piece: bytes) -> str | list[int]:
    """A token's piece as llama-server gives it: its text when its bytes are whole UTF-8, else the bytes."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def tokenized_body(plan: TokenizePlan, answer: TokenizerAnswer) -> Tokenized:
    tokens: list[int | TokenPiece] = list(answer.ids)
    if plan.with_pieces:
        tokens = [TokenPiece(id=i, piece=piece_out(p)) for i, p in zip(answer.ids, answer.pieces, strict=True)]
    out = Tokenized(tokens=tokens)
    if plan.vllm:
        out.count, out.max_model_len = len(answer.ids), answer.n_ctx
    if plan.token_strs:
        out.token_strs = [p.decode("utf-8", errors="replace") for p in answer.pieces]
    return out


def info_body(model: str, answer: TokenizerAnswer) -> TokenizerInfo:
    return TokenizerInfo(
        model=model,
        tokenizer_class=answer.kind,
        bos_token=answer.bos_token,
        bos_token_id=answer.bos_id,
        eos_token=answer.eos_token,
        eos_token_id=answer.eos_id,
        pad_token=None,
        add_bos_token=answer.add_bos,
        chat_template=answer.chat_template,
        model_max_length=answer.n_ctx,
        vocab_size=answer.n_vocab,
    )


def routes(api: Api) -> list[Route]:
    """``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``."""
    scheduler = api.scheduler

    async def ask(model_id: str, params: TokenizerWork, endpoint: str) -> tuple[str, TokenizerAnswer]:
        """The runner's answer to one tokenizer request: the final chunk's text and ``tokenized``."""
        [chunk] = await api.embed(model_id, [params], new_request_id("tok"), endpoint)
        if chunk.tokenized is None:  # an engine of its own that generated instead: it has no tokenizer to ask
            raise InvalidField(
                None, f"model {model_id!r}'s engine answers no tokenizer requests: ask a llama.cpp instance"
            )
        return chunk.text, chunk.tokenized

    async def tokenize(request: Request) -> Response:
        body = decode_body(_tokenize_decoder, await request.body())
        model_id = scheduler.resolve(body.model)
        plan = api.planned(model_id, "tokenize", lambda: tokenize_plan(body))
        _, answer = await ask(model_id, plan.params, "tokenize")
        return json_response(tokenized_body(plan, answer))

    async def detokenize(request: Request) -> Response:
        body = decode_body(_detokenize_decoder, await request.body())
        model_id = scheduler.resolve(body.model)
        params = api.planned(model_id, "detokenize", lambda: detokenize_params(body))
        text, _ = await ask(model_id, params, "detokenize")
        return json_response(Detokenized(content=text, prompt=text))

    async def tokenizer_info(request: Request) -> Response:
        model_id = scheduler.resolve(request.query_params.get("model"))
        params = TokenizeParams(prompt="", add_special=False)
        _, answer = await ask(model_id, params, "tokenizer_info")
        return json_response(info_body(model_id, answer))

    model_query = {
        "name": "model",
        "in": "query",
        "required": False,
        "schema": {"type": "string"},
        "description": "the model whose tokenizer (default: the one a request without a model reaches)",
    }
    return [
        Route(
            path="/tokenize",
            method="POST",
            endpoint=tokenize,
            summary="the model's token ids for a text or a chat (llama-server's and vLLM's shapes)",
            answers={"200": json_answer(Tokenized, "the token ids")},
            errors=GENERATION_ERRORS,
            body=TokenizeRequest,
        ),
        Route(
            path="/detokenize",
            method="POST",
            endpoint=detokenize,
            summary="the text of token ids (llama-server's and vLLM's shapes)",
            answers={"200": json_answer(Detokenized, "the text")},
            errors=GENERATION_ERRORS,
            body=DetokenizeRequest,
        ),
        Route(
            path="/tokenizer_info",
            method="GET",
            endpoint=tokenizer_info,
            summary="the model's tokenizer: special tokens, context, chat template (vLLM's, for remote tokenizers)",
            answers={"200": json_answer(TokenizerInfo, "the tokenizer's facts")},
            errors=GENERATION_ERRORS,
            parameters=(model_query,),
        ),
    ]
