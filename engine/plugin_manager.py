"""Builds the plugin manager: built-ins, then installed entry points, then ``-p`` extras.

Built-in plugins go through exactly the code path a third-party plugin does: a module
name, imported, registered under a short name. The only difference is where the list
comes from (``BUILTIN_PLUGINS`` here, the ``engine.plugins`` entry-point group for
installed packages, ``-p module.path`` on the command line).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
from typing import Iterable

import attrs
import pluggy

import engine
from engine import hookspecs
from engine.errors import PluginError
from engine.registry import Registry

ENTRY_POINT_GROUP = "engine.plugins"
#: Set to 1 to skip entry-point plugins (built-ins and ``-p`` extras still load).
DISABLE_AUTOLOAD_ENV = "ENGINE_DISABLE_PLUGIN_AUTOLOAD"

#: (name, module) of every built-in plugin, in registration order.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("spawn", "engine.plugins.spawn"),
    ("single", "engine.plugins.single"),
    ("ddp", "engine.plugins.ddp"),
    ("torch-file", "engine.plugins.torch_file"),
    ("console", "engine.plugins.console"),
    ("tensorboard", "engine.plugins.tensorboard"),
)

#: Plugins a run cannot do without; ``-p no:NAME`` refuses them.
ESSENTIAL_PLUGINS = frozenset({"spawn", "single", "torch-file"})


@attrs.frozen
class PluginInfo:
    name: str
    module: str
    version: str
    source: str  # "built-in", a distribution name, or "-p"


class EnginePluginManager(pluggy.PluginManager):
    """pluggy's manager plus the engine's registries and a record of where each plugin
    came from."""

    def __init__(self) -> None:
        super().__init__("engine")
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.launchers = Registry("launcher")
        self.parallel_modes = Registry("parallel mode")
        self.checkpointers = Registry("checkpointer")

    def parse_hookimpl_opts(self, plugin, name):
        # Like pytest: a function named engine_* counts as a hook implementation even
        # without @hookimpl, so that a misspelt hook name is reported, not ignored.
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("engine_") and inspect.isroutine(
            getattr(plugin, name, None)
        ):
            opts = {}
        return opts

    # ------------------------------------------------------------------ loading

    def load_plugin(self, name: str, module_name: str, version: str, source: str) -> None:
        if self.is_blocked(name) or name in self.infos:
            return
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise PluginError(
                f'Error importing plugin "{name}": {type(exc).__name__}: {exc}'
            ) from exc
        self._register_checked(module, name)
        self.infos[name] = PluginInfo(name, module_name, version, source)

    def register_object(self, plugin: object, name: str, source: str = "object") -> None:
        """Register an already-imported plugin object (tests, the library API)."""
        self._register_checked(plugin, name)
        self.infos[name] = PluginInfo(name, getattr(plugin, "__name__", repr(plugin)),
                                      engine.__version__, source)

    def _register_checked(self, plugin: object, name: str) -> None:
        try:
            self.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f'Plugin "{name}" is invalid: {exc}') from exc

    def check_pending(self) -> None:
        """Every engine_* function must match a hook spec; name the plugin and hook."""
        specs = [n for n in dir(hookspecs) if n.startswith("engine_")]
        for hook_name in dir(self.hook):
            if not hook_name.startswith("engine_"):
                continue
            caller = getattr(self.hook, hook_name)
            if caller.spec is not None:
                continue
            for impl in caller.get_hookimpls():
                if impl.hookwrapper or impl.optionalhook:
                    continue
                close = difflib.get_close_matches(hook_name, specs, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise PluginError(
                    f'Plugin "{impl.plugin_name}" implements unknown hook '
                    f'"{hook_name}"{hint}'
                )

    def fill_registries(self) -> None:
        for registry, hook in (
            (self.launchers, self.hook.engine_register_launchers),
            (self.parallel_modes, self.hook.engine_register_parallel),
            (self.checkpointers, self.hook.engine_register_checkpointers),
        ):
            # Called one plugin at a time (in registration order) so that the registry
            # knows who registered what: a duplicate name then names both plugins.
            for impl in reversed(hook.get_hookimpls()):
                registry.current_plugin = impl.plugin_name
                impl.function(registry)
            registry.current_plugin = "<unknown>"

    def components_of(self, plugin_name: str) -> dict[str, list[str]]:
        return {
            registry.kind: registry.by_owner(plugin_name)
            for registry in (self.launchers, self.parallel_modes, self.checkpointers)
            if registry.by_owner(plugin_name)
        }

    def hooks_of(self, plugin_name: str) -> list[str]:
        plugin = self.get_plugin(plugin_name)
        return sorted(caller.name for caller in self.get_hookcallers(plugin) or [])


def _entry_points() -> Iterable[tuple[str, str, str, str]]:
    from importlib.metadata import distributions

    seen = set()
    for dist in distributions():
        dist_name = dist.metadata["Name"]
        if dist_name in seen:  # the same distribution on sys.path twice
            continue
        seen.add(dist_name)
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP:
                yield ep.name, ep.value, dist.version, dist_name


def build_plugin_manager(extra: Iterable[str] = (), *, autoload: bool | None = None
                         ) -> EnginePluginManager:
    """``extra`` holds the ``-p`` arguments: ``no:NAME`` blocks a plugin, anything else
    is a module path to import and register."""
    pm = EnginePluginManager()
    extra = list(extra)
    for spec in extra:
        if spec.startswith("no:"):
            name = spec[3:]
            if name in ESSENTIAL_PLUGINS:
                raise PluginError(
                    f'Plugin "{name}" is essential and cannot be disabled '
                    f"(essential: {', '.join(sorted(ESSENTIAL_PLUGINS))})"
                )
            pm.set_blocked(name)

    for name, module_name in BUILTIN_PLUGINS:
        pm.load_plugin(name, module_name, engine.__version__, "built-in")

    if autoload is None:
        autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") in ("", "0")
    if autoload:
        for name, value, version, dist_name in _entry_points():
            pm.load_plugin(name, value.split(":")[0], version, dist_name)

    for spec in extra:
        if not spec.startswith("no:"):
            pm.load_plugin(spec, spec, _module_version(spec), "-p")

    pm.check_pending()
    pm.fill_registries()
    return pm


def _module_version(module_name: str) -> str:
    try:
        return str(getattr(importlib.import_module(module_name), "__version__", "-"))
    except Exception:
        return "-"  # the import error itself is reported by load_plugin


def require_plugins(pm: EnginePluginManager, requirements: Iterable[str]) -> None:
    """Check a recipe's ``REQUIRED_PLUGINS`` such as ``["engine-csv>=0.2"]``."""
    missing = []
    for req in requirements:
        name, op, wanted = _split_requirement(req)
        info = pm.infos.get(name) or next(
            (i for i in pm.infos.values() if i.source == name), None)
        if info is None or (op and not _version_ok(info.version, op, wanted)):
            have = f" (have {info.version})" if info else ""
            missing.append(req + have)
    if missing:
        raise PluginError("Missing required plugins: " + ", ".join(missing))


_OPS = ("==", ">=", "<=", "!=", "~=", ">", "<")


def _split_requirement(req: str) -> tuple[str, str, str]:
    for op in _OPS:
        if op in req:
            name, _, wanted = req.partition(op)
            return name.strip(), op, wanted.strip()
    return req.strip(), "", ""


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _version_ok(have: str, op: str, wanted: str) -> bool:
    h, w = _version_tuple(have), _version_tuple(wanted)
    if op == "~=":
        return h >= w and h[: len(w) - 1] == w[: len(w) - 1]
    return {
        "==": h == w, "!=": h != w, ">=": h >= w, "<=": h <= w, ">": h > w, "<": h < w,
    }[op]
