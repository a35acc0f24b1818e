"""Builds the plugin manager: built-ins, then installed entry points, then ``-p`` extras.

Built-in plugins go through exactly the code path a third-party plugin does (a module
name, imported, registered under a short name); only the list differs
(``BUILTIN_PLUGINS`` here, the ``engine.plugins`` entry-point group, ``-p``). ``-p
no:NAME``, ``-p NAME`` and ``ENGINE_DISABLE_PLUGIN_AUTOLOAD=1`` work as pytest's
(docs/plugins.md, "Packaging").

Every start-up problem is one :class:`~engine.errors.PluginError` line that names the
plugin (an import error, an unknown hook or hook argument, a registration hook that
raises, a name registered twice), and a run refuses to start with it. The commands that
must keep working while a plugin is broken (``--help``, ``doctor``, ``plugins``) build
the manager with ``keep_going=True``: the broken plugin is left out and ``pm.broken``
says why and how to disable it (:meth:`BrokenPlugin.describe`); such a manager also
tries the hooks ``--help`` calls later, so that a plugin failing there is left out too.

What the registration hooks add is kept by engine/registrations.py; which plugin's
code raised an error is found by engine/blame.py.
"""

from __future__ import annotations

import difflib
import importlib
import functools
import inspect
import os
import re
import sys
from typing import Iterable, Mapping

import attrs
import pluggy

import engine
from engine import hookspecs, processes
from engine.blame import attribute  # noqa: F401 (where engine.cli imports it from)
from engine.errors import ConfigError, EngineError, PluginError, first_line, warn
from engine.registrations import Registrations

# importlib.metadata is imported only inside the functions that read the installed
# distributions: importing this module (every run's start) reads none of them.
ENTRY_POINT_GROUP = "engine.plugins"
#: Set to 1 to skip entry-point plugins (built-ins and ``-p`` extras still load).
DISABLE_AUTOLOAD_ENV = "ENGINE_DISABLE_PLUGIN_AUTOLOAD"

#: (name, module) of every built-in plugin, in registration order.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("spawn", "engine.plugins.spawn"),
    ("torchrun", "engine.plugins.torchrun"),
    ("slurm", "engine.plugins.slurm"),
    ("legacy", "engine.plugins.legacy"),
    ("single", "engine.plugins.single"),
    ("ddp", "engine.plugins.ddp"),
    ("dp", "engine.plugins.dp"),
    ("ddp-multigpu", "engine.plugins.ddp_multigpu"),
    ("fsdp", "engine.plugins.fsdp"),
    ("torch-file", "engine.plugins.torch_file"),
    ("async", "engine.plugins.async_file"),
    ("dcp", "engine.plugins.dcp"),
    ("ema", "engine.plugins.ema"),
    ("profiler", "engine.plugins.profiler"),
    ("console", "engine.plugins.console"),
    ("tensorboard", "engine.plugins.tensorboard"),
    ("csv", "engine.plugins.csv_logger"),
)

#: Plugins a run cannot do without (the fallback launcher, the one-process parallel
#: mode, the default checkpointer); ``-p no:NAME`` refuses them.
ESSENTIAL_PLUGINS = frozenset({"spawn", "single", "torch-file"})


@attrs.frozen
class PluginInfo:
    name: str
    module: str  # what was imported: "package.module" or "package.module:object"
    version: str
    source: str  # "built-in", "entry point", "-p" or "object"
    distribution: str = ""  # the installed distribution that provides it, if known

    def describe(self) -> str:
        where = f"distribution {self.distribution} {self.version}" if self.distribution \
            else self.source
        return f"{self.module} ({where})"


@attrs.frozen
class BrokenPlugin:
    """A plugin left out by a ``keep_going`` plugin manager, and why."""

    info: PluginInfo
    error: str  # the one-line PluginError a run would stop with

    def describe(self) -> str:
        """One line: who, the error, and how to disable it."""
        name, dist = self.info.name, self.info.distribution
        where = f" (distribution {dist} {self.info.version})" if dist else ""
        if self.info.source == "entry point":
            # Both controls of this module's docstring; uninstalling is the third way.
            ways = (f"-p no:{name}, or {DISABLE_AUTOLOAD_ENV}=1 (no installed plugin "
                    "loads)" + (f", or pip uninstall {dist}" if dist else ""))
        elif self.info.source == "-p":
            ways = f"leave out -p {name}"
        else:
            ways = f"-p no:{name}"
        return f'plugin "{name}"{where} is broken and was left out: {self.error}; ' \
               f"to disable it: {ways}"


