"""The stream of one Ollama request shaped into NDJSON lines or one object, in the chat or generate shape."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

import msgspec

from tether.protocol import (
    Chunk,
    TokenLogprob,
)
from tether.serve import views
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.ollama.replies import ns, rfc3339
from tether.serve.dialects.plan import Plan
from tether.serve.routes import NDJSON
from tether.serve.statuses import Answer

log = logging.getLogger("tether.api")


_encode = msgspec.json.Encoder().encode


class OllamaShaper:
    """One request's NDJSON lines or whole object, in Ollama's chat or generate shape (see ``generation.Shaper``).

    A tool answer streams as it is decided (``toolkit.AnswerStream``): a direct answer's text as content pieces,
    each call whole in a line of its own once its arguments are complete (as Ollama sends them).
    """

    media_type = NDJSON
    load_seconds = 0.0  # set by the API: how long the request waited for its model to load

    def __init__(
        self, kind: Literal["chat", "generate"], model: str, plan: Plan, started: float, request_id: str = ""
    ) -> None:
        self.kind = kind
        self.model = model
        self.plan = plan
        self.started = started
        self.request_id = request_id
        self.dropped = 0  # the chat's turns left out to fit the context (the final chunk says)
        self.resumed = 0  # times it went on from where it stood on a new runner after its runner died (final chunk)
        self.text: list[str] = []
        self.thinking: list[str] = []  # a reasoning model's, kept apart by the runner
        self.logprobs: list[TokenLogprob] = []
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.answer = plan.tools.stream() if plan.tools is not None else None

    def opening(self) -> bytes:
        return b""

    def feed(self, chunk: Chunk) -> bytes:
        self.dropped = chunk.dropped_messages or self.dropped
        self.resumed = chunk.resumed or self.resumed
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.text.append(chunk.text)
        logprobs = list(chunk.logprobs) if self.plan.logprobs else []
        self.logprobs.extend(logprobs)
        thought = b""
        if chunk.reasoning:
            self.thinking.append(chunk.reasoning)
            thought = self._line(self._object("", thinking=chunk.reasoning))
        if self.answer is not None:
            return thought + self._tool_lines(self.answer.feed(chunk.text))
        if not (chunk.text or logprobs):
            return thought
        return thought + self._line(self._object(chunk.text, logprobs=logprobs))

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        out = b""
        if self.answer is not None:
            out += self._tool_lines(self.answer.finish())
        return out + self._line(self._object("", self._stats(finish, prompt_tokens, completion_tokens)))

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        content: str | None = "".join(self.text)
        calls: list[toolkit.ToolCall] = []
        if self.answer is not None:  # a tool answer cut by a limit: what of it was decided, no JSON
            self.answer.finish()
            content, calls = self.answer.content, self.answer.calls
        stats = self._stats(finish, prompt_tokens, completion_tokens)
        thought = "".join(self.thinking)
        return _encode(self._object(content or "", stats, calls=calls, logprobs=self.logprobs, thinking=thought))

    def stream_error(self, failure: Answer) -> bytes:
        """The line that ends a failed stream: the ``ollama`` clients raise ``ResponseError`` with its message."""
        return self.error_body(failure) + b"\n"

    def error_body(self, failure: Answer) -> bytes:
        return failure.body("ollama")

    def _tool_lines(self, events: list[toolkit.Event]) -> bytes:
        """A tool answer's events as lines: its text as content pieces, each call once complete."""
        out = b""
        for event in events:
            if isinstance(event, toolkit.Text):
                out += self._line(self._object(event.text))
            elif isinstance(event, toolkit.CallClosed):
                message = {"role": "assistant", "content": "", "tool_calls": [tool_call_json(event.index, event.call)]}
                out += self._line({**self._object(""), "message": message})
        return out

    def _stats(self, finish: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first_at if self.first_at is not None else end
        last = self.last_at if self.last_at is not None else end
        fitted: dict[str, Any] = {"resumed": self.resumed} if self.resumed else {}  # tether's, as in OpenAI's usage
        if self.dropped > 0:  # Ollama drops them silently; here the client and the log are told
            fitted["truncated_messages"] = self.dropped
            log.info(
                "request %s: the chat was longer than %s's context: its %d oldest turn(s) were left out (system "
                "messages and the latest turns kept, %d prompt tokens read)",
                self.request_id or "?",
                self.model,
                self.dropped,
                prompt_tokens,
            )
        return {
            "done_reason": "length" if finish == "length" else "stop",
            "total_duration": ns(end - self.started),
            "load_duration": ns(self.load_seconds),  # waiting for the model's load (0 when it was loaded)
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": ns(max(first - self.started - self.load_seconds, 0.0)),
            "eval_count": completion_tokens,
            "eval_duration": ns(last - first),
            **fitted,
        }

    def _object(
        self,
        text: str,
        stats: dict[str, Any] | None = None,
        *,
        calls: list[toolkit.ToolCall] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        thinking: str = "",
    ) -> dict[str, Any]:
        obj: dict[str, Any] = {"model": self.model, "created_at": rfc3339(time.time())}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [tool_call_json(i, c) for i, c in enumerate(calls)]
            obj["message"] = message
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = stats is not None
        if stats is not None:
            obj.update(stats)
        if logprobs and self.plan.logprobs:
            obj["logprobs"] = [views.chat_logprob(e) for e in logprobs]
        return obj

    @staticmethod
    def _line(obj: dict[str, Any]) -> bytes:
        return _encode(obj) + b"\n"


def tool_call_json(index: int, call: toolkit.ToolCall) -> dict[str, Any]:
    """A call in Ollama's shape: the arguments as an object, not as JSON text."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}
