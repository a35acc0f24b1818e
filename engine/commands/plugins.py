"""``engine-run plugins``: every loaded plugin with its version and where it came from
(built-in, an installed distribution's entry point, ``-p``), the hooks it implements and
the components it registers; then what is disabled or installed but not loaded, and
each broken plugin (left out: its error and how to disable it; exit status 1).

    spawn 0.1.0 (built-in; module engine.plugins.spawn)
      hooks: engine_register_launchers
      launcher: spawn
    csv 0.3.1 (distribution engine-csv-logger, entry point; module engine_csv_logger:plugin)
      hooks: engine_addoption, engine_log, engine_run_end
"""

from __future__ import annotations

import argparse

from engine.cli import build_parser, plugin_args
from engine.plugin_manager import DISABLE_AUTOLOAD_ENV, build_plugin_manager


def main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="engine-run plugins",
        description="List the loaded plugins, their versions, hooks and components.")
    parser.add_argument("-p", dest="plugins", action="append", default=[], metavar="NAME",
                        help="-p module.path or -p NAME loads a plugin, -p no:NAME "
                             "disables one (as for a run)")
    parser.parse_args(argv)
    pm = build_plugin_manager(plugin_args(argv), keep_going=True,
                              scratch_parser=build_parser())
    for name, info in pm.infos.items():
        if info.distribution:
            origin = f"distribution {info.distribution}, {info.source}"
        else:
            origin = info.source
        print(f"{name} {info.version} ({origin}; module {info.module})")
        hooks = pm.hooks_of(name)
        print(f"  hooks: {', '.join(hooks) if hooks else '-'}")
        for kind, names in pm.components_of(name).items():
            print(f"  {kind}: {', '.join(names)}")
    if pm.disabled:
        print("disabled: " + ", ".join(f"{n} (-p no:{n})" for n in pm.disabled))
    broken = {b.info.name for b in pm.broken}  # listed below, with why: not twice
    not_loaded = [ep for ep in pm.entry_points
                  if ep.name not in pm.infos and ep.name not in broken
                  and not pm.is_blocked(ep.name) and not pm.is_blocked(ep.distribution)]
    if not pm.autoload:
        print(f"entry-point autoload: off ({DISABLE_AUTOLOAD_ENV} is set)")
    if not_loaded:
        print("installed, not loaded: "
              + ", ".join(f"{ep.name} ({ep.distribution} {ep.version})" for ep in not_loaded)
              + "; load one with -p NAME")
    for broken in pm.broken:
        print(f"broken: {broken.describe()}")
    return 1 if pm.broken else 0
