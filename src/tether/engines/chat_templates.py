"""Chat templates a user can set: a built-in one by name, or a Jinja file, for a GGUF whose own template is missing
(a base model's) or wrong.

The ``chat_template`` option (instance option, catalog field, ``--chat-template``) names one; unset, the GGUF's own
``tokenizer.chat_template`` is used. Built-in templates are written in the Jinja dialect of Hugging Face chat templates
(``messages``, ``add_generation_prompt``, ``bos_token``), rendered by the same formatter as a GGUF's own, and each
names the markers that end a turn in its format (``stop``): a model that was not trained on the format writes them as
plain text, where its end-of-sequence token would not stop it. The names follow llama.cpp's (``--chat-template``).

Both sides read this module: the serving side to detect the template's tool-call and reasoning format before a request
reaches a runner, the runner to render it.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.errors import TetherError

MAX_FILE_BYTES = 1 << 20  # a chat template is a few KB; the largest known (gpt-oss) ~16 KB
GGUF = "gguf"  # what an instance shows when it renders with its GGUF's own template

_SYSTEM_FIRST = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
)

# role markers per format; a system message is its own turn where the format has one, else folded into the first
# user turn (gemma, llama2, mistral-v7 keep it apart in their own way below)
_CHATML = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
_LLAMA3 = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)
_GEMMA = (
    "{{ bos_token }}" + _SYSTEM_FIRST + "{%- for m in turns -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else 'user' -%}"
    "{%- set text = (system + '\\n\\n' + m['content']) if (loop.first and system) else m['content'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + text | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
_LLAMA2 = (
    _SYSTEM_FIRST + "{%- for m in turns -%}"
    "{%- if m['role'] == 'assistant' -%}{{ ' ' + m['content'] | trim + ' ' + eos_token }}"
    "{%- else -%}"
    "{%- set text = ('<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + m['content']) if (loop.first and system) "
    "else m['content'] -%}"
    "{{ bos_token + '[INST] ' + text | trim + ' [/INST]' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
_MISTRAL_V7 = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ '[SYSTEM_PROMPT]' + m['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] + eos_token }}"
    "{%- else -%}{{ '[INST]' + m['content'] + '[/INST]' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
_PHI3 = (
    "{%- for m in messages -%}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
_ZEPHYR = (
    "{%- for m in messages -%}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class ChatTemplate:
    """A template to render chats with: its ``name`` (a built-in's, or the file it was read from), its Jinja
    ``text``, and the strings that end an answer in its format besides the model's end-of-sequence token."""

    name: str
    text: str
    stop: tuple[str, ...] = ()


BUILTIN: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate("chatml", _CHATML, ("<|im_end|>", "<|im_start|>")),
        ChatTemplate("llama2", _LLAMA2, ("[INST]",)),
        ChatTemplate("llama3", _LLAMA3, ("<|eot_id|>", "<|start_header_id|>")),
        ChatTemplate("gemma", _GEMMA, ("<end_of_turn>", "<start_of_turn>")),
        ChatTemplate("mistral-v7", _MISTRAL_V7, ("[INST]",)),
        ChatTemplate("phi3", _PHI3, ("<|end|>", "<|user|>")),
        ChatTemplate("zephyr", _ZEPHYR, ("<|user|>",)),
    )
}
HOW_TO_SET = (
    'set one: the instance option chat_template (POST /v1/instances {..., "options": {"chat_template": '
    '"chatml"}}), the catalog field chat_template, or `tether serve --chat-template NAME|FILE.jinja`; built in: '
    + ", ".join(BUILTIN)
)


class TemplateError(TetherError, ValueError):
    """A ``chat_template`` that names no built-in template and no readable Jinja file; the message says which exist."""


def resolve(value: str, base: Path | None = None) -> ChatTemplate:
    """The template ``value`` names: a built-in one, else a Jinja file (relative to ``base`` when given)."""
    if not isinstance(value, str) or not value.strip():
        raise TemplateError(f"chat_template must be a built-in template's name or a Jinja file, got {value!r}")
    if value in BUILTIN:
        return BUILTIN[value]
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    if not path.is_file():
        close = difflib.get_close_matches(value.lower().replace("_", "-"), list(BUILTIN), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TemplateError(
            f"chat_template {value!r} is neither a built-in template{hint} nor a file ({path} does not exist): "
            f"built in are {', '.join(BUILTIN)}; or give the path of a Jinja chat template file"
        )
    stat = path.stat()
    return _from_file(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _from_file(path: str, size: int, _mtime_ns: int) -> ChatTemplate:
    """A template file read and parsed once per version (size and mtime): the serving side asks on every request
    that needs its tool or reasoning format, and on every instance listing."""
    if size > MAX_FILE_BYTES:
        raise TemplateError(f"chat_template file {path} is {size} bytes; a chat template is at most {MAX_FILE_BYTES}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"chat_template file {path} cannot be read as UTF-8 text: {exc}") from exc
    checked(text, path)
    return ChatTemplate(path, text)


def checked(text: str, name: str) -> str:
    """``text`` once Jinja has parsed it (where Jinja is installed: it comes with llama-cpp-python), so a broken file
    is refused when the instance is created, not at its first chat."""
    environment = _environment()
    if environment is None:
        return text
    import jinja2

    try:
        environment.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat_template {name} is not a valid Jinja template: line {exc.lineno}: {exc}") from exc
    return text


@functools.lru_cache(maxsize=32)
def variables(text: str) -> frozenset[str] | None:
    """The variables a template reads from what it is given (``messages``, ``tools``, ``enable_thinking``, ...):
    what a request's ``chat_template_kwargs`` can set. None where Jinja is missing or the text does not parse."""
    environment = _environment()
    if environment is None:
        return None
    import jinja2
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(text)))
    except jinja2.TemplateSyntaxError:
        return None


@functools.cache
def _environment() -> Any:
    """A Jinja environment that parses what the renderer renders: loop controls, and Hugging Face's
    ``{% generation %}`` block (None without Jinja)."""
    try:
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        return None

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[Generation, jinja2.ext.loopcontrols])
