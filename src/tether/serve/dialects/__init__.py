"""The wire formats a client speaks, each a peer with its own routes and reply types: ``openai`` (chat and text
completions, models), ``responses`` (OpenAI's Responses API), ``ollama`` (Ollama's API), ``embeddings`` (OpenAI's
vectors), ``tokenizer`` (llama-server's and vLLM's tokenize routes); the three large ones are packages of a module per
job (``requests``, ``planning``, ``replies``, ``shaper``, ``handlers``). What they share is in modules of its own, each
with one job: ``conversation`` (the neutral chat every dialect maps its messages into), ``tools`` (function calling in
and out of text, and the conversation rendered for the engine), ``shapes`` (request shapes several APIs take, such as
OpenAI's chat message), ``rules`` (JSON Schema rules several bodies state), ``fields`` (every request field's policy:
honoured, limited, refused, metadata), ``plan`` (the decoded request every dialect hands to generation), ``usage`` (the
token counts OpenAI's two APIs report, each in its names).

Runs in the worker process. A dialect decodes a request into a plan, answers through ``tether.serve.generation``
and tells errors through ``tether.serve.statuses``' one table; it may import ``tether.fleet``, the wire and the
shared modules, never ``tether.serve.app`` (which assembles the dialects) or another dialect
(``tests/test_layout.py`` checks it).
"""
