"""No import cycles inside engine/: every ``import engine...`` and ``from engine...
import`` statement of every module, function-local ones included (a lazy import hides
a cycle from Python, not from the design), read with ast. No optional package
imported by a plain run: the optional loggers import theirs only when enabled. And no
import inside a function without its reason (issue 38). What the imports cost is a
benchmark's, not a test's (a timed assertion fails by chance on a loaded machine):
``python tools/bench_startup.py imports`` (docs/performance.md, "Import")."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

from tests.conftest import engine_env

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "engine"
PLUGINS = ENGINE.parent / "plugins"


def module_name(path: pathlib.Path) -> str:
    parts = ("engine", *path.relative_to(ENGINE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}


def imported(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The engine/ modules that ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(filter(None, [*anchor, base]))
            # ``from engine import snapshot`` imports the module engine.snapshot.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # ``import engine.a.b`` runs engine/a/b.py: the longest prefix that exists.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def function_level_imports(tree: ast.AST) -> list[ast.stmt]:
    """The import statements inside a function (a method's, a nested function's)."""
    functions = [f for f in ast.walk(tree)
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = {node.lineno: node for function in functions for node in ast.walk(function)
             if isinstance(node, (ast.Import, ast.ImportFrom))}
    return [found[line] for line in sorted(found)]


#: A module's rule for its function-level imports: a comment at the module's level (not
#: indented) or a sentence of its docstring, e.g. "torch is imported inside the
#: functions that use it: <who imports this module without torch>".
MODULE_RULE = re.compile(r"imported\s+(only\s+)?inside", re.IGNORECASE)
#: Comments that are tool pragmas, not reasons.
PRAGMA = re.compile(r"#\s*(noqa\b[:\s\w,]*|type:\s*ignore\S*|pragma:.*)$")


def unexplained_imports(path: pathlib.Path, root: pathlib.Path = ENGINE.parent) -> list:
    """``file:line: statement`` for each function-level import of ``path`` without its
    reason. The rule, kept simple: an import stays inside a function only to keep
    start-up fast or to break a cycle, and says so either once for the module (see
    :data:`MODULE_RULE`) or in a comment on it, on an import just above it or on a
    comment line just above those (a run of imports, blank lines allowed between them,
    shares its comment); a pragma such as ``# noqa: F401`` is no reason."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    docstring = ast.get_docstring(tree) or ""
    if MODULE_RULE.search(docstring) or any(
            line.startswith("#") and MODULE_RULE.search(line) for line in lines):
        return []

    def reason(line: str) -> bool:
        comment = line.partition("#")[2].strip()
        return bool(comment) and not PRAGMA.fullmatch("#" + comment)

    found = []
    run = 0  # the first line of the run of imports (blank lines between) this one ends
    end = 0
    for node in function_level_imports(tree):
        if any(line.strip() for line in lines[end:node.lineno - 1]):
            run = node.lineno
        end = node.end_lineno
        above = lines[run - 2] if run > 1 else ""
        if not (any(reason(line) for line in lines[run - 1:end])
                or above.lstrip().startswith("#") and reason(above)):
            found.append(f"{path.relative_to(root)}:{node.lineno}: "
                         f"{lines[node.lineno - 1].strip()}")
    return found


