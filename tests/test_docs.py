"""Docs that run: the docs site builds with warnings as errors, and every command and code block of README.md
and the user guide runs as written, offline.

Blocks are run page by page, in order, in a fresh directory per page: ``python`` blocks in one namespace
(so later blocks use earlier names), ``bash`` blocks line by line with ``set -e``, the ``kvmem`` command
and ``.venv/bin/`` meaning this test's own environment. A block can be left out only by an HTML comment
on the line before it, ``<!-- skip: REASON -->``, and the reason is required (a hub, a GPU, several
processes, this very test). The README's install steps (``python3 -m venv``, ``pip install``) are the
environment under test, so they are not run again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ["README.md", "docs/getting-started.md", "docs/concepts.md", "docs/reading.md", "docs/scanning.md",
         "docs/atlas-format.md", "docs/traces.md", "docs/explorer.md", "docs/explanations.md", "docs/taxonomy.md",
         "docs/extending.md", "docs/notebooks.md"]
RUN = {"python", "bash"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SKIP = re.compile(r"<!--\s*skip:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int
    language: str
    code: str
    skip: str | None


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    out = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        out.append(Block(page, text[:match.start()].count("\n") + 1, match.group(1), match.group(2),
                         skip.group(1) if skip else None))
    return out


def _pages() -> list[str]:
    return [page for page in GUIDE if (ROOT / page).exists()]


def test_every_skip_says_why():
    for page in _pages():
        for block in blocks(page):
            if block.skip is not None:
                assert len(block.skip) > 10, f"{page}:{block.line} skips a block without a reason"
            if block.language not in RUN | {"text", "console", "json", ""}:
                pytest.fail(f"{page}:{block.line}: a {block.language!r} block; use python, bash or text")


def _shell_line(line: str, bin_dir: str) -> str | None:
    """One README/guide command as this environment runs it; None for install steps (the environment itself)."""
    steps = [step.strip() for step in line.split("&&")]
    kept = [step for step in steps if not re.match(r"^(python3 -m venv|(\.venv/bin/)?pip install)", step)]
    if not kept:
        return None
    return " && ".join(kept).replace(".venv/bin/", f"{bin_dir}/")


def _bash_lines(code: str) -> list[str]:
    """Lines of a bash block with backslash continuations joined; comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages())
def test_page_runs(page, tmp_path):
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1"}
    namespace: dict = {"__name__": f"docs:{page}"}
    ran = 0
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in blocks(page):
            if block.skip is not None or block.language not in RUN:
                continue
            where = f"{page}:{block.line}"
            if block.language == "python":
                exec(compile(block.code, where, "exec"), namespace)  # noqa: S102 - the docs' own code
            else:
                for line in _bash_lines(block.code):
                    command = _shell_line(line, bin_dir)
                    if command is None:
                        continue
                    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=tmp_path, env=env,
                                          capture_output=True, text=True, timeout=900)
                    assert done.returncode == 0, f"{where}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            ran += 1
    finally:
        os.chdir(cwd)
    assert ran == len([b for b in blocks(page) if b.language in RUN and b.skip is None]), page


def test_the_docs_site_builds_with_warnings_as_errors(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "atlas-format" / "index.html").exists()
    columns = (tmp_path / "site" / "atlas-format" / "index.html").read_text()
    from kvmem.schema import COLUMNS

    for table, names in COLUMNS.items():  # every column of the format is documented
        for name in names:
            assert f"<code>{name}</code>" in columns, (table, name)
