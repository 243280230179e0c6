"""The stream of one chat or text completion shaped into OpenAI's completion object or its SSE chunks."""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import msgspec

from tether.protocol import (
    Chunk,
    GenerateParams,
    TokenLogprob,
)
from tether.serve import views
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.plan import Plan
from tether.serve.dialects.usage import Tally, render_usage
from tether.serve.statuses import Answer

_encode = msgspec.json.Encoder().encode


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Tokens in the legacy completions API's logprobs shape; ``offset``: the text before them (streaming)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {  # an echoed prompt's first token has no logprob (NaN from the runner): null, as vLLM answers
        "tokens": [e.token for e in entries],
        "token_logprobs": [None if math.isnan(e.logprob) else e.logprob for e in entries],
        "top_logprobs": [None if math.isnan(e.logprob) else {t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


class OpenAIShaper:
    """One request's OpenAI chat or completion objects and SSE chunks (see ``generation.Shaper``).

    A tool answer streams as it is decided (``toolkit.AnswerStream``): a direct answer's text as content deltas, each
    call as OpenAI streams one (a first delta with its index, id, type and name, then its arguments' text).
    """

    media_type = "text/event-stream"
    load_seconds = 0.0  # set by the API: how long the request waited for its model to load

    def __init__(
        self, kind: Literal["chat", "completion"], request_id: str, model: str, plan: Plan | None = None
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.plan = plan or Plan(GenerateParams(prompt=""), None)
        self.text: list[str] = []
        self.reasoning: list[str] = []  # a reasoning model's thinking, kept apart by the runner
        self.logprobs: list[TokenLogprob] = []
        self._offset = 0  # streamed text so far (completion logprobs' text_offset)
        self.tally = Tally()  # what usage reports beside the token counts
        self.answer = self.plan.tools.stream() if self.plan.tools is not None else None

    # --- generation.Shaper ---------------------------------------------------------------------------------------

    def opening(self) -> bytes:
        return self.chunk("", None, first=True)

    def feed(self, chunk: Chunk) -> bytes:
        self.text.append(chunk.text)
        self.tally.feed(chunk)
        thought = b""
        if chunk.reasoning:
            self.reasoning.append(chunk.reasoning)
            thought = self._sse(self._chunk_obj({"reasoning_content": chunk.reasoning}))
        if self.plan.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if self.answer is not None:
            return thought + self._tool_deltas(self.answer.feed(chunk.text))
        if not (chunk.text or (self.plan.logprobs and chunk.logprobs)):
            return thought  # the finish reason goes in a chunk of its own
        return thought + self.chunk(chunk.text, None, logprobs=list(chunk.logprobs) if self.plan.logprobs else None)

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        out = b""
        if self.answer is not None:
            out += self._tool_deltas(self.answer.finish())
        out += self.chunk("", self._finish(finish))
        if self.plan.include_usage:
            out += self.usage_chunk(prompt_tokens, completion_tokens)
        return out + DONE

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        content, calls = self._answer()
        reason = self._finish(finish)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            if calls:
                message["tool_calls"] = [tool_call_json(c) for c in calls]
            logprobs = {"content": [views.chat_logprob(e) for e in self.logprobs], "refusal": None}
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason}
            obj = "chat.completion"
        else:
            logprobs = completion_logprobs(self.logprobs)
            choice = {"index": 0, "text": content or "", "finish_reason": reason}
            obj = "text_completion"
        choice["logprobs"] = logprobs if self.plan.logprobs else None
        return _encode(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": self._usage(prompt_tokens, completion_tokens),
            }
        )

    def stream_error(self, failure: Answer) -> bytes:
        """An SSE event the openai client raises as an ``APIError``: the stream ends with it, never with [DONE]."""
        return b"data: " + failure.body("openai") + b"\n\n"

    def error_body(self, failure: Answer) -> bytes:
        return failure.body("openai")

    # --- pieces ------------------------------------------------------------------------------------------------

    def _answer(self) -> tuple[str | None, list[toolkit.ToolCall]]:
        """The content and the complete calls (a tool answer cut by a limit: what of it was decided, no JSON)."""
        if self.answer is None:
            return "".join(self.text), []
        self.answer.finish()
        return self.answer.content, self.answer.calls

    def _finish(self, finish: str) -> str:
        if self.answer is not None:
            return self.answer.finish_reason(finish)
        return "length" if finish == "length" else "stop"

    def _tool_deltas(self, events: list[toolkit.Event]) -> bytes:
        """A tool answer's events as chat chunks: content deltas, and each call's opening and arguments deltas."""
        out = b""
        for event in events:
            if isinstance(event, toolkit.Text):
                out += self.chunk(event.text, None)
            elif isinstance(event, toolkit.CallOpened):
                function = {"name": event.name, "arguments": ""}
                call = {"index": event.index, "id": event.id, "type": "function", "function": function}
                out += self._sse(self._chunk_obj({"tool_calls": [call]}))
            elif isinstance(event, toolkit.CallArguments):
                call = {"index": event.index, "function": {"arguments": event.delta}}
                out += self._sse(self._chunk_obj({"tool_calls": [call]}))
        return out

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text or logprobs or not finish_reason else {}
            if first:
                delta["role"] = "assistant"
            chunk = self._chunk_obj(delta, finish_reason)
            if logprobs is not None:
                chunk["choices"][0]["logprobs"] = {
                    "content": [views.chat_logprob(e) for e in logprobs],
                    "refusal": None,
                }
            return self._sse(chunk)
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if logprobs is not None:
            choice["logprobs"] = completion_logprobs(logprobs, self._offset)
        self._offset += len(text)
        return self._sse(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def _chunk_obj(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._sse(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self._usage(prompt_tokens, completion_tokens),
            }
        )

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return render_usage("completions", prompt_tokens, completion_tokens, self.tally)

    @staticmethod
    def _sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + _encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def tool_call_json(call: toolkit.ToolCall) -> dict[str, Any]:
    """A call the answer made, in OpenAI's shape: its arguments as the JSON text the model wrote."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
