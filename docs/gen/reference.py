"""Reference pages written from the code at build time: the command line from the argparse parser, the settings from
their model, the HTTP API from the ``/openapi.json`` the server serves, the request fields from the field registry."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import anyio
import httpx
import mkdocs_gen_files

from tether import env
from tether.cli.parser import build_parser, command_helps, subcommands
from tether.cli.settings import ServeSettings, env_name
from tether.fleet.catalog import Catalog
from tether.fleet.fleet import Fleet
from tether.fleet.scheduler import Scheduler
from tether.serve.app import create_app
from tether.serve.dialects import fields


def write_pages() -> None:
    _write("reference/cli.md", cli_page())
    _write("reference/settings.md", settings_page())
    document = served_openapi()
    _write("reference/http.md", http_page(document))
    _write("reference/openapi.json", json.dumps(document, indent=1) + "\n")
    _write("reference/fields.md", fields_page())


def _write(path: str, text: str) -> None:
    with mkdocs_gen_files.open(path, "w") as out:
        out.write(text)


def _cell(text: str) -> str:
    """Text safe inside a table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


# --- the command line ------------------------------------------------------------------------------------------


def cli_page() -> str:
    parser = build_parser()
    lines = [
        "# Command line",
        "",
        "Generated from tether's argparse parser at every docs build: this page is what `tether COMMAND --help` says.",
        "",
        _cell(parser.description or ""),
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    commands = subcommands(parser)
    helps = command_helps(parser)
    lines += [f"| [`tether {name}`](#tether-{name}) | {_cell(helps.get(name, ''))} |" for name in commands]
    lines.append("")
    lines += _options(parser, "tether")
    for name, sub in commands.items():
        lines += [f"## `tether {name}` {{#tether-{name}}}", "", _cell(sub.description or ""), ""]
        lines += ["```text", sub.format_usage().strip(), "```", ""]
        lines += _options(sub, f"tether {name}")
    return "\n".join(lines) + "\n"


def _options(parser: argparse.ArgumentParser, title: str) -> list[str]:
    lines: list[str] = []
    for group in parser._action_groups:
        actions = [
            a for a in group._group_actions if not isinstance(a, argparse._SubParsersAction | argparse._HelpAction)
        ]
        if not actions:
            continue
        heading = {"positional arguments": "arguments", "options": "options"}.get(group.title or "", group.title or "")
        lines += [f"**{heading}**" + (f": {_cell(group.description)}" if group.description else ""), ""]
        lines += ["| option | meaning |", "| --- | --- |"]
        for action in actions:
            lines.append(f"| {_flag(action)} | {_cell(_help(action))} |")
        lines.append("")
    return lines


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    takes = action.nargs != 0
    metavar = action.metavar or (action.dest.upper() if takes else "")
    if isinstance(action.choices, list | tuple) and action.choices:
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    shown = ", ".join(f"`{flag}`" for flag in action.option_strings)
    if takes:
        shown += f" `{'[' + metavar + ']' if action.nargs == '?' else metavar}`"
    return shown


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if text == argparse.SUPPRESS:
        return ""
    if "%(" in text:
        text = text % {**vars(action), "prog": "tether"}
    return text


# --- settings ----------------------------------------------------------------------------------------------------


def settings_page() -> str:
    actions = {a.dest: a for a in subcommands(build_parser())["serve"]._actions if a.option_strings}
    lines = [
        "# Settings",
        "",
        "Generated from `tether serve`'s settings model (`tether.cli.settings.ServeSettings`) and its parser at every "
        "docs build. Every setting is a key of the `--config` file, a `TETHER_*` environment variable and (but for "
        "`models`) a flag; a flag wins over the environment, the environment over the file, the file over the "
        "default. Durations take seconds or `5m`, `1h30m`; sizes bytes or `512M`, `4G`. See "
        "[Configuration](../configuration.md) for the file's layout and an example.",
        "",
        "| key | environment | flag | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, field in ServeSettings.model_fields.items():
        action = actions.get(key)
        flag = f"`{max(action.option_strings, key=len)}`" if action is not None else "-"
        meaning = (_help(action) if action is not None else "") or field.description or ""
        default = field.get_default(call_default_factory=True)
        shown = "-" if default in (None, (), {}) else f"`{default}`"
        lines.append(f"| `{key}` | `{env_name(key)}` | {flag} | {shown} | {_cell(meaning)} |")
    settings_names = {env_name(key) for key in ServeSettings.model_fields}
    lines += [
        "",
        "## Other variables",
        "",
        "Read by every tether process, not by `serve` alone, and so not settings of its file (from `tether.env`).",
        "",
        "| variable | meaning |",
        "| --- | --- |",
    ]
    for name, meaning in _environment_names():
        if name not in settings_names:
            lines.append(f"| `{name}` | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


def _environment_names() -> list[tuple[str, str]]:
    """``tether.env``'s variables and the comment each is declared with (the module is one line per variable)."""
    found = []
    for line in Path(env.__file__).read_text().splitlines():
        match = re.match(r'^[A-Z_]+ = "(TETHER_[A-Z_]+)"\s*#\s*(.*)$', line)
        if match:
            found.append((match.group(1), match.group(2)))
    return found


# --- the HTTP API ------------------------------------------------------------------------------------------------


def served_openapi() -> dict[str, Any]:
    """The document a server serves at ``/openapi.json`` (a server without a key: no ``security``), asked of the
    app itself, in process."""

    async def ask() -> dict[str, Any]:
        app = create_app(Scheduler(Fleet(), Catalog()))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            answer = await client.get("/openapi.json")
            answer.raise_for_status()
            document: dict[str, Any] = answer.json()
            return document

    return anyio.run(ask)


def http_page(document: dict[str, Any]) -> str:
    schemas: dict[str, Any] = document["components"]["schemas"]
    lines = [
        "# HTTP API",
        "",
        "Generated at every docs build from the OpenAPI document the server serves at `GET /openapi.json` "
        "([the same document, as a file](openapi.json)), which is written from the route table the server "
        "registers: a route cannot be served undocumented. Request bodies' fields, and what tether does with each, "
        "are in [Request fields](fields.md). With `--api-key`, every route but `/healthz`, `/readyz` and the "
        "dashboard's page asks `Authorization: Bearer KEY` (401 without it).",
        "",
        "| method | path | what |",
        "| --- | --- | --- |",
    ]
    operations = [(path, method, op) for path, ops in document["paths"].items() for method, op in ops.items()]
    for path, method, op in operations:
        lines.append(f"| {method.upper()} | [`{path}`](#{_anchor(method, path)}) | {_cell(op.get('summary', ''))} |")
    lines.append("")
    used: list[str] = []
    for path, method, op in operations:
        lines += [f"## {method.upper()} `{path}` {{#{_anchor(method, path)}}}", "", _cell(op.get("summary", "")), ""]
        for parameter in op.get("parameters", ()):
            lines.append(f"- {parameter['in']} parameter `{parameter['name']}`")
        body = op.get("requestBody")
        if body:
            schema = body["content"]["application/json"]["schema"]
            lines += [f"Request body (JSON): {_type(schema, used)}", ""]
        lines += ["| status | when | body |", "| --- | --- | --- |"]
        for status, answer in op["responses"].items():
            content = answer.get("content", {})
            shapes = "; ".join(f"{kind}: {_type(c.get('schema', {}), used)}" for kind, c in content.items())
            lines.append(f"| {status} | {_cell(_rst(answer.get('description', '')))} | {_cell(shapes)} |")
        lines.append("")
    lines += ["## Schemas", ""]
    done: set[str] = set()
    while used:
        name = used.pop(0)
        if name in done or name not in schemas:
            continue
        done.add(name)
        lines += _schema(name, schemas[name], used)
    return "\n".join(lines) + "\n"


def _anchor(method: str, path: str) -> str:
    slug = "".join(ch if ch.isalnum() else "-" for ch in path.lower()).strip("-")
    return f"{method.lower()}-{slug or 'root'}"


def _rst(text: str) -> str:
    """Docstring-style double backticks as Markdown code."""
    return text.replace("``", "`")


def _type(schema: dict[str, Any], used: list[str]) -> str:
    """A schema as a short type: a link for a named schema, ``a | b`` for a union, ``array of x``."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        used.append(name)
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " \\| ".join(_type(s, used) for s in schema[key])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        return f"array of {_type(items, used)}" if items else "array"
    if kind == "string" and "contentSchema" in schema:
        return f"events of {_type(schema['contentSchema'], used)}"
    if kind == "object" and "properties" in schema and "data" in schema["properties"]:
        return _type(schema["properties"]["data"], used)
    if isinstance(kind, list):
        return " \\| ".join(kind)
    return str(kind or "any")


def _schema(name: str, schema: dict[str, Any], used: list[str]) -> list[str]:
    lines = [f"### {name} {{#{name.lower()}}}", ""]
    if schema.get("description"):
        lines += [_rst(schema["description"]), ""]
    properties: dict[str, Any] = schema.get("properties", {})
    if not properties:
        lines += [f"Type: {_type({k: v for k, v in schema.items() if k != 'title'}, used)}", ""]
        return lines
    required = set(schema.get("required", ()))
    lines += ["| field | type | required |", "| --- | --- | --- |"]
    for field, sub in properties.items():
        lines.append(f"| `{field}` | {_cell(_type(sub, used))} | {'yes' if field in required else ''} |")
    lines.append("")
    return lines


# --- request fields ------------------------------------------------------------------------------------------------


def fields_page() -> str:
    return "\n".join(
        [
            "# Request fields",
            "",
            "Generated from tether's field registry (`tether.serve.dialects.fields`) at every docs build. Every field "
            "of every request body is honoured (it changes the answer as its API documents), refused (a `400` "
            "naming it, never ignored) or accepted with a stated note; a new field cannot land without a policy "
            "here and a test case (`tests/test_fields.py`). A field marked `round-trip` is one tether's own replies "
            "carry: a client sends it back on its next turn (the openai SDK's message, the Responses API's output "
            "items, Ollama's message), so it is always accepted, and its note says what it means there "
            "(`tests/test_round_trip.py` feeds generated replies of every dialect back).",
            "",
            fields.markdown(),
        ]
    )
