"""What ``bench/gpu_device.sh`` needs on the GPU machine, which has no network: packed here into ``.device-carry/``.

The device machine (see ``bench/gpu_device.sh``) has Python 3.12 with torch, numpy, nvidia-ml-py, anyio, httpx and
more, CUDA's compiler, CMake and ninja, but no package index and no model: everything else travels with the working
tree, within the device tool's 64 MiB (working tree and carried paths together). ``pack`` (the default command)
writes, each part sized and printed, the whole checked against ``BUDGET``:

- ``llama.cpp/``: the llama.cpp vendored in the llama-cpp-python ``LLAMA_CPP_PYTHON`` sdist (the bindings' own
  source, so the same ABI), stripped by ``kept`` to what CMake needs to build ``libllama`` and ``libggml`` with the
  CPU and CUDA backends (tests, examples, tools, common, server, docs, models, media and every other ggml backend
  removed), plus ``gguf-py/gguf`` (llama.cpp's pure-Python GGUF writer, for ``synth``). The sdist is cached as
  ``bench/llama_server.py`` caches it (``~/.cache/tether-bench/sdist``).
- ``llama_cpp/``: llama-cpp-python's pure-Python package from the same sdist. It loads ``libllama.so`` from
  ``$LLAMA_CPP_LIB_PATH`` when set (``llama_cpp/llama_cpp.py``), else from ``llama_cpp/lib``; ``libggml`` and its
  backends are found beside it (the build's ``$ORIGIN`` rpath). The device script sets the variable and also links
  ``llama_cpp/lib`` to the build (``llama_cpp/_ggml.py`` looks only there).
- ``wheels/``: CPython 3.12 manylinux x86-64 (or pure) wheels of every runtime dependency of tether and of
  llama-cpp-python, transitive ones included, but numpy (``DEVICE_HAS``: the image's, which its torch needs), each
  at the version installed in the environment running this script (the ``.venv`` the tests use), so the device runs
  the versions tested here whatever its image holds. tether itself does not travel as
  a wheel: the working tree does, and the device script puts its ``src`` on ``PYTHONPATH``.
- ``model-skeleton.json.gz``: the default model's GGUF without its weights (every metadata key with its GGUF type,
  the tokenizer and chat template included, and every tensor's name, shape and type), read here from the pulled
  model (``tether pull``), which at ~92 MiB is too big to carry.

``synth`` (run on the device) writes a GGUF from the skeleton with llama.cpp's ``gguf-py`` and numpy: the default
model's exact architecture, tokenizer and tensor table, with *random* weights (seeded small normals, std 0.02:
never all zeros, which would make greedy decoding pick an end-of-generation token at once). Matrices are ``Q8_0``
(quantised by gguf-py in numpy; ``--type F16`` for F16), 1-D tensors (the norms) are F32 ones. Random weights give
the real model's speed and memory (same shapes and types as a Q8_0 SmolLM2), not its text.

Run: ``.venv/bin/python bench/gpu_bundle.py [pack]`` here; ``python3 bench/gpu_bundle.py synth --skeleton
.device-carry/model-skeleton.json.gz --out /tmp/synth.gguf`` there. Only the standard library is imported at the
top: ``synth`` runs under the device's Python, ``pack`` under the project's.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server import LLAMA_CPP_PYTHON, BuildFailed, _download, cache_dir, sdist_path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".device-carry"
MIB = 1 << 20
BUDGET = 55 * MIB  # the carried folder; the working tree's own few MiB and this stay under the tool's 64 MiB
TREE_LIMIT = 64 * MIB  # the device tool's limit on what travels in one call (working tree + carried paths)
SKELETON = "model-skeleton.json.gz"
VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
BINDINGS = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/llama_cpp/"

# --------------------------------------------------------------------------------------------------------------
# What of llama.cpp's tree is kept (paths relative to vendor/llama.cpp)
# --------------------------------------------------------------------------------------------------------------

# Configured with LLAMA_BUILD_COMMON/TESTS/EXAMPLES/TOOLS/SERVER/APP OFF, only these are read: the top CMakeLists and
# its cmake/ modules, libllama (include/, src/), ggml with its CPU and CUDA backends, and vendor/'s CMakeLists (it
# adds each vendored library; the header-only ones need their CMakeLists alone, hash/ is a static library).
KEEP_FILES = frozenset({"CMakeLists.txt", "LICENSE", "ggml/CMakeLists.txt", "vendor/CMakeLists.txt", "gguf-py/LICENSE"})
KEEP_TREES = (
    "cmake/",
    "include/",
    "src/",
    "licenses/",
    "ggml/cmake/",
    "ggml/include/",
    "ggml/src/ggml-cpu/",
    "ggml/src/ggml-cuda/",
    "vendor/hash/",
    "gguf-py/gguf/",  # the GGUF writer ``synth`` uses
)
DROP_PARTS = frozenset({"__pycache__", ".github", "tests", "examples"})  # within kept trees too
DROP_VENDOR = frozenset({"cpp-httplib"})  # added by vendor/CMakeLists only for common/

# What is left to the device image's own copy: numpy alone, which its torch was built against. Every other runtime
# dependency travels at the version tested here, though the image has most of them (KINDS.md, "Python packages
# already there", read 2026-11-17: anyio, httpx, psutil, nvidia-ml-py, jinja2, ...): their versions there are not
# known, and a copy on PYTHONPATH shadowing one (pure Python, or a cp312 wheel) breaks nothing else in the image.
DEVICE_HAS = frozenset({"numpy"})
# The device's interpreter, for dependency markers (``python3`` there is CPython 3.12.3 on x86-64 Linux).
DEVICE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17, 12, 5)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)


def kept(rel: str) -> bool:
    """Whether ``rel`` (a file's path in vendor/llama.cpp, '/'-separated) is needed on the device."""
    path = PurePosixPath(rel)
    parts = path.parts
    if not parts or DROP_PARTS.intersection(parts[:-1]):
        return False
    if rel in KEEP_FILES or rel.startswith(KEEP_TREES):
        return True
    if len(parts) == 3 and parts[:2] == ("ggml", "src"):  # ggml's core sources (files, not backend folders)
        return True
    if len(parts) >= 2 and parts[0] == "vendor" and parts[1] in DROP_VENDOR:
        return False
    return len(parts) == 3 and parts[0] == "vendor" and parts[2] == "CMakeLists.txt"


def strip(tree: Path) -> list[str]:
    """Remove from the llama.cpp ``tree`` every file ``kept`` refuses, then the folders left empty; the removed
    files' relative paths, sorted."""
    removed: list[str] = []
    for dirpath, _dirs, files in os.walk(tree):
        for name in files:
            path = Path(dirpath) / name
            rel = path.relative_to(tree).as_posix()
            if not kept(rel):
                path.unlink()
                removed.append(rel)
    for dirpath, _dirs, _files in sorted(os.walk(tree, topdown=False), key=lambda w: -len(w[0])):
        if Path(dirpath) != tree and not any(Path(dirpath).iterdir()):
            Path(dirpath).rmdir()
    return sorted(removed)


def carry_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed): what the device tool counts."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            file = Path(dirpath) / name
            if file.is_file() and not file.is_symlink():
                total += file.stat().st_size
    return total


