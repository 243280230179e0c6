"""Reasoning models in the loops people run: tether and llama.cpp's ``llama-server`` side by side, same GGUF, same
templates (issue 59).

The default model (SmolLM2-135M) is served with the reasoning templates the tests use (``tests/fixtures/templates``):
Qwen3-style with Hermes tool calls, whose model opens its own thinking block and whose history keeps the thinking of
the turns since the last user message (``think-tools.jinja``); R1-style, whose prompt opens the block
(``think.jinja``); Llama 3-style with bare JSON calls (``think-llama3.jinja``). Each side serves the three (tether:
one server, an instance each; llama-server: ``--jinja --chat-template-file F --reasoning-format deepseek``, one
process each, 2 threads, ``-c 2048``). Every request is greedy. The scenarios, on each side:

- ``chat_loop``: a 5-turn openai-SDK agent loop with one tool (``get_weather``) on the Qwen3-style template: each turn
  appends the returned message object as it came (the SDK's idiom) and answers its calls; turns 1 and 4 ask
  ``tool_choice: required`` (an agent's first step, and a check), the rest ``auto``. Counted: errors, turns with
  thinking, turns whose calls came after visible thinking. tether's rendered prompt of turn 5 (what its runner
  renders from that history: turn 4's thinking and call, which the template keeps after the last user message) is
  printed and kept in the record.
- ``responses_loop``: the same five turns through the Responses API, stateless: each next input is the previous one
  plus ``response.output`` as the SDK returned it, plus the calls' outputs. Counted: errors.
- ``template_kwargs``: ``chat_template_kwargs: {"enable_thinking": false}`` and ``true`` on the R1-style template:
  whether the answer has thinking.
- ``structured``: thinking, then a ``json_schema`` answer (strict), and thinking, then a required tool call, on the
  Qwen3-style (Hermes) and Llama 3-style templates: thinking non-empty and the content valid against the schema (the
  call: its tool's name, arguments valid against its parameters).

Run: ``.venv/bin/python bench/agent_loops.py [--no-llama-server]``; llama-server comes from ``bench/llama_server.py``
(found in its cache, or built there unless ``--no-build``: about 10 min on two cores). The last line is one JSON
object: per side (``tether_``, ``llama_server_``) ``chat_loop_errors``, ``chat_loop_turns_thinking``,
``chat_loop_calls_after_thinking``, ``responses_loop_turns`` (turns done before the first error, of 5),
``template_kwargs_off_thinks``,
``template_kwargs_on_thinks``, ``structured_ok`` (of 4) and ``structured`` (each case's outcome), ``errors`` (each
error's text, for the table); ``tether_turn5_prompt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai

import llama_server
from benchstats import describe, emit, print_rows
from serve import Server, ServerFailed, free_port, stop_server, wait_ready
from tether.chaos.target import ServeChild
from tether.models import default_model_path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
QWEN, R1, LLAMA3 = "qwen-style", "r1-style", "llama3-style"
FILES = {QWEN: "think-tools.jinja", R1: "think.jinja", LLAMA3: "think-llama3.jinja"}
TURNS = 5
CHECKS = (0, 3)  # the turns that must call the tool (an agent's first step, and a check before it answers again)
MAX_TOKENS = 96
READY_S = 120.0
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
SYSTEM = "You are a helpful assistant. Use the tools."
FOLLOW_UPS = ("And in Berlin?", "Check Paris again, please.", "Thanks. Say it in one sentence.")


@dataclass
class Side:
    """One server side: the base URL that serves each template's model."""

    name: str
    urls: dict[str, str]
    errors: list[str] = field(default_factory=list)

    def client(self, model: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[model]}/v1", api_key="none", max_retries=0, timeout=300)

    def attempt(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, or None with its error kept (a 400 is the server refusing what the loop sent)."""
        try:
            return call()
        except (openai.APIError, httpx.HTTPError, ValueError, KeyError, jsonschema.ValidationError) as exc:
            self.errors.append(f"{what}: {describe(exc)}"[:300])
            return None


# --------------------------------------------------------------------------------------------------------------
# The servers
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def tether_side() -> Iterator[Side]:
    server = ServeChild(
        "--threads", "2", "--n-ctx", "2048", "--chat-template", str(TEMPLATES / FILES[QWEN]), "--name", QWEN,
        startup=READY_S,
    )  # fmt: skip
    try:
        server.wait_for(rf"{QWEN} ready", READY_S)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for name in (R1, LLAMA3):
                options = {"chat_template": str(TEMPLATES / FILES[name]), "n_ctx": 2048, "parallel": 2}
                http.post("/v1/instances", json={"id": name, "options": options}).raise_for_status()
                deadline = time.monotonic() + READY_S
                while not http.get(f"/v1/instances/{name}").json().get("ready"):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"tether's instance {name} not ready within {READY_S:.0f} s")
                    time.sleep(0.05)  # the server has no push channel for an instance's readiness
        yield Side("tether", dict.fromkeys(FILES, server.url))
    finally:
        server.stop_and_sweep(10)


@contextlib.contextmanager
def llama_server_side(binary: Path, logs: Path) -> Iterator[Side]:
    """One llama-server per template (its template is a start flag), started and stopped as ``bench/serve.py``
    does."""
    servers: list[Server] = []
    try:
        for name, file in FILES.items():
            port = free_port()
            argv = [
                str(binary), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port),
                "-t", "2", "-tb", "2", "-c", "2048", "-np", "1", "--jinja", "--chat-template-file",
                str(TEMPLATES / file), "--reasoning-format", "deepseek",
            ]  # fmt: skip
            log = logs / f"llama-server-{name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            servers.append(Server("llama_server", proc, f"http://127.0.0.1:{port}", log))
            wait_ready(servers[-1], "/health")
        yield Side("llama_server", {name: server.base_url for name, server in zip(FILES, servers, strict=True)})
    finally:
        for server in servers:
            if server.proc.poll() is None:
                stop_server(server)


# --------------------------------------------------------------------------------------------------------------
# The scenarios
# --------------------------------------------------------------------------------------------------------------


def thought(message: Any) -> str:
    return str(getattr(message, "reasoning_content", None) or "")


def chat_loop(side: Side) -> dict[str, Any]:
    client = side.client(QWEN)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]
    follow_ups = list(FOLLOW_UPS)
    errors = thinking = calls_after = 0
    last: list[dict[str, Any]] = []  # what the last turn sent
    for turn in range(TURNS):
        last = [m if isinstance(m, dict) else m.model_dump(exclude_unset=True, mode="json") for m in messages]
        reply = side.attempt(
            f"chat turn {turn + 1}",
            lambda turn=turn: client.chat.completions.create(
                model=QWEN, messages=messages, tools=[WEATHER], tool_choice="required" if turn in CHECKS else "auto",
                temperature=0, max_tokens=MAX_TOKENS,
            ),
        )  # fmt: skip
        if reply is None:
            errors += 1
            messages.append({"role": "user", "content": follow_ups.pop(0) if follow_ups else "Go on."})
            continue
        message = reply.choices[0].message
        thinking += bool(thought(message))
        calls_after += bool(thought(message) and message.tool_calls)
        messages.append(message)
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny, 21 C"}'})
        if not message.tool_calls:
            messages.append({"role": "user", "content": follow_ups.pop(0) if follow_ups else "Go on."})
    return {"errors": errors, "turns_thinking": thinking, "calls_after_thinking": calls_after, "last": last}


def responses_loop(side: Side) -> dict[str, Any]:
    client = side.client(QWEN)
    tool = {"type": "function", **WEATHER["function"]}
    items: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    follow_ups = list(FOLLOW_UPS)
    done = 0
    for turn in range(TURNS):
        response = side.attempt(
            f"responses turn {turn + 1}",
            lambda turn=turn, items=items: client.responses.create(
                model=QWEN, input=items, tools=[tool], tool_choice="required" if turn in CHECKS else "auto",
                temperature=0, max_output_tokens=MAX_TOKENS,
            ),
        )  # fmt: skip
        if response is None:
            break  # the loop cannot go on without the turn's output
        done += 1
        items += response.output
        calls = [item for item in response.output if item.type == "function_call"]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
        if not calls:
            items.append({"role": "user", "content": follow_ups.pop(0) if follow_ups else "Go on."})
    return {"turns": done}


def template_kwargs(side: Side) -> dict[str, bool | None]:
    client = side.client(R1)
    out: dict[str, bool | None] = {}
    for label, enable in (("off", False), ("on", True)):
        reply = side.attempt(
            f"chat_template_kwargs enable_thinking={enable}",
            lambda enable=enable: client.chat.completions.create(
                model=R1, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
                max_tokens=48, extra_body={"chat_template_kwargs": {"enable_thinking": enable}},
            ),
        )  # fmt: skip
        out[label] = None if reply is None else bool(thought(reply.choices[0].message))
    return out


def structured(side: Side) -> dict[str, str]:
    out: dict[str, str] = {}
    question = [{"role": "user", "content": "Name the capital of France and its population."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for model in (QWEN, LLAMA3):
        client = side.client(model)

        def schema(model: str = model, client: openai.OpenAI = client) -> str:
            message = (
                client.chat.completions.create(
                    model=model, messages=question, response_format=fmt, temperature=0, max_tokens=MAX_TOKENS
                )
                .choices[0]
                .message
            )
            jsonschema.validate(json.loads(message.content or ""), CITY)
            return "ok" if thought(message) else "no thinking"

        def tool(model: str = model, client: openai.OpenAI = client) -> str:
            message = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                tool_choice="required", temperature=0, max_tokens=MAX_TOKENS,
            ).choices[0].message  # fmt: skip
            if not message.tool_calls:
                return f"no call: {(message.content or '')[:80]!r}"
            call = message.tool_calls[0].function
            assert call.name == "get_weather", call
            jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])  # type: ignore[arg-type]
            return "ok" if thought(message) else "no thinking"

        for kind, run in (("json_schema", schema), ("tool_call", tool)):
            outcome = side.attempt(f"{kind} on {model}", run)
            out[f"{kind}_{model}"] = "error" if outcome is None else outcome
    return out


def rendered_prompt(messages: list[dict[str, Any]]) -> str:
    """What tether's runner renders for ``messages`` (a loop's turn): the chat planned as the server plans it (Hermes
    tool format) and rendered by the engine's own template code, with the thinking block it opens for a structured
    answer."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from tether.engines.llamacpp.tools import template_messages
    from tether.serve.dialects import openai as dialect
    from tether.serve.dialects import tools as toolkit

    body = {"messages": messages, "tools": [WEATHER], "temperature": 0}
    plan = dialect.chat_plan(dialect.decode("chat", json.dumps(body).encode()), toolkit.HERMES)
    syntax = plan.params.tool_syntax
    assert syntax is not None
    formatter = Jinja2ChatFormatter((TEMPLATES / FILES[QWEN]).read_text(), eos_token="<|im_end|>", bos_token="")
    rendered = formatter(messages=template_messages(plan.params.messages), tools=json.loads(syntax.tools)).prompt
    return rendered + "<think>\n"


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


