"""The HTTP front of a serving worker (``tether serve``): routes, guard, wire formats. No serving logic lives here.

Runs in the worker process. ``app`` assembles the ASGI app from one route table (which also makes the OpenAPI
document, ``schema``); ``guard`` checks every request before any route (Host, Origin, key, body size);
``generation`` admits a generation and answers it with exactly one outcome; ``views`` are the response bodies
beside the dialects' own; ``statuses`` is the one table from tether's typed errors to HTTP status, code and
Retry-After; ``dialects`` are the wire formats; ``metrics`` and ``dashboard`` the operations side. May import
``tether.fleet``, ``tether.node`` and everything below them; never ``tether.cluster`` (known through a protocol) or
``tether.cli``.
"""
