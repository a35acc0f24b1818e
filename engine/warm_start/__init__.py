"""Moved: the warm-start fork server is :mod:`engine.testing.warm_start` (the test
helpers are one package). This name keeps working for a deprecation period, with a
one-line warning naming the new one (CHANGELOG.md).

A package, not ``engine/warm_start.py``: the old file's path is free, so that git sees
the move as a rename and a change made to the old file merges into the new one.
"""

from engine.errors import warn
from engine.testing.warm_start import DISABLE_ENV, WarmStarter, enabled, serve

__all__ = ["DISABLE_ENV", "WarmStarter", "enabled", "serve"]

warn("engine.warm_start moved to engine.testing.warm_start; import it from there "
     "(the old name goes in a later release)")
