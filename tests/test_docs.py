"""The docs site: ``mkdocs build --strict`` passes (a broken link, a missing anchor or a page left out of the nav
fails it); the reference pages are the code's (a flag deleted from the parser is gone from its page with no edit,
every setting, served route and registered field is on its page); the built site renders in a real browser, its
benchmarks page with its plots loaded."""

from __future__ import annotations

import argparse
import http.server
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from conftest import http_site
from tether.cli import parser as cli_parser
from tether.cli.settings import KEYS, env_name
from tether.serve.dialects import fields

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "gen"))
import reference  # noqa: E402

if TYPE_CHECKING:
    from playwright.sync_api import Browser


def build_site(into: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(into)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    into = tmp_path_factory.mktemp("site")
    out = build_site(into)
    assert out.returncode == 0, out.stderr[-4000:]
    return into


@pytest.mark.timeout(150)
def test_the_site_builds_strict_with_every_page_in_the_nav(site: Path) -> None:
    for page in ("index.html", "getting-started/index.html", "configuration/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    for page in ("reference/cli", "reference/settings", "reference/http", "reference/fields"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "reference" / "openapi.json").is_file()


@pytest.mark.serial  # it edits docs/serving.md for its build: a site built beside it would see the broken link
@pytest.mark.timeout(150)
def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    page = ROOT / "docs" / "serving.md"
    text = page.read_text()
    try:
        page.write_text(text + "\nSee [nowhere](no-such-page.md).\n")
        out = build_site(tmp_path / "site")
    finally:
        page.write_text(text)
    assert out.returncode != 0 and "no-such-page.md" in out.stderr, out.stderr[-2000:]


def test_a_flag_deleted_from_the_parser_is_gone_from_its_page(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "`--max-queue` `MAX_QUEUE`" in reference.cli_page()

    def without_max_queue() -> argparse.ArgumentParser:
        parser = cli_parser.build_parser()
        serve = cli_parser.subcommands(parser)["serve"]
        action = next(a for a in serve._actions if "--max-queue" in a.option_strings)
        serve._handle_conflict_resolve(None, [("--max-queue", action)])  # argparse's own way to drop a flag
        return parser

    monkeypatch.setattr(reference, "build_parser", without_max_queue)
    page = reference.cli_page()
    assert "`--max-queue`" not in page and "[--max-queue" not in page
    settings_page = reference.settings_page()
    assert "| `max_queue` | `TETHER_MAX_QUEUE` | - |" in settings_page  # still a setting, no longer a flag


def test_every_setting_route_and_field_is_on_its_generated_page() -> None:
    settings_page = reference.settings_page()
    for key in KEYS:
        assert f"| `{key}` | `{env_name(key)}` |" in settings_page, key
    assert "| `TETHER_RUNTIME_DIR` |" in settings_page and "| `TETHER_DATA_DIR` |" in settings_page
    document = reference.served_openapi()
    http_page = reference.http_page(document)
    for path, operations in document["paths"].items():
        for method in operations:
            assert f"## {method.upper()} `{path}`" in http_page, (method, path)
    assert fields.markdown() in reference.fields_page()
    commands = reference.cli_page()
    for name in cli_parser.subcommands(cli_parser.build_parser()):
        assert f"## `tether {name}`" in commands, name


@pytest.fixture(scope="module")
def served_site(site: Path) -> Iterator[str]:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(site), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    with http_site(Handler) as url:
        yield url


@pytest.mark.timeout(120)
def test_the_home_and_benchmarks_pages_render_with_their_plots(browser: Browser, served_site: str) -> None:
    shots = os.environ.get("TETHER_DOCS_SCREENSHOTS")  # a directory: keep the pages' pictures there
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{served_site}/", wait_until="load")
        assert page.title().startswith("tether"), page.title()
        assert page.locator("article h1").first.inner_text().rstrip("¶") == "tether"
        assert page.locator("nav").get_by_text("Benchmarks").count() >= 1
        if shots:
            page.screenshot(path=str(Path(shots) / "docs-home.png"))
        page.goto(f"{served_site}/benchmarks/", wait_until="load")
        plots = page.locator("article img")
        assert plots.count() >= 3, plots.count()
        widths = page.eval_on_selector_all("article img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
        assert all(width > 0 for width in widths), widths  # every plot loaded
        if shots:
            page.screenshot(path=str(Path(shots) / "docs-benchmarks.png"), full_page=False)
            plots.first.scroll_into_view_if_needed()
            page.screenshot(path=str(Path(shots) / "docs-benchmarks-plot.png"))
    finally:
        page.close()
