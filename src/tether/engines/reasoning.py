"""Reasoning models' thinking, kept apart from their answer: which templates think, and the text split as it streams.

A reasoning model (Qwen3, the DeepSeek-R1 distills, QwQ, ...) writes its thinking between ``<think>`` and ``</think>``
before the answer. Its chat template says so: it names the tags (it strips earlier turns' thinking, or opens the block
in its generation prompt), and where it reads ``enable_thinking`` it can turn thinking off (Qwen3 then writes an empty
block itself). Some templates open the block in the generation prompt (the R1 distills end it with ``<think>\\n``):
the answer then starts inside it, with no opening tag of its own.

The runner renders the prompt and sees the text, so it splits (``Splitter``): every delta's text is divided into
reasoning and answer, a tag cut between two deltas held back until it is whole, the tags themselves in neither. The
serving side reads ``detect`` on the same template to refuse ``think: false`` where the template cannot honour it, and
to list the "thinking" capability.

A structured answer (a JSON schema, tool calls) comes after the thinking: its grammar waits until the block closes.
Where the template leaves it to the model to open the block, the runner opens it in the prompt (as the R1 distills'
templates do), so the answer's start is known; where it wrote the block closed (thinking off), the grammar holds the
answer from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OPEN, CLOSE = "<think>", "</think>"
Block = Literal["open", "closed"] | None  # how a rendered prompt leaves the thinking block (None: without one)
SWITCH = "enable_thinking"  # the template variable Qwen3's templates (and vLLM's, llama.cpp's) turn thinking off with


@dataclass(frozen=True)
class ReasoningFormat:
    """How a template's model thinks: between ``open`` and ``close``; ``switchable``: the template reads
    ``enable_thinking`` and renders a prompt without thinking when it is false."""

    open: str = OPEN
    close: str = CLOSE
    switchable: bool = False


def detect(template: str | None) -> ReasoningFormat | None:
    """The reasoning format of a chat template's model, or None for a model that does not think."""
    if not template or CLOSE not in template:
        return None
    return ReasoningFormat(switchable=SWITCH in template)


def opens_in_prompt(prompt: str, fmt: ReasoningFormat) -> bool:
    """Whether a rendered prompt leaves its answer inside a thinking block (the template opened it, not closed it)."""
    return prompt.rfind(fmt.open) > prompt.rfind(fmt.close)


def closes_in_prompt(prompt: str, fmt: ReasoningFormat) -> bool:
    """Whether a rendered prompt ends with a closed thinking block: the template wrote the thinking (an empty block,
    Qwen3's way of turning it off), and the answer comes next."""
    return prompt.rstrip().endswith(fmt.close)


class Splitter:
    """One answer's text, fed as it is generated, divided into (reasoning, answer) pieces. ``inside``: the answer
    starts inside a thinking block. A tag is recognised only whole; text that could still become one is held back
    until the next piece (or ``flush`` at the end). Only the first block is reasoning: a later ``<think>`` is text."""

    def __init__(self, fmt: ReasoningFormat, inside: bool = False) -> None:
        self.fmt = fmt
        self.inside = inside
        self.done = False  # the thinking block closed: the rest is the answer
        self._trim = False  # the block just closed: the newlines that follow its tag are the layout's, not the answer's
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, answer) text of ``text`` that is known now."""
        reasoning, answer = [], []
        pending = self._held + text
        self._held = ""
        while pending:
            if self.done:
                if self._trim:
                    pending = pending.lstrip("\n")
                    self._trim = not pending
                answer.append(pending)
                break
            if not self.inside:
                stripped = pending.lstrip()
                if not stripped:  # only whitespace yet: it may lead an opening tag, or be the answer's start
                    self._held = pending
                    break
                if stripped.startswith(self.fmt.open):
                    self.inside, pending = True, stripped[len(self.fmt.open) :]
                    continue
                if self.fmt.open.startswith(stripped):  # the tag's beginning: wait for the rest
                    self._held = pending
                    break
                self.done = True  # an answer that does not think first
                continue
            end = pending.find(self.fmt.close)
            if end >= 0:
                reasoning.append(pending[:end])
                pending = pending[end + len(self.fmt.close) :]
                self.inside, self.done, self._trim = False, True, True
                continue
            keep = _partial_suffix(pending, self.fmt.close)
            reasoning.append(pending[: len(pending) - keep])
            self._held = pending[len(pending) - keep :]
            break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What was held back, at the answer's end: inside the block it is reasoning, else answer."""
        held, self._held = self._held, ""
        return (held, "") if self.inside else ("", held)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
