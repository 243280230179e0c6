"""Everything that runs inside a runner process: bootstrap and task loop (``main``), orphan protection
(``lifeline``), the debug engine's fault switches (``faults``); the engines it hosts are in ``tether.engines``.

A runner starts as ``python -m tether.runner`` and imports as little as it can before its orphan protection is
armed. Nothing here imports worker-side code (``tether.node``, ``tether.serve``, ``tether.cli``): only the wire
(``tether.protocol``, ``tether.channel``), ``tether.errors``, ``tether.units``, ``tether.models``, ``tether.kernel``
and ``tether.engines``. ``tests/test_layout.py`` fails when that rule is broken.
"""
