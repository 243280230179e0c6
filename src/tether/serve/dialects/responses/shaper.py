"""The stream of one Responses request shaped into a ``response`` object or its typed server-sent events."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from tether.protocol import (
    Chunk,
)
from tether.serve import views
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.responses.planning import ResponsesPlan
from tether.serve.dialects.responses.replies import new_id
from tether.serve.dialects.usage import Tally, render_usage
from tether.serve.statuses import Answer

_encode = msgspec.json.Encoder().encode


class ResponsesShaper:
    """One request's ``response`` object, or its typed SSE events (see ``generation.Shaper``).

    Text streams as ``response.output_text.delta`` events as it comes; so does a tool answer, as it is decided
    (``toolkit.AnswerStream``): a direct answer's text as a message's deltas, each call as a ``function_call`` item
    added once its name is known, its arguments as ``response.function_call_arguments.delta`` events, done once
    they are complete (a call a limit cut ends ``incomplete`` in a stream, and is left out of a whole answer,
    as are the calls that repeat an earlier one). A failure mid-stream sends
    ``response.failed`` (its ``error`` with the cause) and then an ``error`` event carrying OpenAI's error object
    under ``error``, which the openai client raises as an ``APIError``: never ``response.completed``.
    """

    media_type = "text/event-stream"
    load_seconds = 0.0  # set by the API: how long the request waited for its model to load

    def __init__(self, response_id: str, model: str, plan: ResponsesPlan) -> None:
        self.id = response_id
        self.model = model
        self.plan = plan
        self.created_at = int(time.time())
        self.message_id = new_id("msg")
        self.reasoning_id = new_id("rs")
        self.text: list[str] = []
        self.reasoning: list[str] = []  # a reasoning model's thinking, kept apart by the runner
        self._thinking_at: int | None = None  # the reasoning item's output index, once opened
        self._thinking_done = False
        self._message_at: int | None = None  # a plain answer's message's output index, once opened
        self.logprobs: list[dict[str, Any]] = []
        self._sequence = 0
        self._opened = False
        self.tally = Tally()  # what usage reports beside the token counts
        self.answer = plan.tools.stream() if plan.tools is not None else None
        self._outputs: list[dict[str, Any]] = []  # a tool answer's items, as opened (their index is their place)
        self._calls: dict[int, dict[str, Any]] = {}  # the function_call items, by the call's index

    # --- generation.Shaper ---------------------------------------------------------------------------------------

    def opening(self) -> bytes:
        return self._begin()

    def feed(self, chunk: Chunk) -> bytes:
        self.text.append(chunk.text)
        self.tally.feed(chunk)
        logprobs = [views.chat_logprob(e) for e in chunk.logprobs] if self.plan.logprobs else []
        self.logprobs.extend(logprobs)
        out = self._begin()  # the first chunk is fed before ``opening``: the opening events go first, in sequence
        if chunk.reasoning:
            self.reasoning.append(chunk.reasoning)
            out += self._think(chunk.reasoning)
        if chunk.text and self._thinking_at is not None:
            out += self._thought()
        if self.answer is not None:  # its items are kept streamed or not: a whole answer is made of them too
            out += self._tool_events(self.answer.feed(chunk.text))
            return out if self.plan.stream else b""
        if not self.plan.stream or not (chunk.text or logprobs):
            return out if self.plan.stream else b""
        return out + self._open_message() + self._event(
            "response.output_text.delta", **self._at(self._message_index()), content_index=0, delta=chunk.text,
            logprobs=logprobs,
        )  # fmt: skip

    def closing(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        out = self._begin()
        status = self._status(finish)
        if self._thinking_at is not None:
            out += self._thought("incomplete" if finish == "length" and not "".join(self.text) else "completed")
        if self.answer is None:
            out += self._open_message()
            items = self._items(finish)
            out += self._finish_message(self._message_index(), items[-1])
        else:
            out += self._tool_events(self.answer.finish())
            if not self._outputs and self.answer.content is not None:  # nothing streamed: an empty message
                out += self._tool_events([toolkit.Text("")])
            items = self._tool_items(status)
            for index, item in enumerate(items):
                if item["type"] == "message":
                    out += self._finish_message(index, item)
                elif item["status"] == "incomplete":  # a call the limit cut: its arguments were never done
                    out += self._event("response.output_item.done", output_index=index, item=item)
        event = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(event, response=self._response(status, items, prompt_tokens, completion_tokens))

    def whole(self, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        status = self._status(finish)
        if self.answer is None:
            items = self._items(finish)
        else:
            self._tool_events(self.answer.finish())
            items = [i for i in self._tool_items(status) if i["type"] == "message" or i["status"] == "completed"]
            if not items and self.answer.content is not None:  # a direct answer that is empty, or cut before it began
                items = [self._message(status, self.answer.content, [])]
            items = [i for i in items if i["type"] != "reasoning"]
            if self.reasoning:
                items.insert(0, self._reasoning_item("completed"))
        return _encode(self._response(status, items, prompt_tokens, completion_tokens))

    def stream_error(self, failure: Answer) -> bytes:
        out = self._begin()
        status = "cancelled" if failure.outcome == "cancelled" else "failed"
        partial = [self._message("incomplete", "".join(self.text))] if self.plan.tools is None else []
        response = self._response(status, partial, None, None)
        response["error"] = {"code": failure.code, "message": failure.message, **failure.extra}
        out += self._event("response.failed", response=response)
        error = {"message": failure.message, "type": failure.type, "param": None, "code": failure.code}
        return out + self._event(
            "error", code=failure.code, message=failure.message, param=None, error={**error, **failure.extra}
        )

    def error_body(self, failure: Answer) -> bytes:
        return failure.body("openai")

    # --- pieces ------------------------------------------------------------------------------------------------

    def _status(self, finish: str) -> str:
        if self.answer is not None:  # a tool answer that closed is complete, whatever stopped the generation
            return "incomplete" if self.answer.finish_reason(finish) == "length" else "completed"
        return "incomplete" if finish == "length" else "completed"

    def _items(self, finish: str) -> list[dict[str, Any]]:
        """The output items of a plain answer: its thinking, if any, then its message."""
        status = "incomplete" if finish == "length" else "completed"
        message = self._message(status, "".join(self.text), self.logprobs)
        if not self.reasoning:
            return [message]
        cut = finish == "length" and not "".join(self.text)  # the limit came inside the thinking
        return [self._reasoning_item("incomplete" if cut else "completed"), message]

    def _reasoning_item(self, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": "".join(self.reasoning)}] if status != "in_progress" else []
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [], "content": content}

    def _think(self, text: str) -> bytes:
        """More thinking, as ``response.reasoning_text.delta`` (its item opened first, once)."""
        if not self.plan.stream:
            return b""
        out = b""
        if self._thinking_at is None:
            self._thinking_at = len(self._outputs) if self.answer is not None else 0
            item = self._reasoning_item("in_progress")
            if self.answer is not None:
                self._outputs.append(item)
            out += self._event("response.output_item.added", output_index=self._thinking_at, item=item)
        at = self._at(self._thinking_at, self.reasoning_id)
        return out + self._event("response.reasoning_text.delta", **at, content_index=0, delta=text)

    def _thought(self, status: str = "completed") -> bytes:
        """The thinking ended (the answer began, or the generation did): its item done, once."""
        if self._thinking_done or self._thinking_at is None or not self.plan.stream:
            return b""
        self._thinking_done = True
        at = self._at(self._thinking_at, self.reasoning_id)
        item = self._reasoning_item(status)
        if self.answer is not None:
            self._outputs[self._thinking_at] = item
        out = self._event("response.reasoning_text.done", **at, content_index=0, text="".join(self.reasoning))
        return out + self._event("response.output_item.done", output_index=self._thinking_at, item=item)

    def _message_index(self) -> int:
        return self._message_at if self._message_at is not None else (0 if self._thinking_at is None else 1)

    def _open_message(self) -> bytes:
        """A plain answer's message item and its part, opened once (after its thinking's item, if any)."""
        if self._message_at is not None or self.answer is not None or not self.plan.stream:
            return b""
        self._message_at = self._message_index()
        at = self._message_at
        out = self._event("response.output_item.added", output_index=at, item=self._message("in_progress", None))
        return out + self._event(
            "response.content_part.added", **self._at(at), content_index=0, part=self._part("", [])
        )

    def _tool_events(self, events: list[toolkit.Event]) -> bytes:
        """A tool answer's events: its items opened and filled as they are decided (kept for the answer), and the
        stream's events for them."""
        out = b""
        for event in events:
            if isinstance(event, toolkit.Text):
                if not any(item["type"] == "message" for item in self._outputs):
                    index = len(self._outputs)
                    self._outputs.append(self._message("in_progress", None))
                    out += self._event("response.output_item.added", output_index=index, item=self._outputs[index])
                    out += self._event(
                        "response.content_part.added", **self._at(index), content_index=0, part=self._part("", [])
                    )
                    if not event.text:
                        continue
                index = next(i for i, item in enumerate(self._outputs) if item["type"] == "message")
                out += self._event(
                    "response.output_text.delta", **self._at(index), content_index=0, delta=event.text, logprobs=[]
                )
            elif isinstance(event, toolkit.CallOpened):
                item = {
                    "type": "function_call",
                    "id": new_id("fc"),
                    "call_id": event.id,
                    "name": event.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._calls[event.index] = item
                self._outputs.append(item)
                out += self._event("response.output_item.added", output_index=len(self._outputs) - 1, item=item)
            else:
                item = self._calls[event.index]
                at = self._at(self._outputs.index(item), item["id"])
                if isinstance(event, toolkit.CallArguments):
                    item["arguments"] += event.delta
                    out += self._event("response.function_call_arguments.delta", **at, delta=event.delta)
                else:
                    item.update(arguments=event.call.arguments, status="completed")
                    args = item["arguments"]
                    out += self._event("response.function_call_arguments.done", **at, name=item["name"], arguments=args)
                    out += self._event("response.output_item.done", output_index=at["output_index"], item=item)
        return out

    def _tool_items(self, status: str) -> list[dict[str, Any]]:
        """A tool answer's items as they end: its message with the answer's text, calls the limit cut incomplete."""
        assert self.answer is not None
        items = []
        for item in self._outputs:
            if item["type"] == "message":
                item = self._message(status, self.answer.content or "", [])
            elif item["status"] != "completed":
                item = {**item, "status": "incomplete"}
            items.append(item)
        return items

    def _message(self, status: str, text: str | None, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        content = [] if text is None else [self._part(text, logprobs or [])]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _at(self, index: int, item_id: str | None = None) -> dict[str, Any]:
        return {"item_id": item_id or self.message_id, "output_index": index}

    def _begin(self) -> bytes:
        """``response.created`` and ``response.in_progress``, and for text its message and part (once)."""
        if self._opened:
            return b""
        self._opened = True
        snapshot = self._response("in_progress", [], None, None)
        out = self._event("response.created", response=snapshot)
        return out + self._event("response.in_progress", response=snapshot)

    def _finish_message(self, index: int, item: dict[str, Any]) -> bytes:
        part = item["content"][0]
        at = self._at(index, item["id"])
        out = self._event(
            "response.output_text.done", **at, content_index=0, text=part["text"], logprobs=part["logprobs"]
        )
        out += self._event("response.content_part.done", **at, content_index=0, part=part)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _response(
        self, status: str, output: list[dict[str, Any]], prompt_tokens: int | None, completion_tokens: int | None
    ) -> dict[str, Any]:
        done = status in ("completed", "incomplete")
        usage = None
        if prompt_tokens is not None and completion_tokens is not None:
            usage = render_usage("responses", prompt_tokens, completion_tokens, self.tally)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.plan.echo,
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(obj) + b"\n\n"
