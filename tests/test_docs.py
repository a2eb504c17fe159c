"""Every ```python block in README.md and docs/*.md runs, in order, file by file.

Each file's blocks run in one IPython shell (so ``%ddp`` magics and
``%%ddp`` cells work) with a fresh namespace where ``import nbddp`` and
``%load_ext nbddp`` ran, as a reader pasting them into a new notebook would,
on the suite's 2 CPU workers. A block that is not
meant to run here (a fragment, a Slurm recipe) is preceded by the line
``<!-- no-run -->`` (the convention is documented in docs/index.md).

A doc that starts workers itself (``%ddp start``, ``nbddp.start(``) gets
them stopped first, so it starts its own exactly as written.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_RUN = "<!-- no-run -->"
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    run: bool


def extract_blocks(text: str) -> list[Block]:
    """Fenced code blocks, each marked runnable unless ``<!-- no-run -->`` precedes it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"code block opened at line {start + 1} is never closed (missing {fence})")
        previous = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        blocks.append(Block(start + 1, lang, "\n".join(body) + "\n", previous != NO_RUN))
        i += 1
    return blocks


def doc_files() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md", *sorted(f"docs/{n}" for n in os.listdir(docs) if n.endswith(".md"))]


def runnable(rel: str) -> list[Block]:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return [b for b in extract_blocks(f.read()) if b.lang == "python" and b.run]


def test_extract_blocks_follows_the_no_run_convention():
    text = (
        "intro\n\n```python\nx = 1\n```\n\n<!-- no-run -->\n```python\nslurm()\n```\n"
        "```bash\nls\n```\n<!-- no-run -->\n\n````python\nprint('```')\n````\n"
    )
    blocks = extract_blocks(text)
    assert [(b.line, b.lang, b.run) for b in blocks] == [(3, "python", True), (8, "python", False),
                                                         (11, "bash", True), (16, "python", False)]
    assert blocks[0].source == "x = 1\n" and blocks[3].source == "print('```')\n"
    with pytest.raises(ValueError, match="opened at line 2 is never closed"):
        extract_blocks("a\n```python\nx = 1\n")


def test_index_links_every_guide_and_every_link_resolves():
    with open(os.path.join(ROOT, "docs", "index.md"), encoding="utf-8") as f:
        index = f.read()
    guides = [rel.removeprefix("docs/") for rel in doc_files() if rel.startswith("docs/") and rel != "docs/index.md"]
    missing = [g for g in guides if f"({g})" not in index and f"({g}#" not in index]
    assert not missing, f"docs/index.md does not link {missing}"
    broken = []
    for rel in doc_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(rel), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{rel} -> {target}")
    assert not broken, f"links to files that do not exist: {broken}"


@pytest.fixture(scope="module")
def shell(ipython_shell):
    return ipython_shell


def _fresh_namespace(shell, load: bool) -> None:
    """A new notebook (workers untouched): empty namespace; with ``load``, ``import nbddp`` and ``%load_ext nbddp`` done."""
    if "nbddp" in shell.extension_manager.loaded:
        shell.run_line_magic("unload_ext", "nbddp")
    shell.reset(new_session=False)
    if load:
        shell.run_cell("import nbddp\n%load_ext nbddp", store_history=False).raise_error()


def starts_own_workers(rel: str) -> bool:
    return any("%ddp start" in b.source or "nbddp.start(" in b.source for b in runnable(rel))


# the pages that run on the suite's workers first, then those that start their own: each of those
# stops the workers the one before it started, and the shared ones are started again once, after the last
@pytest.mark.docs
@pytest.mark.parametrize("rel", sorted((f for f in doc_files() if runnable(f)), key=starts_own_workers))
def test_doc_code_blocks_run(rel, request, _suite_session, shell, tmp_path, monkeypatch):
    import nbddp

    blocks = runnable(rel)
    if starts_own_workers(rel):
        nbddp.stop()  # the doc starts its own workers, as a reader would
    else:
        request.getfixturevalue("workers")
    monkeypatch.chdir(tmp_path)  # files a doc writes land here
    _fresh_namespace(shell, load=True)
    try:
        for n, block in enumerate(blocks, 1):
            result = shell.run_cell(block.source, store_history=False)
            if not result.success:
                err = result.error_before_exec or result.error_in_exec
                pytest.fail(f"{rel}, block {n} (line {block.line}) failed: {type(err).__name__}: {err}\n"
                            f"--- the block ---\n{block.source}")
    finally:
        _fresh_namespace(shell, load=False)
