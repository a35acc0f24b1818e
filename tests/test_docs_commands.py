"""The docs' blocks of commands run one after another as written: each training command
in a block trains in a run folder of its own (one into the folder of the command before
it would resume that run, or be refused as a completed run of another config), and
commands that write data write it to folders of their own. Each training command runs
verbatim with ``--dry-run``, whose plan says its output folder."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import REPO, run_cli_here


def blocks(document: str) -> list[list[list[str]]]:
    """The ``engine-run`` commands of each fenced block of ``document``, as arguments."""
    text = (REPO / document).read_text()
    found = []
    for block in re.findall(r"```(?:sh)?\n(.*?)```", text, re.S):
        commands = [shlex.split(line, comments=True)[1:] for line in block.splitlines()
                    if line.startswith("engine-run ")]
        if len(commands) > 1:
            found.append(commands)
    return found


def output_dir(args: list[str]) -> str:
    proc = run_cli_here(*args, "--dry-run", check=True)
    return re.search(r"^  output dir +(\S+)$", proc.stdout, re.M)[1]


@pytest.mark.parametrize("document", ["docs/compile.md", "docs/data.md"])
def test_the_commands_of_a_block_write_to_folders_of_their_own(document):
    checked = 0
    for commands in blocks(document):
        training = [args for args in commands if args[0].endswith(".py")]
        folders = [output_dir(args) for args in training]
        assert len(set(folders)) == len(folders), (training, folders)
        written = [args[args.index("--out") + 1] for args in commands if "--out" in args]
        assert len(set(written)) == len(written), commands
        checked += len(training) + len(written)
    assert checked >= 3  # the blocks were found
