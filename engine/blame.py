"""Error attribution: which plugin's code raised an exception.

An unexpected exception (a KeyError, not an :class:`~engine.errors.EngineError`) that
comes out of a plugin is reported as the plugin's, with the component or hook and the
line: ``plugin 'x' (launcher 'mpi'): KeyError: 'RANK' (raised at FILE:LINE)``, so that
the user knows whom to ask. Anything else (the engine's own errors, the recipe's code)
is shown as it is.
"""

from __future__ import annotations

import inspect
import os
import traceback

from engine.errors import EngineError, PluginCodeError, first_line


def blame(pm, exc: BaseException) -> tuple[str, str] | None:
    """Whose code raised ``exc``: ("plugin 'x' (parallel mode 'y')", "file:line"), or
    ("plugin 'x' (hook engine_log)", ...), or None when no plugin code is on the
    traceback. The innermost frame that is a registered component's method (its ``self``
    or ``cls``) or lies in a plugin's module wins: code the plugin called (torch, engine
    helpers) is the plugin's doing. ``pm`` is the run's plugin manager."""
    components = {}
    for registry in pm.registries:
        for name, cls in registry.items():
            components[cls] = (registry.owner(name), f"{registry.kind} {name!r}")
    files = {}
    for name, plugin in pm.list_name_plugin():
        module = plugin if inspect.ismodule(plugin) else inspect.getmodule(type(plugin))
        path = getattr(module, "__file__", None)
        if path and name is not None:
            files[os.path.realpath(path)] = name
    found = None  # (plugin, what, where) of the innermost frame in plugin code
    for frame, lineno in reversed(list(traceback.walk_tb(exc.__traceback__))):
        owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
        cls = owner if isinstance(owner, type) else type(owner)
        component = components.get(cls) if owner is not None else None
        if component is not None and (found is None or found[0] == component[0]):
            # The component whose method ran (or called) the failing code.
            where = found[2] if found else f"{frame.f_code.co_filename}:{lineno}"
            return f"plugin {component[0]!r} ({component[1]})", where
        plugin = files.get(os.path.realpath(frame.f_code.co_filename))
        function = frame.f_code.co_name
        hook = f"hook {function}" if function.startswith("engine_") else ""
        if plugin is not None and found is None:
            found = (plugin, hook, f"{frame.f_code.co_filename}:{lineno}")
        elif found is not None and plugin == found[0] and hook and not found[1]:
            found = (plugin, hook, found[2])  # the hook that called the helper
        if found is not None and found[1]:
            break  # a hook: its caller is the engine
    if found is None:
        return None
    plugin, what, where = found
    return f"plugin {plugin!r}" + (f" ({what})" if what else ""), where


def attribute(pm, exc: BaseException) -> BaseException:
    """``exc`` as the user should see it: an unexpected exception raised in a plugin's
    code becomes a :class:`PluginCodeError` that names the plugin, the component or
    hook, and the line; anything else (engine errors, the recipe's own code) is
    returned as it is. ``pm`` may be None (no plugin manager yet: nothing to blame)."""
    if pm is None or isinstance(exc, EngineError) or not isinstance(exc, Exception):
        return exc
    found = blame(pm, exc)
    if found is None:
        return exc
    who, where = found
    blamed = PluginCodeError(f"{who}: {type(exc).__name__}: {first_line(exc)} "
                             f"(raised at {where})")
    blamed.__cause__ = exc
    return blamed