def run_side(side: Side) -> dict[str, Any]:
    started = time.monotonic()
    loop = chat_loop(side)
    kwargs = template_kwargs(side)
    result: dict[str, Any] = {
        "chat_loop_errors": loop["errors"],
        "chat_loop_turns_thinking": loop["turns_thinking"],
        "chat_loop_calls_after_thinking": loop["calls_after_thinking"],
        "responses_loop_turns": responses_loop(side)["turns"],
        "template_kwargs_off_thinks": kwargs["off"],
        "template_kwargs_on_thinks": kwargs["on"],
    }
    cases = structured(side)
    result["structured"] = cases
    result["structured_ok"] = sum(outcome == "ok" for outcome in cases.values())
    result["errors"] = side.errors
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["_last"] = loop["last"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-llama-server", action="store_true", help="tether alone")
    parser.add_argument("--no-build", action="store_true", help="use a cached llama-server only, never build one")
    args = parser.parse_args()
    out: dict[str, Any] = {"bench": "agent_loops", "turns": TURNS, "max_tokens": MAX_TOKENS}
    with tether_side() as side:
        mine = run_side(side)
    last = mine.pop("_last")
    out.update({f"tether_{k}": v for k, v in mine.items()})
    out["tether_turn5_prompt"] = rendered_prompt(last)
    binary: Path | None = None
    if not args.no_llama_server:
        with tempfile.TemporaryDirectory(prefix="tether-agent-loops-") as logs:
            try:
                binary = llama_server.find()
                if binary is None and not args.no_build:
                    binary = llama_server.build(Path(logs) / "build.log")
                if binary is None:
                    out["llama_server_skipped"] = "no cached llama-server (run bench/llama_server.py --build)"
                else:
                    with llama_server_side(binary, Path(logs)) as side:
                        theirs = run_side(side)
                    theirs.pop("_last")
                    out.update({f"llama_server_{k}": v for k, v in theirs.items()})
            except (llama_server.BuildFailed, ServerFailed) as exc:
                out["llama_server_skipped"] = describe(exc)
    print("tether's rendered prompt of turn 5 (the Qwen3-style template keeps the thinking since the last user turn):")
    print(out["tether_turn5_prompt"])
    keys = ("chat_loop_errors", "chat_loop_turns_thinking", "chat_loop_calls_after_thinking", "responses_loop_turns",
            "template_kwargs_off_thinks", "template_kwargs_on_thinks", "structured_ok")  # fmt: skip
    sides = ["tether", *(["llama_server"] if "llama_server_chat_loop_errors" in out else [])]
    print_rows(["scenario", *sides], [[k, *(str(out.get(f"{s}_{k}")) for s in sides)] for k in keys])
    for side_name in sides:
        for error in out[f"{side_name}_errors"]:
            print(f"{side_name}: {error}")
    emit(out)


if __name__ == "__main__":
    main()
