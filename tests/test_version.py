"""The version moves with what changed (CHANGELOG.md): one number, said alike by the
package, its distribution's metadata source and the changelog's newest release."""

from __future__ import annotations

import re

import engine
from tests.conftest import REPO


def test_the_package_pyproject_and_changelog_name_one_version():
    pyproject = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    released = re.findall(r"^## (\d+\.\d+\.\d+)", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert pyproject.group(1) == engine.__version__
    assert released and released[0] == engine.__version__, released[:1]
