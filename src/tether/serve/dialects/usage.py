"""The ``usage`` an OpenAI-shaped answer reports, built once for both of OpenAI's namings.

Chat and text completions name the counts ``prompt_tokens`` and ``completion_tokens`` (and their ``*_details``),
the Responses API ``input_tokens`` and ``output_tokens``; what is counted is the same, and so are tether's
``speculation`` and ``resumed`` beside them. A shaper keeps a ``Tally`` of its chunks and renders it in its API's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tether.protocol import Chunk
from tether.serve.generation import Speculation

Naming = Literal["completions", "responses"]  # chat and text completions' names, or the Responses API's
_PROMPT_AND_COMPLETION: dict[Naming, tuple[str, str]] = {
    "completions": ("prompt", "completion"),
    "responses": ("input", "output"),
}


@dataclass
class Tally:
    """What an answer's chunks say beside its text: the completion's tokens that wrote only thinking, and (from the
    final chunk) the prompt's tokens the prompt cache supplied and what speculative decoding did."""

    reasoning_tokens: int = 0
    cached_tokens: int = 0
    speculation: Speculation = field(default_factory=Speculation)
    resumed: int = 0  # times the worker resumed it on a new runner (docs/resume.md)

    def feed(self, chunk: Chunk) -> None:
        if chunk.reasoning and not chunk.text:
            self.reasoning_tokens += chunk.tokens
        if chunk.finish_reason is not None:
            self.cached_tokens = chunk.cached_tokens
            self.speculation = Speculation.of(chunk)
            self.resumed = chunk.resumed


def render_usage(naming: Naming, prompt_tokens: int, completion_tokens: int, tally: Tally) -> dict[str, Any]:
    """The ``usage`` object in ``naming``'s field names; the Responses API's prompt details also count the tokens
    written to a cache, which none are here (the prompt cache is the runner's, not billed)."""
    prompt, completion = _PROMPT_AND_COMPLETION[naming]
    cached = {"cached_tokens": tally.cached_tokens}
    if naming == "responses":
        cached["cache_write_tokens"] = 0
    return {
        f"{prompt}_tokens": prompt_tokens,
        f"{completion}_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        f"{prompt}_tokens_details": cached,
        f"{completion}_tokens_details": tally.speculation.details(tally.reasoning_tokens),
        "speculation": tally.speculation.usage(),
        "resumed": tally.resumed,
    }