def import_graph() -> dict[str, set[str]]:
    modules = engine_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each
    holds at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each component, e.g. ``["engine.a", "engine.b", "engine.a"]``."""
    return [cycle_in(graph, component) for component in components(graph)]


def cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle in {component}")


def test_the_walk_sees_function_local_and_relative_imports(tmp_path):
    modules = {"engine.a": tmp_path / "a.py", "engine.b": tmp_path / "b.py",
               "engine.pkg": tmp_path / "pkg" / "__init__.py", "engine.pkg.c": tmp_path}
    source = tmp_path / "a.py"
    source.write_text("import os\nimport engine.b\n"
                      "def f():\n    from engine.pkg import c, not_a_module\n"
                      "def g():\n    from . import b\n    from .pkg.c import x\n")
    assert imported("engine.a", source, modules) == {"engine.b", "engine.pkg", "engine.pkg.c"}
    graph = {"engine.a": {"engine.b"}, "engine.b": {"engine.c"}, "engine.c": {"engine.a"},
             "engine.d": {"engine.a"}}
    assert cycles(graph) == [["engine.a", "engine.b", "engine.c", "engine.a"]]


def test_engine_has_no_import_cycle():
    graph = import_graph()
    found = components(graph)
    assert not found, "import cycles in engine/:\n" + "\n".join(
        f"{' -> '.join(cycle_in(graph, c))}   (all of {', '.join(sorted(c))} import each "
        "other, directly or not)" for c in found)


def test_the_optional_loggers_are_not_imported_unless_enabled():
    # mlflow and wandb are entry-point plugins every run loads (their config groups are
    # part of every config): loading them and firing their hooks with the defaults
    # (enabled=false), as a plain run does, must import neither package. In a new
    # process: this one may have imported them for their own tests.
    code = textwrap.dedent("""
        import sys, types
        from engine.config import TrainConfig, with_groups
        from engine.plugin_manager import build_plugin_manager
        pm = build_plugin_manager(autoload=True)
        assert {"mlflow", "wandb"} <= set(pm.infos), sorted(pm.infos)
        eng = types.SimpleNamespace(is_rank0=True, cfg=with_groups(TrainConfig(),
                                                                   pm.config_groups))
        for name in ("mlflow", "wandb"):
            plugin = pm.get_plugin(name)
            plugin.engine_run_start(ctx=eng)
            plugin.engine_log(ctx=eng, metrics={"train/loss": 1.0}, step=1)
            plugin.engine_run_end(ctx=eng, summary={"status": "completed"})
        print(sorted(m for m in ("mlflow", "wandb") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=engine_env(), text=True,
                         capture_output=True, timeout=120, cwd=ENGINE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_engine_run_starts_without_torch_or_the_modules_only_a_run_needs():
    # engine.cli and engine.launching import these inside the functions that need them
    # (the reason their imports stay there): --help, --version and the commands
    # (engine-run runs, report...) start without them. In a new process, as above.
    later = ("torch", "engine.config", "engine.plugin_manager", "engine.launcher",
             "engine.snapshot", "engine.recipe")
    code = f"import sys, engine.cli; print([m for m in {later!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], env=engine_env(), text=True,
                         capture_output=True, timeout=120, cwd=ENGINE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


#: What a run's imports (``import torch, engine.cli, engine.trainer, engine.plugin_manager``:
#: ``python tools/bench_startup.py imports`` measures their cost) leave for later: the
#: plugins (build_plugin_manager imports them), the recipe, the commands, the optional
#: packages.
NOT_IMPORTED_AT_START = ("engine.plugins", "engine.recipe", "engine.commands",
                         "packaging.requirements", "torchdata", "datasets", "engine.memory",
                         "engine.shm", "engine.shm_codec", "secrets")


def test_a_runs_imports_read_no_installed_distribution_and_leave_the_rest_for_later():
    # importlib.metadata's readers recorded from the end of torch's import (which scans
    # entry points of its own); in new processes, as above.
    code = textwrap.dedent(f"""
        import importlib.metadata as metadata, json, sys
        import torch
        calls = []
        for name in ("entry_points", "distributions", "distribution",
                     "packages_distributions"):
            def record(*args, _name=name, _real=getattr(metadata, name), **kwargs):
                calls.append(_name)
                return _real(*args, **kwargs)
            setattr(metadata, name, record)
        import engine.cli, engine.trainer, engine.plugin_manager
        print(json.dumps([calls, [m for m in {NOT_IMPORTED_AT_START!r} if m in sys.modules]]))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=engine_env(), text=True,
                         capture_output=True, timeout=120, cwd=ENGINE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[], []]"
    # Without torch (engine-run's launcher), the plugin manager's module does not even
    # import importlib.metadata: its functions do, when they read the distributions.
    code = ("import sys, engine.cli, engine.plugin_manager; "
            "print('importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=engine_env(), text=True,
                         capture_output=True, timeout=120, cwd=ENGINE.parent)
    assert (out.returncode, out.stdout.strip()) == (0, "False"), out.stderr


def test_every_import_inside_a_function_says_why(tmp_path):
    # The rule itself, on modules made to pass and to fail it.
    (tmp_path / "bare.py").write_text("import os\n\ndef f():\n    import json\n"
                                      "    from typing import (\n        Any)\n"
                                      "def g():\n    import numpy  # noqa: F401\n"
                                      "    import torch  # a reason, for this line only\n"
                                      "    x = 1\n    import yaml\n")
    (tmp_path / "each.py").write_text("def f():\n    # optional: only YAML needs them\n"
                                      "    import yaml\n    from yaml import (\n"
                                      "        safe_load)\n    import toml\n"
                                      "    from engine import data  # imports torch\n"
                                      "def g():\n    import torch  # and those below\n"
                                      "\n    from engine import trainer\n")
    (tmp_path / "module.py").write_text("# torch is imported inside the functions: the "
                                        "launcher imports this module\n"
                                        "def f():\n    import torch\n")
    bare = unexplained_imports(tmp_path / "bare.py", tmp_path)
    assert [line.partition(": ")[2] for line in bare] == [
        "import json", "from typing import (", "import numpy  # noqa: F401", "import yaml"]
    assert bare[0] == "bare.py:4: import json"
    assert unexplained_imports(tmp_path / "each.py", tmp_path) == []
    assert unexplained_imports(tmp_path / "module.py", tmp_path) == []
    # Then engine/ and plugins/ (engine/plugins may be a link to plugins/: read once).
    files = sorted({p.resolve() for top in (ENGINE, PLUGINS) for p in top.rglob("*.py")})
    found = [line for path in files for line in unexplained_imports(path)]
    assert not found, (
        "imports inside functions without their reason (issue 38: keep one there only to "
        "keep start-up fast or to break a cycle, and say which in a comment on or just "
        "above it, or once for the module: \"torch is imported inside the functions that "
        "use it: <who imports this module without it>\"; else import it at the top):\n"
        + "\n".join(found))
