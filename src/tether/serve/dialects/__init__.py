"""The wire formats a client speaks, each with its own routes: ``openai`` (chat and text completions, models),
``responses`` (OpenAI's Responses API), ``ollama`` (Ollama's API), ``embeddings`` (OpenAI's vectors), with the
parts they share: ``tools`` (function calling in and out of text), ``fields`` (every request field's policy:
honoured, limited, refused, metadata), ``plan`` (the decoded request every dialect hands to generation).

Runs in the worker process. A dialect decodes a request into a plan, answers through ``tether.serve.generation``
and tells errors through ``tether.serve.statuses``' one table; it may import ``tether.fleet`` and the wire, never
``tether.serve.app`` (which assembles the dialects) or another dialect's routes.
"""
