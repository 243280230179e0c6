"""The layout keeps the process model: runner-side code never imports worker-side code, and the wire imports only
the wire. Checked on the source (every import, inside functions too) and on a real runner's ``sys.modules``. And
it stays readable: no import cycle (type-only imports count), no class name used for two things, no module
imported under another package's name."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import tether

SRC = Path(tether.__file__).parent

# Which side each package runs on, and which sides it may import. The package ``tether`` itself imports lazily.
SHARED = ("tether.protocol", "tether.channel", "tether.errors", "tether.units", "tether.models", "tether.env")
SIDES: dict[str, tuple[str, ...]] = {
    "shared": (*SHARED, "tether.kernel"),
    "runner": ("tether.runner", "tether.engines"),
    "node": ("tether.node",),
    "fleet": ("tether.fleet",),  # the node's serving logic (instances, models, scheduling), without HTTP
    "serve": ("tether.serve",),
    "cluster": ("tether.cluster",),  # beside the fleet: the fleet knows it only through a protocol
    "cli": ("tether.cli",),
    "chaos": ("tether.chaos",),  # attacks servers from outside: it may not use the code it tests
}
MAY_IMPORT = {
    "shared": {"shared"},
    "runner": {"shared", "runner"},
    "node": {"shared", "runner", "node"},
    "fleet": {"shared", "runner", "node", "fleet"},
    "serve": {"shared", "runner", "node", "fleet", "serve"},
    "cluster": {"shared", "runner", "node", "cluster"},
    "cli": {"shared", "runner", "node", "fleet", "serve", "cluster", "cli", "chaos"},
    "chaos": {"shared", "chaos"},
}


def side_of(module: str) -> str | None:
    for side, prefixes in SIDES.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return side
    return None


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Every tether module imported anywhere in ``tree`` (inside functions too), but not under TYPE_CHECKING."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("tether"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tether"):
            if node.module == "tether":  # from tether import x: the submodule x, or a lazy re-export
                found.extend((node.lineno, f"tether.{a.name}") for a in node.names)
            else:
                found.append((node.lineno, node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def layout_violations(root: Path) -> list[str]:
    """Each import in the package at ``root`` that crosses a side it may not (as ``file:line: a -> b``)."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        side = side_of(module)
        if side is None:
            continue
        for line, imported in _imports(ast.parse(path.read_text())):
            target = side_of(imported)
            if target is not None and target not in MAY_IMPORT[side]:
                problems.append(f"{path.relative_to(root.parent)}:{line}: {module} ({side}) imports {imported}")
    return problems


@pytest.mark.timeout(30)
def test_no_module_imports_across_a_side_it_may_not() -> None:
    assert layout_violations(SRC) == []


