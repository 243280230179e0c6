"""tether's HTTP API (``tether serve``): OpenAI-compatible generation, instance admin, probes and metrics."""

from tether.api.app import create_app

__all__ = ["create_app"]
