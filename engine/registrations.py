"""What the plugins register, and where it goes: the registration hooks' side of the
plugin manager.

The registration hooks (``engine_register_*``) are called one plugin at a time, so that
whatever a plugin returns is recorded with its name: a name taken twice names both
plugins (the first keeps it), a bad return value names the plugin, and a plugin left
out later (a ``keep_going`` manager) takes everything it registered with it. They fill
the component registries (``launchers``, ``parallel_modes``, ``checkpointers``),
``config_groups``, ``run_files`` and :meth:`Registrations.commands`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

# The base classes the registries check subclasses against: their modules import no torch.
from engine.checkpoint import Checkpointer
from engine.errors import EngineError, PluginError, first_line
from engine.launcher import Launcher
from engine.parallel import Parallel
from engine.registry import NAME_PATTERN, Registry


class Registrations:
    """The registration side of :class:`engine.plugin_manager.EnginePluginManager`. It
    relies on the loading side for ``hook``, ``infos``, ``has_plugin`` and
    ``_leave_out`` (which calls :meth:`discard_registrations`)."""

    def _init_registrations(self) -> None:
        self.launchers = Registry("launcher", Launcher)
        self.parallel_modes = Registry("parallel mode", Parallel)
        self.checkpointers = Registry("checkpointer", Checkpointer)
        #: The plugins' config groups by name (engine_register_config_groups), in
        #: registration order, and which plugin added each.
        self.config_groups: dict[str, type] = {}
        self.config_group_owners: dict[str, str] = {}
        #: The files and folders the plugins write in a run's out_dir
        #: (engine_register_run_files), and which plugin declared each first.
        self.run_files: dict[str, str] = {}
        self._commands: dict[str, object] | None = None

    @property
    def registries(self) -> tuple[Registry, ...]:
        return self.launchers, self.parallel_modes, self.checkpointers

    def _call_registration(self, impl, hook_name: str, *args):
        """(True, what ``impl.function(*args)`` of a registration hook returned), or
        (False, None) when it raised and ``keep_going`` left the plugin out; without
        ``keep_going`` the error is raised, naming the plugin."""
        try:
            return True, impl.function(*args)
        except Exception as exc:
            error = exc if isinstance(exc, EngineError) else PluginError(
                f'Plugin "{impl.plugin_name}" failed in {hook_name}: '
                f"{type(exc).__name__}: {first_line(exc)}")
            if error is not exc:
                error.__cause__ = exc
            self._leave_out(self.infos[impl.plugin_name], error, registered=True)
            return False, None

    def _collect(self, hook_name: str, add: Callable[[str, Any], None]) -> None:
        """Call the registration hook ``hook_name`` one plugin at a time and hand what
        each returned to ``add(plugin, returned)``; a PluginError from either names the
        plugin (which ``keep_going`` leaves out)."""
        for impl in getattr(self.hook, hook_name).get_hookimpls():
            ok, returned = self._call_registration(impl, hook_name)
            if not ok:
                continue
            try:
                add(impl.plugin_name, returned)
            except PluginError as exc:
                self._leave_out(self.infos[impl.plugin_name], exc, registered=True)

    def fill_registries(self) -> None:
        for registry, hook in (
            (self.launchers, self.hook.engine_register_launchers),
            (self.parallel_modes, self.hook.engine_register_parallel),
            (self.checkpointers, self.hook.engine_register_checkpointers),
        ):
            # One plugin at a time, in registration order (built-ins first), so that the
            # registry knows who registered what: a duplicate name then names both
            # plugins, and the one that came first keeps it.
            for impl in hook.get_hookimpls():
                if not self.has_plugin(impl.plugin_name):
                    continue  # left out (keep_going) by an earlier registration hook
                registry.current_plugin = impl.plugin_name
                if impl.hookwrapper or impl.wrapper:
                    self._leave_out(self.infos[impl.plugin_name], PluginError(
                        f'Plugin "{impl.plugin_name}": the registration hook '
                        f'"{hook.name}" cannot be a wrapper'), registered=True)
                    continue
                self._call_registration(impl, hook.name,
                                        *[{"registry": registry}[a] for a in impl.argnames])
            registry.current_plugin = "<unknown>"

    def collect_config_groups(self) -> None:
        """The plugins' config groups (engine_register_config_groups)."""
        self._collect("engine_register_config_groups", self._add_config_groups)

    def _add_config_groups(self, plugin: str, groups) -> None:
        if not isinstance(groups, Mapping):
            raise PluginError(
                f'Plugin "{plugin}": engine_register_config_groups must return a '
                f"dict of group name to attrs class, not {type(groups).__name__}")
        for name, group in groups.items():
            if not (isinstance(name, str) and NAME_PATTERN.match(name)
                    and name.isidentifier()):
                raise PluginError(f'Plugin "{plugin}" adds a config group named '
                                  f"{name!r}; a group name is a Python identifier")
            if not attrs.has(group):
                raise PluginError(f'Plugin "{plugin}" adds config group {name!r} '
                                  f"as {group!r}, which is not an attrs class")
            if name in self.config_groups:
                raise PluginError(
                    f"config group {name!r} is added twice: by plugin "
                    f"{self.config_group_owners[name]!r} and by plugin {plugin!r}; "
                    "disable one with -p no:NAME")
            self.config_groups[name] = group
            self.config_group_owners[name] = plugin

    def collect_run_files(self) -> None:
        """What each plugin writes in a run's out_dir (engine_register_run_files)."""
        self._collect("engine_register_run_files", self._add_run_files)

    def _add_run_files(self, plugin: str, names) -> None:
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise PluginError(
                f'Plugin "{plugin}": engine_register_run_files must return a list '
                f"of file or folder names, not {names!r}")
        for name in names:
            # A name, not a path: --overwrite must never reach outside out_dir.
            if name in ("", ".", "..") or "/" in name or "\\" in name:
                raise PluginError(
                    f'Plugin "{plugin}" declares the run file {name!r}; a run file '
                    "is the name of a file or folder directly inside out_dir")
            self.run_files.setdefault(name, plugin)

    def commands(self) -> dict[str, object]:
        """The plugins' ``engine-run`` commands (engine_register_commands), by name."""
        if self._commands is not None:
            return self._commands
        found: dict[str, object] = {}
        for impl in self.hook.engine_register_commands.get_hookimpls():
            ok, added = self._call_registration(impl, "engine_register_commands")
            for name, main in (added or {}).items() if ok else ():
                if name in found:
                    raise PluginError(f"engine-run command {name!r} is added twice; "
                                      "disable one plugin with -p no:NAME")
                found[name] = main
        self._commands = found
        return found

    def try_options(self, parser) -> None:
        """Call each plugin's engine_addoption on ``parser``, a scratch ``engine-run``
        parser, one plugin at a time: one that raises, or adds an option already taken (by
        the engine or an earlier plugin), is named (and left out with ``keep_going``)."""
        for impl in self.hook.engine_addoption.get_hookimpls():
            self._call_registration(impl, "engine_addoption",
                                    *[{"parser": parser}[a] for a in impl.argnames])

    def discard_registrations(self, plugin_name: str) -> None:
        """Forget everything ``plugin_name`` registered (it is being left out)."""
        for registry in self.registries:
            registry.discard_owner(plugin_name)
        for group in [g for g, owner in self.config_group_owners.items()
                      if owner == plugin_name]:
            del self.config_groups[group], self.config_group_owners[group]
        for name in [n for n, owner in self.run_files.items() if owner == plugin_name]:
            del self.run_files[name]

    def components_of(self, plugin_name: str) -> dict[str, list[str]]:
        """What ``plugin_name`` registered, by kind (for ``engine-run plugins``)."""
        found = {registry.kind: registry.by_owner(plugin_name)
                 for registry in self.registries if registry.by_owner(plugin_name)}
        groups = [n for n, owner in self.config_group_owners.items() if owner == plugin_name]
        if groups:
            found["config group"] = groups
        files = [n for n, owner in self.run_files.items() if owner == plugin_name]
        if files:
            found["run file"] = files
        return found
