"""Serving many users: the fleet of model instances and the HTTP API in front of it (``tether serve``).

Runs in the worker process. ``fleet`` owns the instances and admits requests to their queues; ``app`` is the
ASGI app (OpenAI-compatible generation, instance admin, probes), ``openai`` its wire format, ``metrics`` its
Prometheus metrics. May import ``tether.node`` and everything below it; never ``tether.cli``.
"""

from tether.serve.app import create_app

__all__ = ["create_app"]
