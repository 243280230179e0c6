"""Ollama's API beside OpenAI's: the routes Open WebUI, Continue and the ``ollama`` clients call, on the same fleet.

``/api/chat`` and ``/api/generate`` become the same ``Plan`` an OpenAI request does and are answered through
``Api.respond``, so every promise holds here too; only the bytes are Ollama's (NDJSON, streaming by default, errors
as ``{"error": ...}`` with tether's ``code``, ``param`` and ``cause``). The rules an edit must keep: a runner failure
mid-stream ends the stream with an error line carrying the cause, never with ``done: true``; every field is honoured
or refused (``fields``); where Ollama's semantics decide (sampling defaults, a chat fitted to ``num_ctx``,
``keep_alive``, a request without a prompt) they are followed as Ollama documents them. One module per job:
``requests`` (the bodies, their fields' policies), ``planning`` (a request to its ``Plan``), ``replies`` (the reply
types, the models described), ``shaper`` (the stream shaped into replies), ``handlers`` (the routes); this package
re-exports what the app, the tests and the benchmarks use. What a client sees: docs/clients.md, "Ollama clients".
"""

from tether.serve.dialects.ollama.handlers import OLLAMA_VERSION, routes
from tether.serve.dialects.ollama.planning import (
    chat_plan,
    chat_turns,
    embed_inputs,
    embed_texts,
    generate_plan,
    show_model,
)
from tether.serve.dialects.ollama.replies import OllamaFunctionOut, OllamaMessageOut, OllamaToolCallOut
from tether.serve.dialects.ollama.requests import (
    BEYOND_SCHEMA,
    SCHEMA_RULES,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaFunctionCall,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaShowRequest,
    OllamaToolCall,
    decode,
)
from tether.serve.dialects.ollama.shaper import OllamaShaper

__all__ = [
    "BEYOND_SCHEMA",
    "OLLAMA_VERSION",
    "SCHEMA_RULES",
    "OllamaChatRequest",
    "OllamaEmbedRequest",
    "OllamaEmbeddingsRequest",
    "OllamaFunctionCall",
    "OllamaFunctionOut",
    "OllamaGenerateRequest",
    "OllamaMessage",
    "OllamaMessageOut",
    "OllamaShaper",
    "OllamaShowRequest",
    "OllamaToolCall",
    "OllamaToolCallOut",
    "chat_plan",
    "chat_turns",
    "decode",
    "embed_inputs",
    "embed_texts",
    "generate_plan",
    "routes",
    "show_model",
]
