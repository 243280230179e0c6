"""What a model file says about itself: its size, digest, GGUF metadata (architecture, parameter count,
quantization, chat template, license) and the capabilities its engine gives it, for every model a request can
name, loaded or not (Ollama's ``/api/tags``, ``/api/show`` and ``/api/ps`` describe models with these).

Reading a GGUF header takes ~0.1 s: ``facts`` caches by path, size and mtime, and is called off the event loop.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.engines import chat_templates, reasoning, registry
from tether.engines.gguf import GgufArray, GgufError, read_gguf
from tether.errors import UnknownEngine
from tether.fleet.fleet import Hosted
from tether.fleet.scheduler import Scheduler
from tether.models import DefaultModelMissing, default_model_path
from tether.protocol import EngineSpec

FILE_TYPES = {  # llama.cpp's llama_ftype: general.file_type -> the quantization's name
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}


NO_DETAILS: dict[str, Any] = {
    "parent_model": "",
    "format": "",
    "family": "",
    "families": None,
    "parameter_size": "",
    "quantization_level": "",
}


@dataclass(frozen=True)
class ModelFacts:
    """What a model's listings say of it, as far as its model file tells."""

    path: str | None
    size: int
    modified_at: float
    digest: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    template: str  # the chat template chats are written with: the chat_template option's, else the GGUF's own
    license: str
    template_name: str = ""  # which: "gguf", a built-in's name or a Jinja file's path ("": none at all)


def human_number(n: int) -> str:
    """A parameter count as Ollama writes one: 8.0B, 134.52M, 7B."""
    for scale, unit, places in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == math.floor(value) else f"{value:.{places}f}{unit}"
    return str(n)


@dataclass(frozen=True)
class ListedModel:
    """A model a request can name, loaded or not: its id, its engine spec, when it was created."""

    id: str
    spec: EngineSpec
    created_at: float

    @classmethod
    def of(cls, hosted: Hosted) -> ListedModel:
        return cls(hosted.id, hosted.instance.spec, hosted.created_at)


def model_path(item: ListedModel) -> Path | None:
    spec = item.spec
    if spec.model is not None:
        return Path(spec.model)
    if spec.engine == "llama.cpp":
        try:
            return default_model_path()
        except DefaultModelMissing:
            return None
    return None


@functools.lru_cache(maxsize=64)
def _gguf_facts(path: str, size: int, mtime_ns: int) -> ModelFacts:
    """The facts of one model file (cached by path, size and mtime: a changed file is read again)."""
    digest = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()
    details = {**NO_DETAILS, "format": "gguf"}
    try:
        gguf = read_gguf(path)
    except GgufError:  # not a GGUF (a plugin engine's own format): its size and digest are all there is to say
        return ModelFacts(path, size, mtime_ns / 1e9, digest, NO_DETAILS, {}, "", "")
    meta = gguf.metadata
    arch = gguf.architecture or ""
    parameters = sum(math.prod(t.shape) for t in gguf.tensors)
    file_type = meta.get("general.file_type")
    quantization = FILE_TYPES.get(file_type, "") if isinstance(file_type, int) else ""
    if not quantization:  # the commonest quantized tensor type speaks for the file
        types = [t.type_name for t in gguf.tensors if t.type_name not in ("F32", "F16")]
        quantization = max(set(types), key=types.count) if types else ""
    details.update(
        family=arch,
        families=[arch] if arch else None,
        parameter_size=human_number(parameters),
        quantization_level=quantization,
    )
    info: dict[str, Any] = {"general.parameter_count": parameters}
    for key, value in meta.items():
        if key == "tokenizer.chat_template" or isinstance(value, GgufArray):
            continue  # the template has a field of its own; large arrays (the vocabulary) are not read
        info[key] = list(value) if isinstance(value, tuple) else value
    template = meta.get("tokenizer.chat_template")
    license_ = meta.get("general.license")
    return ModelFacts(
        path,
        size,
        mtime_ns / 1e9,
        digest,
        details,
        info,
        template if isinstance(template, str) else "",
        license_ if isinstance(license_, str) else "",
        chat_templates.GGUF if isinstance(template, str) and template else "",
    )


def facts(item: ListedModel) -> ModelFacts:
    """The facts of ``item``'s model (reads its GGUF header, ~0.1 s, once per file version: call off the loop)."""
    path = model_path(item)
    try:
        stat = path.stat() if path is not None else None
    except OSError:
        stat = None
    if path is None or stat is None:  # an engine without a model file (the debug engine), or a file gone
        digest = hashlib.sha256(f"{item.spec.engine}\0{item.id}\0{item.created_at}".encode())
        details = {**NO_DETAILS, "family": item.spec.engine}
        return ModelFacts(None, 0, item.created_at, digest.hexdigest(), details, {}, "", "")
    found = _gguf_facts(str(path), stat.st_size, stat.st_mtime_ns)
    chosen = item.spec.options.get("chat_template")
    if isinstance(chosen, str):
        try:
            template = chat_templates.resolve(chosen)
        except chat_templates.TemplateError:  # its file gone since: the runner refuses its next load, saying so
            return found
        return dataclasses.replace(found, template=template.text, template_name=template.name)
    return found


def options_of(item: ListedModel) -> dict[str, Any]:
    """The model's engine options in effect: its own over the engine's declared defaults."""
    spec = item.spec
    try:
        defaults = dict(registry.resolve(spec.engine).options)
    except UnknownEngine:  # a plugin that no longer imports: its own options are all there is to say
        defaults = {}
    return {**defaults, **spec.options}


def capabilities(item: ListedModel) -> list[str]:
    if item.spec.engine == "debug":
        return ["completion", "tools", "embedding"]  # it does both: embeddings are hashes of the text
    if options_of(item).get("embedding"):
        return ["embedding"]
    # tools in the model's own tool format where its template has one, else the generic; thinking where it thinks
    thinks = reasoning.detect(facts(item).template) is not None
    return ["completion", "tools", "thinking"] if thinks else ["completion", "tools"]


def listed(scheduler: Scheduler) -> list[ListedModel]:
    """Every model a request can name, loaded or not: the catalog's, then instances added beside it."""
    items = []
    for model_id in scheduler.names():
        slot = scheduler.slots.get(model_id)
        if slot is not None:
            created = slot.hosted.created_at if slot.hosted is not None else scheduler.started_at
            items.append(ListedModel(model_id, slot.model.config.spec(), created))
        else:
            items.append(ListedModel.of(scheduler.fleet.get(model_id)))
    return items
