"""Registries of components chosen by name (launchers, parallel modes, checkpointers).

They are filled by the registration hooks (``registry.add(cls)``: the name is the
class's ``name`` attribute, so the name a component reports and the one typed on the
command line cannot differ). Unlike a dict, a registry refuses a name that
is already taken (naming both plugins), a name that could not be typed on the command
line, and a component that is not a subclass of the registry's base class; a lookup of
an unknown name lists what is registered.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from engine.errors import PluginError

#: Names are typed on the command line (``--parallel NAME``, ``checkpointer=NAME``).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


class Registry:
    def __init__(self, kind: str, base: type | None = None):
        self.kind = kind  # "launcher", "parallel mode", "checkpointer"
        self.base = base  # components must subclass it (None: anything goes)
        self._entries: dict[str, Any] = {}
        self._owners: dict[str, str] = {}
        # Set by the plugin manager while it calls one plugin's registration hook.
        self.current_plugin = "<unknown>"

    def add(self, component: Any, name: str | None = None) -> None:
        """Register ``component`` under its own ``name`` attribute: the name the class
        reports (in summary.json, in messages) and the one typed on the command line are
        then the same. Plugins written for 0.1 call ``add("name", cls)``; that still
        works when the two agree."""
        plugin = self.current_plugin
        if isinstance(component, str) and name is not None:  # add("name", cls) of 0.1
            component, name = name, component
            declared = getattr(component, "name", None)
            if declared != name:
                raise PluginError(
                    f"plugin {plugin!r} registers {self.kind} {name!r} as "
                    f"{describe(component)}, whose name attribute is {declared!r}; "
                    f"set name = {name!r} in the class and call registry.add(cls)")
        elif name is not None:
            raise PluginError(
                f"plugin {plugin!r} passes a separate name {name!r} for {self.kind} "
                f"{describe(component)}; the name comes from the class: call "
                "registry.add(cls)")
        else:
            name = getattr(component, "name", None)
        if self.base is not None and not (isinstance(component, type)
                                          and issubclass(component, self.base)):
            raise PluginError(
                f"plugin {plugin!r} registers {self.kind} {name!r} as {component!r}, "
                f"which is not a subclass of {self.base.__module__}.{self.base.__qualname__}"
            )
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise PluginError(
                f"plugin {plugin!r} registers a {self.kind} named {name!r}"
                f" ({describe(component)}.name); a name is "
                "letters, digits, '-', '_' and '.', starting with a letter or digit"
            )
        if name in self._entries:
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by plugin "
                f"{self._owners[name]!r} and by plugin {plugin!r}; "
                f"disable one with -p no:NAME"
            )
        self._entries[name] = component
        self._owners[name] = plugin

    def get(self, name: str) -> Any:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            close = difflib.get_close_matches(str(name), list(self._entries), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PluginError(
                f"{self.kind} {name!r} is not available (plugin may not be installed); "
                f"{hint}registered: {known}"
            ) from None

    def owner(self, name: str) -> str:
        return self._owners[name]

    def names(self) -> list[str]:
        return list(self._entries)

    def items(self):
        return self._entries.items()

    def discard_owner(self, plugin_name: str) -> None:
        """Remove what ``plugin_name`` registered (a plugin left out as broken)."""
        for name in self.by_owner(plugin_name):
            del self._entries[name], self._owners[name]

    def by_owner(self, plugin_name: str) -> list[str]:
        return [n for n, owner in self._owners.items() if owner == plugin_name]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)


def describe(component: Any) -> str:
    """``module.Class`` for a class, its repr otherwise."""
    if isinstance(component, type):
        return f"{component.__module__}.{component.__qualname__}"
    return repr(component)
