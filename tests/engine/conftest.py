"""Fixtures the engine's tests share."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, made_once_per_session, read_summary, run_cli

#: A recipe with everything that makes exact resume hard (tests/recipes/tiny_resume.py),
#: and the config its kill-and-resume tests run: 3 epochs of 6 steps.
RESUME_RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
RESUME_BASE = ("epochs=3", "checkpoint.every_steps=4", "checkpoint.keep_last=2")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """weights_sha256 of uninterrupted runs of RESUME_RECIPE with RESUME_BASE, by number
    of processes (``reference[2]``): each run once per session (on whichever xdist
    worker first asks), whichever module's killed runs compare with it.
    ``reference.folders[2]``: that run's out_dir, for tests that read a completed run
    (engine.load_model)."""

    class Digests(dict):
        folders: dict = {}

        def __missing__(self, nproc: int) -> str:
            out = made_once_per_session(
                tmp_path_factory, f"reference{nproc}",
                lambda out: run_cli(RESUME_RECIPE, *RESUME_BASE, f"out_dir={out}",
                                    "--nproc", str(nproc), check=True))
            self[nproc] = read_summary(out)["weights_sha256"]
            self.folders[nproc] = out
            return self[nproc]

    return Digests()