@attrs.frozen
class EntryPoint:
    """One ``engine.plugins`` entry point of an installed distribution."""

    name: str
    value: str  # "module" or "module:object"
    distribution: str
    version: str


def normalize(name: str) -> str:
    """Distribution names compare like pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: The run object's hook argument, its name before 0.3 and the version that drops that.
RUN_ARG, OLD_RUN_ARG, OLD_RUN_ARG_UNTIL = "ctx", "engine", "0.4.0"


def _speaks_for_the_run() -> bool:
    """Whether a warning about the run's plugins is this process's to say, once a run:
    not in a worker engine-run's launcher started (the launcher said it), and only on
    rank 0 where each rank is started by another tool (torchrun's RANK, srun's
    SLURM_PROCID)."""
    return (not processes.started_by_this_launcher()
            and all(os.environ.get(name, "0") == "0" for name in ("RANK", "SLURM_PROCID")))


class RunHookCaller(pluggy.HookCaller):
    """A hook with the run object. Called with ``ctx=`` (or ``engine=``, by code written
    before 0.3), it passes the object under both names, so that implementations that ask
    for either get it; every call site thus names it once."""

    __slots__ = ()

    def __call__(self, **kwargs):
        if RUN_ARG in kwargs:
            kwargs.setdefault(OLD_RUN_ARG, kwargs[RUN_ARG])
        elif OLD_RUN_ARG in kwargs:
            kwargs[RUN_ARG] = kwargs[OLD_RUN_ARG]
        return super().__call__(**kwargs)


class EnginePluginManager(Registrations, pluggy.PluginManager):
    """pluggy's manager plus a record of where each plugin came from (here) and what
    the plugins registered (engine/registrations.py: the registries ``launchers``,
    ``parallel_modes``, ``checkpointers``, ``config_groups``, ``run_files``,
    :meth:`commands`)."""

    def __init__(self, keep_going: bool = False) -> None:
        super().__init__("engine")
        self.add_hookspecs(hookspecs)
        for caller in vars(self.hook).values():
            if RUN_ARG in caller.spec.argnames:
                caller.__class__ = RunHookCaller
        self.infos: dict[str, PluginInfo] = {}
        self._init_registrations()
        self.autoload = True
        self.disabled: list[str] = []  # the NAMEs of -p no:NAME
        #: False (a run): a broken plugin is a PluginError. True (--help, doctor,
        #: plugins): it is left out and listed in ``broken``, so that these commands
        #: still work and can say which plugin is broken.
        self.keep_going = keep_going
        self.broken: list[BrokenPlugin] = []

    @functools.cached_property
    def entry_points(self) -> list[EntryPoint]:
        """The installed ones, loaded or not: read when first needed (autoload, a -p or
        -p no: name, ``engine-run plugins``), not by a manager that needs none."""
        return installed_entry_points()

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

    def load_plugin(self, name: str, target: str, *, version: str, source: str,
                    distribution: str = "") -> None:
        """Import ``target`` ("module" or "module:object") and register it as ``name``."""
        if self.is_blocked(name) or (distribution and self.is_blocked(distribution)):
            return
        new = PluginInfo(name, target, version, source, distribution)
        try:
            if name in self.infos:
                raise PluginError(
                    f'two plugins are named "{name}": {self.infos[name].describe()} and '
                    f"{new.describe()}; uninstall one, or disable a distribution with "
                    f"-p no:DISTRIBUTION"
                )
            plugin = import_plugin(name, target)
            if self.is_registered(plugin):
                return  # the same module asked for twice (entry point and -p): load it once
            self._register_checked(plugin, name)
        except PluginError as exc:
            self._leave_out(new, exc)
            return
        self.infos[name] = new

    def load_entry_point(self, ep: EntryPoint, source: str = "entry point") -> None:
        self.load_plugin(ep.name, ep.value, version=ep.version, source=source,
                         distribution=ep.distribution)

    def register_object(self, plugin: object, name: str, source: str = "object") -> None:
        """Register an already-imported plugin object (tests, the library API)."""
        info = PluginInfo(name, getattr(plugin, "__name__", type(plugin).__name__),
                          engine.__version__, source)
        try:
            self._register_checked(plugin, name)
        except PluginError as exc:
            self._leave_out(info, exc)
            return
        self.infos[name] = info

    def _leave_out(self, info: PluginInfo, error: EngineError, *,
                   registered: bool = False) -> None:
        """A run stops at a broken plugin (``error`` is raised); with ``keep_going`` it
        is recorded in ``broken`` and, if it was ``registered`` already (a registration
        hook failed), unregistered with its components and config groups."""
        if not self.keep_going:
            raise error
        self.broken.append(BrokenPlugin(info, str(error)))
        if not registered:
            return  # nothing of it was kept (the name may be another plugin's)
        del self.infos[info.name]
        self.unregister(name=info.name)
        self.discard_registrations(info.name)

    def _register_checked(self, plugin: object, name: str) -> None:
        self._check_hooks(plugin, name)
        try:
            self.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            if self.get_plugin(name) is plugin:
                self.unregister(name=name)  # pluggy stops half-way through the plugin
            detail = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise PluginError(f'Plugin "{name}" is invalid: {detail}') from None
        except ValueError as exc:  # pluggy: name or object already registered
            raise PluginError(f'Plugin "{name}" cannot be registered: {exc}') from None

    def _check_hooks(self, plugin: object, name: str) -> None:
        """Every hook implementation must name a hook spec, and may take fewer arguments
        than its hook, never others: pluggy's message spans lines, and it accepts a
        misspelt ``@engine.hookimpl def egnine_run_end`` (never called) silently. Asking
        for the run object as ``engine`` (before 0.3) is warned once (RunHookCaller)."""
        old_name = []  # the hooks that ask for the run object by its name before 0.3
        for attr in dir(plugin):
            opts = self.parse_hookimpl_opts(plugin, attr)
            if opts is None:
                continue
            hook_name = opts.get("specname") or attr
            caller = getattr(self.hook, hook_name, None)
            spec = caller.spec if isinstance(caller, pluggy.HookCaller) else None
            if spec is None:
                if opts.get("optionalhook"):
                    continue
                specs = [n for n in dir(hookspecs) if n.startswith("engine_")]
                close = difflib.get_close_matches(hook_name, specs, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                function = f" (function {attr})" if attr != hook_name else ""
                raise PluginError(f'Plugin "{name}" implements unknown hook '
                                  f'"{hook_name}"{function}{hint}')
            provided = argnames(spec.function)
            asked = argnames(getattr(plugin, attr))
            extra = [a for a in asked if a not in provided]
            if extra:
                if RUN_ARG in provided:  # as the docs name them; the old name still works
                    provided = [RUN_ARG] + [a for a in provided
                                            if a not in (RUN_ARG, OLD_RUN_ARG)]
                raise PluginError(
                    f'Plugin "{name}" implements hook "{hook_name}" with argument(s) '
                    f"{', '.join(extra)} that the hook does not provide; it provides: "
                    f"{', '.join(provided) or 'no arguments'}"
                )
            if OLD_RUN_ARG in asked and RUN_ARG in provided:
                old_name.append(hook_name)
        if old_name and _speaks_for_the_run():
            warn(f'plugin "{name}" asks for the run object as "{OLD_RUN_ARG}" (in '
                 f'{", ".join(sorted(old_name))}): the argument is "{RUN_ARG}" now, the '
                 f'same object; "{OLD_RUN_ARG}" works until {OLD_RUN_ARG_UNTIL}')

    # ---------------------------------------------------------------- queries

    def find(self, name: str) -> PluginInfo | None:
        """The loaded plugin called ``name``, or provided by the distribution ``name``."""
        if name in self.infos:
            return self.infos[name]
        wanted = normalize(name)
        return next((info for info in self.infos.values()
                     if normalize(info.name) == wanted or
                     (info.distribution and normalize(info.distribution) == wanted)), None)

    def why_absent(self, name: str) -> str:
        """Why the plugin ``name`` is not loaded, in a few words."""
        wanted = normalize(name)
        if any(normalize(d) == wanted for d in self.disabled):
            return f"disabled with -p no:{name}"
        for ep in self.entry_points:
            if wanted in (normalize(ep.name), normalize(ep.distribution)):
                return (f"installed ({ep.distribution} {ep.version}) but not loaded because "
                        f"{DISABLE_AUTOLOAD_ENV} is set; add -p {ep.name}")
        return "not installed"

    def hooks_of(self, plugin_name: str) -> list[str]:
        plugin = self.get_plugin(plugin_name)
        return sorted(caller.name for caller in self.get_hookcallers(plugin) or [])


def argnames(function) -> list[str]:
    """The arguments pluggy passes to ``function`` (those without a default; no self)."""
    params = [p for p in inspect.signature(function).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
              and p.default is p.empty]
    names = [p.name for p in params]
    if names and names[0] in ("self", "cls") and "." in getattr(function, "__qualname__", ""):
        names = names[1:]
    return names


def import_plugin(name: str, target: str) -> object:
    """Import "module" or "module:object.attr"; any failure names the plugin."""
    module_name, _, attr_path = target.partition(":")
    try:
        plugin = importlib.import_module(module_name)
        for attr in filter(None, attr_path.split(".")):
            plugin = getattr(plugin, attr)
    except Exception as exc:
        raise PluginError(
            f'Error importing plugin "{name}": {type(exc).__name__}: {first_line(exc)}'
        ) from exc
    return plugin


def installed_entry_points() -> list[EntryPoint]:
    from importlib import metadata

    found = []
    # importlib.metadata lists a distribution once even when it is on sys.path twice.
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        found.append(EntryPoint(ep.name, ep.value, dist.name if dist else "",
                                dist.version if dist else "-"))
    return found


def object_name(plugin: object) -> str:
    """The name a plugin object is registered under: its ``__name__`` (a module, a
    class), else its type's and id's."""
    return getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{id(plugin):x}"


def build_plugin_manager(extra: Iterable = (), *, autoload: bool | None = None,
                         objects: Mapping[str, object] | None = None,
                         keep_going: bool = False,
                         scratch_parser=None) -> EnginePluginManager:
    """``extra`` holds the ``-p`` arguments: ``no:NAME`` blocks a plugin, anything else
    names an entry point or a module to import and register, and a plugin object
    (``engine.fit(plugins=[Timer()])``) joins ``objects`` (names -> plugin objects,
    registered last). ``autoload``: unless ENGINE_DISABLE_PLUGIN_AUTOLOAD is set (not 0).
    ``keep_going``: a broken plugin is left out and listed in ``pm.broken`` (for
    ``--help``, ``doctor``, ``plugins``); a mistake on the command line (``-p no:`` of an
    unknown or essential name) still raises. ``scratch_parser``: with ``keep_going``, a
    fresh ``engine.cli.build_parser()`` (this module does not import the CLI) to try the
    plugins' options on."""
    pm = EnginePluginManager(keep_going)
    objects = {**(objects or {}), **{object_name(p): p for p in extra if not isinstance(p, str)}}
    extra = [spec for spec in extra if isinstance(spec, str)]
    disable = [spec[3:] for spec in extra if spec.startswith("no:")]
    add = [spec for spec in extra if not spec.startswith("no:")]
    for name in disable:
        if name in ESSENTIAL_PLUGINS:
            raise PluginError(
                f'Plugin "{name}" is essential and cannot be disabled '
                f"(essential: {', '.join(sorted(ESSENTIAL_PLUGINS))})"
            )
        pm.set_blocked(name)
        pm.disabled.append(name)

    for name, module_name in BUILTIN_PLUGINS:
        pm.load_plugin(name, module_name, version=engine.__version__, source="built-in")

    if autoload is None:
        autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") in ("", "0")
    pm.autoload = autoload
    if autoload:
        for ep in pm.entry_points:
            pm.load_entry_point(ep)

    by_name = {ep.name: ep for ep in pm.entry_points} if add else {}
    for spec in add:
        if spec in pm.infos:
            continue  # already loaded: a built-in, or an entry point autoload found
        if spec in by_name:
            pm.load_entry_point(by_name[spec], source="-p")
        else:
            working_directory_importable()
            version, dist = module_version(spec)
            pm.load_plugin(spec, spec, version=version, source="-p", distribution=dist)

    for name, plugin in objects.items():
        pm.register_object(plugin, name)

    known = {name for name, _ in BUILTIN_PLUGINS} | set(add) | set(objects)
    if disable:  # what a -p no:NAME may name: the installed entry points' names too
        known |= {n for ep in pm.entry_points for n in (ep.name, ep.distribution)}
    for name in disable:
        if name not in known and normalize(name) not in map(normalize, known):
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PluginError(
                f'-p no:{name}: no plugin or distribution is named "{name}"; {hint}plugins: '
                + ", ".join(sorted({*pm.infos, *(ep.name for ep in pm.entry_points)}))
            )

    pm.fill_registries()
    pm.collect_config_groups()
    pm.collect_run_files()
    if keep_going:
        # What --help calls later is tried now, so that a plugin that fails there is
        # left out and named too.
        pm.commands()
        if scratch_parser is not None:
            pm.try_options(scratch_parser)
    return pm