def over_budget(sizes: dict[str, int], tree: int, budget: int = BUDGET, limit: int = TREE_LIMIT) -> list[str]:
    """What is too big: the carried parts (``sizes``, bytes by part) over ``budget``, or with the working tree's
    ``tree`` bytes over the device tool's ``limit``; empty when it all fits."""
    carried = sum(sizes.values())
    problems = []
    if carried > budget:
        biggest = ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]))
        problems.append(f"the carry is {carried / MIB:.1f} MiB, over its {budget / MIB:.0f} MiB budget ({biggest})")
    if carried + tree > limit:
        problems.append(
            f"the carry ({carried / MIB:.1f} MiB) and the working tree ({tree / MIB:.1f} MiB) make "
            f"{(carried + tree) / MIB:.1f} MiB, over the device tool's {limit / MIB:.0f} MiB"
        )
    return problems


# --------------------------------------------------------------------------------------------------------------
# pack (here)
# --------------------------------------------------------------------------------------------------------------


def _unpack(sdist: Path, out: Path) -> None:
    """The kept part of the vendored llama.cpp into ``out/llama.cpp``, the bindings into ``out/llama_cpp``."""
    with tarfile.open(sdist) as archive:
        for member in archive:
            if member.name.startswith(VENDOR) and kept(member.name[len(VENDOR) :]):
                target = out / "llama.cpp" / member.name[len(VENDOR) :]
            elif member.name.startswith(BINDINGS) and "__pycache__" not in member.name:
                target = out / "llama_cpp" / member.name[len(BINDINGS) :]
            else:
                continue
            if not member.isfile() or ".." in PurePosixPath(member.name).parts:
                continue
            source = archive.extractfile(member)
            assert source is not None
            target.parent.mkdir(parents=True, exist_ok=True)
            with source, target.open("wb") as dest:
                shutil.copyfileobj(source, dest)
            os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
    strip(out / "llama.cpp")  # a guard: nothing unkept came through


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(roots: Iterable[str]) -> dict[str, str]:
    """Every distribution ``roots`` (requirement strings) need at run time on the device, transitive ones included,
    with the version installed here: canonical name -> version. Requirements with extras or markers false on the
    device's Python (``DEVICE_MARKERS``) are left out."""
    from packaging.requirements import Requirement  # this environment's (pip's own needs it)

    wanted: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(DEVICE_MARKERS):
            continue
        name = _canonical(req.name)
        if name in wanted:
            continue
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing = f"{req.name} is needed on the device but not installed here: run `make install-dev`"
            raise SystemExit(missing) from None
        wanted[name] = dist.version
        todo += [Requirement(r) for r in dist.requires or ()]
    return wanted


