"""Every relative link in README.md and docs/*.md points to a file that exists, and every
#anchor to a heading of its target, by GitHub's slug rules: the README was cut into
docs/ pages, and a link left pointing at a moved section would go nowhere silently."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")


def prose(path):
    """The lines outside fenced code blocks (a link or heading in a code block is text)."""
    inside = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            yield line


def slug(heading):
    """GitHub's anchor for a heading: its rendered text lowercased, everything but letters,
    digits, spaces, hyphens and underscores dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen, result = {}, set()
    for line in prose(path):
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def test_slugs_follow_githubs_rules():
    assert slug("Restarting failed workers: `--max-restarts N`") == \
        "restarting-failed-workers---max-restarts-n"
    assert slug("Experiment tracking: MLflow and Weights & Biases") == \
        "experiment-tracking-mlflow-and-weights--biases"
    assert slug("engine.fit: a recipe from Python") == "enginefit-a-recipe-from-python"
    assert slug("`engine_log(engine, metrics, step)`") == "engine_logengine-metrics-step"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(document):
    broken = []
    for line in prose(document):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = (document.parent / path).resolve() if path else document
            if not file.exists():
                broken.append(f"{target}: no file {file.relative_to(REPO)}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{document.relative_to(REPO)}: " + "; ".join(broken)
