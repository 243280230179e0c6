"""Ollama's API beside OpenAI's: the routes Open WebUI, Continue and the ``ollama`` clients call, on the same fleet.

``/api/chat`` and ``/api/generate`` become the same ``Plan`` an OpenAI request does and are answered through
``Api.respond``, so every promise holds here too (one outcome per request, the status decided by the first token,
a runner failure mid-stream ends the stream with an ``{"error": ...}`` line carrying the cause, never with a
``done: true`` line); only the bytes are Ollama's (NDJSON, one object a line, streaming by default). Errors are
Ollama's shape, ``{"error": "<message>"}``, with tether's ``code``, ``param`` and ``cause`` beside the message.

Every field is honoured or refused, as on the OpenAI side (``fields``). The choices Ollama's semantics force:

* Absent sampling options take Ollama's documented defaults (its Modelfile reference: temperature 0.8, top_k 40,
  top_p 0.9, min_p 0, repeat_penalty 1.1 over the last 64 tokens, ``num_predict`` -1: until the model stops or its
  context is full): a client that sends none (Open WebUI, the ``ollama`` client) gets what Ollama would give it,
  not a penalty-free sampler that rambles. ``seed: -1`` is Ollama's "random".
* A chat longer than the instance's context keeps its system messages and its latest turns, as Ollama does
  (``GenerateParams.fit_context``); the final object says how many turns were left out (``truncated_messages``, an
  extra field Ollama's clients ignore) and the server logs it; ``prompt_eval_count`` is the prompt really read.
* ``num_ctx`` is the request's own context: its chat is fitted into ``num_ctx`` tokens and its answer ends when they
  are full, as with Ollama; one larger than the instance's ``n_ctx`` gets the instance's (Ollama would reload the
  model with a larger context; tether serves the instance started ahead, whose context ``/api/show`` and
  ``/api/ps`` report). Other load-time options (``num_gpu``, ``num_thread``, ...) are refused, naming the instance
  option to set instead (``POST /v1/instances``).
* ``/api/embed``'s ``truncate`` (default true, as Ollama's) keeps the first ``n_ctx`` tokens of an input too long
  for the instance's context; false refuses it (400, with the numbers). ``/api/embeddings`` (no such field) cuts too.
* ``keep_alive`` is the scheduler's (``tether.fleet.scheduler``): how long the model stays loaded once idle, 0 to
  unload it after this request, negative for ever; an empty prompt with ``keep_alive: 0`` is ``ollama stop``.
* A request without a prompt (or messages) is Ollama's "load the model": the model is loaded (waiting for it) and
  the answer is ``done_reason: "load"``; with ``keep_alive: 0`` it is unloaded instead (``done_reason: "unload"``).
* Durations are measured on the request's timeline (nanoseconds): ``total_duration`` from arrival to the answer,
  ``load_duration`` waiting for the model to load (0 when it was loaded), ``prompt_eval_duration`` from then to the
  first token (queue wait included), ``eval_duration`` from the first token to the last.
* ``/api/tags`` and ``/api/show`` describe every model a request can name (loaded or not), with its
  ``capabilities`` (an embedding instance's are ``["embedding"]``: clients do not offer it for chat), ``/api/ps``
  the loaded ones (``expires_at``: when keep-alive unloads them), from their GGUF headers: the ``digest`` is the
  sha256 of the file's path, size and mtime (hashing gigabytes per listing would be too slow), and ``/api/ps``'s
  ``size`` is the runner's footprint plus the weights it maps that are resident.

``/api/version`` answers ``OLLAMA_VERSION`` (clients compare it with the Ollama release they need) and tether's own
version in the ``X-Tether-Version`` header.

Not served: Ollama's model management (pull, push, create, copy, delete, blobs): instances are tether's
(``/v1/instances``).

One module per job: ``requests`` (the bodies and their fields' policies), ``planning`` (a request to the ``Plan``
it runs), ``replies`` (the reply types, and the models described), ``shaper`` (the stream shaped into replies),
``handlers`` (the routes). This package re-exports what the app, the tests and the benchmarks use.
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
