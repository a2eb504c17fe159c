"""The API reference site: every public name has an entry, every guide is in the nav, and ``mkdocs build --strict``
passes (no broken link, no missing reference, every docstring read)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import nbddp

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"


def _entries() -> set[str]:
    return {m for page in REFERENCE.glob("*.md") for m in re.findall(r"^::: nbddp\.(\S+)$", page.read_text(), re.M)}


def test_every_public_name_has_a_reference_entry():
    missing = sorted(set(nbddp.__all__) - _entries())
    assert missing == [], f"add '::: nbddp.NAME' for each to a page of docs/reference/: {missing}"
    assert sorted(_entries() - set(nbddp.__all__)) == []  # and nothing that is not public


def test_every_page_of_docs_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if f": {p}\n" not in nav] == []


@pytest.mark.docs
def test_mkdocs_build_strict_passes_and_renders_every_public_name(tmp_path):
    """About 10 CPU-seconds: mkdocs, Material and griffe read the package and every page."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    html = "".join(p.read_text() for p in (site / "reference").rglob("*.html"))
    unrendered = [name for name in nbddp.__all__ if f'id="nbddp.{name}"' not in html]
    assert unrendered == [], f"in the nav but not rendered from a docstring: {unrendered}"
    assert "trust_checkpoint" in (site / "reference" / "training" / "index.html").read_text()
