"""``chat_template_kwargs`` (vLLM's, SGLang's and llama-server's field, which clients send through ``extra_body``):
more variables for the model's chat template, each checked before a request reaches a runner.

A key names one variable the template reads (``enable_thinking``, a template's own flags); a key it never reads
would change nothing, so it is refused with the names it does read, as an unknown field is. ``enable_thinking`` is
the thinking switch the dialects already honour (``thinking``), so it must agree with ``reasoning_effort``. The
names the renderer itself sets (``messages``, ``tools``, ...) are the request's own and cannot be overridden.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tether.engines import chat_templates, reasoning
from tether.errors import InvalidField
from tether.fleet.scheduler import Scheduler
from tether.serve.dialects import tools as toolkit

FIELD = "chat_template_kwargs"
ENABLE_THINKING = f"{FIELD}.{reasoning.SWITCH}"
# what the renderer passes itself (llama-cpp-python's Jinja formatter): the request's own messages and tools
RESERVED = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
    }
)


def split(kwargs: dict[str, Any] | None, effort: bool | None) -> tuple[bool | None, str | None]:
    """``kwargs`` checked: (thinking on, off or unsaid, from ``enable_thinking`` and ``effort``, the dialect's own
    switch, which must agree), and the JSON text of the other variables (``GenerateParams.template_kwargs``)."""
    if not kwargs:
        return effort, None
    rest: dict[str, Any] = {}
    want = effort
    for key, value in kwargs.items():
        at = f"{FIELD}.{key}"
        if not key.isidentifier():
            raise InvalidField(
                at, f"{at}: a template variable's name is an identifier (letters, digits, _), got {key!r}"
            )
        if key in RESERVED:
            raise InvalidField(
                at,
                f"{at}: {key!r} is set from the request itself (its messages, tools and generation prompt): remove it",
            )
        if key == reasoning.SWITCH:
            if not isinstance(value, bool):
                raise InvalidField(at, f"{at} must be true or false, got {value!r}")
            if effort is not None and effort != value:
                said = "none" if not effort else "an effort other than none"
                raise InvalidField(
                    at,
                    f"{at} is {str(value).lower()} but the request's thinking switch says {said} "
                    "(reasoning_effort, reasoning.effort or think): they contradict each other; send one of them",
                )
            want = value
            continue
        rest[key] = value  # JSON as it came: the body's decoder refused NaN, Infinity and numbers out of range
    return want, (msgspec.json.encode(rest).decode() if rest else None)


async def check(scheduler: Scheduler, model_id: str, kwargs: dict[str, Any] | None) -> None:
    """Refuse a variable ``model_id``'s chat template never reads (``enable_thinking`` is the thinking switch's to
    judge); a template that cannot be read here (a plugin's model) takes them as they are."""
    names = [key for key in kwargs or () if key != reasoning.SWITCH]
    if not names:
        return
    template = await toolkit.template_of(scheduler, model_id)
    read = chat_templates.variables(template) if template else None
    if read is None:
        return
    for key in names:
        if key not in read:
            known = ", ".join(sorted(read - RESERVED)) or "none but the request's own"
            raise InvalidField(
                f"{FIELD}.{key}",
                f"{FIELD}.{key}: the chat template of model {model_id!r} reads no variable {key!r}, so it would "
                f"change nothing; the variables it reads: {known}",
            )