@pytest.mark.timeout(30)
def test_the_check_catches_runner_code_that_imports_worker_code(tmp_path: Path) -> None:
    """The check itself can fail: a runner-side module importing the supervisor (even inside a function) is caught."""
    package = tmp_path / "tether"
    (package / "runner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "runner" / "__init__.py").write_text("")
    (package / "runner" / "sneaky.py").write_text(
        "def f():\n    from tether.node.supervisor import Supervisor\n    return Supervisor\n"
    )
    (package / "protocol.py").write_text("from tether.engines import base\n")
    assert layout_violations(package) == [
        "tether/protocol.py:1: tether.protocol (shared) imports tether.engines",
        "tether/runner/sneaky.py:2: tether.runner.sneaky (runner) imports tether.node.supervisor",
    ]


@pytest.mark.timeout(30)
def test_a_runner_imports_nothing_of_the_worker_side() -> None:
    """What a real runner process has imported once it serves (both built-in engines' modules loaded)."""
    code = (
        "import sys, tether.runner.main, tether.engines.debug, tether.engines.llamacpp.engine\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('tether'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True)
    modules = out.stdout.split()
    assert "tether.runner.main" in modules
    assert [m for m in modules if side_of(m) in ("node", "serve", "cli")] == []


@pytest.mark.timeout(30)
def test_single_node_tether_never_imports_ray() -> None:
    """Ray is an optional extra: serving (the app, the fleet, the scheduler, the CLI) loads none of it, nor the
    cluster package, until ``tether serve --ray`` asks."""
    code = (
        "import sys, tether.cli.main, tether.cli.serve, tether.serve.app, tether.fleet.scheduler\n"
        "print(' '.join(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'tether.cluster')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True)
    assert out.stdout.split() == []


@pytest.mark.timeout(30)
def test_the_public_api_is_one_list_and_every_name_resolves() -> None:
    """``tether`` re-exports from ``_EXPORTS``; the TYPE_CHECKING imports (for type checkers) name the same."""
    exported = {name for names in tether._EXPORTS.values() for name in names}
    assert set(tether.__all__) == exported | {"__version__"}
    tree = ast.parse((SRC / "__init__.py").read_text())
    guarded = {
        (node.module, alias.name)
        for block in tree.body
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert guarded == {(module, name) for module, names in tether._EXPORTS.items() for name in names}
    for name in sorted(exported):
        assert getattr(tether, name) is not None
    for name in ("Instance", "RestartPolicy", "Deadlines", "CancelReply", "Supervisor", "TetherError"):
        assert name in exported


@pytest.mark.timeout(30)
def test_every_error_tether_raises_on_purpose_has_one_root() -> None:
    from tether.errors import TetherError

    roots = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (
                node.name.endswith(("Error", "Exists", "Missing"))
                or any(
                    isinstance(b, ast.Name) and b.id in ("Exception", "ValueError", "OSError", "LookupError")
                    for b in node.bases
                )
            ):
                roots.append((path, node.name))
    assert roots, "no error classes found: the scan is broken"
    for path, name in roots:
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        cls = getattr(__import__(module, fromlist=[name]), name)
        assert issubclass(cls, TetherError), f"{module}.{name} does not derive from TetherError"


# --------------------------------------------------------------------------------------------------------------
# Readable: no cycles, one meaning per class name, no misleading aliases
# --------------------------------------------------------------------------------------------------------------


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Which tether modules each module imports: every import (inside functions and under TYPE_CHECKING too), and
    the packages above each imported module (importing ``a.b.c`` runs ``a/b/__init__.py``). The root package
    ``tether`` is left out: it is the public facade, importing lazily (its TYPE_CHECKING block names everything)."""
    modules = _modules(root)
    top = root.name
    graph: dict[str, set[str]] = {name: set() for name in modules if name != top}
    for name in graph:
        for node in ast.walk(ast.parse(modules[name].read_text())):
            explicit: list[str] = []  # imported by name: an edge even to the module's own package
            implied: list[str] = []  # a module imported: its packages run first, unless they are the module's own
            if isinstance(node, ast.Import):
                implied = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    (implied if f"{node.module}.{a.name}" in modules else explicit).append(f"{node.module}.{a.name}")
                explicit = [node.module] if explicit else []
                implied.append(node.module)
            for target in explicit:
                if target in modules and target != name:
                    graph[name].add(target)
            for target in implied:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the module and each package above it, below the root
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                        graph[name].add(prefix)
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """The import cycles of the package at ``root``: each strongly connected component of more than one module
    (Tarjan's algorithm), sorted."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def reused_class_names(root: Path) -> dict[str, list[str]]:
    """Class names defined in more than one module: name -> those modules."""
    where: dict[str, list[str]] = defaultdict(list)
    for name, path in _modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    return {cls: sorted(mods) for cls, mods in sorted(where.items()) if len(set(mods)) > 1}


def misleading_aliases(root: Path) -> list[str]:
    """Imports that bind a module or name under the name of another tether package or module (``from
    tether.cluster import agent as node`` hides ``tether.node``)."""
    modules = _modules(root)
    names = {module.rsplit(".", 1)[-1] for module in modules}
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    if alias.asname and alias.asname in names and alias.asname != alias.name.rsplit(".", 1)[-1]:
                        found.append(f"{module}:{node.lineno}: {alias.name} as {alias.asname}")
    return found


SHARED_DIALECT_MODULES = (
    "conversation",
    "fields",
    "plan",
    "rules",
    "shapes",
    "template_args",
    "thinking",
    "tools",
    "usage",
)
"""The modules of ``tether.serve.dialects`` every dialect may use; each other module there is a dialect."""


def dialect_of(module: str, package: str, shared: tuple[str, ...] = SHARED_DIALECT_MODULES) -> str | None:
    """The dialect ``module`` belongs to: the name under ``package`` (``tether.serve.dialects``) of its module, or of
    its package when the dialect is a package (``ollama.planning`` is ``ollama``'s); None for a shared module."""
    if not module.startswith(package + "."):
        return None
    name = module.removeprefix(package + ".").split(".")[0]
    return None if name in shared else name


def dialect_modules(root: Path, shared: tuple[str, ...] = SHARED_DIALECT_MODULES) -> list[str]:
    """The dialects' modules in the package at ``root``: every module of its ``serve.dialects`` but the shared ones
    (a dialect package and each of its modules among them)."""
    package = f"{root.name}.serve.dialects"
    return sorted(m for m in _modules(root) if dialect_of(m, package, shared) is not None)


def dialect_crossings(root: Path, shared: tuple[str, ...] = SHARED_DIALECT_MODULES) -> list[str]:
    """Each import of one dialect by another (type-only ones too), as ``a imports b``. A dialect package's own
    modules import each other freely: only an import of another dialect's module or package crosses."""
    graph = import_graph(root)
    package = f"{root.name}.serve.dialects"
    return sorted(
        f"{m} imports {t}"
        for m in dialect_modules(root, shared)
        for t in sorted(graph[m])
        if dialect_of(t, package, shared) not in (None, dialect_of(m, package, shared))
    )


@pytest.mark.timeout(30)
def test_no_dialect_imports_another() -> None:
    """Each dialect is a peer, not a library the others convert through: what two of them share (the neutral
    conversation, a request shape two APIs take, a schema rule) lives in a shared module."""
    dialects = dialect_modules(SRC)
    assert "tether.serve.dialects.openai" in dialects and "tether.serve.dialects.ollama" in dialects
    assert "tether.serve.dialects.ollama.planning" in dialects  # a dialect package's modules are its dialect's
    for name in SHARED_DIALECT_MODULES:
        assert (SRC / "serve" / "dialects" / f"{name}.py").is_file(), f"no shared module {name}: update the list"
    assert dialect_crossings(SRC) == []


@pytest.mark.timeout(30)
def test_the_dialect_check_catches_a_dialect_that_borrows_from_another(tmp_path: Path) -> None:
    package = tmp_path / "tether"
    dialects = package / "serve" / "dialects"
    dialects.mkdir(parents=True)
    for folder in (package, package / "serve", dialects):
        (folder / "__init__.py").write_text("")
    (dialects / "tools.py").write_text("")
    (dialects / "alpha.py").write_text("from tether.serve.dialects import tools\n")
    (dialects / "beta.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tether.serve.dialects.alpha import Thing\n"
    )
    (dialects / "gamma.py").write_text("from tether.serve.dialects import alpha, tools\n")
    assert dialect_modules(package, ("tools",)) == [
        "tether.serve.dialects.alpha",
        "tether.serve.dialects.beta",
        "tether.serve.dialects.gamma",
    ]
    assert dialect_crossings(package, ("tools",)) == [
        "tether.serve.dialects.beta imports tether.serve.dialects.alpha",
        "tether.serve.dialects.gamma imports tether.serve.dialects.alpha",
    ]


@pytest.mark.timeout(30)
def test_the_dialect_check_catches_a_dialect_package_that_borrows_from_another(tmp_path: Path) -> None:
    """A dialect package's modules may import each other (even one named like a shared module), not another
    dialect; nor may another dialect import a package dialect's module."""
    package = tmp_path / "tether"
    dialects = package / "serve" / "dialects"
    delta = dialects / "delta"
    delta.mkdir(parents=True)
    for folder in (package, package / "serve", dialects):
        (folder / "__init__.py").write_text("")
    (dialects / "tools.py").write_text("")
    (dialects / "alpha.py").write_text("from tether.serve.dialects import tools\n")
    (delta / "__init__.py").write_text("from tether.serve.dialects.delta.planning import plan\n")
    (delta / "planning.py").write_text(
        "from tether.serve.dialects import tools\nfrom tether.serve.dialects.delta import replies\n"
    )
    (delta / "replies.py").write_text("from tether.serve.dialects.alpha import Thing\n")
    (delta / "tools.py").write_text("from tether.serve.dialects.delta.replies import Reply\n")
    (dialects / "epsilon.py").write_text("from tether.serve.dialects.delta.planning import plan\n")
    assert dialect_modules(package, ("tools",)) == [
        "tether.serve.dialects.alpha",
        "tether.serve.dialects.delta",
        "tether.serve.dialects.delta.planning",
        "tether.serve.dialects.delta.replies",
        "tether.serve.dialects.delta.tools",
        "tether.serve.dialects.epsilon",
    ]
    assert dialect_crossings(package, ("tools",)) == [
        "tether.serve.dialects.delta.replies imports tether.serve.dialects.alpha",
        "tether.serve.dialects.epsilon imports tether.serve.dialects.delta",
        "tether.serve.dialects.epsilon imports tether.serve.dialects.delta.planning",
    ]


@pytest.mark.timeout(30)
def test_no_import_cycles() -> None:
    assert import_cycles(SRC) == []


@pytest.mark.timeout(30)
def test_the_cycle_check_catches_a_cycle_even_through_type_only_imports(tmp_path: Path) -> None:
    package = tmp_path / "tether"
    (package / "serve").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "serve" / "__init__.py").write_text("")
    (package / "serve" / "app.py").write_text("from tether.serve import dialect\n")
    (package / "serve" / "dialect.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tether.serve.app import Api\n"
    )
    (package / "serve" / "alone.py").write_text("import tether.serve.dialect\nfrom tether.serve import app\n")
    assert import_cycles(package) == [["tether.serve.app", "tether.serve.dialect"]]
    # A package whose __init__ imports a module that takes a name from that __init__: a cycle too.
    (package / "serve" / "__init__.py").write_text("from tether.serve.alone import x\nhelper = 1\n")
    (package / "serve" / "alone.py").write_text("from tether.serve import helper\nx = helper\n")
    assert ["tether.serve", "tether.serve.alone"] in import_cycles(package)


@pytest.mark.timeout(30)
def test_no_class_name_means_two_things() -> None:
    assert reused_class_names(SRC) == {}


@pytest.mark.timeout(30)
def test_no_module_is_imported_under_another_ones_name() -> None:
    assert misleading_aliases(SRC) == []


ENGINE_PACKAGE = "tether.engines.llamacpp"
ENGINE_PACKAGE_USERS = {
    "tether.cli.build": "`tether build deterministic` compiles this engine's batch-invariant library",
}
"""Who outside ``engines/llamacpp/`` may import it, and why. The registry names it by a string, never by an import."""


def engine_package_users(root: Path, package: str = ENGINE_PACKAGE) -> set[str]:
    """The modules outside ``package`` that import it (or any module in it)."""
    graph = import_graph(root)
    return {
        m
        for m, targets in graph.items()
        if not (m == package or m.startswith(package + "."))
        and any(t == package or t.startswith(package + ".") for t in targets)
    }


@pytest.mark.timeout(30)
def test_only_the_registry_names_the_llamacpp_engine() -> None:
    """``engines/`` shows the plugin contract apart from its one engine: everything else reaches llama.cpp through
    the contract and the registry (which names ``tether.engines.llamacpp.engine:LlamaCppEngine`` as a string)."""
    assert engine_package_users(SRC) <= set(ENGINE_PACKAGE_USERS)
    registry = (SRC / "engines" / "registry.py").read_text()
    assert f'"{ENGINE_PACKAGE}.engine:LlamaCppEngine"' in registry


@pytest.mark.timeout(30)
def test_the_engine_package_check_catches_a_borrower(tmp_path: Path) -> None:
    package = tmp_path / "tether"
    engine = package / "engines" / "llamacpp"
    engine.mkdir(parents=True)
    (package / "serve").mkdir()
    for folder in (package, package / "engines", engine, package / "serve"):
        (folder / "__init__.py").write_text("")
    (engine / "batch.py").write_text("")
    (engine / "engine.py").write_text("from tether.engines.llamacpp import batch\n")
    (package / "serve" / "app.py").write_text("def f():\n    from tether.engines.llamacpp.batch import Batch\n")
    assert engine_package_users(package) == {"tether.serve.app"}


MONOTONIC_ALLOWED = {
    "tether/clock.py": "the clock itself: ``MONOTONIC`` is time.monotonic",
    # The runner side has no Clock seam: it times itself in its own process's real time.
    "tether/runner/": "the heartbeat's send time, read by the supervisor as evidence, not as a deadline",
    "tether/engines/": "an engine's step pacing, RPC connects and its load's reported duration, inside the runner",
    "tether/kernel/": "Linux primitives (a pidfd wait, a cgroup removal) bounded in real time beneath every rule",
    "tether/channel.py": "the wire's partial-frame growth detector: shared code, given no clock",
    "tether/chaos/": "the campaign measures a server from outside, in real time, and imports only shared modules",
    # Worker-side code that measures or waits on something real rather than enforcing a rule about time.
    "tether/node/spawn.py": "when a process was started, as a record",
    "tether/node/orphans.py": "how long the orphan sweep at start took, reported",
    "tether/node/drill.py": "the orphan drill measures how fast the kernel ends a real process tree",
    "tether/node/recent.py": "the default of its injectable clock (a callable, as tests pass their own)",
    "tether/node/stacks.py": "waits for a real runner's stack dump on a real pipe, so a stepped test still gets it",
    "tether/cluster/agent.py": "paces the relay of token batches to Ray's item rate: throughput, not a rule",
    "tether/serve/": "HTTP requests' durations for replies and metrics, and the trace snapshot's bound: real time",
    "tether/cli/": "a command's own timings, printed",
}
"""Where ``time.monotonic`` may be read directly, and why. Every rule about time elsewhere (deadlines, keep-alive,
eviction, backoff, leases) reads a ``Clock`` (``tether.clock``), so a test can step it and prove it at its default."""


def monotonic_readers(root: Path, allowed: dict[str, str] = MONOTONIC_ALLOWED) -> list[str]:
    """Each read of ``time.monotonic`` (or ``monotonic_ns``, or one imported from ``time``) outside ``allowed``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        if any(where == place or (place.endswith("/") and where.startswith(place)) for place in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            direct = (
                isinstance(node, ast.Attribute)
                and node.attr in ("monotonic", "monotonic_ns")
                and isinstance(node.value, ast.Name)
                and node.value.id == "time"
            )
            imported = (
                isinstance(node, ast.ImportFrom)
                and node.module == "time"
                and any(alias.name in ("monotonic", "monotonic_ns") for alias in node.names)
            )
            if direct or imported:
                found.append(f"{where}:{node.lineno}")
    return found


@pytest.mark.timeout(30)
def test_rules_about_time_read_the_clock_not_time_monotonic() -> None:
    for place in MONOTONIC_ALLOWED:
        assert (SRC.parent / place).exists(), f"{place} is gone: update MONOTONIC_ALLOWED"
    assert monotonic_readers(SRC) == []


@pytest.mark.timeout(30)
def test_the_clock_check_catches_time_monotonic_outside_its_places(tmp_path: Path) -> None:
    package = tmp_path / "tether"
    (package / "fleet").mkdir(parents=True)
    (package / "chaos").mkdir()
    (package / "clock.py").write_text("import time\nnow = time.monotonic\n")
    (package / "chaos" / "trial.py").write_text("import time\nbegan = time.monotonic()\n")
    (package / "fleet" / "keep.py").write_text("import time\n\ndef left(at):\n    return at - time.monotonic()\n")
    (package / "fleet" / "evict.py").write_text("from time import monotonic as now\n")
    allowed = {"tether/clock.py": "the clock", "tether/chaos/": "outside"}
    assert monotonic_readers(package, allowed) == ["tether/fleet/evict.py:1", "tether/fleet/keep.py:4"]
