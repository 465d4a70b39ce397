"""The code blocks of README.md and docs/*.md that a user can run on a fresh clone, run as written.

A block is runnable when the line before its fence is a marker comment, which renders as nothing:

    <!-- runnable -->           cheap: runs in the default suite, on a fresh copy of the checkout
    <!-- runnable: demo -->     runs after `make demo` (`slow`): the demo's run directory and model exist

Blocks run in order (README.md, then docs/*.md by name; within a file, top to bottom), each in its own
process, in a temporary copy of the checkout with the project's virtualenv as `.venv` and `.venv/bin` first on
PATH (as after `source .venv/bin/activate`), a home directory of its own and no Ray cluster (RAY_ADDRESS unset,
RAY_TMPDIR private). `bash` blocks run with `bash -euo pipefail`; in a block whose lines start with `$ `
(a command and its printed output) only those lines run. `python` blocks run with the virtualenv's Python. A
non-zero exit fails the test, naming the file and line of the block.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- runnable(?:: (?P<kind>demo))? -->\s*$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")


@dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    after_demo: bool

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def script(self) -> str:
        lines = self.code.splitlines()
        if self.lang == "bash" and any(line.startswith("$ ") for line in lines):
            lines = [line[2:] for line in lines if line.startswith("$ ")]
        return "\n".join(lines) + "\n"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The marked blocks of one markdown file, in order; a marker not followed by a fence is an error."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i])
        if marker:
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if fence is None or fence["lang"] not in ("bash", "python"):
                raise ValueError(f"{path.relative_to(root)}:{i + 1}: a runnable marker must precede a ```bash or "
                                 "```python fence")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out.append(Block(str(path.relative_to(root)), i + 2, fence["lang"], "\n".join(lines[i + 2:end]),
                             marker["kind"] == "demo"))
            i = end
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def _venv() -> Path:
    own = ROOT / ".venv"
    return own if (own / "bin" / "python").exists() else Path(sys.prefix)


@pytest.fixture
def clone(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A copy of the checkout's files (tracked and untracked, not ignored) with `.venv`, and a user's environment."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    repo = tmp_path / "repo"
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    (repo / ".venv").symlink_to(_venv(), target_is_directory=True)
    ray_tmp = tempfile.mkdtemp(prefix="pf-doc-")  # short: Ray's socket paths
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "XLA_FLAGS", "VIRTUAL_ENV") and not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path / "home"), RAY_TMPDIR=ray_tmp, PYTHONPATH=str(repo), JAX_PLATFORMS="cpu",
               PATH=f"{repo / '.venv' / 'bin'}:{env.get('PATH', '')}", PAGEFLEET_PROGRESS="0")
    try:
        yield repo, env
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def run_block(block: Block, repo: Path, env: dict[str, str], timeout_s: float) -> None:
    command = (["bash", "-euo", "pipefail", "-c", block.script()] if block.lang == "bash"
               else [str(repo / ".venv" / "bin" / "python"), "-c", block.script()])
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (f"{block.where} exited {done.returncode}:\n{block.script()}\n--- stdout\n"
                                  f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-5000:]}")


def test_markers_precede_runnable_fences_and_some_blocks_are_marked():
    found = all_blocks()  # raises on a stray marker
    assert any(not b.after_demo for b in found) and any(b.after_demo for b in found)
    assert any(b.file == "README.md" and b.lang == "python" for b in found)  # the README's Python block


def test_the_cheap_blocks_run_as_written(clone):
    repo, env = clone
    for block in all_blocks():
        if not block.after_demo:
            run_block(block, repo, env, timeout_s=300)


@pytest.mark.slow  # `make demo` (minutes of compiling and sampling), then every block, the demo's included
def test_every_block_runs_as_written_after_make_demo(clone):
    repo, env = clone
    # The virtualenv is already installed: -o keeps make from reinstalling it for a newer pyproject.toml copy.
    demo = subprocess.run(["make", "-o", ".venv/.installed-dev", "demo"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-5000:]
    for block in all_blocks():
        run_block(block, repo, env, timeout_s=1200)