def working_directory_importable() -> None:
    """``-p mymodule`` finds ``./mymodule.py``, as a recipe finds its sibling files:
    the ``engine-run`` script's folder, not the working directory, heads sys.path. Last
    on it, so an installed module of the same name still wins; spawned workers inherit
    it (and import their plugins here again)."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def packages_distributions() -> dict[str, list[str]]:
    """importlib.metadata's top-level module -> distributions map, read once per
    process and ``sys.path`` (it reads every installed distribution's file list; a warm
    spare, engine/spares.py, reads it before it forks)."""
    return _packages_distributions(tuple(sys.path))


@functools.lru_cache(maxsize=4)
def _packages_distributions(path: tuple[str, ...]) -> dict[str, list[str]]:
    from importlib import metadata

    return metadata.packages_distributions()


def module_version(module_name: str) -> tuple[str, str]:
    """(version, distribution) of a ``-p`` module: its distribution's, else its
    ``__version__``, else "-"."""
    from importlib import metadata

    top = module_name.split(":")[0].split(".")[0]
    for dist in packages_distributions().get(top, []):
        try:
            return metadata.version(dist), dist
        except metadata.PackageNotFoundError:
            continue
    try:
        module = importlib.import_module(module_name.split(":")[0])
    except Exception:
        return "-", ""  # the import error itself is reported by load_plugin
    return str(getattr(module, "__version__", "-")), ""


def require_plugins(pm: EnginePluginManager, requirements: Iterable[str]) -> None:
    """Check a recipe's ``REQUIRED_PLUGINS``, such as ``["engine-csv-logger>=0.3"]``.

    A name matches a loaded plugin's name or its distribution's; the specifier uses
    pip's rules (``>=0.3,<1``, ``~=0.3.1``, ``==0.3.*``)."""
    # only a recipe with REQUIRED_PLUGINS needs packaging: imported here, not by every run
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    missing = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            raise ConfigError(
                f"REQUIRED_PLUGINS entry {text!r} is not a requirement; write a plugin or "
                "distribution name with an optional version specifier, e.g. "
                "'engine-csv-logger>=0.3'"
            ) from None
        info = pm.find(req.name)
        if info is None:
            missing.append(f"{text} ({pm.why_absent(req.name)})")
            continue
        if not req.specifier:
            continue
        try:
            ok = req.specifier.contains(Version(info.version), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            missing.append(f"{text} (have {info.version})")
    if missing:
        raise PluginError("Missing required plugins: " + ", ".join(missing))
