"""The ``tether`` command: a parser (``parser``) and one module per command (``run``, ``serve``, ``status``,
``orphans``, ``chaos``).

Runs in the worker process; the top of the import graph (nothing imports ``tether.cli``, and it may import every
other package). A command imports what
only it needs when it runs: ``tether orphans`` never imports the HTTP stack.
"""

from tether.cli.main import main

__all__ = ["main"]
