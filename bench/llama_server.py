"""llama.cpp's own C++ ``llama-server``, for the serving benchmark: find it in the bench's cache, or build it there.

The llama.cpp it builds is the one vendored in the llama-cpp-python sdist of the version tether uses
(``LLAMA_CPP_PYTHON``), so the C++ server and ``llama_cpp`` (in tether and in ``llama_cpp.server``) run the same
kernels. Everything lives under the bench's cache directory, ``$XDG_CACHE_HOME/tether-bench`` (default
``~/.cache/tether-bench``):

- ``sdist/llama_cpp_python-VERSION.tar.gz``: ``python -m pip download --no-deps --no-binary :all:
  llama-cpp-python==VERSION`` (into a temporary directory first, then moved: a file there is complete);
- ``src/llama_cpp_python-VERSION/``: the sdist unpacked (also through a temporary directory);
- ``src/llama_cpp_python-VERSION/vendor/llama.cpp/build/bin/llama-server``: built there with ``cmake -B build
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF
  -DCMAKE_BUILD_TYPE=Release`` (on x86 also ``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`` in ``CMAKE_C_FLAGS`` and
  ``CMAKE_CXX_FLAGS``, as the Makefile builds llama-cpp-python) and ``cmake --build build -j2 --target llama-server``
  (about 10 min on two cores; without curl the server cannot download models, and the bench gives it a local GGUF).

``find()`` returns the cached binary when it exists, its build directory was configured with those flags and
``--version`` runs, else None; it never builds. ``build(log)``
does whatever of the three steps is still missing, writing every tool's output to ``log`` (not the terminal), and
raises ``BuildFailed`` saying why (no cmake or compiler, download failed, build failed, with the log's tail). It is
idempotent: a finished step is reused, an interrupted build resumes (cmake rebuilds only what is missing), and a
lock file in the cache serialises builds of two runs at once.

Run: ``.venv/bin/python bench/llama_server.py [--build]`` prints the binary's path (``--build``: build it if
missing), or why there is none.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
# No AMX tiles on x86 (as the Makefile builds llama-cpp-python): ggml's AMX matmul segfaults on this project's VMs.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX = (f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}") if platform.machine() == "x86_64" else ()
CMAKE_CONFIGURE = (
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_CURL=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    *NO_AMX,
)
JOBS = 2
VERSION_TIMEOUT = 30.0
DOWNLOAD_TIMEOUT = 900.0
BUILD_TIMEOUT = 3600.0


class BuildFailed(RuntimeError):
    """llama-server could not be built; the message says why and what to do."""


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tether-bench`` (an absolute ``XDG_CACHE_HOME`` only, as the spec says), else
    ``~/.cache/tether-bench``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "tether-bench"


def sdist_path() -> Path:
    return cache_dir() / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"


def source_dir() -> Path:
    """The vendored llama.cpp of the unpacked sdist."""
    return cache_dir() / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def binary_path() -> Path:
    return source_dir() / "build" / "bin" / "llama-server"


def default_log() -> Path:
    return cache_dir() / "llama-server-build.log"


def version(binary: Path) -> str | None:
    """The first line ``binary --version`` prints, or None when it does not run (missing, broken, a library gone)."""
    try:
        out = subprocess.run(
            [str(binary), "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    lines = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("version")), lines[0] if lines else "unknown version")


def configured_as_asked() -> bool:
    """Whether the cached build directory was configured with this module's C flags (a binary built before the
    flags changed, the AMX one among them, must be rebuilt: cmake reconfigures and rebuilds what they touch)."""
    try:
        cache = (source_dir() / "build" / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return False
    wanted = dict(arg[2:].split("=", 1) for arg in NO_AMX)
    flags = {line.split(":", 1)[0]: line.split("=", 1)[1] for line in cache.splitlines() if line.startswith("CMAKE_C")}
    return all(flags.get(name, "") == value for name, value in wanted.items())


def find() -> Path | None:
    """The cached ``llama-server`` when it exists, was built with this module's flags and ``--version`` runs;
    never builds."""
    binary = binary_path()
    ok = binary.is_file() and configured_as_asked() and version(binary) is not None
    return binary if ok else None


def log_tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run(cmd: list[str], log: Path, what: str, timeout: float, cwd: Path | None = None) -> None:
    """Run one step with its output appended to ``log``; raise ``BuildFailed`` with the log's tail if it fails."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}{f'  (in {cwd})' if cwd else ''}\n".encode())
        out.flush()
        try:
            status = subprocess.run(
                cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            raise BuildFailed(
                f"{what} did not finish within {timeout:.0f} s; run the bench again to resume "
                f"(log: {log}):\n{log_tail(log)}"
            ) from None
        except OSError as exc:
            raise BuildFailed(f"{what} could not start: {exc}") from None
    if status != 0:
        raise BuildFailed(f"{what} failed with status {status} (log: {log}); it ends with:\n{log_tail(log)}")


def _tools() -> None:
    """cmake and a C and C++ compiler must be on PATH."""
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake")
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        missing.append("a C compiler (cc, gcc or clang)")
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if missing:
        raise BuildFailed(
            f"cannot build llama-server: {', '.join(missing)} not found on PATH; install them "
            "(Debian/Ubuntu: apt-get install cmake build-essential) and run again"
        )


def _download(log: Path) -> Path:
    """The sdist, downloaded once: into a temporary directory beside its place, then moved there."""
    target = sdist_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp]
        try:
            _run(cmd, log, f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist", DOWNLOAD_TIMEOUT)
        except BuildFailed as exc:
            raise BuildFailed(f"{exc}\n(is the package index reachable? pip's proxy settings apply)") from None
        got = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not got:
            raise BuildFailed(f"pip download left no llama_cpp_python-*.tar.gz in {tmp} (log: {log})")
        os.replace(got[0], target)
    return target


def _unpack(sdist: Path, log: Path) -> Path:
    """The sdist unpacked once (through a temporary directory, renamed when complete)."""
    src = source_dir()
    if (src / "CMakeLists.txt").is_file():
        return src
    root = src.parent.parent  # src/llama_cpp_python-VERSION
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".unpack-", dir=root.parent) as tmp:
        try:
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError, EOFError) as exc:
            sdist.unlink(missing_ok=True)  # a broken download: fetch it again next time
            raise BuildFailed(f"cannot unpack {sdist} ({exc}); removed it: run again to download it again") from None
        unpacked = Path(tmp) / root.name
        if not (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            raise BuildFailed(f"{sdist} holds no {root.name}/vendor/llama.cpp/CMakeLists.txt")
        if root.exists():  # an older partial tree (e.g. an interrupted rename): replace it
            shutil.rmtree(root)
        os.replace(unpacked, root)
    with log.open("a") as out:
        out.write(f"unpacked {sdist} into {root}\n")
    return src


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One build at a time in this cache (another bench run waits here for the first one's build)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(log: Path | None = None) -> Path:
    """Download, unpack and build whatever is missing; return the binary (see the module docstring)."""
    log = log or default_log()
    log.parent.mkdir(parents=True, exist_ok=True)
    with _locked():
        found = find()
        if found is not None:  # built meanwhile (or before)
            return found
        _tools()
        src = _unpack(_download(log), log)
        _run(["cmake", "-B", "build", *CMAKE_CONFIGURE], log, "cmake configure (llama.cpp)", BUILD_TIMEOUT, src)
        target = ["cmake", "--build", "build", f"-j{JOBS}", "--target", "llama-server"]
        _run(target, log, "building llama-server", BUILD_TIMEOUT, src)
        binary = binary_path()
        if version(binary) is None:
            raise BuildFailed(f"the build finished but {binary} --version does not run (log: {log})")
        return binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build it when it is not in the cache")
    parser.add_argument("--log", type=Path, default=None, help=f"build log (default {default_log()})")
    args = parser.parse_args(argv)
    binary = find()
    if binary is None and args.build:
        log = args.log or default_log()
        print(f"building llama-server (about 10 min on two cores); log: {log}", flush=True)
        try:
            binary = build(log)
        except BuildFailed as exc:
            print(f"FAILURE: {exc}")
            return 1
    if binary is None:
        print(f"llama-server is not built ({binary_path()} missing or does not run); --build builds it")
        return 1
    print(f"{binary} ({version(binary)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
