"""llama.cpp's batch-invariant build: a row's logits depend on its sequence alone, never on what shares its batch.

llama.cpp's CPU backend sums a row in an order set by the shape of the batch it is in, through four kernels
(docs/deterministic.md, "Why an answer depends on its batch"; ``bench/batch_variance.py`` reproduces each): the
tiled K-quant matmul is turned off at run time (``RUNTIME_ENV``), weight repacking by the engine's model parameter,
and llamafile's sgemm and AMX only by a build of their own. That build is llama.cpp from the sdist of the installed
llama-cpp-python (the same source and ABI as its bindings), made by ``tether build deterministic`` into
``<sys.prefix>/share/tether/``. A runner loads it by ``LLAMA_CPP_LIB_PATH``, set before llama-cpp-python is first
imported (``activate``), which is why a deterministic engine needs a process of its own.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from tether.errors import TetherError

PACKAGE = "llama-cpp-python"
MARKER = "tether-invariant.json"  # written last: a directory without it is an unfinished build
LIBRARY = "libllama.so"
BUILD_HINT = "build it once with `tether build deterministic` (~2 min; `make install-dev` does)"
# Compiled out: llamafile's sgemm (the one source only a build removes), AMX, and what tether never loads.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the libraries find each other beside themselves, wherever they are
    "-DGGML_LLAMAFILE=OFF",
    "-DGGML_RPC=ON",  # a multi-rank instance's peers
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # AMX tiles: another GEMM (and they crash on Sapphire Rapids)
RUNTIME_ENV = {"GGML_CPU_TILED_MM": "0"}  # the tiled K-quant matmul off: vec_dot for every row count


class InvariantBuildMissing(TetherError):
    """The batch-invariant build is not there; the message says how to build it."""


class InvariantBuildFailed(TetherError):
    """``tether build deterministic`` could not finish; nothing was installed."""


def bindings_version() -> str | None:
    """The installed llama-cpp-python's version (its metadata: the library is not loaded), None when absent."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_dir(version: str | None = None) -> Path:
    """Where the build for ``version`` (default: the installed bindings') lives, built or not."""
    return Path(sys.prefix) / "share" / "tether" / f"llama-invariant-{version or bindings_version() or 'none'}"


def built(version: str | None = None) -> Path | None:
    """The build's directory when it is complete, else None."""
    where = library_dir(version)
    return where if (where / MARKER).is_file() and (where / LIBRARY).is_file() else None


def missing() -> str | None:
    """Why a deterministic engine cannot load here (None: the build is there): checked when an instance is created,
    so it is refused at once rather than by its runner."""
    if built() is not None:
        return None
    return (
        f"deterministic decoding needs tether's batch-invariant build of llama.cpp {bindings_version()}, which is "
        f"not at {library_dir()}: {BUILD_HINT}"
    )


def activate() -> Path:
    """Make this process load the batch-invariant build when llama-cpp-python is imported; its directory.
    ``InvariantBuildMissing`` when it is not built, or when this process already loaded another llama.cpp."""
    where = built()
    if where is None:
        raise InvariantBuildMissing(missing() or "")
    bindings = sys.modules.get("llama_cpp.llama_cpp")
    if bindings is not None:
        loaded = Path(getattr(bindings, "_base_path", ""))
        if loaded.resolve() != where.resolve():
            raise InvariantBuildMissing(
                f"this process already loaded llama.cpp from {loaded}, not the batch-invariant build at {where}: a "
                "deterministic engine needs a process of its own (tether runs every instance in one; in Python, "
                "create it in a fresh process)"
            )
        return where
    os.environ["LLAMA_CPP_LIB_PATH"] = str(where)
    os.environ.update(RUNTIME_ENV)
    return where


def build(*, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Build the batch-invariant libraries for the installed bindings (nothing when built, unless ``force``)."""
    version = bindings_version()
    if version is None:
        raise InvariantBuildFailed(f"{PACKAGE} is not installed: install tether's llama extra first (`make install`)")
    target = library_dir(version)
    if built(version) is not None and not force:
        log(f"the batch-invariant llama.cpp {version} is built: {target}")
        return target
    cmake, ninja = _tool("cmake"), _tool("ninja")
    if cmake is None:
        raise InvariantBuildFailed("cmake is not installed: `pip install cmake ninja` (or your system's package)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tether-invariant-") as scratch:
        work = Path(scratch)
        log(f"fetching the source of {PACKAGE} {version} (its sdist, from pip's index or cache)")
        sdist = _sdist(version, work / "sdist")
        source = _unpack(sdist, work / "src")
        options = [*CMAKE_OPTIONS, *_flags()]
        if ninja is not None:
            options += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        log(f"configuring llama.cpp without llamafile's sgemm or AMX ({' '.join(options[3:5])})")
        _run([cmake, "-S", str(source), "-B", str(work / "build"), *options], "configuring")
        jobs = str(max(1, len(os.sched_getaffinity(0))))
        log(f"compiling llama and ggml on {jobs} cores (~2 min on 2)")
        _run([cmake, "--build", str(work / "build"), "-j", jobs, "--target", "llama", "ggml"], "compiling")
        staged = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            for library in sorted((work / "build" / "bin").glob("lib*.so*")):
                shutil.copy2(library, staged / library.name, follow_symlinks=False)
            if not (staged / LIBRARY).exists():
                raise InvariantBuildFailed(f"the build produced no {LIBRARY} in {work / 'build' / 'bin'}")
            marker = {"version": version, "cmake": options, "machine": platform.machine()}
            (staged / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
    log(f"built: {target}")
    return target


def _tool(name: str) -> str | None:
    """This environment's own (pip's ``cmake``/``ninja`` packages) first, else the system's."""
    mine = Path(sys.prefix) / "bin" / name
    return str(mine) if mine.is_file() else shutil.which(name)


def _flags() -> list[str]:
    """The C and C++ flags: AMX off on x86-64, beside what ``CMAKE_ARGS`` (llama-cpp-python's build variable) adds."""
    extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
    kept = [a for a in extra if not a.startswith(("-DCMAKE_C_FLAGS=", "-DCMAKE_CXX_FLAGS=", "-DGGML_LLAMAFILE="))]
    kept = [a for a in kept if a.startswith("-DGGML_")]  # backends and CPU choices only; the rest is fixed above
    if platform.machine() in ("x86_64", "AMD64"):
        kept += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return kept


def _sdist(version: str, into: Path) -> Path:
    into.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
    _run([*command, "--dest", str(into), f"{PACKAGE}=={version}"], "fetching the source")
    found = sorted(into.glob("*.tar.gz"))
    if not found:
        raise InvariantBuildFailed(f"pip fetched no sdist of {PACKAGE} {version} into {into}")
    return found[0]


def _unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    roots = sorted(into.glob("*/vendor/llama.cpp"))
    if not roots:
        raise InvariantBuildFailed(f"{sdist.name} holds no vendor/llama.cpp: not the source this build expects")
    return roots[0]


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise InvariantBuildFailed(f"{what} failed (exit {done.returncode}): {shlex.join(command[:4])} ...\n{tail}")
