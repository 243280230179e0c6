"""Build-time pages (mkdocs-gen-files runs this on every `mkdocs build`): reference pages from the code, the
benchmarks page and its plots from bench/results. Nothing written here is a file in docs/: a flag deleted from the
parser is gone from its page on the next build, with no edit."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import figures  # noqa: E402
import reference  # noqa: E402

reference.write_pages()
figures.write_pages()
