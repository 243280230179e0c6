"""Thinking on or off, as each dialect asks for it (Ollama's ``think``, OpenAI's ``reasoning_effort``, the Responses
API's ``reasoning.effort``), checked against the model's chat template before a request reaches a runner.

A template turns thinking on or off (``enable_thinking``), not up or down: every effort but "none" is "on". What a
template cannot do is refused with the reason, never ignored: thinking asked of a model that does not think, or
turned off where the template cannot turn it off. The runner keeps the thinking apart from the answer either way
(``engines.reasoning``).
"""

from __future__ import annotations

from tether.engines import reasoning
from tether.errors import InvalidField
from tether.fleet.scheduler import Scheduler
from tether.serve.dialects import tools as toolkit

EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's reasoning_effort values


def wanted(effort: str | None) -> bool | None:
    """An effort as on (True), off (False) or the template's default (None)."""
    return None if effort is None else effort != "none"


async def reasoning_for(scheduler: Scheduler, model_id: str) -> reasoning.ReasoningFormat | None:
    """How ``model_id``'s chat template thinks (None: it does not, or it cannot be read here)."""
    return reasoning.detect(await toolkit.template_of(scheduler, model_id))


async def switch(scheduler: Scheduler, model_id: str, want: bool | None, field: str) -> bool | None:
    """``GenerateParams.thinking`` for a request that asks ``want`` in ``field``: None leaves the template's
    default; an ask the template cannot honour is an ``InvalidField`` that says why and what to do."""
    if want is None:
        return None
    fmt = await reasoning_for(scheduler, model_id)
    if fmt is None:
        if want:
            raise InvalidField(
                field,
                f"model {model_id!r} does not think: its chat template has no thinking block (no </think>); omit "
                f"{field}, or serve a reasoning model",
            )
        return None  # nothing to turn off
    if not fmt.switchable:
        if not want:
            raise InvalidField(
                field,
                f"model {model_id!r} always thinks: its chat template cannot turn thinking off (it does not read "
                f"enable_thinking); omit {field}, or set a chat template that can (the chat_template option)",
            )
        return None  # it thinks anyway
    return want