def tether_requirements() -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps: list[str] = project["dependencies"]
    return deps


def _wheel_for(cache: Path, name: str, version: str) -> Path | None:
    for wheel in sorted(cache.glob("*.whl")):
        dist, got = wheel.name.split("-")[:2]
        if _canonical(dist) == name and got == version:
            return wheel
    return None


def _wheels(needed: dict[str, str], out: Path) -> list[str]:
    """Each ``name==version`` as a py3.12 manylinux x86-64 (or pure) wheel, from the cache or pip; their names."""
    cache = cache_dir() / "wheels-cp312"
    cache.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for name, version in sorted(needed.items()):
        wheel = _wheel_for(cache, name, version)
        if wheel is None:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
            command += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3"]
            command += ["--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p))]
            command += ["-d", str(cache), f"{name}=={version}"]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"pip found no cp312 manylinux wheel of {name}=={version}:\n{done.stderr[-2000:]}")
            wheel = _wheel_for(cache, name, version)
            if wheel is None:
                raise SystemExit(f"pip downloaded no wheel of {name}=={version} into {cache}")
        shutil.copy2(wheel, out / wheel.name)
        names.append(wheel.name)
    return names


def skeleton(model: Path) -> dict[str, Any]:
    """``model``'s GGUF without its weights: every metadata key (GGUF's own header fields and the architecture,
    which the writer adds, excepted) as ``[key, [type, subtype...], value]``, every tensor as ``[name, shape,
    type]`` (shape in GGUF's order, innermost first). Needs ``gguf`` importable (``pack`` puts the carried one
    first)."""
    import gguf

    reader = gguf.GGUFReader(model)
    kv = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kv.append([key, [t.name for t in field.types], field.contents()])
    arch = reader.fields["general.architecture"].contents()
    tensors = [[t.name, [int(n) for n in t.shape], t.tensor_type.name] for t in reader.tensors]
    return {"source": model.name, "sha256": _sha256(model), "architecture": arch, "kv": kv, "tensors": tensors}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def pack(out: Path, model: Path) -> dict[str, Any]:
    """Write the carry folder ``out`` afresh (see the module docstring); its manifest, sizes included."""
    began = time.monotonic()
    sdist = sdist_path()
    if not sdist.is_file():
        print(f"fetching the llama-cpp-python {LLAMA_CPP_PYTHON} sdist into {sdist.parent}", flush=True)
        try:
            _download(cache_dir() / "gpu-bundle-download.log")
        except BuildFailed as exc:
            raise SystemExit(str(exc)) from None
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    _unpack(sdist, out)

    roots = [*tether_requirements(), *(importlib.metadata.requires("llama_cpp_python") or ())]
    closure = runtime_closure(roots)
    carried = {name: version for name, version in closure.items() if name not in DEVICE_HAS}
    wheels = _wheels(carried, out / "wheels")

    sys.path.insert(0, str(out / "llama.cpp" / "gguf-py"))  # the carried writer's reader, not this venv's gguf
    with gzip.open(out / SKELETON, "wt", encoding="utf-8") as f:
        json.dump(skeleton(model), f, ensure_ascii=False)

    sizes = {part: carry_size(out / part) for part in ("llama.cpp", "llama_cpp", "wheels", SKELETON)}
    manifest = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "sdist": sdist.name,
        "sdist_sha256": _sha256(sdist),
        "model": model.name,
        "wheels": wheels,
        "device_has": sorted(n for n in closure if n in DEVICE_HAS),
        "sizes": sizes,
        "seconds": round(time.monotonic() - began, 1),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def working_tree_files(root: Path = ROOT) -> list[str]:
    """The files of the checkout a fresh clone of it would have, relative to ``root``: tracked ones and untracked ones
    git does not ignore (what the device tool sends besides carried paths)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return [name for name in map(os.fsdecode, listed) if name and (root / name).is_file()]


def working_tree_size() -> int:
    """Bytes of what the device tool sends besides carried paths."""
    return sum(carry_size(ROOT / name) for name in working_tree_files())


# --------------------------------------------------------------------------------------------------------------
# synth (on the device)
# --------------------------------------------------------------------------------------------------------------


def synthesize(spec: dict[str, Any], out: Path, qtype: str = "Q8_0", seed: int = 0, std: float = 0.02) -> int:
    """Write a GGUF with ``spec``'s metadata and tensor table (a ``skeleton``) and random weights: 2-D and larger
    tensors seeded normals of ``std`` stored as ``qtype`` (Q8_0 or F16), 1-D ones (norms) F32 ones. Its bytes."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[qtype]
    values = gguf.GGUFValueType
    writer = gguf.GGUFWriter(str(out), spec["architecture"])
    for key, types, value in spec["kv"]:
        if key == "general.file_type":
            value = int(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
        elif key == "general.name":
            value = f"{value} (random weights: tether's GPU bench)"
        sub = values[types[-1]] if types[0] == "ARRAY" else None
        writer.add_key_value(key, value, values[types[0]], sub_type=sub)
    rng = np.random.default_rng(seed)
    for name, shape, _type in spec["tensors"]:
        numpy_shape = tuple(reversed(shape))  # GGUF lists the innermost dimension first
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(numpy_shape, dtype=np.float32))
        else:
            weights = rng.standard_normal(numpy_shape, dtype=np.float32) * np.float32(std)
            writer.add_tensor(name, gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out.stat().st_size


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv.insert(0, "pack")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="write .device-carry/ (here)")
    packing.add_argument("--out", type=Path, default=CARRY, help=f"the carry folder (default {CARRY})")
    packing.add_argument("--model", type=Path, default=None, help="the GGUF to copy (default: tether's default)")
    synth = commands.add_parser("synth", help="write the random-weights GGUF (on the device)")
    synth.add_argument("--skeleton", type=Path, default=CARRY / SKELETON)
    synth.add_argument("--out", type=Path, required=True)
    synth.add_argument("--type", choices=("Q8_0", "F16"), default="Q8_0", help="the matrices' type (default Q8_0)")
    synth.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.command == "synth":
        sys.path.insert(0, str(args.skeleton.parent / "llama.cpp" / "gguf-py"))
        began = time.monotonic()
        with gzip.open(args.skeleton, "rt", encoding="utf-8") as f:
            spec = json.load(f)
        size = synthesize(spec, args.out, args.type, args.seed)
        print(
            f"synthesized {args.out}: {spec['source']}'s {len(spec['tensors'])} tensors and {len(spec['kv'])} keys, "
            f"random {args.type} matrices, {size / MIB:.1f} MiB in {time.monotonic() - began:.1f} s",
            flush=True,
        )
        return 0

    if args.model is None:
        from tether.models import DefaultModelMissing, default_model_path

        try:
            args.model = default_model_path()
        except DefaultModelMissing as exc:
            raise SystemExit(str(exc)) from None
    manifest = pack(args.out, args.model)
    sizes, tree = manifest["sizes"], working_tree_size()
    for part, size in sizes.items():
        print(f"{part:<24} {size / MIB:8.2f} MiB")
    print(f"{'carry, total':<24} {sum(sizes.values()) / MIB:8.2f} MiB (budget {BUDGET / MIB:.0f} MiB)")
    print(f"{'working tree':<24} {tree / MIB:8.2f} MiB (with the carry: {(tree + sum(sizes.values())) / MIB:.2f} MiB)")
    print(f"wheels: {', '.join(manifest['wheels'])}")
    print(f"left to the device's own: {', '.join(manifest['device_has'])}")
    problems = over_budget(sizes, tree)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print(json.dumps({"carry_bytes": sum(sizes.values()), "tree_bytes": tree, "ok": not problems, **manifest}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
